"""Checkpoints that do not stall training: ``ferry.save_async(path, tensors)``.

The call returns at once; ferry's threads copy the tensors (GPU tensors through a bounded
pinned ring on a copy stream, host tensors by all cores) and write a safetensors file with
ferry's checksums, fsynced and renamed over ``path`` only when whole (``ferry checkpoint
verify`` checks it; ``safetensors.torch.load_file`` reads it).

What waits for what:

* The copies read what torch queued on its current streams before the call.
* torch's writes do not wait for ferry by themselves, so:
  - every ``torch.optim.Optimizer.step`` (``ferry.optim.OffloadAdamW`` too) first waits until
    every save in flight has copied its tensors: a global step pre-hook, installed by the
    first save (with no save in flight it returns at once); the copies run at several GB/s
    (12-20 GB/s beside training on the H200), so a step waits for what is left of them;
  - any other in-place write to a saved tensor must come after ``pending.wait_snapshot()``;
  - a tensor written in place since the call when its copy is checked (at the optimizer's
    barrier, ``wait_snapshot()``, ``wait()``, or when the ``PendingSave`` is dropped) makes
    the save keep the old file: ``wait()`` raises ``FerryError`` naming the tensor, and no
    file mixes two moments. The file is renamed over ``path`` only after that check.
* With ``device_copy=True`` the GPU tensors are first copied on their GPU in the call (after
  the work torch queued on its current streams, each dtype's contiguous tensors together, at
  the device's memory speed), torch's current streams wait for those copies on the device, and
  the snapshot reads the copies: writes after the call, optimizer steps included, wait for
  nothing, at the price of device memory the size of the GPU tensors (from ferry's pool) until
  their snapshot is taken. Where it runs out, every tensor is treated as without it.
* Dropping a ``PendingSave`` waits for its copies (a fraction of a second), not for the file:
  the write finishes in the background, and an error in it is raised by the next
  ``save_async``.
"""

from __future__ import annotations

import threading
import weakref

from . import _ferry

_LOCK = threading.Lock()
_IN_FLIGHT: "weakref.WeakSet[PendingSave]" = weakref.WeakSet()
_HOOK = None


def _check_in_flight(reading_only: bool = False) -> None:
    """Waits for the copies of every save in flight, and checks them; with ``reading_only``,
    only of the saves that read tensors torch may write (the others are checked once their
    snapshot is taken, without waiting)."""
    with _LOCK:
        flying = list(_IN_FLIGHT)
    for pending in flying:
        if reading_only and pending._private:
            if pending.snapshot_taken():
                pending.wait_snapshot()
            continue
        pending.wait_snapshot()


def _before_optimizer_step(optimizer, args, kwargs):
    _check_in_flight(reading_only=True)


def _track(pending: "PendingSave") -> None:
    global _HOOK
    with _LOCK:
        _IN_FLIGHT.add(pending)
        if _HOOK is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _HOOK = register_optimizer_step_pre_hook(_before_optimizer_step)


def _untrack(pending: "PendingSave") -> None:
    # The hook stays: torch iterates its hooks while calling them, so it cannot go from there.
    with _LOCK:
        _IN_FLIGHT.discard(pending)


class PendingSave:
    """A save in flight: ``wait()`` gives its report (a dict of sizes, times and memory) or
    raises its error; ``wait_snapshot()`` blocks until every tensor is copied."""

    def __init__(self, inner, watched):
        self._inner = inner
        # (name, tensor, version) of each tensor torch may write before its copy is taken.
        self._watched = watched
        self._private = not watched
        self._checked = False

    @property
    def path(self) -> str:
        return self._inner.path

    def done(self) -> bool:
        """Whether the file is written (or the save failed)."""
        return self._inner.done()

    def snapshot_taken(self) -> bool:
        """Whether every tensor has been copied."""
        return self._inner.snapshot_taken()

    def wait_snapshot(self) -> None:
        """Blocks until every tensor is copied; in-place writes to them are safe after it."""
        if self._checked:
            return
        self._inner.wait_snapshot()
        self._check()

    def _check(self) -> None:
        # Runs right after the snapshot, before the caller writes: a version that moved was
        # moved by a write queued while the copies may still have been reading.
        if self._checked:
            return
        self._checked = True
        for name, t, version in self._watched:
            if t._version != version:
                self._inner.abandon(
                    f"tensor {name!r} was written in place after save_async and before its "
                    f"copy was taken (torch version {version} -> {t._version}), so the file "
                    "could mix two moments; the previous file is kept. Write saved tensors "
                    "only after pending.wait_snapshot() (optimizer steps wait by themselves)"
                )
                break
        else:
            self._inner.confirm()
        self._watched = []
        _untrack(self)

    def wait(self) -> dict:
        """Waits for the file to be synced and renamed; returns the report."""
        try:
            self.wait_snapshot()
            return self._inner.wait()
        finally:
            _untrack(self)

    def __del__(self):
        # The file is kept only once checked: do it now, while the tensors are known.
        try:
            if not self._checked and not self._inner.done():
                self.wait_snapshot()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"PendingSave({self.path!r}, {state})"


def save_async(
    path, tensors, *, memory="pageable", staging_bytes=None, metadata=None, device_copy=False
) -> PendingSave:
    """Starts writing ``tensors`` (a dict of name to torch tensor, a state dict say, or a list of
    pairs) to ``path`` and returns a :class:`PendingSave` at once.

    ``memory``: ``"pageable"`` (default: the snapshot in pageable host memory, freed as the
    file is written), ``"pinned"`` (straight into pinned memory within
    ferry's pinned budget), or a number of bytes (at most that much snapshot in host memory at
    once; the disk sets the pace and writes wait longer). ``staging_bytes``: the pinned ring
    GPU tensors cross through (256 MiB). ``metadata``: strings for the file's header.
    ``device_copy``: copy the GPU tensors on their GPU first (see the module docs), so that
    writes after the call never wait."""
    import torch

    items = list(tensors.items()) if hasattr(tensors, "items") else list(tensors)
    names = [str(k) for k, _ in items]
    detached = []
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"save_async: {name!r} is a {type(t).__name__}, not a torch.Tensor")
        detached.append(t.detach())
    gpus = sorted({t.device.index or 0 for t in detached if t.device.type == "cuda"})
    streams = [(g, torch.cuda.current_stream(g).cuda_stream) for g in gpus]
    if isinstance(memory, bool) or not isinstance(memory, (str, int)):
        raise TypeError(f"save_async: memory={memory!r}: use 'pageable', 'pinned' or a byte count")
    mode, bound = (memory, None) if isinstance(memory, str) else ("bounded", memory)
    if bound is not None and bound <= 0:
        raise ValueError(f"save_async: memory={memory}: a bound must be a positive byte count")
    extra = {} if staging_bytes is None else {"staging_bytes": staging_bytes}
    # A save waits for an earlier one to the same file, and an earlier one is renamed only once
    # checked: check them all now (their copies are normally long done), or this call would
    # wait on a check that only this thread can make.
    _check_in_flight()
    versions = [t._version for t in detached]
    # As DLPack capsules made without synchronizing: ferry orders the copies after `streams`
    # (torch's `__dlpack__` records and waits on an event per tensor, ~13 us each).
    to_dlpack = getattr(torch._C, "_to_dlpack", None)
    capsules = [to_dlpack(t) for t in detached] if to_dlpack is not None else detached
    inner = _ferry.save_async(
        str(path), names, capsules, streams, mode, bound, metadata=metadata,
        device_copy=bool(device_copy), **extra
    )
    # The GPU tensors copied in the call are the save's own: torch's writes no longer reach
    # what it reads.
    copied = inner.device_copied_all()
    watched = [
        (name, t, version)
        for name, t, version in zip(names, detached, versions)
        if not (copied and t.is_cuda)
    ]
    pending = PendingSave(inner, watched)
    _track(pending)
    return pending
