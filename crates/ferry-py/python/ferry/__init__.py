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

from . import _ferry
from ._ferry import FerryError, Pending, Tensor, TransferReport

__all__ = [
    "FerryError",
    "PendingMove",
    "Tensor",
    "TransferReport",
    "cpu",
    "cuda_available",
    "empty_cache",
    "from_torch",
    "move_state_dict",
    "pinned_budget",
    "pinned_stats",
    "set_pinned_budget",
    "to",
    "to_chunked",
    "to_torch",
]
__version__ = _ferry.__version__

cuda_available = _ferry.cuda_available
empty_cache = _ferry.empty_cache
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
    """``t`` on ``device`` in pieces along axis 0 through bounded pinned staging (``chunks``
    pieces, or at most ``max_staging_bytes`` of staging). Detached: no gradient path."""
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
