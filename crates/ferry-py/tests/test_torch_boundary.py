"""ferry next to torch at the boundary: stream order against torch's current stream (inside
``torch.cuda.stream(s)`` too), ferry's pinned memory reused only after torch's queued copies,
pinning in place, misaligned memory, torch's current device. The races are made certain, not
likely: a long kernel (``torch.cuda._sleep``) holds torch's stream before the move, and the
torch write that could overtake the copy follows at once. The CUDA cases skip without a GPU (they
run on the GPU machine); the others run in CI."""

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferry  # noqa: E402

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and ferry.cuda_available()),
    reason="needs a CUDA device",
)

N = 64 << 20  # 256 MiB of float32: a copy of it takes milliseconds, a fill microseconds
SLEEP = 200_000_000  # cycles of torch.cuda._sleep: about 0.1 s on an H200


def test_cuda_means_torchs_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert ferry._device_name("cuda") == "cuda:1"
    assert ferry._device_name(torch.device("cuda")) == "cuda:1"
    assert ferry._device_name("cuda:0") == "cuda:0"
    assert ferry._device_name(2) == "cuda:2"


def test_misaligned_torch_host_tensors_move_and_are_not_shared():
    a = np.zeros(4 * 1024 + 4, np.uint8)[1 : 4 * 1024 + 1].view(np.float32)
    a[:] = np.arange(1024, dtype=np.float32)
    t = torch.from_numpy(a)
    assert t.data_ptr() % 4 != 0
    out, report = ferry.to(t, "cpu", dtype=torch.float16, report=True)
    assert torch.equal(out, t.to(torch.float16))
    assert report.realigned_bytes == 4096
    with pytest.raises(ValueError, match="not aligned"):
        ferry.from_torch(t)


def test_bad_arguments_raise_exceptions_never_panics():
    t = torch.ones(3)
    for call in (
        lambda: ferry.to(t, "cuda:x"),
        lambda: ferry.to(t, "cpu", dtype="complex64"),
        lambda: ferry.to_chunked(t.view(3, 1), "cpu", chunks=0),
        lambda: ferry.empty_pinned([1 << 62, 1 << 62]),
        lambda: ferry.to(torch.ones(3, dtype=torch.int32), "cpu"),
    ):
        # pyo3's PanicException derives from BaseException: `Exception` would not catch it.
        with pytest.raises(Exception):
            call()


def zeros_behind_a_long_kernel():
    """A zero tensor, with a long kernel queued on torch's current stream after its fill."""
    x = torch.zeros(N, device="cuda")
    torch.cuda._sleep(SLEEP)
    return x


@cuda
@pytest.mark.parametrize("side_stream", [False, True])
def test_a_torch_write_after_a_non_blocking_move_never_overtakes_it(side_stream):
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        x = zeros_behind_a_long_kernel()
        pending = ferry.to(x, "cpu", non_blocking=True)
        x.fill_(1.0)  # queued on torch's current stream after the move
        out = pending.wait() if isinstance(pending, ferry.PendingMove) else pending
    assert int(out.count_nonzero()) == 0


@cuda
@pytest.mark.parametrize("side_stream", [False, True])
def test_blocking_moves_read_what_torch_queued_before_them(side_stream):
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        x = zeros_behind_a_long_kernel()
        x.fill_(2.0)
        small = torch.full((1000,), 2.0, device="cuda")
        host = ferry.cpu(x)
        chunked = ferry.to_chunked(x.view(-1, 1024), "cpu", chunks=4)
        # x crosses as soon as it is added (on ferry's copy stream), the small ones packed
        torch.cuda._sleep(SLEEP)
        x.fill_(2.0)
        sd = ferry.move_state_dict({"small": small, "x": x, "x2": x[: N // 2]}, "cpu")
        x.fill_(3.0)
        small.fill_(3.0)
    for out in (host, chunked.view(-1), sd["x"], sd["x2"], sd["small"]):
        assert bool((out == 2.0).all())


@cuda
def test_to_async_then_order_stream_keeps_a_torch_write_behind_the_copy():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = zeros_behind_a_long_kernel()
        pending = ferry.to_async(x, "cpu")
        pending.order_stream()  # torch's stream waits for the copy on the device
        x.fill_(1.0)
        out = pending.wait()
    assert int(out.count_nonzero()) == 0


@cuda
def test_to_async_warns_when_the_source_was_written_before_the_copy_was_ordered():
    x = zeros_behind_a_long_kernel()
    pending = ferry.to_async(x, "cpu")
    x.fill_(1.0)  # may overtake the copy: the result is not trusted
    with pytest.warns(RuntimeWarning, match="order_stream"):
        pending.wait()
    # Written after the copy was waited for: no warning.
    pending = ferry.to_async(x, "cpu")
    pending.wait()
    x.fill_(2.0)


@cuda
def test_a_stream_to_source_written_while_it_streams_is_an_error():
    x = torch.zeros(4096, 1024, device="cuda")
    with ferry.stream_to(x, chunks=8) as stream:
        next(stream)
        x.fill_(1.0)
        with pytest.raises(ferry.FerryError, match="written in place"):
            next(stream)


@cuda
@pytest.mark.parametrize("side_stream", [False, True])
def test_a_gpu_result_is_not_reused_under_torchs_queued_work(side_stream):
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    first, second = torch.full((N,), 1.0), torch.full((N,), 2.0)
    with torch.cuda.stream(stream):
        y = ferry.to(first, "cuda")
        torch.cuda._sleep(SLEEP)
        doubled = y * 2  # queued behind the long kernel, reads y
        del y
        gc.collect()
        again = ferry.to(second, "cuda")  # may take y's block: only after `doubled` read it
    torch.cuda.synchronize()
    assert bool((doubled == 2.0).all())
    assert bool((again == 2.0).all())


@cuda
@pytest.mark.parametrize("side_stream", [False, True])
def test_pinned_memory_torch_frees_is_reused_only_after_its_queued_copy(side_stream):
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    g = torch.empty(N, device="cuda")
    for make in ("empty_pinned", "cpu"):
        with torch.cuda.stream(stream):
            if make == "empty_pinned":
                h = ferry.empty_pinned([N])
                assert h is not None, "the pinned budget has no room for the test"
                h.fill_(1.0)
            else:
                h = ferry.cpu(torch.ones(N, device="cuda"))
            torch.cuda._sleep(SLEEP)
            g.copy_(h, non_blocking=True)  # queued behind the long kernel, reads h
            del h
            gc.collect()
            h2 = ferry.empty_pinned([N])  # must not be h's block while the copy is queued
            h2.fill_(2.0)
        torch.cuda.synchronize()
        assert bool((g == 1.0).all()), make
        del h2


@cuda
def test_record_stream_covers_copies_on_other_streams():
    other = torch.cuda.Stream()
    g = torch.empty(N, device="cuda")
    h = ferry.empty_pinned([N])
    h.fill_(1.0)
    with torch.cuda.stream(other):
        torch.cuda._sleep(SLEEP)
        g.copy_(h, non_blocking=True)
    ferry.record_stream(h, other)  # the current stream is the default one: not covered without it
    del h
    gc.collect()
    h2 = ferry.empty_pinned([N])
    h2.fill_(2.0)
    torch.cuda.synchronize()
    assert bool((g == 1.0).all())
    # torch's own memory goes to torch's record_stream.
    mine = torch.empty(8, device="cuda")
    ferry.record_stream(mine, other)


@cuda
def test_pin_in_place_locks_within_the_budget_until_freed():
    before = ferry.pinned_stats()["registered_bytes"]
    t = torch.arange(N, dtype=torch.float32)
    pointer = t.data_ptr()
    assert not t.is_pinned()
    assert ferry.pin_(t) is t
    assert t.is_pinned() and t.data_ptr() == pointer
    assert ferry.pinned_stats()["registered_bytes"] == before + t.nbytes
    # Pinned memory moves by DMA straight from where it is: no staging.
    on_gpu, report = ferry.to(t, "cuda", report=True)
    assert report.staging_peak_bytes == 0
    assert torch.equal(on_gpu.cpu(), t)
    g = t.to("cuda", non_blocking=True)  # torch sees it pinned too
    torch.cuda.synchronize()
    assert torch.equal(g.cpu(), t)
    assert ferry.pin_(t) is t  # pinned already
    assert ferry.pinned_stats()["registered_bytes"] == before + t.nbytes
    del t, on_gpu, g
    gc.collect()
    assert ferry.pinned_stats()["registered_bytes"] == before
    # Beyond the budget: an error that names it.
    budget = ferry.pinned_budget()
    ferry.empty_cache("cpu")  # cached blocks would be trimmed to make room
    ferry.set_pinned_budget(ferry.pinned_stats()["reserved_bytes"] + (1 << 20))
    try:
        with pytest.raises(ferry.FerryError, match="FERRY_PINNED_BUDGET"):
            ferry.pin_(torch.empty(N))
    finally:
        ferry.set_pinned_budget(budget)


@cuda
def test_misaligned_gpu_memory_is_copied_into_aligned_memory():
    import ctypes

    from ferry import _ferry

    raw = torch.zeros(4 * 1024 + 4, dtype=torch.uint8, device="cuda")
    raw[1 : 4 * 1024 + 1].view(torch.uint8).copy_(
        torch.arange(1024, dtype=torch.float32, device="cuda").view(torch.uint8)
    )
    capsule = torch.utils.dlpack.to_dlpack(raw[1 : 4 * 1024 + 1])
    # Relabel the capsule's bytes as 1024 float32 one byte into the allocation, as a producer at
    # an odd offset would hand them over: DLTensor is {data, device (2 x i32), ndim (i32),
    # dtype (u8 code, u8 bits, u16 lanes), shape*, strides*, byte_offset}.
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    base = get(capsule, b"dltensor")
    ctypes.c_uint8.from_address(base + 20).value = 2  # kDLFloat
    ctypes.c_uint8.from_address(base + 21).value = 32
    shape = ctypes.c_void_p.from_address(base + 24).value
    ctypes.c_int64.from_address(shape).value = 1024
    strides = ctypes.c_void_p.from_address(base + 32).value
    if strides:
        ctypes.c_int64.from_address(strides).value = 1
    out, report = _ferry.to(capsule, "cpu", None, False, None, "cuda:0")
    assert report.realigned_bytes == 4096
    assert torch.equal(ferry.to_torch(out), torch.arange(1024, dtype=torch.float32))
