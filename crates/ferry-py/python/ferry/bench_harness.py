"""What every Python bench shares, ``python -m ferry.bench`` and the PyTorch scripts of
``ferry bench`` (crates/ferry-bench/python) alike: importing torch, the ``--serve`` loop, timing,
saved activations, medians, tables, and the optimizer rows both optimizer-offload benches compare.

It imports nothing but the standard library (torch is passed in or imported when used), so the
scripts load this file by its path in the repository with only torch installed.

The ``--serve`` protocol (crates/ferry-bench/src/harness/pytorch.rs speaks the other end): the
first line is ``{"ready": true, "torch": ..., "cuda": ..., "device": ..., ...}``, or
``{"error": why}`` followed by exit status 1 when PyTorch or the GPUs it needs are missing. Then
each request line on stdin gets exactly one JSON line back: the handler's dict, or
``{<echo>: request, "error": "Type: msg"}`` when the handler raised. ``quit`` or the end of stdin
ends the loop.
"""

import json
import statistics
import sys
import time

__all__ = ["emit", "import_torch", "require_torch", "describe", "serve", "count", "synced_ms",
           "timed_steps", "saved_storages", "median", "table", "SimpleOffload", "optimizer_rows"]


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


def count(text, what, zero_ok=False):
    """The count a request spells as ``text``, at least 1 (0 too when ``zero_ok``); ValueError
    naming ``what`` otherwise."""
    value = int(text)
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{what} must be {'>= 0' if zero_ok else '>= 1'}, got {value}")
    return value


def synced_ms(torch, work):
    """Milliseconds of work(), from issue to usable result: the GPU synchronized before the
    clock starts and before it stops (time.perf_counter), so the sample is the whole of the
    work. What work() returns is dropped after the clock stops, so freeing it is not timed."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = work()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    del result
    return ms


def timed_steps(torch, step, warmup, samples):
    """Milliseconds of each of ``samples`` calls of step() after ``warmup`` untimed ones, the GPU
    synchronized after each, and the peak GPU memory allocated over the timed ones (bytes)."""
    times = []
    for i in range(warmup + samples):
        if i == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times, torch.cuda.max_memory_allocated()


def saved_storages(torch, forward, counted=lambda t: True):
    """(bytes, count) of the distinct storages autograd saves for backward while forward() runs
    (its result dropped after), of the saved tensors counted(t) accepts. Only the forward: the
    graph holds every saved tensor until it is dropped, so no address is reused while counting."""
    storages = {}

    def pack(t):
        if counted(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(storages.values()), len(storages)


def median(samples, empty=None):
    """The median of the samples (the mean of the two middle ones for an even count); ``empty``
    for no samples when given, else statistics.StatisticsError."""
    if not samples and empty is not None:
        return empty
    return statistics.median(samples)


def table(header, rows):
    """A Markdown table's lines: the header, its rule, one line per row of cells (strings; an
    empty cell stays one space wide)."""
    line = lambda cells: " ".join(["|", *(f"{c} |" if c else "|" for c in cells)])  # noqa: E731
    return [line(header), "|" + "---|" * len(header), *map(line, rows)]


class SimpleOffload:
    """The simple optimizer offload: after backward, every gradient to pinned host memory, torch's
    fused CPU AdamW on fp32 host copies of the weights, the weights back; nothing overlaps."""

    def __init__(self, params, lr):
        import torch

        self.params = list(params)
        self.host = [p.detach().to("cpu", torch.float32).pin_memory() for p in self.params]
        self.grads = [torch.empty_like(h).pin_memory() for h in self.host]
        self.opt = torch.optim.AdamW(self.host, lr=lr, fused=True)
        self.synchronize = torch.cuda.synchronize

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        for p, g in zip(self.params, self.grads):
            g.copy_(p.grad, non_blocking=True)
        self.synchronize()
        for h, g in zip(self.host, self.grads):
            h.grad = g
        self.opt.step()
        for p, h in zip(self.params, self.host):
            p.detach().copy_(h, non_blocking=True)


def optimizer_rows(torch, lr):
    """The rows both optimizer-offload benches compare, (name, maker over parameters) in the order
    they run: torch's fused AdamW on the GPU (the baseline, first), the simple offload, and
    torchao's CPUOffloadOptimizer (fused CPU AdamW), also with offload_gradients=True, where
    torchao is importable; and a note saying why torchao's rows are left out, or None."""
    rows = [
        ("AdamW on the GPU (fused)", lambda ps: torch.optim.AdamW(ps, lr=lr, fused=True)),
        ("simple offload", lambda ps: SimpleOffload(ps, lr)),
    ]
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as err:
        return rows, f"torchao is not importable ({err}): its rows are left out"
    for name, options in (("torchao CPUOffloadOptimizer", {}),
                          ("torchao, offload_gradients=True", {"offload_gradients": True})):
        rows.append((name, lambda ps, options=options: CPUOffloadOptimizer(
            ps, torch.optim.AdamW, lr=lr, fused=True, **options)))
    return rows, None
