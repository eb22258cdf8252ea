"""Checkpoints that do not stall training: ``ferry.save_async(path, state)``, and
``ferry.load(path, device)`` to read them back.

``state`` is a dict of name to tensor (a model's ``state_dict()``), written as it is, or a
nested state (``{"model": model.state_dict(), "optim": opt.state_dict()}``): its tensors are
written under their dotted paths (``optim.state.0.exp_avg``) and everything else (the
``param_groups``, ints, floats, strings, None) as one JSON description in the header, from
which :func:`load` rebuilds the state exactly (``ferry/state_tree.py`` has the scheme).

The call returns at once; ferry's threads copy the tensors (GPU tensors through a bounded
pinned ring on a copy stream, host tensors by all cores but two) and write a safetensors file
with ferry's checksums, fsynced and renamed over ``path`` only when whole (``ferry checkpoint
verify`` checks it; ``safetensors.torch.load_file`` reads it).

What waits for what:

* The copies read what torch queued on its current streams before the call.
* torch's writes do not wait for ferry by themselves, so:
  - every ``torch.optim.Optimizer.step`` (``ferry.optim.OffloadAdamW`` too) first waits until
    every save in flight has copied its tensors: a global step pre-hook, installed by the
    first save (with no save in flight it returns at once); the copies run at several GB/s
    (12-20 GB/s beside training on the H200), so a step waits for what is left of them;
  - any other in-place write to a saved tensor must come after ``pending.order_writes()``
    (tensors copied on their GPU: a wait queued on torch's streams, nothing blocks) or
    ``pending.wait_snapshot()`` (any tensor: blocks until the snapshot is taken);
  - a tensor written in place since the call when its copy is checked (at the optimizer's
    barrier, ``wait_snapshot()``, ``wait()``, or when the ``PendingSave`` is dropped) makes
    the save keep the old file: ``wait()`` raises ``FerryError`` naming the tensor, and no
    file mixes two moments. The file is renamed over ``path`` only after that check.
* By default, where the GPU has room (see below), the GPU tensors are first copied on their
  GPU in the call (after the work torch queued on its current streams, each dtype's
  contiguous tensors together, at the device's memory speed), and the snapshot reads the
  copies: writes after the call, optimizer steps included, wait for nothing. Tensors of 1 MiB
  or more are copied on ferry's copy stream, beside the forward and backward torch queues
  next (a 12 GB state's copy takes 10-13 ms of an H100, which the next step paid in full on
  torch's stream): the next optimizer step's pre-hook (or the next save) makes torch's current
  streams wait on the GPU for those copies, so the step's writes come after them, and a
  tensor written in place before that (its version moved) makes the save keep the old file,
  as above. Smaller tensors (a norm's running statistics, which a forward writes) are copied
  on the stream torch's current streams wait for at once. The price is device memory the size
  of the GPU tensors (from ferry's allocator) until the file has caught up with the snapshot
  (``memory="auto"``); it then goes back to ferry's
  cache, where the next save of the same state finds it, so only the first save pays for the
  allocation. That cache is ferry's, not torch's: torch cannot use it, and a save made before
  training reaches its peak memory keeps it from training; ``ferry.empty_cache()`` gives it
  back to the driver (the next save then allocates again). "Room": the driver's free memory
  plus ferry's cached blocks cover the copies and leave a 32nd of the GPU (at least 1 GiB) for
  training; memory torch's caching allocator holds counts as taken. Without room (or with ``device_copy=False``) the tensors are read in
  place and the optimizer's step waits for the copies it would overwrite: the snapshot then
  lands in pinned memory (``memory="auto"``, the default), at the link's rate, in ferry's
  pinned pool within its budget and kept there for the next save. ``device_copy=True`` copies
  wherever memory can be had.
* Dropping a ``PendingSave`` waits for the copies it reads in place (a fraction of a second;
  where every tensor was copied on its GPU it only orders torch's streams after those copies),
  not for the file: the write finishes in the background, and an error in it is raised by the
  next ``save_async``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from . import _ferry, state_tree
from .checkpoint_file import CHECKSUM_KEY, read_file, read_header

_LOCK = threading.Lock()
_IN_FLIGHT: "weakref.WeakSet[PendingSave]" = weakref.WeakSet()
_HOOK = None


def _check_in_flight() -> None:
    """Waits for the copies of every save in flight that reads tensors torch may write, and
    checks them (the others, confirmed at their call, are let go once their snapshot is taken,
    without waiting)."""
    with _LOCK:
        flying = list(_IN_FLIGHT)
    for pending in flying:
        try:
            pending._order_writes()
            if pending._checked:
                continue
            if pending._private:
                if pending.snapshot_taken():
                    pending.wait_snapshot()
                continue
            pending.wait_snapshot()
        except ValueError:
            # Waited for meanwhile on the thread that owns it (dcp.async_save's writer, say),
            # which checked it before taking it: nothing is left to wait for.
            if not pending._checked:
                raise


def _before_optimizer_step(optimizer, args, kwargs):
    _check_in_flight()


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

    def __init__(self, inner: _ferry.PendingSave, watched: list, side: Sequence[Any] = ()) -> None:
        self._inner = inner
        # (name, tensor, version) of each tensor torch may write before its copy is taken.
        self._watched = watched
        # The same of each tensor copied on ferry's copy stream beside torch's work: torch's
        # writes to it are safe once its streams wait for those copies (`_order_writes`).
        self._side = list(side)
        self._side_lock = threading.Lock()
        self._private = not watched
        self._checked = False
        # One thread at a time waits for the snapshot and checks the versions (the check runs
        # once, before any caller writes): the optimizer's barrier on the training thread and
        # dcp.async_save's thread may both get here. Another thread meanwhile answers "not yet"
        # rather than waiting (this lock is taken without the GIL; the extension's own wait
        # holds none of its locks either, so no thread holding the GIL ever waits on one).
        self._calls = threading.RLock()

    @property
    def path(self) -> str:
        return self._inner.path

    def done(self) -> bool:
        """Whether the file is written (or the save failed)."""
        # A thread waiting for the snapshot holds the lock: the file is not written yet.
        if not self._calls.acquire(blocking=False):
            return False
        try:
            return self._inner.done()
        finally:
            self._calls.release()

    def snapshot_taken(self) -> bool:
        """Whether every tensor has been copied."""
        if not self._calls.acquire(blocking=False):
            return False
        try:
            return self._inner.snapshot_taken()
        finally:
            self._calls.release()

    def wait_snapshot(self) -> None:
        """Blocks until every tensor is copied; in-place writes to them are safe after it."""
        if self._checked:
            return
        with self._calls:
            if self._checked:
                return
            self._inner.wait_snapshot()
            self._check()

    def _take_side(self) -> list:
        with self._side_lock:
            side, self._side = self._side, []
        return side

    def _abandon_if_written(self, tensors: list, before: str) -> bool:
        """Abandons the save if one of ``tensors`` (name, tensor, version) was written in place
        since the call; says whether it did."""
        for name, t, version in tensors:
            if t._version != version:
                self._inner.abandon(
                    f"tensor {name!r} was written in place after save_async and before "
                    f"{before} (torch version {version} -> {t._version}), so the file could mix "
                    "two moments; the previous file is kept. Write saved tensors only after "
                    "the next optimizer.step(), pending.order_writes() (tensors copied on "
                    "their GPU) or pending.wait_snapshot()"
                )
                return True
        return False

    def order_writes(self) -> None:
        """The barrier for in-place writes to saved GPU tensors outside an optimizer step: torch's
        current streams wait on the GPU for the save's device copies (never the host), so
        writes queued after this call come after them. The optimizer's step pre-hook and the
        next save call do it by themselves. Where a tensor was written in place since the call,
        the save keeps the old file and ``wait()`` raises naming it. Tensors read in place
        (without a device copy) still need :meth:`wait_snapshot`."""
        self._order_writes()

    def _order_writes(self) -> None:
        # Between steps (the optimizer's step pre-hook, the next save): torch's current streams
        # wait on the GPU for the copies on ferry's copy stream, so its writes from now on come
        # after them; one queued before may have raced them.
        side = self._take_side()
        if not side or self._abandon_if_written(side, "its device copy was ordered"):
            return
        import torch

        gpus = sorted({t.get_device() for _, t, _ in side})
        self._inner.order_writes_after([(g, torch.cuda.current_stream(g).cuda_stream)
                                        for g in gpus])
        if self._private:
            self._inner.confirm()

    def _check(self) -> None:
        # Runs right after the snapshot, before the caller writes: a version that moved was
        # moved by a write queued while the copies may still have been reading.
        if self._checked:
            return
        self._checked = True
        side = self._take_side()
        if not (self._abandon_if_written(self._watched, "its copy was taken")
                or self._abandon_if_written(side, "its device copy was ordered")):
            self._inner.confirm()
        self._watched = []
        _untrack(self)

    def wait(self) -> dict[str, Any]:
        """Waits for the file to be synced and renamed; returns the report."""
        try:
            self.wait_snapshot()
            # Checked: no thread enters the extension's wait_snapshot any more, so this wait
            # (which holds no lock while it waits) needs no turn.
            return self._inner.wait()
        finally:
            _untrack(self)

    def __del__(self):
        # The file is kept only once checked: do it now, while the tensors are known. Where
        # nothing is read in place, that is ordering torch's streams after the device copies
        # (never the paced snapshot, which lasts as long as the write).
        try:
            if self._checked or self.done():
                return
            if self._private:
                self._order_writes()
            else:
                self.wait_snapshot()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"PendingSave({self.path!r}, {state})"


# The dtypes ferry's files hold (ferry-tensor's DType), as torch and as safetensors name them.
WRITABLE_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "uint8")
_FERRY_FILE_DTYPES = {"F32", "F64", "F16", "BF16", "I64", "U8"}


def _named_tensors(tensors: Any, torch: Any) -> tuple[list[tuple[str, Any]], str | None]:
    """The (name, tensor) pairs to write and, for a nested state, its description."""
    if isinstance(tensors, Mapping):

        def is_tensor(value: Any) -> bool:
            return isinstance(value, torch.Tensor)

        if state_tree.is_flat(tensors, is_tensor):
            return list(tensors.items()), None
        return state_tree.flatten(tensors, is_tensor)
    items = list(tensors)
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(
                f"save_async: {item!r} is not a (name, tensor) pair: pass a dict (flat or "
                "nested) or a list of pairs"
            )
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"save_async: {name!r} is a {type(t).__name__}, not a torch.Tensor")
    return [(str(k), t) for k, t in items], None


def save_async(
    path: str | os.PathLike[str],
    tensors: Mapping[Any, Any] | Sequence[tuple[str, Any]],
    *,
    memory: str | int = "auto",
    staging_bytes: int | None = None,
    metadata: Mapping[str, str] | None = None,
    device_copy: bool | None = None,
) -> PendingSave:
    """Starts writing ``tensors`` to ``path`` and returns a :class:`PendingSave` at once.

    ``tensors``: a dict of name to torch tensor (a state dict; written as it is), a list of
    (name, tensor) pairs, or a nested state of dicts, lists and tuples whose leaves are tensors,
    None, bools, ints, floats and strings (``{"model": model.state_dict(), "optim":
    opt.state_dict()}``): its tensors are written under their paths joined with ``"."``, the
    rest as a JSON description under ``"ferry.structure"`` in the header (see
    ``ferry/state_tree.py``); :func:`load` rebuilds it. The path comes first (``torch.save``
    and safetensors' ``save_file`` take the object first: the swapped order is refused).

    ``memory``: ``"auto"`` (default: where every GPU tensor was copied on its GPU, nothing
    then waiting for the snapshot, a bound of ``staging_bytes``: the copies cross at the disk's
    pace into pinned pieces the writer writes as they are, no drain beside the training (the
    report's ``"memory"`` gives the bound); ``"pageable"`` where CPU tensors are saved
    beside them; ``"pinned"`` where GPU tensors are read in place, so the optimizer's step
    waits no longer than the link takes), ``"pageable"`` (the
    snapshot in pageable host memory, freed as the file is written), ``"pinned"`` (straight
    into pinned memory within ferry's pinned budget, kept in its pool for the next save), or a
    number of bytes (at most that much snapshot in host memory at once; the disk sets the pace
    and writes wait longer). The report's ``"memory"`` says which was used. ``staging_bytes``:
    the pinned ring GPU tensors cross through (256 MiB). ``metadata``: strings for the file's
    header.
    ``device_copy``: copy the GPU tensors on their GPU first, so that writes after the call
    never wait: where the GPU has room (``None``, the default), always (``True``) or never
    (``False``); see the module docs."""
    import torch

    if not isinstance(path, (str, os.PathLike)):
        if isinstance(tensors, (str, os.PathLike)):
            raise TypeError(
                "save_async takes the path first, then the state: ferry.save_async(path, state) "
                "(torch.save and safetensors' save_file take the object first)"
            )
        raise TypeError(f"save_async: the path is a {type(path).__name__}: give a str or a Path")
    named, structure = _named_tensors(tensors, torch)
    header = dict(metadata or {})
    for key in (state_tree.STRUCTURE_KEY, CHECKSUM_KEY):
        if key in header:
            raise ValueError(
                f"save_async: metadata key {key!r} is reserved: ferry writes its own entry "
                "under it; store your value under another key"
            )
    if structure is not None:
        header[state_tree.STRUCTURE_KEY] = structure
    return start_save(path, named, header, memory, staging_bytes, device_copy)


def reserve_device_copy(
    tensors: Mapping[Any, Any] | Sequence[tuple[str, Any]],
    *,
    device_copy: bool | None = None,
) -> int:
    """Takes the GPU memory that the device copies of ``save_async(path, tensors,
    device_copy=device_copy)`` use now, into ferry's allocator cache, and compiles the kernels
    the copies launch, so that the first save's call allocates and compiles nothing either
    (without it, that call pays ``cuMemAlloc``, about 10 ms a GiB, and the compile: the first
    call of a process took 4.9 s on an H200 and 11.7 s on a fresh H100; every later save reuses
    the memory the one before gave back). Call it once where a
    stall is not felt (after building the model and optimizer, before the loop: the optimizer's
    state must exist, so after its first step or ``state_dict()`` of a built one) with the
    state the saves will take, or one of the same shapes and dtypes. ``tensors`` as
    :func:`save_async` takes them. ``device_copy``: as :func:`save_async` decides: ``None``
    reserves only on GPUs with room for the copies now, ``True`` wherever memory can be had,
    ``False`` nothing. Returns the bytes held ready. The memory stays ferry's (torch cannot use
    it) until :func:`ferry.empty_cache`."""
    import torch

    named, _ = _named_tensors(tensors, torch)
    writable = {getattr(torch, name) for name in WRITABLE_DTYPES}
    # Tensors of other dtypes are refused by the save itself: nothing to reserve for them.
    gpu = [t.detach() for _, t in named if t.is_cuda and t.dtype in writable]
    to_dlpack = getattr(torch._C, "_to_dlpack", None)
    capsules = [to_dlpack(t) for t in gpu] if to_dlpack is not None else gpu
    flag = None if device_copy is None else bool(device_copy)
    return _ferry.reserve_device_copy(capsules, device_copy=flag)


def start_save(
    path: str | os.PathLike[str],
    named: list[tuple[str, Any]],
    header: dict[str, str],
    memory: str | int = "auto",
    staging_bytes: int | None = None,
    device_copy: bool | None = None,
    owned: bool = False,
) -> PendingSave:
    """:func:`save_async` of (name, tensor) pairs and a header. ``owned``: the tensors are the
    caller's private copies (a staged state), which nothing writes while they are saved: no
    version check, and optimizer steps do not wait for their snapshot."""
    import torch

    names = [name for name, _ in named]
    writable = {getattr(torch, name) for name in WRITABLE_DTYPES}
    detached = []
    # Per tensor, the cheapest of torch's attributes: the call's time is the loop's stall.
    for name, t in named:
        if t.dtype not in writable:
            raise TypeError(
                f"save_async: {name!r} is a {t.dtype} tensor; ferry's files hold "
                f"{', '.join(WRITABLE_DTYPES)}: convert it first (integers to int64, bools to "
                "uint8)"
            )
        detached.append(t.detach() if t.requires_grad else t)
    gpus = sorted({t.get_device() for t in detached if t.is_cuda})
    streams = [(g, torch.cuda.current_stream(g).cuda_stream) for g in gpus]
    if isinstance(memory, bool) or not isinstance(memory, (str, int)):
        raise TypeError(
            f"save_async: memory={memory!r}: use 'auto', 'pageable', 'pinned' or a byte count"
        )
    mode, bound = (memory, None) if isinstance(memory, str) else ("bounded", memory)
    if bound is not None and bound <= 0:
        raise ValueError(f"save_async: memory={memory}: a bound must be a positive byte count")
    extra = {} if staging_bytes is None else {"staging_bytes": staging_bytes}
    # A save waits for an earlier one to the same file, and an earlier one that reads tensors
    # torch may write is renamed only once checked: check those now (their copies are normally
    # long done), or this call would wait on a check that only this thread can make. The others
    # were confirmed at their call.
    _check_in_flight()
    versions = [t._version for t in detached]
    # As DLPack capsules made without synchronizing: ferry orders the copies after `streams`
    # (torch's `__dlpack__` records and waits on an event per tensor, ~13 us each).
    to_dlpack = getattr(torch._C, "_to_dlpack", None)
    capsules = [to_dlpack(t) for t in detached] if to_dlpack is not None else detached
    inner = _ferry.save_async(
        str(path), names, capsules, streams, mode, bound, metadata=header or None,
        device_copy=None if device_copy is None else bool(device_copy), **extra
    )
    # The GPU tensors copied in the call are the save's own: torch's writes no longer reach
    # what it reads.
    copied = inner.device_copied_all()
    watched = [
        (name, t, version)
        for name, t, version in zip(names, detached, versions)
        if not (owned or (copied and t.is_cuda))
    ]
    beside = set() if owned else set(inner.side_copied())
    side = [(n, t, v) for n, t, v in zip(names, detached, versions) if n in beside]
    if not watched and not side:
        # Nothing torch writes is read: nothing to check before the rename (the snapshot of a
        # device copy goes at the disk's pace, and no later call should wait for it).
        inner.confirm()
    pending = PendingSave(inner, watched, side)
    _track(pending)
    return pending


def _target(device: Any) -> str:
    from . import _device_name

    name = _device_name(device)
    if name == "cpu" or (name.startswith("cuda:") and name[5:].isdigit()):
        return name
    raise ValueError(
        f"load: device={device!r}: use 'cpu', 'cuda', 'cuda:N', a GPU index or a torch.device"
    )


def load(path: str | os.PathLike[str], device: Any = "cpu") -> Any:
    """What :func:`save_async` wrote to ``path``, its tensors on ``device`` (``"cpu"``,
    ``"cuda"`` (torch's current device), ``"cuda:N"``, an int or a ``torch.device``): the
    nested state as it was given, or, for a flat save (or any safetensors file), a dict of name
    to tensor in file order.

    The file is checked before anything is returned: a truncated or damaged file, one that is
    not safetensors, or a tensor whose bytes differ from the CRC32 ferry recorded is a
    ``FerryError`` naming the file and the problem; a missing file a ``FileNotFoundError``.
    A file of ferry's dtypes (every file ``save_async`` writes) is read by ferry's reader, which
    hashes each tensor as it reads it and, for a GPU, streams the file through a bounded
    pinned ring into the tensors on the GPU (nothing of the file's size on the host). A
    safetensors file with other dtypes (int32, bool, float8...) is read here into host memory
    and moved with torch's ``.to``."""
    target = _target(device)
    shown = os.fspath(path)
    with open(path, "rb") as f:
        header = read_header(f, shown)
    if all(e.dtype in _FERRY_FILE_DTYPES for e in header.entries):
        from . import to_torch

        pairs, metadata = _ferry.load_checkpoint(shown, target)
        tensors = {name: to_torch(t) for name, t in pairs}
    else:
        tensors, metadata = read_file(path)
        if target != "cpu":
            tensors = {k: t.to(target) for k, t in tensors.items()}
    structure = metadata.get(state_tree.STRUCTURE_KEY)
    if structure is None:
        return tensors
    return state_tree.rebuild(structure, tensors, shown)


def load_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The strings given as ``metadata`` to the :func:`save_async` that wrote ``path`` (ferry's
    own entries left out); only the header is read, and checked."""
    shown = os.fspath(path)
    with open(path, "rb") as f:
        header = read_header(f, shown)
    return {k: v for k, v in header.metadata.items() if k != state_tree.STRUCTURE_KEY}
