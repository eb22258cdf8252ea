"""ferry.save_async next to torch: the file equals what safetensors writes, an optimizer step
right after the call leaves the file with the weights of the call, copies come after torch's
queued work (on its default stream and inside ``torch.cuda.stream``), an in-place write that
could reach a snapshot keeps the old file and says so, and bad arguments are refused. The CUDA
cases skip without a GPU (they run on the GPU machine)."""

import json
import os

import pytest

torch = pytest.importorskip("torch")

import ferry  # noqa: E402

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "U8": torch.uint8,
}


def _load(path):
    """A safetensors file read with torch alone (the format: an 8-byte header length, the JSON
    header, the tensors' bytes), so these tests need no safetensors package."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = bytearray(data[8 + n + start : 8 + n + end])
        dtype = _DTYPES[info["dtype"]]
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(info["shape"])
    return out

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and ferry.cuda_available()),
    reason="needs a CUDA device",
)


def _state(device):
    torch.manual_seed(5)
    big = torch.randn(300, 250, device=device)
    return {
        "big": big,
        "cols": big[:, 10:110],
        "half": torch.randn(70, 90, device=device).half(),
        "bf16": torch.randn(33, device=device).bfloat16(),
        "steps": torch.arange(2500, device=device),
        "scalar": torch.tensor(3.5, dtype=torch.float64, device=device),
        "empty": torch.zeros(0, 7, device=device),
    }


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k].cpu(), b[k].cpu()), k


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("memory", ["pageable", "pinned", 1 << 16])
def test_the_file_holds_the_tensors(tmp_path, device, memory):
    state = _state(device)
    path = tmp_path / "s.safetensors"
    pending = ferry.save_async(path, state, memory=memory, metadata={"step": "7"})
    assert isinstance(pending, ferry.PendingSave)
    report = pending.wait()
    assert report["tensors"] == len(state)
    assert report["bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    assert report["call_s"] <= report["elapsed_s"] and report["snapshot_s"] <= report["elapsed_s"]
    _same(_load(path), {k: v.contiguous() for k, v in state.items()})
    with open(path, "rb") as f:
        header = f.read(8 + int.from_bytes(f.read(8), "little"))
    assert b'"step":"7"' in header and b"ferry.crc32" in header
    with pytest.raises(ValueError, match="already waited"):
        pending.wait()


def _sgd_model(device):
    torch.manual_seed(1)
    model = torch.nn.Linear(512, 512).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return model, opt


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_an_optimizer_step_after_the_call_waits_for_the_copies(tmp_path, device):
    model, opt = _sgd_model(device)
    model(torch.randn(64, 512, device=device)).square().sum().backward()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = tmp_path / "m.safetensors"
    # The bounded mode through a small ring, read in place: the copies take a while on any
    # machine.
    pending = ferry.save_async(
        path, model.state_dict(), memory=1 << 16, staging_bytes=1 << 16, device_copy=False
    )
    opt.step()
    assert pending.snapshot_taken(), "the step waited for the copies"
    assert not torch.equal(model.weight.detach(), before["weight"]), "the step moved the weights"
    pending.wait()
    _same(_load(path), before)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_a_write_that_could_reach_the_snapshot_keeps_the_old_file(tmp_path, device):
    path = tmp_path / "w.safetensors"
    w = torch.ones(1 << 20, device=device)
    ferry.save_async(path, {"w": w}).wait()
    pending = ferry.save_async(path, {"w": w * 2})
    pending.wait()
    t = torch.full((1 << 20,), 3.0, device=device)
    pending = ferry.save_async(
        path, {"w": t}, memory=1 << 16, staging_bytes=1 << 16, device_copy=False
    )
    t.add_(1.0)  # no barrier: this write may land in the copy
    with pytest.raises(ferry.FerryError, match="'w' was written in place"):
        pending.wait()
    assert torch.equal(_load(path)["w"], torch.full((1 << 20,), 2.0))
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"], "no temporary is left"
    # After wait_snapshot() writes are safe.
    t = torch.full((1 << 20,), 5.0, device=device)
    pending = ferry.save_async(path, {"w": t})
    pending.wait_snapshot()
    t.add_(1.0)
    pending.wait()
    assert torch.equal(_load(path)["w"], torch.full((1 << 20,), 5.0))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_the_default_memory_is_pinned_only_where_gpu_tensors_are_read_in_place(tmp_path, device):
    # Read in place, a GPU tensor's writes wait for its DMA, which lands at the link's rate only
    # in pinned memory; copied on the GPU, nothing waits: the disk's pace, within the staging
    # (the report names the bound); on the host, pageable memory.
    t = torch.randn(1 << 18, device=device)
    path = tmp_path / "m.safetensors"
    on_gpu = device == "cuda"
    copied = str(256 << 20) if on_gpu else "pageable"
    for device_copy, expected in [(None, copied), (False, "pinned" if on_gpu else "pageable")]:
        report = ferry.save_async(path, {"t": t}, device_copy=device_copy).wait()
        assert report["memory"] == expected, (device_copy, report)
        assert report["device_copied"] == (t.nbytes if on_gpu and device_copy is None else 0)
    assert ferry.save_async(path, {"t": t}, memory="pinned").wait()["memory"] == "pinned"
    assert ferry.save_async(path, {"t": t}, memory=1 << 20).wait()["memory"] == str(1 << 20)
    assert torch.equal(_load(path)["t"], t.cpu())


def test_reserving_the_device_copy_holds_nothing_for_host_tensors():
    state = {"model": {"w": torch.zeros(8)}, "step": 3}
    for device_copy in (None, True, False):
        assert ferry.reserve_device_copy(state, device_copy=device_copy) == 0


@cuda
def test_a_reserved_device_copy_lets_the_first_save_allocate_nothing(tmp_path):
    # Sizes nothing else here caches: the first save can find only the reservation's memory.
    state = {
        "model": {"w": torch.randn(1_048_576 + 8_195, device="cuda")},
        "optim": {"m": torch.randn(1_048_576 + 4_097, device="cuda"), "lr": 0.1},
    }
    nbytes = sum(t.nbytes for t in (state["model"]["w"], state["optim"]["m"]))
    assert ferry.reserve_device_copy(state, device_copy=False) == 0
    assert ferry.reserve_device_copy(state, device_copy=True) == nbytes
    before = ferry.memory_stats("cuda")["device_allocations"]
    report = ferry.save_async(tmp_path / "r.safetensors", state, device_copy=True).wait()
    assert report["device_copied"] == nbytes
    assert ferry.memory_stats("cuda")["device_allocations"] == before
    back = ferry.load(tmp_path / "r.safetensors")
    assert torch.equal(back["model"]["w"], state["model"]["w"].cpu())
    assert back["optim"]["lr"] == 0.1


@cuda
def test_the_call_queues_the_device_copy_and_never_waits_for_the_gpu(tmp_path):
    # With the GPU held busy by a kernel queued before the call, the call returns while it still
    # runs: the copies are queued behind it, and nothing in the call (the release of torch's
    # memory that the copies replace included) waits for them.
    state = {f"t{i}": torch.randn(4096, device="cuda") for i in range(64)}
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)  # about two seconds of one GPU thread spinning
    pending = ferry.save_async(tmp_path / "q.safetensors", state, device_copy=True)
    busy = not torch.cuda.current_stream().query()
    report = pending.wait()
    assert busy, "save_async waited for the GPU"
    assert report["device_copied"] == 64 * 4096 * 4
    assert torch.equal(_load(tmp_path / "q.safetensors")["t3"], state["t3"].cpu())


def test_bad_arguments_are_refused_with_the_fix(tmp_path):
    t = torch.zeros(4)
    # {"a": [1, 2]} is a nested state now (test_nested_and_dcp.py); an object JSON cannot hold
    # is still refused.
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        ferry.save_async(tmp_path / "a.safetensors", {"a": object()})
    with pytest.raises(TypeError, match="'auto', 'pageable', 'pinned' or a byte count"):
        ferry.save_async(tmp_path / "a.safetensors", {"a": t}, memory=1.5)
    with pytest.raises(ValueError, match='not one of "auto"'):
        ferry.save_async(tmp_path / "a.safetensors", {"a": t}, memory="fast")
    with pytest.raises(ValueError, match="positive"):
        ferry.save_async(tmp_path / "a.safetensors", {"a": t}, memory=0)
    with pytest.raises(ferry.FerryError, match="no file|No such file"):
        ferry.save_async(tmp_path / "missing" / "a.safetensors", {"a": t})
    with pytest.raises(ferry.FerryError, match="more than once"):
        ferry.save_async(tmp_path / "a.safetensors", [("a", t), ("a", t)])
    assert os.listdir(tmp_path) == []


@cuda
@pytest.mark.parametrize("side_stream", [False, True])
def test_the_copies_come_after_torchs_queued_work(tmp_path, side_stream):
    x = torch.zeros(1 << 26, device="cuda")  # 256 MiB
    s = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time before the write
        x.fill_(1.0)
        pending = ferry.save_async(tmp_path / "x.safetensors", {"x": x})
    pending.wait()
    saved = _load(tmp_path / "x.safetensors")["x"]
    assert bool((saved == 1.0).all()), f"{int((saved != 1.0).sum())} elements read too early"


def test_a_training_loop_saving_to_one_file_never_waits_on_itself(tmp_path):
    # Each save waits for the one before to the same file, which is renamed only once checked;
    # the optimizer's barrier and the next call check it, so a loop that never waits goes on.
    path = tmp_path / "latest.safetensors"
    model, opt = _sgd_model("cpu")
    for step in range(4):
        model(torch.randn(8, 512)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
        pending = ferry.save_async(path, model.state_dict())
    pending.wait()
    _same(_load(path), expected)


@cuda
@pytest.mark.parametrize("device_copy", [None, True])
def test_with_a_device_copy_writes_after_the_call_wait_for_nothing(tmp_path, device_copy):
    # Two dtypes, a view that is not contiguous, and an optimizer: all written right after the
    # call, with no barrier, and the file still holds the moment of the call. By default
    # (None) too: a few MiB find room on any GPU.
    model, opt = _sgd_model("cuda")
    model(torch.randn(64, 512, device="cuda")).square().sum().backward()
    half = torch.arange(4096, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    strided = torch.arange(64 * 64, device="cuda", dtype=torch.float32).view(64, 64).t()
    state = {**model.state_dict(), "half": half, "strided": strided}
    before = {k: v.detach().contiguous().clone() for k, v in state.items()}
    path = tmp_path / "d.safetensors"
    pending = ferry.save_async(
        path, state, memory=1 << 16, staging_bytes=1 << 16, device_copy=device_copy
    )
    # Every GPU tensor was copied in the call: the step's pre-hook has nothing to wait for.
    assert pending._private
    opt.step()
    half.add_(1.0)
    strided.mul_(-1.0)
    assert not torch.equal(model.weight.detach(), before["weight"]), "the step moved the weights"
    pending.wait()
    _same(_load(path), before)


@cuda
def test_a_device_copy_is_not_overtaken_by_a_write_on_torchs_side_stream(tmp_path):
    # The side stream is still busy at the call; the write queued after order_writes() must
    # come after ferry's copy on the device, or the copy would read a half-written tensor.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.randn(64 << 20, device="cuda")
        expected = x.clone()
        torch.cuda._sleep(50_000_000)
        path = tmp_path / "side.safetensors"
        pending = ferry.save_async(path, {"x": x}, device_copy=True)
        # 256 MiB: copied on ferry's copy stream, beside what torch queues next.
        assert pending._inner.side_copied() == ["x"]
        pending.order_writes()
        x.fill_(-1.0)
    assert pending._private
    pending.wait()
    assert torch.equal(_load(path)["x"], expected.cpu())
    side.synchronize()
    assert bool((x == -1.0).all()), "the write ran"


@cuda
def test_large_tensors_are_copied_beside_the_next_step_and_its_optimizer_orders_them(tmp_path):
    # A 4 MiB weight is copied on ferry's copy stream: the forward and backward torch queues
    # next do not wait for it, the optimizer's step does (on the GPU), and the file holds the
    # moment of the call. A small tensor (a norm's statistics) is copied in torch's order, so a
    # write to it before the step is safe.
    model = torch.nn.Linear(1024, 1024, bias=False).cuda()
    stats = torch.zeros(256, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(64, 1024, device="cuda")
    model(x).square().sum().backward()
    opt.zero_grad()
    state = {"weight": model.weight, "stats": stats}
    before = {k: v.detach().clone() for k, v in state.items()}
    path = tmp_path / "beside.safetensors"
    pending = ferry.save_async(path, state)
    assert pending._inner.side_copied() == ["weight"]
    stats.add_(1.0)  # in the forward, say
    model(x).square().sum().backward()
    opt.step()
    assert not torch.equal(model.weight.detach(), before["weight"]), "the step moved it"
    pending.wait()
    _same(_load(path), before)


@cuda
def test_a_write_before_the_device_copy_is_ordered_keeps_the_old_file(tmp_path):
    # Written in place right after the call, outside an optimizer step and without
    # order_writes(): the write may have raced the copy on ferry's copy stream, so the save
    # keeps the previous file and says which tensor, rather than write a file of two moments.
    path = tmp_path / "raced.safetensors"
    w = torch.full((1 << 20,), 3.0, device="cuda")
    ferry.save_async(path, {"w": w}).wait()
    pending = ferry.save_async(path, {"w": w})
    w.mul_(2.0)
    with pytest.raises(ferry.FerryError, match="'w' was written in place .* device copy"):
        pending.wait()
    assert torch.equal(_load(path)["w"], torch.full((1 << 20,), 3.0))
    assert sorted(os.listdir(tmp_path)) == ["raced.safetensors"], "no temporary is left"
    # Dropping the save orders torch's streams after its copies (without waiting for the
    # snapshot, which lasts as long as the write): a write after the drop is safe.
    pending = ferry.save_async(path, {"w": w})
    pending.__del__()
    w.mul_(2.0)
    pending.wait()
    assert torch.equal(_load(path)["w"], torch.full((1 << 20,), 6.0))


_STEPS_WHILE_ANOTHER_THREAD_SAVES = """
import faulthandler, os, sys, threading, torch, ferry
faulthandler.dump_traceback_later(60, exit=True)
model = torch.nn.Linear(256, 256)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
stop = False
def saver():
    while not stop:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ferry.save_async(os.path.join(sys.argv[1], "x.safetensors"), state).wait()
thread = threading.Thread(target=saver)
thread.start()
for _ in range(400):
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    opt.zero_grad()
stop = True
thread.join()
print("ok")
"""


def test_a_save_waited_for_on_another_thread_never_deadlocks_the_optimizers_barrier(tmp_path):
    # dcp.async_save's pattern: a thread waits for its save while the training thread steps.
    # The extension's wait_snapshot waits without the GIL holding the save's lock; a step's
    # barrier asking the same save then held the GIL waiting for that lock (400 steps
    # deadlocked every time before the package serialized its calls). In a child process, so
    # that a deadlock fails the test instead of hanging the suite.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _STEPS_WHILE_ANOTHER_THREAD_SAVES, str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.skipif(
    not (torch.cuda.is_available() and ferry.cuda_available() and torch.cuda.device_count() > 1),
    reason="needs two CUDA devices",
)
@pytest.mark.parametrize("device_copy", [None, False])
def test_tensors_on_two_gpus_are_saved_each_after_its_own_gpus_work(tmp_path, device_copy):
    # Each GPU's copies come after the work torch queued on that GPU's current stream.
    state = {}
    for gpu in (0, 1):
        with torch.cuda.device(gpu):
            t = torch.zeros(1 << 22, device=f"cuda:{gpu}")
            torch.cuda._sleep(20_000_000)
            t.fill_(gpu + 1.0)
            state[f"t{gpu}"] = t
    path = tmp_path / "two.safetensors"
    report = ferry.save_async(path, state, device_copy=device_copy).wait()
    assert report["device_bytes"] == 2 * (1 << 24)
    back = _load(path)
    assert bool((back["t0"] == 1.0).all()) and bool((back["t1"] == 2.0).all())
