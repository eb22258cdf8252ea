"""The torch side of ``ferry.plan``: finding a model's regions, measuring one step of them
(times by hooks, saved bytes by a ``saved_tensors_hooks`` pack hook, the link by pinned copies),
and the offload scope a plan enters inside its offloaded regions. It reads no costs: it produces
them (``_SavedBytes.costs``) for the planner in ``_plan_costs``."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from . import pinned_stats
from ._plan_costs import Link, RegionCost
from .offload import _FERRY_DTYPES, _dtype_name, offload_saved


def find_regions(model: nn.Module) -> List[nn.Module]:
    """The model's repeated blocks: the children of the ``nn.ModuleList`` or ``nn.Sequential``
    whose children are all of one class (at least two), holding the most parameters (GPT-2's
    ``transformer.h``, Llama's ``model.layers``, timm ViT's ``blocks``)."""
    best: Optional[Tuple[int, int, nn.Module]] = None
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        children = list(module.children())
        if len({type(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or (size, len(children)) > best[:2]:
            best = (size, len(children), module)
    if best is None:
        raise ValueError(
            f"no repeated blocks found in {type(model).__name__} (no nn.ModuleList or "
            "nn.Sequential of at least two modules of one class): pass regions=[...], the "
            "modules to plan for, in forward order")
    return list(best[2].children())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts (model outputs are such)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _storage(t: torch.Tensor) -> Tuple[Any, int]:
    """A key for the memory under ``t`` and its bytes; a tensor without plain storage counts as
    its own bytes."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return ("tensor", id(t)), t.numel() * t.element_size()


class _Clock:
    """Marks in time: CUDA events on a GPU (what the device ran), perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return float(end - start) * 1e3
        end.synchronize()
        return float(start.elapsed_time(end))


class _RegionWatch:
    """Hooks on each region: which one runs now, when its forward ran, and when its backward
    started (its output's gradient) and ended (its input's gradient). Callbacks let the
    profiler count saves and the plan drive offload."""

    def __init__(self, modules: Sequence[nn.Module], clock: _Clock,
                 on_enter: Optional[Callable[[int, Any], None]] = None,
                 on_exit: Optional[Callable[[int], None]] = None,
                 on_backward: Optional[Callable[[int], None]] = None):
        self.clock = clock
        self.on_enter, self.on_exit, self.on_backward = on_enter, on_exit, on_backward
        self.current: Optional[int] = None
        self.entered: List[int] = []  # region indices in the order their forwards started
        self.exited: Set[int] = set()
        # Per region, per call: [fwd start, fwd end, bwd start, bwd end] marks.
        self.spans: List[List[List[Any]]] = [[] for _ in modules]
        self._handles = []
        for i, module in enumerate(modules):
            self._handles.append(module.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(i), always_call=True))

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            self.current = i
            self.entered.append(i)
            span = [self.clock.mark(), None, None, None]
            self.spans[i].append(span)
            if torch.is_grad_enabled():
                first = next((t for t in _tensors((args, kwargs)) if t.requires_grad), None)
                if first is not None:
                    first.register_hook(self._at_backward(span, 3, i))
            if self.on_enter is not None:
                self.on_enter(i, (args, kwargs))
        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.spans[i][-1][1] = self.clock.mark()
            self.current = None
            self.exited.add(i)
            if self.on_exit is not None:
                self.on_exit(i)
            first = next((t for t in _tensors(output) if t.requires_grad), None)
            if first is not None:
                first.register_hook(self._at_backward(self.spans[i][-1], 2, i))
        return hook

    def _at_backward(self, span: List[Any], slot: int, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if span[slot] is None:
                span[slot] = self.clock.mark()
                if slot == 2 and self.on_backward is not None:
                    self.on_backward(i)
        return hook

    def times(self, i: int) -> Tuple[Optional[float], Optional[float]]:
        """Region ``i``'s forward and backward ms over its calls (None: not seen)."""
        fwd = bwd = 0.0
        fwd_seen = bwd_seen = False
        for start, end, bstart, bend in self.spans[i]:
            if end is not None:
                fwd, fwd_seen = fwd + self.clock.ms(start, end), True
            if bstart is not None and bend is not None:
                bwd, bwd_seen = bwd + self.clock.ms(bstart, bend), True
        return (fwd if fwd_seen else None), (bwd if bwd_seen else None)

    def reset(self) -> None:
        self.current = None
        self.entered, self.exited = [], set()
        self.spans = [[] for _ in self.spans]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _PhasePeaks:
    """On a GPU, the most memory allocated above the step's start over each phase of a step:
    the forward (until the first region's backward starts) and each region's backward (from its
    start until the next region's backward starts, or the step's end)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = 0
        self.phase: Optional[int] = None  # -1: the forward; i: region i's backward
        self.forward = 0
        self.backward: Dict[int, int] = {}

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.phase = -1

    def _close(self) -> None:
        peak = max(0, torch.cuda.max_memory_allocated(self.device) - self.base)
        if self.phase == -1:
            self.forward = max(self.forward, peak)
        elif self.phase is not None:
            self.backward[self.phase] = max(self.backward.get(self.phase, 0), peak)

    def at_backward(self, i: int) -> None:
        """Region ``i``'s backward starts (host side: the allocator counts as the ops are
        issued, so no synchronization is needed)."""
        if self.phase is None:
            return
        self._close()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.phase = i

    def stop(self) -> None:
        torch.cuda.synchronize(self.device)
        if self.phase is not None:
            self._close()
        self.phase = None

    def peaks(self, regions: int) -> Optional[Tuple[int, List[int]]]:
        """(forward, per region backward) or None where a region's backward was not seen."""
        if any(i not in self.backward for i in range(regions)):
            return None
        return self.forward, [self.backward[i] for i in range(regions)]


def _phase_peaks(device: torch.device) -> Optional[_PhasePeaks]:
    """The meter of a profiled step's device memory per phase: a GPU's allocator; none on the
    CPU, which has no allocator statistics."""
    return _PhasePeaks(device) if device.type == "cuda" else None


class _Use:
    """One storage seen in the profiled step: saved by autograd, or a region's input."""

    __slots__ = ("ref", "nbytes", "savers", "offloadable", "cast")

    def __init__(self, ref: Any, nbytes: int):
        self.ref, self.nbytes = ref, nbytes
        self.savers: Set[int] = set()
        self.offloadable = True
        self.cast = False  # a cast of a parameter (autocast caches it for the forward)


_BEFORE, _HEAD = -1, -2  # savers outside the regions: before the last one ended, after it


def _offloadable(t: torch.Tensor, min_bytes: int) -> bool:
    """What ``offload_saved`` moves, bar the device: a ferry dtype (or bool), at least
    ``min_bytes``, made by a recorded op."""
    if t.numel() * t.element_size() < min_bytes:
        return False
    if _dtype_name(t.dtype) not in _FERRY_DTYPES and t.dtype != torch.bool:
        return False
    base = t._base if t._base is not None else t
    return base.grad_fn is not None


def _autocast_caching(device_type: str) -> bool:
    """Whether an autocast scope on ``device_type`` is on and keeps its casts for the forward
    (asked outside any op: inside one, autocast's own dispatch reports it off)."""
    try:
        on = torch.is_autocast_enabled(device_type)
    except TypeError:  # a torch whose call takes no device
        on = torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()
    return bool(on) and torch.is_autocast_cache_enabled()


def _model_device_type(model: nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"


class _SavedBytes:
    """The storages autograd saves during the profiled step, who saved each, and each region's
    inputs; parameters and buffers are left out (the model holds them anyway)."""

    def __init__(self, model: nn.Module, regions: int, min_offload_bytes: int):
        self.min_offload_bytes = min_offload_bytes
        self.watch: Optional[_RegionWatch] = None
        self.of_model = {_storage(t)[0] for t in list(model.parameters()) + list(model.buffers())}
        self.live: Dict[Any, _Use] = {}  # storage key -> its _Use while that storage is alive
        self.uses: List[_Use] = []
        self.inputs: List[Set[_Use]] = [set() for _ in range(regions)]
        # Per region, its input tensors and their versions at entry, until its forward ends
        # (held no longer: the measured step's memory must not count them).
        self.versions: List[List[Tuple[torch.Tensor, int]]] = [[] for _ in range(regions)]
        self.written = [False] * regions
        self.shared = self.head = 0
        # Per region, whether an autocast scope (with its cache) was on when it ran.
        self.autocast = [False] * regions
        self.device_type = _model_device_type(model)

    def _use(self, t: torch.Tensor) -> Optional[_Use]:
        key, nbytes = _storage(t)
        if key in self.of_model:
            return None
        use = self.live.get(key)
        if use is not None and use.ref is not None and use.ref.expired():
            use = None  # that storage was freed and its memory given to this one
        if use is None:
            ref = StorageWeakRef(t.untyped_storage()) if isinstance(key, int) else None
            use = self.live[key] = _Use(ref, nbytes)
            self.uses.append(use)
        return use

    def enter(self, i: int, inputs: Any) -> None:
        # Read here, outside any op: inside one, autocast's own dispatch reports it off.
        self.autocast[i] = self.autocast[i] or _autocast_caching(self.device_type)
        for t in _tensors(inputs):
            use = self._use(t)
            if use is not None:
                self.inputs[i].add(use)
            self.versions[i].append((t, t._version))

    def exit(self, i: int) -> None:
        """Region ``i``'s forward ended: whether it wrote an input in place is known."""
        self.written[i] = self.writes_inputs(i)
        self.versions[i] = []

    def writes_inputs(self, i: int) -> bool:
        return self.written[i] or any(t._version != v for t, v in self.versions[i])

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        use = self._use(t)
        if use is not None and self.watch is not None:
            region = self.watch.current
            if region is None:
                region = _HEAD if len(self.watch.exited) == len(self.inputs) else _BEFORE
            use.savers.add(region)
            use.offloadable = use.offloadable and _offloadable(t, self.min_offload_bytes)
            use.cast = use.cast or self._casts_a_parameter(t)
        return t

    def _casts_a_parameter(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (or the tensor it views) is a cast of one of the model's parameters, as
        autocast makes and keeps in its cache until the forward ends."""
        base = t._base if t._base is not None else t
        fn = base.grad_fn
        if fn is None or not type(fn).__name__.startswith("ToCopyBackward"):
            return False
        source = fn.next_functions[0][0] if fn.next_functions else None
        variable = getattr(source, "variable", None)
        return isinstance(variable, torch.Tensor) and _storage(variable)[0] in self.of_model

    def costs(self, names: Sequence[str], times: Sequence[Tuple[float, Optional[float]]],
              grads: Sequence[int]) -> Tuple[RegionCost, ...]:
        n = len(names)
        saved, offloadable, cached = [0] * n, [0] * n, [0] * n
        shared = head = 0
        inputs = set().union(*self.inputs)
        for use in self.uses:
            if not use.savers:
                continue
            only = next(iter(use.savers)) if len(use.savers) == 1 else None
            if only is not None and only >= 0 and use not in inputs:
                saved[only] += use.nbytes
                offloadable[only] += use.nbytes if use.offloadable else 0
                cached[only] += use.nbytes if use.cast and self.autocast[only] else 0
            elif use.savers == {_HEAD}:
                head += use.nbytes
            else:
                shared += use.nbytes
        regions = []
        for i in range(n):
            unsaved = sum(u.nbytes for u in self.inputs[i] if not u.savers)
            forward, backward = times[i]
            regions.append(RegionCost(names[i], forward, saved[i], backward, offloadable[i],
                                      unsaved, not self.writes_inputs(i), grads[i],
                                      cached_bytes=cached[i]))
        self.shared, self.head = shared, head
        return tuple(regions)


def _measure_link(device: torch.device, nbytes: int = 64 << 20) -> Link:
    """The best of three pinned copies each way on a side stream."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    back = torch.empty_like(src)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    best = {"out": float("inf"), "in": float("inf")}
    with torch.cuda.stream(stream):
        for _ in range(3):
            for direction, dst, source in (("out", host, src), ("in", back, host)):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                dst.copy_(source, non_blocking=True)
                end.record(stream)
                end.synchronize()
                best[direction] = min(best[direction], start.elapsed_time(end))
    return Link(nbytes / (best["out"] / 1e3), nbytes / (best["in"] / 1e3))


def _host_room() -> Optional[int]:
    """The pinned memory ferry's pool may still hand out (None: unknown)."""
    try:
        stats = pinned_stats()
        return max(0, stats["budget_bytes"] - stats["allocated_bytes"])
    except Exception:  # no driver: offload is not offered anyway
        return None


# -- Applying a plan -----------------------------------------------------------------------------


class _RegionOffload(offload_saved):
    """``offload_saved``, entered only while an offloaded region runs its forward, leaving that
    region's inputs where they are (a recompute would hold them too; the cost model counts them
    as shared). No upload ahead on unpack: the plan uploads a region's records when the backward
    of the region after it starts (``upload``), so they come back inside that backward."""

    def __init__(self, min_bytes: int):
        super().__init__(min_bytes=min_bytes, prefetch=0, prefetch_bytes=0)
        self._region: Optional[int] = None
        self._last = -1
        self._inputs: Set[Any] = set()
        self._records: Dict[int, List[int]] = {}  # region -> indices into self._saved, this step
        self._region_hooks: Any = None
        self._bare = False

    def enter(self, i: int, inputs: Any, hooks: bool = True) -> None:
        """Region ``i``'s forward starts: what it saves is offloaded (``hooks``), or only the
        outputs its selective recompute keeps (``pack_kept``)."""
        if self._steps == 0 or i <= self._last:  # the first offloaded region of a step
            if self._steps:
                self._next_step()
            self._steps += 1
            self._records = {}
        self._last, self._region = i, i
        self._inputs = {_storage(t)[0] for t in _tensors(inputs)}
        if hooks:
            self._region_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack,
                                                                          self._unpack)
            self._region_hooks.__enter__()

    def exit(self) -> None:
        if self._region_hooks is not None:
            self._region_hooks.__exit__(None, None, None)
            self._region_hooks = None
        self._region = None
        # The records hold what backward reads: only the graph may keep them past the forward.
        self._seen.clear()

    def _offloadable(self, t: torch.Tensor) -> bool:
        if self._region is None or _storage(t)[0] in self._inputs:
            return False
        # A selective region's kept outputs were made below autograd: no grad_fn to ask for.
        return self._movable(t) if self._bare else super()._offloadable(t)

    def pack_kept(self, i: int, t: torch.Tensor) -> Any:
        """A kept output of selective region ``i`` (inside its forward): a record on its way to
        the host, or ``t`` where it stays (too small, or the pinned budget is full)."""
        self._bare = True
        try:
            return self._pack(t)
        finally:
            self._bare = False

    def _pack(self, t: torch.Tensor) -> Any:
        before = len(self._saved)
        packed = super()._pack(t)
        if len(self._saved) > before and self._region is not None:
            self._records.setdefault(self._region, []).append(before)
        return packed

    def upload(self, i: int) -> None:
        """Starts the uploads of region ``i``'s records, the last saved first."""
        for index in reversed(self._records.pop(i, [])):
            record = self._saved[index]() if index < len(self._saved) else None
            if record is None or record.used or record.on_device is not None:
                continue
            taken = record.start_upload()
            if taken:
                record.ahead = True
                self._ahead += taken
                self.stats["ahead_peak_bytes"] = max(self.stats["ahead_peak_bytes"], self._ahead)


def _grad_bytes(params: Iterable[nn.Parameter]) -> int:
    """The bytes of the gradients of the trainable ones of ``params``."""
    unique = {id(p): p for p in params if p.requires_grad}
    return sum(p.numel() * p.element_size() for p in unique.values())


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
