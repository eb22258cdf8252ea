"""What every PyTorch side of `ferry bench` shares: importing torch, the `--serve` loop, timing.

The `--serve` protocol (crates/ferry-bench/src/harness/pytorch.rs speaks the other end): the first
line is `{"ready": true, "torch": ..., "cuda": ..., "device": ..., ...}`, or `{"error": why}` followed
by exit status 1 when PyTorch or the GPUs it needs are missing. Then each request line on stdin
gets exactly one JSON line back: the handler's dict, or `{<echo>: request, "error": "Type: msg"}`
when the handler raised. `quit` or the end of stdin ends the loop.

A script imports this module after putting its own directory first on sys.path, so it works
when run by path from any directory:

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness
"""

import json
import statistics
import sys
import time


def emit(obj):
    """One JSON line on stdout, flushed: one answer."""
    print(json.dumps(obj), flush=True)


def import_torch(cuda=True, gpus=1, nccl=False):
    """(torch, None), or (None, a message saying why it cannot be used here).

    cuda: a CUDA device is needed; gpus: at least this many of them; nccl: torch.distributed
    with NCCL is needed too.
    """
    try:
        import torch
    except ImportError as err:
        return None, f"PyTorch is not importable with {sys.executable} ({err})"
    if not cuda:
        return torch, None
    if not torch.cuda.is_available():
        return None, f"PyTorch {torch.__version__} sees no CUDA device"
    if torch.cuda.device_count() < gpus:
        return None, (
            f"PyTorch sees {torch.cuda.device_count()} CUDA device(s); this needs {gpus}"
        )
    if nccl:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_nccl_available():
            return None, f"PyTorch {torch.__version__} was built without NCCL"
    return torch, None


def require_torch(**needs):
    """torch for a run outside --serve; without it, print {"error": why} and exit 1."""
    torch, why = import_torch(**needs)
    if torch is None:
        emit({"error": why})
        sys.exit(1)
    return torch


def load_gpt():
    """tests/torch/gpt.py as a module: the GPT of `ferry train gpt` in PyTorch, the model the
    benches that train ferry's GPT build on PyTorch's side."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[3] / "tests" / "torch" / "gpt.py"
    spec = importlib.util.spec_from_file_location("ferry_gpt", path)
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    return gpt


def describe(torch, **extra):
    """The hello line's facts: torch and CUDA versions, the first GPU's name (or why none)."""
    gpu = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "device": torch.cuda.get_device_name(0) if gpu else "no CUDA device",
        **extra,
    }


def serve(start, answer, torch_needs=None, echo="case", cleanup=None):
    """The `--serve` loop.

    start(torch) -> (state, hello): called once torch imported; hello is the dict after
    "ready". answer(state, request) -> dict: one request line (stripped), one answer; an
    exception becomes an error answer and the loop goes on. torch_needs: keyword arguments of
    import_torch. echo: the key that names the failed request in an error answer.
    cleanup(state): runs when the loop ends, however it ends.
    """
    torch = require_torch(**(torch_needs or {}))
    state, hello = start(torch)
    emit({"ready": True, **hello})
    try:
        for line in sys.stdin:
            request = line.strip()
            if request == "quit":
                break
            try:
                emit(answer(state, request))
            except Exception as err:  # one failed request must not end the others
                emit({echo: request, "error": f"{type(err).__name__}: {err}"})
    finally:
        if cleanup is not None:
            cleanup(state)


def synced_ms(torch, work):
    """Milliseconds of work(), the GPU synchronized before the clock starts and before it
    stops (time.perf_counter), so the sample is the whole of the work. What work() returns is
    dropped after the clock stops, so freeing it is not timed."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = work()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    del result
    return ms


def median(samples):
    """The median of the samples (the mean of the two middle ones for an even count)."""
    return statistics.median(samples)
