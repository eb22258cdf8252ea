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
    host = p.wait()                       # handed out only once the copy has landed

Errors are ``ferry.FerryError`` (a ``RuntimeError``) with ferry's message, which names the fix.
"""

from __future__ import annotations

from typing import NamedTuple

from . import _ferry
from ._ferry import FerryError, Pending, Tensor, TransferReport

__all__ = [
    "Chunk",
    "ChunkStream",
    "FerryError",
    "PendingMove",
    "Tensor",
    "TransferReport",
    "cpu",
    "cuda_available",
    "empty_cache",
    "empty_pinned",
    "from_torch",
    "memory_stats",
    "move_state_dict",
    "offload_saved",
    "pinned_budget",
    "pinned_stats",
    "reset_peak_memory_stats",
    "set_pinned_budget",
    "stream_to",
    "to",
    "to_async",
    "to_chunked",
    "to_torch",
]
__version__ = _ferry.__version__

cuda_available = _ferry.cuda_available
empty_cache = _ferry.empty_cache
memory_stats = _ferry.memory_stats
reset_peak_memory_stats = _ferry.reset_peak_memory_stats
pinned_budget = _ferry.pinned_budget
pinned_stats = _ferry.pinned_stats
set_pinned_budget = _ferry.set_pinned_budget


def _torch():
    import torch

    return torch


def _device_name(device) -> str:
    """'cpu', 'cuda' or 'cuda:N' from a str, an int or a torch.device."""
    if isinstance(device, int):
        return f"cuda:{device}"
    text = str(device)
    return "cuda:0" if text == "cuda" else text


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def from_torch(t) -> Tensor:
    """A ferry tensor over ``t``'s memory (no copy); it keeps ``t`` alive."""
    return _ferry.from_dlpack(t.detach() if getattr(t, "requires_grad", False) else t)


def to_torch(x: Tensor):
    """A torch tensor over ``x``'s memory (no copy); ferry's memory returns to its pools when
    torch frees it."""
    return _torch().from_dlpack(x)


class PendingMove:
    """A non-blocking move in flight: ``ready()`` never blocks, ``wait()`` returns the torch
    tensor once its copy has landed (and ``report`` is then set). The tensor cannot be had
    before that."""

    def __init__(self, pending: Pending):
        self._pending = pending
        self.report: TransferReport | None = None

    def ready(self) -> bool:
        return self._pending.ready()

    def wait(self):
        tensor, self.report = self._pending.wait()
        return to_torch(tensor)


def _move(t, device: str, dtype: str | None, non_blocking: bool):
    """(torch tensor or PendingMove, report or None), without autograd."""
    out = _ferry.to(t, device, dtype, non_blocking)
    if isinstance(out, Pending):
        return PendingMove(out), None
    tensor, report = out
    return to_torch(tensor), report


def _autograd_move():
    torch = _torch()

    class Move(torch.autograd.Function):
        """A device move in torch's graph: backward moves the gradient home (device, dtype)."""

        @staticmethod
        def forward(ctx, t, device, dtype):
            ctx.home = (_device_name(t.device), _dtype_name(t.dtype))
            out, _ = _move(t.detach(), device, dtype, False)
            return out

        @staticmethod
        def backward(ctx, grad):
            device, dtype = ctx.home
            back, _ = _move(grad.contiguous(), device, dtype, False)
            return back, None, None

    return Move


_MOVE = None


def to(t, device, dtype=None, non_blocking: bool = False, report: bool = False):
    """``t`` on ``device`` ('cpu', 'cuda', 'cuda:N', an int or a torch.device), cast to
    ``dtype`` on the way (on whichever side moves fewer bytes).

    ``non_blocking=True`` returns a :class:`PendingMove` for a GPU-to-host move still in flight
    (beyond the pinned budget the move blocks instead and the tensor comes back at once). A
    tensor that requires grad (with grad enabled) is moved in torch's graph, blocking.
    ``report=True`` returns ``(tensor, TransferReport)``.
    """
    global _MOVE
    torch = _torch()
    device, dtype = _device_name(device), _dtype_name(dtype)
    if getattr(t, "requires_grad", False) and torch.is_grad_enabled():
        if _MOVE is None:
            _MOVE = _autograd_move()
        out = _MOVE.apply(t, device, dtype)
        return (out, None) if report else out
    # Outside the graph (no grad, or grad disabled) the source crosses detached.
    source = t.detach() if getattr(t, "requires_grad", False) else t
    out, rep = _move(source, device, dtype, non_blocking)
    return (out, rep) if report else out


def cpu(t, report: bool = False):
    """``t`` on the host, like ``t.cpu()`` (gradient path kept when ``t`` requires grad)."""
    return to(t, "cpu", report=report)


def to_chunked(t, device, chunks=None, max_staging_bytes=None, report: bool = False):
    """``t`` on ``device`` in pieces along axis 0 through bounded pinned staging: at most a
    ``chunks``-th of the tensor (a quarter by default), or at most ``max_staging_bytes``, never
    less than one row. Detached: no gradient path."""
    tensor, rep = _ferry.to_chunked(
        t.detach(), _device_name(device), chunks, max_staging_bytes
    )
    out = to_torch(tensor)
    return (out, rep) if report else out


def move_state_dict(state_dict, device, report: bool = False):
    """A state dict (name to tensor) on ``device``, batched by dtype; values are detached."""
    detached = {name: value.detach() for name, value in state_dict.items()}
    moved, rep = _ferry.move_state_dict(detached, _device_name(device))
    out = {name: to_torch(value) for name, value in moved.items()}
    return (out, rep) if report else out


def empty_pinned(shape, dtype="float32"):
    """An uninitialised host tensor (torch) of ``shape`` in page-locked memory from ferry's
    pinned pool, or ``None`` when the pinned budget has no room. Its block returns to the pool
    when torch frees the tensor."""
    block = _ferry.empty_pinned(list(shape), _dtype_name(dtype))
    return None if block is None else to_torch(block)


def to_async(t, device) -> PendingMove:
    """``t`` on ``device`` (a GPU-to-host or host-to-GPU move), queued on a copy stream ferry
    keeps for that GPU and returned at once: the copy runs while torch's default stream
    computes. Ordered after the work already queued on the default stream; ``wait()`` hands the
    tensor out once it has landed. Detached: no gradient path."""
    source = t.detach() if getattr(t, "requires_grad", False) else t
    return PendingMove(_ferry.to_async(source, _device_name(device)))


class Chunk(NamedTuple):
    """One host chunk of a streamed tensor: its position, the rows of the source it holds, and
    the rows themselves (a torch tensor on the host, detached)."""

    index: int
    rows: range
    tensor: object


class ChunkStream:
    """The host chunks of a tensor along axis 0, in order (see :func:`stream_to`). Iterate it;
    ``close()`` (or leaving a ``with`` block) stops early and gives the staging back."""

    def __init__(self, inner):
        self._inner = inner

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        index, start, stop, tensor = next(self._inner)
        return Chunk(index, range(start, stop), to_torch(tensor))

    def __len__(self) -> int:
        return len(self._inner)

    @property
    def waited_ms(self) -> float:
        """How long iteration has waited for copies, in all (near 0 when the work per chunk
        outlasts a chunk's copy)."""
        return self._inner.waited_ms

    @property
    def report(self) -> TransferReport | None:
        return self._inner.report

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


def stream_to(t, chunks=None, max_staging_bytes=None) -> ChunkStream:
    """The host chunks of ``t`` along axis 0, in order, while the next ones are in flight: a GPU
    tensor's chunks come through a ring of pinned staging (at most a ``chunks``-th of the
    tensor, a quarter by default, or at most ``max_staging_bytes``), a host tensor's are views of its
    rows. Each chunk is detached data; keeping one is safe (the ring takes a fresh block).
    Do not write ``t`` in place until the stream is done."""
    return ChunkStream(_ferry.stream_to(t.detach(), chunks, max_staging_bytes))


from .offload import offload_saved  # noqa: E402  (uses the moves above)
