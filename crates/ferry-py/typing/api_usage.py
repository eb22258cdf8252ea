"""What a typed program calls in ferry, checked by mypy in CI (`.ci/run`) against the package's
annotations and `_ferry.pyi`: a wrong stub, or an annotation that drifts from what the package
returns, fails here. Never run; only type-checked."""

from typing import Any

import numpy as np

import ferry
from ferry import _ferry


def moves(x: np.ndarray) -> None:
    t: _ferry.Tensor = _ferry.from_dlpack(x)
    shape: list[int] = t.shape
    dtype: str = t.dtype
    moved, report = _ferry.to_chunked(x, "cpu", chunks=2)
    path: str = report.path
    bytes_moved: int = report.bytes_moved
    pending: _ferry.Pending = _ferry.to_async(x, "cpu")
    landed, _ = pending.wait()
    stream: _ferry.ChunkStream = _ferry.stream_to(x, chunks=4)
    for index, start, stop, chunk in stream:
        rows: int = stop - start
    waited: float = stream.waited_ms
    stream.close()
    print(shape, dtype, moved, path, bytes_moved, landed, index, rows, chunk, waited)


def memory() -> None:
    available: bool = ferry.cuda_available()
    if available:
        stats: dict = ferry.memory_stats(0)
        ferry.reset_peak_memory_stats()
        ferry.empty_cache("cuda:0")
        print(stats["allocated_bytes.all.current"])
    budget: int = _ferry.pinned_budget()
    print(budget)


def errors() -> None:
    try:
        _ferry.to(np.ones(3), "tpu")
    except ferry.FerryError as err:
        message: str = str(err)
        print(message)


def checkpoints(model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
    held: int = ferry.reserve_device_copy({"model": model_state}, device_copy=None)
    print(held)
    pending: ferry.PendingSave = ferry.save_async(
        "ckpt.safetensors", {"model": model_state, "optim": optim_state}, metadata={"step": "7"}
    )
    taken: bool = pending.snapshot_taken()
    report: dict[str, Any] = pending.wait()
    flat: ferry.PendingSave = ferry.save_async("flat.safetensors", model_state, memory=1 << 20)
    flat.wait_snapshot()
    state = ferry.load("ckpt.safetensors", device="cpu")
    on_gpu = ferry.load("ckpt.safetensors", 0)
    strings: dict[str, str] = ferry.load_metadata("ckpt.safetensors")
    print(taken, report["bytes"], state["optim"], on_gpu, strings)


def distributed_checkpoints(state: dict[str, Any]) -> None:
    import ferry.dcp

    writer = ferry.dcp.FerryStorageWriter("ckpt/step-100", overwrite=False, memory="pinned")
    reader = ferry.dcp.FerryStorageReader("ckpt/step-100")
    staged: dict[str, Any] = ferry.dcp.FerryStager().stage(state)
    info = ferry.dcp.StorageInfo("__0_0.safetensors", 64, 16, name="model.weight")
    print(writer.checkpoint_id, reader.checkpoint_id, staged, info.relative_path)


def memory_plan(model: Any, step: Any) -> None:
    import ferry.plan

    plan = ferry.plan.MemoryPlan.profile(model, step, fraction=0.5)
    with plan:
        step()
    smaller: ferry.plan.MemoryPlan = plan.retarget(fraction=0.4)
    print(plan.explain(), smaller.predicted_peak_bytes, smaller.reachable)
