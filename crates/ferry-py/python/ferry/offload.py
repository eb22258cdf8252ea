"""``ferry.offload_saved``: the tensors torch's autograd saves for backward, moved to pinned host
memory as the forward saves them and brought back ahead of their use in backward.

The counterpart of ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, built on torch's
``saved_tensors_hooks``. What differs:

- Host memory comes from ferry's pinned pool, within its budget: blocks are cached and reused
  (``save_on_cpu`` asks the driver for page-locked memory for every saved tensor, which costs
  milliseconds each), and a tensor that would not fit the budget stays on the GPU instead of
  failing.
- The copies run on a side stream while the forward and the backward keep computing on the
  current stream. The scope holds a saved tensor until its copy has completed, then lets go, so
  torch's allocator reuses its memory at once, in stream order; the forward waits on the host
  only when more than ``in_flight`` copies are still running. (Handing the tensor back at once
  with ``record_stream`` instead was measured: torch's allocator then cannot reuse a block
  before its copy's event has been seen complete, and a forward queued far ahead of the GPU
  took fresh memory; peak reserved memory did not go down at all.)
- Backward uploads ahead (in reverse order of saving) while the current op computes: at least
  the next ``prefetch`` tensors, and more while the uploads not yet used hold less than
  ``prefetch_bytes``, so the link has work queued across ops of every size. By default that
  window is an eighth of what the step offloaded, at most 256 MiB: a model that saves a few
  hundred MiB does not get them all back at the start of backward. Uploads go into
  memory allocated on the current stream (the blocks the forward freed) and start after the
  work queued there so far; the current stream waits for an upload on the device, never on the
  host. A tensor whose copy to
  the host was still running when backward reached it (the last ones saved, when the host runs
  ahead) is read where it is, with no upload.
- Nothing outlives the step: once backward has used every record, the scope and what it held
  are freed (no reference cycle is left for the collector).
- A tensor saved by two ops (tanh's output, read again by the next linear layer) is copied once,
  and parameters and the input batch stay where they are: their owners keep them alive, so a
  copy would free nothing.
"""

from __future__ import annotations

import weakref
from collections import deque

from . import _ferry, _torch, to_torch

_FERRY_DTYPES = {"float32", "float64", "float16", "bfloat16", "int64", "uint8"}

# The default upload window: this share of the bytes the step offloaded, at most this many.
_WINDOW_SHARE = 8
_MAX_WINDOW_BYTES = 256 << 20


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _peak_allocated(device) -> int | None:
    """torch's peak allocated memory on GPU ``device`` since its last reset; None for no GPU."""
    if device is None or device.type != "cuda":
        return None
    return _torch().cuda.max_memory_allocated(device)


def _reset_peak(device) -> None:
    _torch().cuda.reset_peak_memory_stats(device)


class _Saved:
    """One saved activation: on the GPU (``original``) until its copy to pinned host memory
    (``host``) has completed, then only on the host until backward brings it back
    (``on_device``). Under a memory target it may stay on the GPU for good."""

    __slots__ = ("index", "scope", "device", "shape", "dtype", "nbytes", "host", "copied",
                 "original", "on_device", "uploaded", "used", "ahead", "__weakref__")

    def __init__(self, index, scope, t):
        self.index = index
        self.scope = scope
        self.device = t.device
        self.shape = t.shape
        self.dtype = t.dtype
        self.nbytes = t.numel() * t.element_size()
        self.host = None  # torch tensor over ferry's pinned block, written on the side stream
        self.copied = None  # event on the side stream after the copy to the host
        self.original = t  # the GPU tensor while the scope holds it
        self.on_device = None  # what backward reads, once there
        self.uploaded = None  # event after which `on_device` may be read (None: at once)
        self.used = False
        self.ahead = False  # uploaded ahead of its use: counted in the scope's prefetch window

    def start_copy(self, host, side):
        """Queues the copy to ``host`` on ``side``, after the work that produced the tensor."""
        torch = _torch()
        source = self.original
        if source.dtype == torch.bool:  # ferry has no bool: the same bytes as uint8
            source, host = source.view(torch.uint8), host.view(torch.uint8)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            host.copy_(source, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(side)
        self.host = host if self.dtype != torch.bool else host.view(torch.bool)

    def start_upload(self) -> int:
        """Brings the tensor back to the GPU (or marks it read in place); the bytes of GPU
        memory the upload takes."""
        if self.on_device is not None:
            return 0
        if self.original is not None:
            # Still on the GPU: kept there by a memory target, or its copy to the host is still
            # running (the host ran ahead into backward). Read it in place, once that copy (if
            # any) has completed, and upload nothing.
            self.on_device, self.original = self.original, None
            self.uploaded = self.copied
            if self.host is not None:
                self.scope.stats["read_in_place"] += 1
            return 0
        torch = _torch()
        current = torch.cuda.current_stream(self.device)
        side = self.scope._side_stream(self.device, "in")
        # Allocated on the current stream, from the blocks the forward's freed activations left
        # in its pool (an allocation on the side stream would take fresh memory from a pool of
        # its own, and the reserved peak would grow by the uploads). The side stream first waits
        # for the work queued so far on the current stream, which may still use the block; the
        # backward op queued next overlaps the copy.
        dest = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        side.wait_stream(current)
        side.wait_event(self.copied)  # the copy out (on the other side stream) has landed
        with torch.cuda.stream(side):
            dest.copy_(self.host, non_blocking=True)
            self.uploaded = torch.cuda.Event()
            self.uploaded.record(side)
        # No record_stream: the current stream waits for the upload before it reads `dest`
        # (in unpack) or before the block can be handed out again (in __del__, if never read),
        # so the block returns to the current stream's pool in order, at once.
        self.on_device = dest
        # The pinned block goes back to ferry's pool only after the upload has read it.
        self.scope._releasing.append((self.uploaded, self.host))
        return self.nbytes

    def __del__(self):
        # A record dropped with its graph while a copy may still use the GPU tensor it frees (the
        # copy to the host of `original`, or an upload nothing read): work queued on the current
        # stream after this point, which may reuse the block, runs after that copy.
        if self.ahead:
            self.scope._ahead -= self.nbytes
        pending = None
        if self.original is not None:
            pending = self.copied
        elif self.on_device is not None and not self.used:
            pending = self.uploaded
        if pending is not None:
            try:
                _torch().cuda.current_stream(self.device).wait_event(pending)
            except Exception:  # interpreter shutdown: nothing runs after it anyway
                pass


class offload_saved:
    """A context manager: inside it, every tensor that torch's autograd saves for backward, that
    lives on a GPU, holds at least ``min_bytes`` and was made by a recorded op (it has a
    ``grad_fn``), moves to pinned host memory, with at most ``in_flight`` copies running at once.
    Backward brings each back, uploading at least the next ``prefetch`` ones, and more while
    less than ``prefetch_bytes`` are uploaded ahead, as the current one is used (the window
    costs up to ``prefetch_bytes`` of GPU memory beyond one tensor; by default an eighth of the
    bytes the step offloaded, at most 256 MiB, ``stats["window_bytes"]``). Gradients are the
    same bits as without the scope.

    ``max_device_bytes`` sets a memory target instead of offloading everything: saved tensors
    stay on the GPU while torch's allocated memory on it
    (``torch.cuda.memory_allocated``) is within the target, and once it is above, the oldest
    ones kept are offloaded first, so what backward needs first (the last saved) stays on the
    GPU and only the copies the target requires are paid for. The forward waits for a copy to
    complete only when allocated memory is above the target while copies still hold it, and
    only where their completion brings it under: a target out of reach at a save (everything
    saved so far already leaving, and still above) is not waited for, the forward goes on as
    when offloading everything (``stats["out_of_reach"]`` counts those saves), at the same
    memory and without stalling on the link. What the step allocates after the last save (the
    loss and its gradient, the first backward ops) comes on top of the memory at the saves:
    GPT-2's loss over its 50,257-token vocabulary takes the step 2.7 GiB above a target met at
    every save. So at the end of backward the scope reads the step's peak
    (``torch.cuda.max_memory_allocated``), and a scope used again for the next step keeps as
    much more room at its saves as the step went over (``stats["headroom_bytes"]``):
    enter the same scope every step for the step's peak to come under the target once it has
    learnt that room: from the second step for some models, after a few for others (in the
    models bench, GPT-2's looser target). To read a step's own peak, the scope resets torch's
    peak statistic (``torch.cuda.reset_peak_memory_stats``) when entered while the peak so far
    is above the target::

        scope = ferry.offload_saved(max_device_bytes=40 << 30)
        for x in batches:
            with scope:
                loss = model(x).square().mean()
            loss.backward()

    ``stats`` counts what happened in the scope's last step::

        with ferry.offload_saved() as scope:
            loss = model(x).square().mean()
        loss.backward()
        print(scope.stats)
    """

    def __init__(self, min_bytes: int = 1 << 20, prefetch: int = 1, in_flight: int = 2,
                 max_device_bytes: int | None = None, prefetch_bytes: int | None = None):
        if min_bytes < 0 or prefetch < 0 or (prefetch_bytes or 0) < 0 or in_flight < 1:
            raise ValueError("min_bytes, prefetch and prefetch_bytes must be >= 0, in_flight >= 1")
        if max_device_bytes is not None and max_device_bytes < 0:
            raise ValueError("max_device_bytes must be >= 0 (or None: offload everything)")
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.prefetch_bytes = prefetch_bytes
        self._ahead = 0  # bytes uploaded ahead of their use, not used yet
        self.in_flight = in_flight
        self.max_device_bytes = max_device_bytes
        # Room kept below the target at the saves for what the step allocates after them, and
        # the highest allocated memory seen in this step; learnt across steps of this scope.
        self._headroom = 0
        self._peak = 0
        self._steps = 0
        self._unused = 0  # records of this step backward has not read yet
        self._device = None  # the GPU of the records, once one is saved
        self.stats = self._fresh_stats()
        # Weak: a saved tensor lives as long as torch's graph holds it, not as long as the scope.
        self._saved: list[weakref.ref] = []
        self._seen: dict = {}
        self._streams: dict = {}
        self._releasing: deque = deque()  # (event, pinned tensor) until the event completes
        # (event, record, bytes) of the copies to the host running; the record holds the GPU
        # tensor until its copy has completed.
        self._copies: deque = deque()
        # Under a target: records still on the GPU, oldest first, and the bytes of the copies
        # running (their GPU tensors leave once the copies complete).
        self._kept: deque = deque()
        self._leaving = 0
        self._hooks = None

    def _fresh_stats(self) -> dict:
        return {
            "offloaded": 0,
            "offloaded_bytes": 0,
            "shared": 0,
            "kept": 0,
            "kept_under_target": 0,
            "kept_under_target_bytes": 0,
            "kept_over_budget": 0,
            "prefetched": 0,
            "fetched_on_demand": 0,
            "read_in_place": 0,
            "ahead_peak_bytes": 0,
            "waited_for_target": 0,
            "out_of_reach": 0,
            "window_bytes": 0,
            "headroom_bytes": self._headroom,
        }

    def __enter__(self) -> offload_saved:
        torch = _torch()
        if self._steps:
            self._next_step()
        self._steps += 1
        if self.max_device_bytes is not None:
            if self._device is None and torch.cuda.is_initialized():
                self._device = torch.device("cuda", torch.cuda.current_device())
            # A peak from before this step would hide this step's own.
            peak = _peak_allocated(self._device)
            if peak is not None and peak > self.max_device_bytes:
                _reset_peak(self._device)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._hooks.__exit__(*exc)
        # The hooks hold bound methods of this scope: dropped here, so the scope is freed with
        # the last record (as the graph is), not by the cycle collector some time later.
        self._hooks = None
        self._seen.clear()
        for ref in self._kept:
            record = ref()
            if record is not None and record.host is None:
                self.stats["kept_under_target"] += 1
                self.stats["kept_under_target_bytes"] += record.nbytes
        self._kept.clear()
        return False

    def _next_step(self) -> None:
        """Entered again: the last step's overshoot of the target becomes room kept at the
        saves, and the counts start afresh."""
        if self._unused:
            # Backward did not read every record (or has not run, or its graph was dropped
            # unused): what its end would have done.
            self._end_of_backward()
        if self.max_device_bytes is not None and self._peak > self.max_device_bytes:
            over = self._peak - self.max_device_bytes
            self._headroom = min(self.max_device_bytes, self._headroom + over)
        self._peak = 0
        self._unused = 0
        self.stats = self._fresh_stats()
        # Records of the last step's graph are gone once its backward has run: start the list
        # afresh then (prefetching walks it by index).
        if all(ref() is None for ref in self._saved):
            self._saved = []

    def _end_of_backward(self) -> None:
        self.settle(wait=True)
        if self.max_device_bytes is not None:
            self._peak = max(self._peak, _peak_allocated(self._device) or 0)

    def __del__(self):
        # Copies still running hold pinned blocks of ferry's pool: let them finish first.
        if getattr(self, "_releasing", None) or getattr(self, "_copies", None):
            self.settle(wait=True)

    def _drain_copies(self, keep: int, wait: bool) -> None:
        """Lets go of the GPU tensors whose copies to the host have completed, waiting for the
        oldest while more than ``keep`` are running (for all with ``wait``)."""
        while self._copies:
            event, record, nbytes = self._copies[0]
            if wait or len(self._copies) > keep:
                event.synchronize()
            elif not event.query():
                return
            self._copies.popleft()
            self._leaving -= nbytes
            saved = record()
            if saved is not None:
                saved.original = None

    def settle(self, wait: bool = False) -> None:
        """Lets go of the GPU tensors whose copies to the host have completed, and of the pinned
        blocks whose copies have (all of them, waiting, with ``wait=True``); a block returns to
        ferry's pool once its record is gone too. Each save and each unpack does this as well."""
        self._drain_copies(self.in_flight, wait)
        while self._releasing:
            event, _ = self._releasing[0]
            if wait:
                event.synchronize()
            elif not event.query():
                return
            self._releasing.popleft()

    def _side_stream(self, device, direction: str):
        """The side stream of ``device`` for copies ``"out"`` to the host or ``"in"`` from it:
        one each, so the forward's last copies out and the backward's first uploads use both
        directions of the link at once instead of queuing behind each other."""
        stream = self._streams.get((device, direction))
        if stream is None:
            stream = self._streams[(device, direction)] = _torch().cuda.Stream(device)
        return stream

    def _movable(self, t) -> bool:
        """On a GPU, at least ``min_bytes``, of a dtype ferry moves (or bool)."""
        if not t.is_cuda or t.numel() * t.element_size() < self.min_bytes:
            return False
        return _dtype_name(t.dtype) in _FERRY_DTYPES or t.dtype == _torch().bool

    def _offloadable(self, t) -> bool:
        if not self._movable(t):
            return False
        base = t._base if t._base is not None else t
        return base.grad_fn is not None

    def _offload(self, saved: _Saved) -> bool:
        """Starts the copy of a record still on the GPU to pinned host memory; False when the
        pinned budget has no room (it stays on the GPU)."""
        torch = _torch()
        dtype = "uint8" if saved.dtype == torch.bool else _dtype_name(saved.dtype)
        # The scope frees each block only once its own copies are done (`_releasing`).
        block = _ferry.empty_pinned(list(saved.shape), dtype, True)
        if block is None:
            self.stats["kept_over_budget"] += 1
            return False
        saved.start_copy(to_torch(block), self._side_stream(saved.device, "out"))
        # Whatever happens to the record (a graph dropped unused), the block is not given back
        # to ferry's pool while the copy still writes it.
        self._releasing.append((saved.copied, saved.host))
        # The GPU tensor is held (by its record) until its copy has completed, then torch frees
        # it in stream order; backward reads it in place if it gets there first.
        self._copies.append((saved.copied, weakref.ref(saved), saved.nbytes))
        self._leaving += saved.nbytes
        self.stats["offloaded"] += 1
        self.stats["offloaded_bytes"] += saved.nbytes
        self._drain_copies(self.in_flight, wait=False)
        return True

    def _meet_target(self, device) -> None:
        """Offloads the oldest records kept on the GPU while allocated memory, less what copies
        already running will free, is above the target; then waits for running copies while
        allocated memory itself is still above it."""
        cuda = _torch().cuda
        target = self.max_device_bytes - self._headroom

        def over() -> int:
            return cuda.memory_allocated(device) - target

        while self._kept and over() > self._leaving:
            record = self._kept.popleft()()
            if record is not None and record.host is None and not record.used:
                self._offload(record)
        if over() > self._leaving:
            # Even once every copy running has landed, allocated memory stays above the target:
            # waiting would stall the forward on the link for nothing.
            self.stats["out_of_reach"] += 1
            return
        while self._copies and over() > 0:
            self.stats["waited_for_target"] += 1
            self._drain_copies(len(self._copies) - 1, wait=False)

    def _pack(self, t):
        if not self._offloadable(t):
            self.stats["kept"] += 1
            return t
        # The same tensor saved again (by the next op) while it is alive. Once it has been freed,
        # its memory may hold a new tensor with the same key: the weak reference tells them apart.
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t._version)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is t:
            self.stats["shared"] += 1
            return seen[1]
        self.settle()
        saved = _Saved(len(self._saved), self, t)
        self._unused += 1
        self._device = t.device
        self._saved.append(weakref.ref(saved))
        self._seen[key] = (weakref.ref(t), saved)
        if self.max_device_bytes is None:
            self._offload(saved)
        else:
            self._kept.append(weakref.ref(saved))
            self._meet_target(t.device)
        return saved

    def _prefetch_before(self, index: int) -> None:
        """Starts the uploads of the records saved before ``index``, latest first: at least
        ``prefetch`` of them, and on while less than the window is uploaded ahead."""
        window = self._window()
        self.stats["window_bytes"] = window
        count = 0
        for i in range(index - 1, -1, -1):
            if count >= self.prefetch and self._ahead >= window:
                return
            earlier = self._saved[i]()
            if earlier is None or earlier.used:
                continue
            count += 1
            taken = earlier.start_upload()
            if taken:
                earlier.ahead = True
                self._ahead += taken
                self.stats["ahead_peak_bytes"] = max(self.stats["ahead_peak_bytes"], self._ahead)

    def _window(self) -> int:
        """Bytes backward keeps uploaded ahead: ``prefetch_bytes``, or by default a share of
        what the step offloaded."""
        if self.prefetch_bytes is not None:
            return self.prefetch_bytes
        return min(_MAX_WINDOW_BYTES, self.stats["offloaded_bytes"] // _WINDOW_SHARE)

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        self.settle()
        if not saved.used:
            saved.used = True
            self._unused -= 1
            if self._unused == 0:
                # The step's last record: once backward is over, the pinned blocks of the
                # copies and uploads still listed go back to ferry's pool (a scope used again
                # for the next step would hold them until then; one used once, until it is
                # garbage).
                try:
                    _torch().autograd.Variable._execution_engine.queue_callback(
                        self._end_of_backward)
                except RuntimeError:  # read outside a backward pass (a saved tensor inspected)
                    self._end_of_backward()
            offloaded = saved.host is not None
            if saved.on_device is None:
                self.stats["fetched_on_demand"] += offloaded
                saved.start_upload()
            else:
                self.stats["prefetched"] += offloaded
            if saved.ahead:
                saved.ahead = False
                self._ahead -= saved.nbytes
            self._prefetch_before(saved.index)
        if saved.uploaded is not None:
            _torch().cuda.current_stream(saved.device).wait_event(saved.uploaded)
        # Kept for a second op that saved the same tensor; freed with the record, when torch's
        # graph lets go of it (as the tensor itself would have been).
        return saved.on_device
