"""ferry's device moves for PyTorch tensors.

Every function takes torch tensors and returns torch tensors; the bytes cross between torch and
ferry through DLPack, without copies. A move of a tensor that requires grad is recorded in
torch's graph (a ``torch.autograd.Function``), so the gradient goes back to the source device
and dtype as it does for ``t.to(...)``::

    import torch, ferry
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    y = ferry.cpu(x)                      # like x.cpu(), faster
    y.sum().backward()                    # x.grad is on cuda:0
    h = ferry.to(x.detach(), "cpu", dtype=torch.float16)
    p = ferry.to(x.detach(), "cpu", non_blocking=True)
    # a PendingMove while the copy is in flight, else the tensor itself (landed, or beyond the
    # pinned budget): wait() hands the tensor out only once the copy has landed
    host = p.wait() if isinstance(p, ferry.PendingMove) else p

Errors are ``ferry.FerryError`` (a ``RuntimeError``) with ferry's message, which names the fix.
"""

from __future__ import annotations

import sys
import warnings
from typing import NamedTuple

from . import _ferry
from ._ferry import FerryError, Pending, Tensor, TransferReport

__all__ = [
    "Chunk",
    "ChunkStream",
    "FerryError",
    "PendingMove",
    "PendingSave",
    "Tensor",
    "TransferReport",
    "cpu",
    "cuda_available",
    "empty_cache",
    "empty_pinned",
    "from_torch",
    "load",
    "load_metadata",
    "memory_stats",
    "move_state_dict",
    "offload_saved",
    "pin_",
    "pinned_budget",
    "pinned_stats",
    "record_stream",
    "reserve_device_copy",
    "reset_peak_memory_stats",
    "save_async",
    "set_pinned_budget",
    "stream_to",
    "to",
    "to_async",
    "to_chunked",
    "to_torch",
]
__version__ = _ferry.__version__

cuda_available = _ferry.cuda_available
pinned_budget = _ferry.pinned_budget
pinned_stats = _ferry.pinned_stats
set_pinned_budget = _ferry.set_pinned_budget

_TORCH = None


def _torch():
    """torch, imported on first use; ferry then learns to ask it for its current streams."""
    global _TORCH
    if _TORCH is None:
        import torch

        def current_streams(ordinals):
            # Never initializes CUDA: without it torch has queued nothing on any GPU.
            if not torch.cuda.is_initialized():
                return []
            return [torch.cuda.current_stream(i).cuda_stream for i in ordinals]

        _ferry.set_current_streams(current_streams)
        _TORCH = torch
    return _TORCH


def _is_torch(t) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(t, torch.Tensor)


def _device_name(device) -> str:
    """'cpu' or 'cuda:N' from a str, an int or a torch.device; a bare 'cuda' is torch's current
    device, as it is for torch's own moves."""
    if isinstance(device, int):
        return f"cuda:{device}"
    text = str(device)
    if text == "cuda":
        torch = sys.modules.get("torch")
        # torch's current device is 0 until CUDA is initialized (set_device initializes it).
        initialized = torch is not None and torch.cuda.is_initialized()
        return f"cuda:{torch.cuda.current_device()}" if initialized else "cuda:0"
    return text


def _gpu_name(device) -> str:
    """'cuda:N' for the memory functions: a str, an int, a torch.device, or None for torch's
    current device, as torch.cuda's own take."""
    return _device_name("cuda" if device is None else device)


def memory_stats(device=None) -> dict:
    """The statistics of ferry's allocator on GPU ``device`` (``None``: torch's current device;
    an int, ``"cuda:N"`` or a ``torch.device``), ferry's own memory only: ``allocated_bytes``,
    ``reserved_bytes``, ``peak_allocated_bytes``, ``allocations``, ``cache_hits``,
    ``device_allocations``, ``frees``, and the same bytes under ``torch.cuda.memory_stats``'s
    names (``allocated_bytes.all.current``, ``allocated_bytes.all.peak``,
    ``reserved_bytes.all.current``)."""
    stats = _ferry.memory_stats(_gpu_name(device))
    stats["allocated_bytes.all.current"] = stats["allocated_bytes"]
    stats["allocated_bytes.all.peak"] = stats["peak_allocated_bytes"]
    stats["reserved_bytes.all.current"] = stats["reserved_bytes"]
    return stats


def empty_cache(device=None) -> None:
    """Returns the cached blocks of ferry's allocator on GPU ``device`` (as
    :func:`memory_stats` takes it) to the driver, like ``torch.cuda.empty_cache``; ``"cpu"``
    empties the pinned pool instead."""
    _ferry.empty_cache(_gpu_name(device))


def reset_peak_memory_stats(device=None) -> None:
    """Starts ``peak_allocated_bytes`` of GPU ``device`` (as :func:`memory_stats` takes it) over
    from what is allocated now."""
    _ferry.reset_peak_memory_stats(_gpu_name(device))


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _gpu(device: str) -> int | None:
    return int(device.split(":")[1]) if device.startswith("cuda:") else None


def _current_stream(gpu: int | None) -> int | None:
    """torch's current stream on GPU ``gpu`` as a handle, or None (no GPU, or no torch)."""
    if gpu is None or "torch" not in sys.modules:
        return None
    return _torch().cuda.current_stream(gpu).cuda_stream


def _source(t):
    """What crosses into ferry for ``t``, and its device: a torch tensor as a DLPack capsule made
    with no synchronization (ferry orders itself with torch's current stream), anything else
    (a numpy array, a ferry.Tensor) as it is."""
    if _is_torch(t):
        torch = _torch()
        t = t.detach() if t.requires_grad else t
        device = _device_name(t.device)
        to_dlpack = getattr(torch._C, "_to_dlpack", None)
        if to_dlpack is not None:
            return to_dlpack(t), device
        return t.__dlpack__(stream=-1) if t.is_cuda else t.__dlpack__(), device
    kind, index = t.__dlpack_device__()
    return t, (f"cuda:{index}" if kind == 2 else "cpu")


def _from_capsule(capsule):
    torch = _torch()
    from_dlpack = getattr(torch._C, "_from_dlpack", None)
    return from_dlpack(capsule) if from_dlpack is not None else torch.from_dlpack(capsule)


def from_torch(t) -> Tensor:
    """A ferry tensor over ``t``'s memory (no copy); it keeps ``t`` alive. Memory that is not
    aligned to its dtype is refused (sharing it is the point): pass a ``.clone()``."""
    return _ferry.from_dlpack(t.detach() if getattr(t, "requires_grad", False) else t)


def to_torch(x: Tensor, stream=None):
    """A torch tensor over ``x``'s memory (no copy); ferry's memory returns to its pools when
    torch frees it, after the work torch queued on it (on its current stream) has run. A GPU
    tensor is handed to ``stream`` (torch's current stream by default), which waits for
    ferry's work on it on the device."""
    if x.device.startswith("cuda"):
        if stream is None:
            stream = _current_stream(_gpu(x.device))
        return _from_capsule(x.__dlpack__(stream=1 if stream == 0 else stream))
    return _from_capsule(x.__dlpack__())


class PendingMove:
    """A move in flight. ``ready()`` never blocks; ``wait()`` returns the torch tensor once its
    copy has landed (and sets ``report``): the tensor cannot be had before that.

    A move from :func:`to_async` runs on ferry's copy stream while torch computes, so its source
    is in use until the copy lands, as with a torch side stream: work queued on torch's stream
    after the call (``x.fill_(1.0)``) may overtake the copy's read. Call :meth:`order_stream`
    before writing the source (it makes the current stream wait for the copy on the device,
    without a host wait), or ``wait()`` first. ``wait()`` warns when the source was written in
    place before either. A ``ferry.to(..., non_blocking=True)`` move is ordered with torch's
    current stream already."""

    def __init__(self, pending: Pending, gpu: int | None = None, source=None, on_default=False):
        self._pending = pending
        self._gpu = gpu
        self._source = source if _is_torch(source) else None
        self._version = self._source._version if self._source is not None else None
        # The source's version when the copy was last known to be safe from later writes.
        self._safe_version = self._version if on_default else None
        self.report: TransferReport | None = None

    def _now_safe(self) -> None:
        if self._source is not None and self._safe_version is None:
            self._safe_version = self._source._version

    def ready(self) -> bool:
        done = self._pending.ready()
        if done:
            self._now_safe()
        return done

    def order_stream(self, stream=None) -> None:
        """Makes ``stream`` (torch's current stream by default) wait, on the device, for the
        copy: work queued there afterwards (a write of the source, a kernel that reads the
        result) runs after the copy has landed. Never blocks the host."""
        if self._gpu is None:
            return
        if stream is None:
            stream = _torch().cuda.current_stream(self._gpu)
        index = stream.device.index if stream.device.index is not None else self._gpu
        self._pending.order_stream(index, stream.cuda_stream)
        self._now_safe()

    def wait(self):
        tensor, self.report = self._pending.wait()
        if self._source is not None:
            last = self._source._version if self._safe_version is None else self._safe_version
            written = last != self._version
            self._source = None
            if written:
                warnings.warn(
                    "the source of ferry.to_async was written in place before its copy was known "
                    "to have landed: the result may hold the new values. Call "
                    "pending.order_stream() (no host wait) or pending.wait() before writing it.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return to_torch(tensor)


def _move(t, device: str, dtype: str | None, non_blocking: bool):
    """(torch tensor or PendingMove, report), without autograd."""
    capsule, source = _source(t)
    gpu = _gpu(source) if _gpu(source) is not None else _gpu(device)
    out = _ferry.to(capsule, device, dtype, non_blocking, _current_stream(gpu), source)
    if isinstance(out, Pending):
        return PendingMove(out, gpu, t, on_default=True), None
    tensor, report = out
    return to_torch(tensor), report


def _autograd_move():
    torch = _torch()

    class Move(torch.autograd.Function):
        """A device move in torch's graph: backward moves the gradient home (device, dtype)."""

        @staticmethod
        def forward(ctx, t, device, dtype, reports=None):
            ctx.home = (_device_name(t.device), _dtype_name(t.dtype))
            out, report = _move(t.detach(), device, dtype, False)
            if reports is not None:
                reports.append(report)
            return out

        @staticmethod
        def backward(ctx, grad):
            # The gradient goes home through this same Function: under create_graph its move
            # is in the graph too, so second derivatives flow through it (a raw copy here
            # would cut them silently).
            device, dtype = ctx.home
            return Move.apply(grad.contiguous(), device, dtype), None, None, None

    return Move


_MOVE = None


def to(t, device, dtype=None, non_blocking: bool = False, report: bool = False):
    """``t`` on ``device`` ('cpu', 'cuda' (torch's current device), 'cuda:N', an int or a
    torch.device), cast to ``dtype`` on the way (on whichever side moves fewer bytes).

    Ordered with torch's current stream, as ``t.to(...)`` is: the move reads what torch queued
    before it, and nothing torch queues after it can overtake its reads or writes, inside
    ``torch.cuda.stream(s)`` too. ``non_blocking=True`` returns a :class:`PendingMove` for a
    GPU-to-host move still in flight (beyond the pinned budget the move blocks instead and the
    tensor comes back at once). A tensor that requires grad (with grad enabled) is moved in
    torch's graph, blocking. ``report=True`` returns ``(tensor, TransferReport)``. Host memory
    not aligned to its dtype (an odd-offset numpy view) is copied into aligned memory first
    (``report.realigned_bytes``).
    """
    global _MOVE
    torch = _torch()
    device, dtype = _device_name(device), _dtype_name(dtype)
    if getattr(t, "requires_grad", False) and torch.is_grad_enabled():
        if _MOVE is None:
            _MOVE = _autograd_move()
        reports = []
        out = _MOVE.apply(t, device, dtype, reports)
        return (out, reports[0]) if report else out
    out, rep = _move(t, device, dtype, non_blocking)
    return (out, rep) if report else out


def cpu(t, report: bool = False):
    """``t`` on the host, like ``t.cpu()`` (gradient path kept when ``t`` requires grad)."""
    return to(t, "cpu", report=report)


def to_chunked(t, device, chunks=None, max_staging_bytes=None, report: bool = False):
    """``t`` on ``device`` in pieces along axis 0 through bounded pinned staging: at most a
    ``chunks``-th of the tensor (a quarter by default), or at most ``max_staging_bytes``, never
    less than one row. Detached: no gradient path. Ordered with torch's current stream."""
    device = _device_name(device)
    capsule, source = _source(t)
    gpu = _gpu(source) if _gpu(source) is not None else _gpu(device)
    tensor, rep = _ferry.to_chunked(
        capsule, device, chunks, max_staging_bytes, _current_stream(gpu), source
    )
    out = to_torch(tensor)
    return (out, rep) if report else out


def move_state_dict(state_dict, device, report: bool = False):
    """A state dict (name to tensor) on ``device``, batched by dtype; values are detached.
    Ordered with torch's current stream on every GPU involved. Going to the host, each tensor
    of 4 MiB or more starts crossing as the loop over the dict reaches it, the small ones
    follow packed into one copy, and the results are made torch tensors while the last bytes
    cross: the call returns once all have landed."""
    torch = _torch()  # the results are torch tensors; ferry learns torch's streams here
    move = _ferry.StateDictMove(_device_name(device))
    add = move.add
    # The common case, torch tensors, without _source's per-tensor work: the capsule says its
    # device.
    tensor, to_dlpack = torch.Tensor, getattr(torch._C, "_to_dlpack", None)
    for name, value in state_dict.items():
        if to_dlpack is not None and isinstance(value, tensor):
            add(name, to_dlpack(value.detach() if value.requires_grad else value))
        else:
            add(name, *_source(value))
    from_dlpack = getattr(torch._C, "_from_dlpack", None) or torch.from_dlpack
    out, rep = move.finish(from_dlpack)
    return (out, rep) if report else out


def empty_pinned(shape, dtype="float32"):
    """An uninitialised host tensor (torch) of ``shape`` in page-locked memory from ferry's
    pinned pool. Its block returns to the pool when torch frees the tensor, once the work torch
    had queued on its current stream by then has run (a copy from it still in flight, say); see
    :func:`record_stream` for others. Beyond the pinned budget it raises ``FerryError`` (a
    ``RuntimeError``), as ``torch.empty(..., pin_memory=True)`` raises when it cannot pin."""
    shape = list(shape)
    block = _ferry.empty_pinned(shape, _dtype_name(dtype))
    if block is None:
        stats = _ferry.pinned_stats()
        raise FerryError(
            f"empty_pinned: a {dtype} tensor of shape {tuple(shape)} does not fit ferry's pinned "
            f"budget ({stats['budget_bytes']} bytes, {stats['allocated_bytes']} in use): free "
            "pinned tensors, raise the budget with ferry.set_pinned_budget(...), or use "
            "pageable memory (torch.empty)"
        )
    return to_torch(block)


def pin_(t):
    """Page-locks the memory of host tensor ``t`` where it is (``cuMemHostRegister``), within
    ferry's pinned budget, and returns ``t``: later moves of it, torch's
    ``t.to('cuda', non_blocking=True)`` included, are direct DMA at the link. ``t`` is rebound
    (``set_``) to a storage over the same memory that keeps it locked; the memory is unregistered
    when that storage is freed, after the copies torch queued from it have run. A tensor pinned
    already is returned as it is. Beyond the budget, a ``FerryError`` names it and how to raise
    it (``set_pinned_budget``, ``FERRY_PINNED_BUDGET``)."""
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise TypeError("pin_ takes a torch tensor on the host")
    if t.is_cuda:
        raise ValueError(f"pin_ page-locks host memory; this tensor is on {t.device}")
    if t.is_pinned() or t.numel() == 0:
        return t
    # A capsule of another tensor over the same storage: the capsule holds its tensor, and one
    # holding `t` itself would, after `set_`, hold the new storage that holds the capsule.
    capsule, _ = _source(t.detach())
    locked, newly = _ferry.pin(capsule)
    if newly:
        view = to_torch(locked)
        with torch.no_grad():
            t.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())
    return t


def record_stream(t, stream) -> None:
    """Tells ferry that ``t`` is used by work queued on torch stream ``stream``, as
    ``torch.Tensor.record_stream`` does for torch's memory: ferry's memory behind ``t`` (a
    result of a move, pinned or on a GPU, or memory pinned by :func:`pin_`) is not reused before
    the work queued there by the time ``t`` is freed has run. Without it ferry orders reuse
    after torch's current stream only. For torch's own memory it calls
    ``t.record_stream(stream)`` (GPU tensors; torch tracks its own pinned memory itself)."""
    torch = _torch()
    index = stream.device.index if stream.device.index is not None else torch.cuda.current_device()
    if _ferry.record_stream(t.data_ptr(), t.is_cuda, index, stream.cuda_stream):
        return
    if t.is_cuda:
        t.record_stream(stream)


def to_async(t, device) -> PendingMove:
    """``t`` on ``device`` (a GPU-to-host or host-to-GPU move), queued on a copy stream ferry
    keeps for that GPU and returned at once: the copy runs while torch computes. It reads what
    was queued on torch's current stream before the call; what is queued there after it is not
    ordered after the copy, so the source is in use until the copy lands: call
    ``order_stream()`` on the result before writing the source (no host wait), or ``wait()``.
    ``wait()`` hands the tensor out once it has landed. Detached: no gradient path."""
    device = _device_name(device)
    capsule, source = _source(t)
    gpu = _gpu(source) if _gpu(source) is not None else _gpu(device)
    pending = _ferry.to_async(capsule, device, _current_stream(gpu), source)
    return PendingMove(pending, gpu, t)


class Chunk(NamedTuple):
    """One host chunk of a streamed tensor: its position, the rows of the source it holds, and
    the rows themselves (a torch tensor on the host, detached)."""

    index: int
    rows: range
    tensor: object


class ChunkStream:
    """The host chunks of a tensor along axis 0, in order (see :func:`stream_to`). Iterate it;
    ``close()`` (or leaving a ``with`` block) stops early and gives the staging back."""

    def __init__(self, inner, source=None):
        self._inner = inner
        self._source = source if _is_torch(source) else None
        self._version = self._source._version if self._source is not None else None
        # What waited_ms and report said when the stream was closed: they stay readable after
        # a `with` block, as the docs print them.
        self._closed = None

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        index, start, stop, tensor = next(self._inner)
        if self._source is not None and self._source._version != self._version:
            self.close()
            raise FerryError(
                "the source of ferry.stream_to was written in place while it streamed: chunks "
                f"from {index} on may hold the new values. Write it only after the stream is "
                "done (or closed), or stream a .clone()"
            )
        return Chunk(index, range(start, stop), to_torch(tensor))

    def __len__(self) -> int:
        return len(self._inner)

    @property
    def waited_ms(self) -> float:
        """How long iteration has waited for copies, in all (near 0 when the work per chunk
        outlasts a chunk's copy)."""
        return self._inner.waited_ms if self._closed is None else self._closed[0]

    @property
    def report(self) -> TransferReport | None:
        """The stream's report (``None`` until it has one); what it was at ``close()`` stays
        readable after it, and after the ``with`` block."""
        return self._inner.report if self._closed is None else self._closed[1]

    def close(self) -> None:
        if self._closed is None:
            self._closed = (self._inner.waited_ms, self._inner.report)
        self._inner.close()
        self._source = None

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


def stream_to(t, chunks=None, max_staging_bytes=None) -> ChunkStream:
    """The host chunks of ``t`` along axis 0, in order, while the next ones are in flight: a GPU
    tensor's chunks come through a ring of pinned staging (at most a ``chunks``-th of the
    tensor, a quarter by default, or at most ``max_staging_bytes``), a host tensor's are views
    of its rows. Each chunk is detached data; keeping one is safe (the ring takes a fresh block).
    The copies read what torch queued on its current stream before the call, and run on ferry's
    copy stream while torch computes: the source is in use until the stream is done, so do not
    write it before then (a write is detected: the next chunk raises ``FerryError``)."""
    capsule, source = _source(t)
    inner = _ferry.stream_to(
        capsule, chunks, max_staging_bytes, _current_stream(_gpu(source)), source
    )
    return ChunkStream(inner, t)


from .offload import offload_saved  # noqa: E402  (uses the moves above)
from .checkpoint import (  # noqa: E402
    PendingSave,
    load,
    load_metadata,
    reserve_device_copy,
    save_async,
)


def __getattr__(name):
    # ferry.optim subclasses torch.optim.Optimizer, ferry.dcp torch.distributed.checkpoint's
    # storage classes, and ferry.plan wraps torch modules, so they import torch: only on first
    # use.
    if name in ("optim", "dcp", "plan"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'ferry' has no attribute {name!r}")
