"""ferry's Python package against torch: zero-copy exchange and lifetimes, the moves, autograd
across the boundary, errors. Skipped where torch is not installed (CI runs test_numpy.py); the
CUDA tests skip without a GPU (they run on the GPU machine)."""

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferry  # noqa: E402

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and ferry.cuda_available()),
    reason="needs a CUDA device",
)


def test_exchange_shares_memory_both_ways():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    x = ferry.from_torch(t)
    assert x.shape == [3, 4] and x.dtype == "float32" and x.device == "cpu"
    back = ferry.to_torch(x)
    t[1, 2] = 100.0  # a write through torch is seen through ferry's view
    assert back[1, 2].item() == 100.0
    assert back.data_ptr() == t.data_ptr()


def test_a_ferry_tensor_keeps_the_torch_memory_alive():
    t = torch.full((256, 256), 7.0)
    x = ferry.from_torch(t)
    del t
    gc.collect()
    torch.zeros(256, 256) + 1  # would likely reuse freed memory
    assert torch.equal(ferry.to_torch(x), torch.full((256, 256), 7.0))


def test_strided_views_cross_without_a_copy():
    t = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    view = t.t()[1:, ::2]
    back = ferry.to_torch(ferry.from_torch(view))
    assert torch.equal(back, view)
    assert back.stride() == view.stride()


def test_numpy_reads_a_ferry_tensor():
    t = torch.randn(5, 3)
    out = ferry.cpu(t)
    assert np.array_equal(np.from_dlpack(ferry.from_torch(out)), t.numpy())


def test_cast_on_the_host_matches_torch():
    t = torch.randn(64, 32)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        out, report = ferry.to(t, "cpu", dtype=dtype, report=True)
        assert out.dtype == dtype
        assert torch.equal(out, t.to(dtype))
        assert report.path == "same_device" and report.grad_bytes_copied == 0


def test_autograd_sends_the_gradient_home_in_the_source_dtype():
    x = torch.randn(8, 4, requires_grad=True)
    y = ferry.to(x, "cpu", dtype=torch.float64)
    assert y.dtype == torch.float64 and y.requires_grad
    (y * 3).sum().backward()
    assert x.grad.dtype == torch.float32
    assert torch.equal(x.grad, torch.full((8, 4), 3.0))


def test_a_move_in_the_graph_reports_as_any_other():
    x = torch.randn(8, 4, requires_grad=True)
    y, report = ferry.to(x, "cpu", dtype=torch.float64, report=True)
    assert y.requires_grad and report is not None
    assert report.path == "same_device" and report.grad_bytes_copied == 0


def test_a_bad_dtype_is_a_type_error_as_in_torch():
    with pytest.raises(TypeError, match="unknown dtype"):
        ferry.to(torch.ones(2), "cpu", dtype="float7")


def test_a_stream_still_reports_after_its_with_block():
    x = torch.randn(64, 8)
    with ferry.stream_to(x, chunks=4) as stream:
        rows = sum(len(chunk.rows) for chunk in stream)
        inside = stream.report
    assert rows == 64 and inside is not None
    after = stream.report
    assert after is not None and (after.path, after.chunks) == (inside.path, inside.chunks)
    assert stream.report is after and stream.waited_ms >= 0.0  # fixed once closed


def test_second_derivatives_flow_through_a_move():
    # y = sum(x^2) through a move to f64 plus sum(x^3) directly: dy/dx = 2x + 3x^2, and the
    # derivative of its sum is 2 + 6x, which needs the move's backward to be in the graph.
    x = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    y = (ferry.to(x, "cpu", dtype=torch.float64) ** 2).sum() + (x.double() ** 3).sum()
    (dy,) = torch.autograd.grad(y, x, create_graph=True)
    assert torch.allclose(dy, 2 * x.detach() + 3 * x.detach() ** 2)
    (d2y,) = torch.autograd.grad(dy.sum(), x)
    assert torch.equal(d2y, torch.tensor([5.0, -4.0, 14.0]))


def test_no_grad_moves_record_nothing():
    x = torch.randn(4, requires_grad=True)
    with torch.no_grad():
        y = ferry.cpu(x)
    assert not y.requires_grad


def test_state_dict_moves_keep_names_and_values():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    sd = model.state_dict()
    moved, report = ferry.move_state_dict(sd, "cpu", report=True)
    assert list(moved) == list(sd)
    for name in sd:
        assert torch.equal(moved[name], sd[name])


def test_state_dicts_of_torch_tensors_arrays_and_grad_leaves_move_whole():
    w = torch.randn(64, 32, requires_grad=True)
    sd = {"w": w, "b": torch.arange(5), "half": torch.randn(7).half(),
          "array": np.arange(6, dtype=np.float64).reshape(2, 3)}
    moved, report = ferry.move_state_dict(sd, "cpu", report=True)
    assert list(moved) == list(sd)
    assert not moved["w"].requires_grad and torch.equal(moved["w"], w.detach())
    assert torch.equal(moved["b"], sd["b"]) and torch.equal(moved["half"], sd["half"])
    assert np.array_equal(moved["array"].numpy(), sd["array"])
    assert report.path == "batched" and report.chunks == len(sd)


def test_a_state_dict_move_takes_no_tensors_once_finished():
    move = ferry._ferry.StateDictMove("cpu")
    move.add("x", torch._C._to_dlpack(torch.ones(3)))
    out, _ = move.finish()
    assert torch.equal(torch.from_dlpack(out["x"]), torch.ones(3))
    with pytest.raises(RuntimeError, match="start a new one"):
        move.add("y", torch._C._to_dlpack(torch.ones(3)))
    with pytest.raises(RuntimeError, match="start a new one"):
        move.finish()


def test_errors_name_the_fix():
    t = torch.ones(3)
    with pytest.raises(ValueError, match="cuda:N"):
        ferry.to(t, "tpu")
    with pytest.raises(TypeError, match="convert to float32"):
        ferry.from_torch(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="not both"):
        ferry.to_chunked(t, "cpu", chunks=2, max_staging_bytes=64)
    assert issubclass(ferry.FerryError, RuntimeError)


def test_the_pinned_budget_is_visible_and_settable():
    if not ferry.cuda_available():
        with pytest.raises(ferry.FerryError, match="CUDA"):
            ferry.pinned_budget()
        return
    before = ferry.pinned_budget()
    ferry.set_pinned_budget(64 << 20)
    assert ferry.pinned_budget() == 64 << 20
    assert ferry.pinned_stats()["budget_bytes"] == 64 << 20
    ferry.set_pinned_budget(before)


@cuda
def test_cpu_of_a_cuda_tensor_matches_torch():
    t = torch.randn(1000, 333, device="cuda")
    out, report = ferry.cpu(t, report=True)
    assert out.device.type == "cpu"
    assert torch.equal(out, t.cpu())
    assert report.path in ("device_to_pinned", "device_to_pageable", "chunked")
    assert report.bytes_moved == t.numel() * 4


@cuda
def test_to_cuda_and_casts_on_the_gpu_match_torch():
    t = torch.randn(257, 129)
    out = ferry.to(t, "cuda")
    assert out.device == torch.device("cuda:0") and torch.equal(out.cpu(), t)
    g = torch.randn(300, 300, device="cuda")
    half = ferry.to(g, "cpu", dtype=torch.bfloat16)
    assert torch.equal(half, g.to(torch.bfloat16).cpu())


@cuda
def test_work_queued_on_torch_side_streams_is_seen():
    t = torch.zeros(4096, 1024, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # a long kernel before the write
        t.fill_(3.0)
        out = ferry.cpu(t)
    assert torch.all(out == 3.0)


@cuda
def test_non_blocking_is_handed_out_only_after_the_copy():
    t = torch.randn(64 << 20 // 4, device="cuda")
    pending = ferry.to(t, "cpu", non_blocking=True)
    if isinstance(pending, ferry.PendingMove):
        out = pending.wait()
        assert pending.report is not None
    else:  # beyond the pinned budget the move blocked
        out = pending
    assert torch.equal(out, t.cpu())


@cuda
def test_gradients_cross_devices_like_torch():
    x = torch.randn(64, 8, device="cuda", requires_grad=True)
    y = ferry.cpu(x)
    (y ** 2).sum().backward()
    assert x.grad.device == x.device
    assert torch.allclose(x.grad, 2 * x.detach())


@cuda
def test_chunked_and_state_dict_moves_match_torch():
    t = torch.randn(4096, 256, device="cuda")
    out, report = ferry.to_chunked(t, "cpu", max_staging_bytes=1 << 20, report=True)
    assert torch.equal(out, t.cpu())
    assert report.staging_peak_bytes <= 1 << 20 and report.chunks > 1
    model = torch.nn.Linear(512, 512).cuda()
    moved = ferry.move_state_dict(model.state_dict(), "cpu")
    for name, value in model.state_dict().items():
        assert torch.equal(moved[name], value.cpu())


@cuda
def test_memory_returns_to_ferrys_pool_when_torch_frees_it():
    t = torch.randn(8 << 20 // 4, device="cuda")
    out = ferry.cpu(t)
    held = ferry.pinned_stats()["allocated_bytes"]
    del out
    gc.collect()
    assert ferry.pinned_stats()["allocated_bytes"] < held


def test_a_host_tensor_streams_views_of_its_rows():
    t = torch.randn(4096, 256)  # 4 MiB: a quarter of it stages 2 pieces of 512 KiB at a time
    stream = ferry.stream_to(t, chunks=4)
    n = len(stream)
    assert n >= 4
    chunks = list(stream)
    assert [c.index for c in chunks] == list(range(n))
    assert [r for c in chunks for r in c.rows] == list(range(4096))
    for c in chunks:
        assert torch.equal(c.tensor, t[c.rows.start : c.rows.stop])
        assert not c.tensor.requires_grad


def test_offload_keeps_host_tensors_and_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    x = torch.randn(8, 16)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with ferry.offload_saved(min_bytes=0) as scope:
        loss = model(x).sum()
    loss.backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    assert scope.stats["offloaded"] == 0 and scope.stats["kept"] > 0
    with pytest.raises(ValueError, match=">= 0"):
        ferry.offload_saved(min_bytes=-1)


def test_empty_pinned_needs_the_pinned_pool():
    if not ferry.cuda_available():
        with pytest.raises(ferry.FerryError, match="CUDA"):
            ferry.empty_pinned((4, 4))
        return
    t = ferry.empty_pinned((4, 4), torch.float16)
    assert t.shape == (4, 4) and t.dtype == torch.float16 and t.is_pinned()


@cuda
def test_empty_pinned_beyond_the_budget_raises_as_torch_does():
    budget = ferry.pinned_budget()
    try:
        ferry.set_pinned_budget(1 << 20)
        with pytest.raises(ferry.FerryError, match="pinned budget") as err:
            ferry.empty_pinned((1 << 20,), torch.float32)
        assert isinstance(err.value, RuntimeError)
    finally:
        ferry.set_pinned_budget(budget)


def test_to_async_needs_a_gpu_side():
    with pytest.raises(ValueError, match="to_async moves to or from a GPU"):
        ferry.to_async(torch.ones(3), "cpu")


@cuda
def test_a_cuda_tensor_streams_in_bounded_staging():
    t = torch.randn(1000, 333, device="cuda")
    with ferry.stream_to(t, max_staging_bytes=1 << 20) as stream:
        n = len(stream)
        assert n > 2
        seen = 0
        for chunk in stream:
            assert chunk.tensor.device.type == "cpu"
            assert torch.equal(chunk.tensor, t[chunk.rows.start : chunk.rows.stop].cpu())
            seen += len(chunk.rows)
        assert seen == 1000
        assert stream.report.staging_peak_bytes <= 1 << 20
    early = ferry.stream_to(t, chunks=8)
    first = next(early)
    early.close()  # stops with copies in flight: nothing breaks, the chunk handed out stays valid
    assert torch.equal(first.tensor, t[first.rows.start : first.rows.stop].cpu())


@cuda
def test_to_async_lands_while_torch_computes():
    t = torch.randn(4096, 1024, device="cuda")
    pending = ferry.to_async(t, "cpu")
    busy = t @ t.T  # queued behind nothing: runs while the copy does
    out = pending.wait()
    assert torch.equal(out, t.cpu()) and pending.report is not None
    back = ferry.to_async(out, "cuda").wait()
    assert torch.equal(back, t)
    del busy


@cuda
def test_offload_saved_gives_the_same_gradients_and_frees_gpu_memory():
    model = tanh_mlp(4, 1024).cuda()
    x = torch.randn(4096, 1024, device="cuda")

    def step(offload):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        if offload:
            with ferry.offload_saved() as scope:
                loss = model(x).square().mean()
            torch.cuda.synchronize()
            scope.settle(wait=True)
        else:
            scope = None
            loss = model(x).square().mean()
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        return [p.grad.clone() for p in model.parameters()], held, scope

    plain, held_plain, _ = step(False)
    offloaded, held_offload, scope = step(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
    again, _, _ = step(True)  # blocks freed by the first step come back: no mix-up
    assert all(torch.equal(a, b) for a, b in zip(plain, again))
    stats = scope.stats
    # the four tanh outputs (16 MiB each), each saved by tanh and by the next op
    assert stats["offloaded"] == 4 and stats["shared"] >= 3
    assert stats["prefetched"] + stats["fetched_on_demand"] == stats["offloaded"]
    assert stats["prefetched"] >= 2
    # After the forward none of the four 16 MiB activations is held on the GPU any more (without
    # the scope all four are); the step's peaks are measured by python -m ferry.bench.
    assert held_plain >= 4 * (16 << 20)
    assert held_offload < 16 << 20
    scope.settle(wait=True)
    with pytest.raises(ValueError, match="in_flight"):
        ferry.offload_saved(in_flight=0)


@cuda
def test_offload_saved_leaves_nothing_behind_when_the_host_runs_ahead():
    """Forward and backward queued without a wait: the last copies to the host may still be
    running when backward reaches their tensors (read in place then). After the step only the
    gradients are left on the GPU, with the cycle collector off: nothing waits for it."""
    import gc
    import weakref

    model = tanh_mlp(4, 1024).cuda()
    x = torch.randn(4096, 1024, device="cuda")
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            with ferry.offload_saved() as scope:
                loss = model(x).square().mean()
            loss.backward()
            stats, probe = dict(scope.stats), weakref.ref(scope)
            del scope, loss
            torch.cuda.synchronize()
            assert probe() is None, "the scope outlived its graph"
            left = torch.cuda.memory_allocated() - base
            assert left <= grad_bytes, (left, grad_bytes)
            assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
            assert stats["prefetched"] + stats["fetched_on_demand"] == stats["offloaded"] == 4
    finally:
        gc.enable()


@cuda
def test_memory_stats_count_ferrys_device_memory():
    ferry.reset_peak_memory_stats("cuda:0")
    before = ferry.memory_stats("cuda:0")["allocated_bytes"]
    for device in (0, None, torch.device("cuda", 0)):
        stats = ferry.memory_stats(device)
        assert stats["allocated_bytes.all.current"] == stats["allocated_bytes"] == before
    on_gpu = ferry.to(torch.randn(1 << 20), "cuda")
    stats = ferry.memory_stats("cuda:0")
    assert stats["allocated_bytes"] >= before + (4 << 20)
    assert stats["peak_allocated_bytes"] >= stats["allocated_bytes"]
    del on_gpu


def tanh_mlp(blocks: int = 6, width: int = 64):
    """``blocks`` of Linear(width, width) and tanh, seeded: each tanh output is one saved
    activation."""
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def test_offload_bookkeeping_on_host_tensors(host_offload):
    import weakref

    model = tanh_mlp()
    x = torch.randn(32, 64)
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    from ferry import offload

    packed = []
    pack = offload.offload_saved._pack

    def spy(self, t):
        if type(t.grad_fn).__name__ == "TanhBackward0":
            packed.append(t.untyped_storage())
        return pack(self, t)

    for _ in range(2):  # the second step reuses the first one's freed memory
        model.zero_grad(set_to_none=True)
        packed.clear()
        offload.offload_saved._pack = spy
        try:
            with ferry.offload_saved(min_bytes=0, prefetch=2) as scope:
                loss = model(x).square().mean()
                probes = [weakref.ref(s()) for s in scope._saved]
        finally:
            offload.offload_saved._pack = pack
        scope.settle(wait=True)
        # After the forward, nothing but this test holds what was offloaded.
        held = [torch._C._storage_Use_Count(s._cdata) for s in packed]
        packed.clear()
        assert held and max(held) == 1, held
        loss.backward()
        assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
        stats = scope.stats
        # six tanh outputs, each saved by tanh and again by the next op
        assert stats["offloaded"] == 6 and stats["shared"] == 6
        assert stats["prefetched"] + stats["fetched_on_demand"] == 6
        assert stats["fetched_on_demand"] == 1 and stats["prefetched"] == 5
        assert not scope._copies and not scope._releasing
        del loss
        assert all(p() is None for p in probes)  # records go with torch's graph


@pytest.mark.parametrize("prefetch,prefetch_bytes,ahead", [(1, 0, 1), (2, 0, 2), (1, 3 * 32 * 64 * 4, 3), (1, 1 << 30, 5)])
def test_backward_uploads_ahead_by_count_and_by_bytes(host_offload, prefetch, prefetch_bytes, ahead):
    model = tanh_mlp()
    x = torch.randn(32, 64)
    with ferry.offload_saved(min_bytes=0, prefetch=prefetch, prefetch_bytes=prefetch_bytes) as scope:
        loss = model(x).square().mean()
    loss.backward()
    stats = scope.stats
    assert stats["offloaded"] == 6 and stats["fetched_on_demand"] == 1
    # Six tanh outputs of 32 x 64 floats: the window held `ahead` of them at its widest.
    assert stats["ahead_peak_bytes"] == ahead * 32 * 64 * 4
    assert scope._ahead == 0


def test_the_default_window_is_an_eighth_of_what_the_step_offloaded(host_offload):
    # 256 MiB ahead brought a small model's every activation back at the start of backward, so
    # the scope lowered nothing: by default the window follows the step's offloaded bytes.
    model = tanh_mlp()
    x = torch.randn(32, 64)
    activation = 32 * 64 * 4
    with ferry.offload_saved(min_bytes=0) as scope:
        loss = model(x).square().mean()
    loss.backward()
    stats = scope.stats
    assert stats["offloaded"] == 6 and stats["window_bytes"] == 6 * activation // 8
    # Under one activation: one upload ahead at a time (`prefetch`), not five.
    assert stats["ahead_peak_bytes"] == activation
    # A step that offloads gigabytes keeps the 256 MiB window.
    scope.stats["offloaded_bytes"] = 8 << 30
    assert scope._window() == 256 << 20


class _SlowEvent:
    """A copy that completes only when waited for."""

    def __init__(self, *args, **kwargs):
        self.done = False

    def record(self, stream=None):
        pass

    def synchronize(self):
        self.done = True

    def query(self):
        return self.done


def test_a_target_out_of_reach_does_not_stall_the_forward(host_offload, monkeypatch):
    """The weights alone (stubbed: ten activations' bytes) are above the target: no save can
    meet it, so the scope offloads as without a target and never waits for a copy to land."""
    model = tanh_mlp()
    x = torch.randn(32, 64)
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    activation = 32 * 64 * 4
    scope = ferry.offload_saved(min_bytes=0, max_device_bytes=2 * activation)

    def allocated(device=None):
        records = [r() for r in scope._saved]
        held = sum(r.nbytes for r in records if r is not None and r.original is not None)
        return 10 * activation + held

    monkeypatch.setattr(torch.cuda, "memory_allocated", allocated)
    monkeypatch.setattr(torch.cuda, "Event", _SlowEvent)
    model.zero_grad(set_to_none=True)
    with scope:
        loss = model(x).square().mean()
    stats = scope.stats
    assert stats["offloaded"] == 6 and stats["out_of_reach"] == 6
    assert stats["waited_for_target"] == 0, stats
    loss.backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))


def test_a_memory_target_keeps_what_backward_needs_first(host_offload, monkeypatch):
    """With max_device_bytes, saved tensors stay on the device while allocated memory is within
    the target; above it the oldest are offloaded first. Allocated memory is stubbed as the
    bytes of the records still holding their device tensor."""
    from ferry import offload

    model = tanh_mlp()
    x = torch.randn(32, 64)
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    activation = 32 * 64 * 4
    scopes = []

    def allocated(device=None):
        records = [r() for r in scopes[-1]._saved] if scopes else []
        return sum(r.nbytes for r in records if r is not None and r.original is not None)

    monkeypatch.setattr(torch.cuda, "memory_allocated", allocated)
    model.zero_grad(set_to_none=True)
    scope = ferry.offload_saved(min_bytes=0, max_device_bytes=3 * activation)
    scopes.append(scope)
    with scope:
        loss = model(x).square().mean()
        records = [r() for r in scope._saved]
    # Six tanh outputs: the three saved last stay on the device, the first three went to the host.
    on_host = [r.index for r in records if r.host is not None]
    assert on_host == [0, 1, 2], on_host
    assert scope.stats["offloaded"] == 3 and scope.stats["kept_under_target"] == 3
    assert allocated() <= 3 * activation
    loss.backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    assert scope.stats["prefetched"] + scope.stats["fetched_on_demand"] == 3
    with pytest.raises(ValueError, match="max_device_bytes"):
        ferry.offload_saved(max_device_bytes=-1)


def test_a_scope_entered_again_keeps_room_for_what_backward_allocates(host_offload, monkeypatch):
    """The target holds at each save, but the step allocates more after the last (the loss;
    stubbed here as one activation's bytes after the forward): the scope reads the step's peak
    at the end of backward and, entered again for the next step, keeps that much room at its
    saves, so the step's peak comes under the target. It resets torch's peak statistic when
    entered with a peak above the target, to read the next step's own."""
    model = tanh_mlp()
    x = torch.randn(32, 64)
    activation = 32 * 64 * 4
    scope = ferry.offload_saved(min_bytes=0, max_device_bytes=3 * activation)
    memory = {"loss": 0, "peak": 0}

    def allocated(device=None):
        records = [r() for r in scope._saved]
        now = memory["loss"] + sum(r.nbytes for r in records if r is not None and r.original is not None)
        memory["peak"] = max(memory["peak"], now)
        return now

    def reset(device=None):
        memory["peak"] = 0
        memory["peak"] = allocated()

    from ferry import offload

    monkeypatch.setattr(torch.cuda, "memory_allocated", allocated)
    monkeypatch.setattr(offload, "_peak_allocated", lambda device: memory["peak"])
    monkeypatch.setattr(offload, "_reset_peak", reset)
    offloaded, peaks = [], []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with scope:
            loss = model(x).square().mean()
        offloaded.append(scope.stats["offloaded"])
        memory["loss"] = activation  # what the step holds beyond the saves, for a moment
        allocated()
        memory["loss"] = 0
        loss.backward()
        peaks.append(memory["peak"])
        del loss
    # The first step kept three on the device and went one activation over; from then on the
    # scope keeps that room: two kept, four offloaded, the peak at the target (measured on its
    # own after the reset the scope made when entered again).
    assert offloaded == [3, 4, 4]
    assert scope.stats["headroom_bytes"] == activation
    assert peaks == [4 * activation, 3 * activation, 3 * activation]
    # Each step's records only: the list starts afresh once the last step's graph is gone.
    assert len(scope._saved) == 6


def test_a_scope_lets_go_of_its_pinned_blocks_when_backward_ends(host_offload, monkeypatch):
    """Copies still running when the scope last looked keep their pinned blocks listed; at the
    end of backward the scope waits for them and lets go, so a scope entered again next step
    does not hold a step's worth of pinned memory in between (seen on the H200: 10 GiB)."""
    running = []

    class Slow:  # an event that reports running until waited for
        def __init__(self):
            self.done = False
            running.append(self)

        def record(self, stream=None):
            pass

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    monkeypatch.setattr(torch.cuda, "Event", Slow)
    model = tanh_mlp(4)
    scope = ferry.offload_saved(min_bytes=0)
    for _ in range(2):
        with scope:
            loss = model(torch.randn(32, 64)).square().mean()
        assert scope.stats["offloaded"] == 4 and len(scope._releasing) > 0
        loss.backward()
        assert len(scope._releasing) == 0
        assert all(event.done for event in running)
