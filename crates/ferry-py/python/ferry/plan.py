"""``ferry.plan``: a memory plan for an unmodified ``torch.nn.Module`` in eager mode. Each of the
model's repeated blocks (a *region*) keeps what autograd saves in it, offloads it to pinned host
memory, recomputes it in backward, or recomputes it selectively (the outputs of its matrix
products and attention kept, the cheap ops run again); the choice comes from a profiled step and
a target for the activation bytes at the step's peak (what autograd saves, and the parameter
gradients backward has made by then)::

    plan = ferry.plan.MemoryPlan.profile(model, lambda: loss_fn(model(x)).backward(),
                                         fraction=0.5)
    print(plan)                    # per region: choice, saved bytes, predicted extra ms
    for x in batches:
        with plan:
            loss_fn(model(x)).backward()
        print(plan.explain())      # now with the measured ms of the last step

The planner is ferry's one planner, in Rust (``ferry::autograd::MemoryPlan``): ``choose``,
``predict_peak``, ``offload_fits`` and ``extra_ms`` pass the measured costs (``StepCost``) to it.
This package measures (``_plan_torch``) and applies. Offload is chosen only where the link moves
a region's tensors out inside the forward compute that follows it and back inside the backward
of the next region, and costs what the profile measured a step with it to add (on a GPU; else
nothing); recompute costs one forward of the region, a selective one what its profile measured.
Free offloads come first, then the move cheapest per byte freed; the rest is kept. See
docs/memory-plan.md for the model and what it assumes.

Recompute is ``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``
around the region's forward (dropout draws the same masks again), selective with ferry's
dispatch modes as its ``context_fn`` (``_plan_selective``); offload is ferry's
``offload_saved`` scope, entered only inside the chosen regions.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import cuda_available
from ._plan_costs import (CHOICES, Choice, Decision, Link, RegionCost, StepCost, choose,
                          extra_ms, forced, offload_fits, predict_peak)
from ._plan_selective import Kept, Tally, recomputed
from ._plan_torch import (_bytes, _Clock, _grad_bytes, _host_room, _measure_link,
                          _model_device, _phase_peaks, _RegionOffload, _RegionWatch, _SavedBytes,
                          _storage, _tensors, find_regions)

__all__ = ["CHOICES", "Choice", "Decision", "Link", "MemoryPlan", "PlanError", "RegionCost",
           "StepCost", "TargetUnreachable", "choose", "extra_ms", "find_regions", "offload_fits",
           "predict_peak"]


class PlanError(RuntimeError):
    """What profiling or applying a plan found wrong with the model or the step; the message
    names the fix."""


class TargetUnreachable(UserWarning):
    """The target is below the least peak the plan reaches (``least_bytes``); the plan runs at
    that least peak. ``warnings.simplefilter("error", TargetUnreachable)`` makes it raise."""

    def __init__(self, message: str, least_bytes: int):
        super().__init__(message)
        self.least_bytes = least_bytes


_APPLIED: "weakref.WeakKeyDictionary[nn.Module, MemoryPlan]" = weakref.WeakKeyDictionary()


class MemoryPlan:
    """Per region of a model, keep, offload or recompute (whole or selectively) what autograd
    saves, chosen to bring the step's activation bytes at its peak (saved tensors, and the
    parameter gradients backward has made by then) to a target at the least predicted time. A
    plan profiled on a GPU predicts from the step's measured device memory instead, and its
    bytes (targets, peaks) are all the step allocates above its start (``cost.measured``).

    Build it with ``MemoryPlan.profile(model, step_fn, target_bytes=... | fraction=...)``, or
    from costs of your own with ``MemoryPlan(regions, cost, target_bytes=... | fraction=... |
    choices=...)``. ``fraction`` is of the plain step's peak (``cost.plain_bytes``);
    ``choices`` forces a choice per region (``"keep"``, ``"offload"``, ``"recompute"``,
    ``"selective"``, ``"selective_offload"``). A target below the least peak the plan reaches
    warns ``TargetUnreachable`` and plans for that least peak (``reachable`` is False,
    ``least_bytes`` says it).

    Use it around each step (``with plan:``) or for good (``plan.apply()`` until
    ``plan.remove()``); either way one plan serves every step. ``str(plan)`` / ``explain()``
    tell, per region, the choice, its saved bytes, its predicted and, after a step, measured ms.
    """

    def __init__(self, regions: Sequence[nn.Module], cost: StepCost, *,
                 target_bytes: Optional[int] = None, fraction: Optional[float] = None,
                 choices: Optional[Sequence[str]] = None, min_offload_bytes: int = 1 << 20,
                 device: Optional[torch.device] = None):
        self.regions: Tuple[nn.Module, ...] = tuple(regions)
        if len(self.regions) != len(cost.regions):
            raise ValueError(f"{len(self.regions)} modules for {len(cost.regions)} region costs")
        if len({id(m) for m in self.regions}) != len(self.regions):
            raise ValueError("a module is given twice in regions")
        self.cost = cost
        self.min_offload_bytes = min_offload_bytes
        self.device = device if device is not None else (
            _model_device(self.regions[0]) if self.regions else torch.device("cpu"))
        given = sum(x is not None for x in (target_bytes, fraction, choices))
        if given != 1:
            raise ValueError("pass exactly one of target_bytes=, fraction= (of the plain step's "
                             "activation bytes at the peak) or choices=")
        if choices is not None:
            self.decision = self._forced(choices)
        else:
            if fraction is not None:
                if not 0 < fraction <= 1:
                    raise ValueError(f"fraction={fraction}: it is a part of the plain step's "
                                     "activation bytes at the peak and must be in (0, 1]")
                target_bytes = max(1, int(fraction * cost.plain_bytes))
            assert target_bytes is not None
            self.decision = choose(cost, target_bytes)
            if not self.decision.reachable:
                warnings.warn(TargetUnreachable(
                    f"target {_bytes(target_bytes)} of activations is below the least "
                    f"this plan reaches, {_bytes(self.decision.least_bytes)} "
                    f"({self.decision.least_bytes} bytes): planned for that instead",
                    self.decision.least_bytes), stacklevel=2)
        self._applied = self._entered_applied = False
        self._wrapped: List[Tuple[nn.Module, Any]] = []
        # Per selective region, what its recomputes used and could not reuse.
        self._tallies: Dict[int, Tally] = {}
        self._watch: Optional[_RegionWatch] = None
        self._scope: Optional[_RegionOffload] = None

    def _forced(self, choices: Sequence[str]) -> Decision:
        if len(choices) != len(self.regions):
            raise ValueError(f"{len(choices)} choices for {len(self.regions)} regions")
        for region, choice in zip(self.cost.regions, choices):
            if choice not in CHOICES:
                raise ValueError(
                    f"region {region.name}: choice {choice!r} is not one of {CHOICES}")
            if choice in ("offload", "selective_offload") and self.cost.link is None:
                raise ValueError(f"region {region.name}: {choice} needs a GPU and its link to "
                                 "pinned host memory; on the CPU choose keep or recompute")
            if choice in ("recompute", "selective", "selective_offload") \
                    and not region.recomputable:
                raise ValueError(f"region {region.name} writes in place to its input, so a "
                                 "recompute would read the new values: keep or offload it")
            if choice in ("selective", "selective_offload") and region.selective_bytes is None:
                raise ValueError(f"region {region.name}: no selective recompute was measured "
                                 "for it (profile with selective=True): choose keep, offload "
                                 "or recompute")
        picked: Tuple[Choice, ...] = tuple(choices)  # type: ignore[arg-type]
        return forced(self.cost, picked)

    @classmethod
    def profile(cls, model: nn.Module, step_fn: Callable[[], Any], *,
                target_bytes: Optional[int] = None, fraction: Optional[float] = None,
                regions: Optional[Sequence[nn.Module]] = None, warmup: int = 1,
                min_offload_bytes: int = 1 << 20, selective: bool = True,
                offload: bool = True) -> MemoryPlan:
        """Runs ``step_fn`` (a forward and backward of ``model``) ``warmup`` times, then once
        more measuring each region, and plans for the target. With ``selective`` (the default)
        the same again (at least one warmup) with every region selectively recomputed,
        measuring what that holds and adds, so the plan may choose it. On a GPU the measured
        step also records the device memory it takes over its forward and over each region's
        backward (resetting torch's peak memory statistics as it goes), from which the plan
        predicts its peaks: its bytes are then all the step allocates above its start. With
        ``offload`` (the default) and a GPU's link, two steps more (each after ``warmup``):
        every region offloaded, then every selectively measured one selectively recomputed with
        its kept outputs offloaded, measuring what each adds (the waits for the copies), so
        the plan counts what offloading costs instead of taking it as hidden. The
        measured step starts with the gradients set to None, as ``zero_grad()`` leaves them;
        the steps accumulate gradients as any step does; the RNG streams are left as they were."""
        if warmup < 0:
            raise ValueError(f"warmup={warmup} must be >= 0")
        if sum(x is not None for x in (target_bytes, fraction)) != 1:
            raise ValueError("pass exactly one of target_bytes= or fraction= (of the plain "
                             "step's activation bytes at the peak)")
        names = {m: name for name, m in model.named_modules()}
        modules = list(find_regions(model) if regions is None else regions)
        _check_regions(modules, names)
        device = _model_device(model)
        cuda = device.type == "cuda"
        devices = [device.index if device.index is not None else torch.cuda.current_device()] \
            if cuda else []
        counter = _SavedBytes(model, len(modules), min_offload_bytes)
        meter = _phase_peaks(device)
        with torch.random.fork_rng(devices=devices):
            for _ in range(warmup):
                step_fn()
            # As a step after zero_grad(): its gradients are allocated inside it.
            model.zero_grad(set_to_none=True)
            watch = _RegionWatch(modules, _Clock(device), on_enter=counter.enter,
                                 on_exit=counter.exit,
                                 on_backward=None if meter is None else meter.at_backward)
            counter.watch = watch
            if meter is not None:
                meter.start()
            try:
                with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                    step_fn()
            finally:
                if meter is not None:
                    meter.stop()
                watch.remove()
        not_run = [names[m] for i, m in enumerate(modules) if not watch.spans[i]]
        if not_run:
            raise PlanError(f"the step did not run regions {not_run}: pass regions= that "
                            "step_fn runs")
        if not any(use.savers for use in counter.uses):
            raise PlanError("the step saved no tensors for backward: run the forward in step_fn "
                            "with grad enabled (not under torch.no_grad() or inference_mode)")
        times = [watch.times(i) for i in range(len(modules))]
        link = _link_of(device)
        host = _host_room() if link is not None else None
        grads = [_grad_bytes(m.parameters()) for m in modules]
        inside = {id(p) for m in modules for p in m.parameters()}
        outside = _grad_bytes(p for p in model.parameters() if id(p) not in inside)
        costs = counter.costs([names[m] for m in modules], [(f or 0.0, b) for f, b in times],
                              grads)
        if selective:
            with torch.random.fork_rng(devices=devices):
                measured = _measure_selective(modules, [names[m] for m in modules], step_fn,
                                              device, [r.recomputable for r in costs],
                                              max(1, warmup))
            costs = tuple(_with_selective(r, times[i], measured[i])
                          for i, r in enumerate(costs))
        # Forward order, as the windows of the cost model need it.
        order = sorted(range(len(modules)), key=watch.entered.index)
        peaks = None if meter is None else meter.peaks(len(modules))
        cost = StepCost(tuple(costs[i] for i in order), counter.shared, counter.head, link, host,
                        outside, forward_peak_bytes=None if peaks is None else peaks[0],
                        backward_peak_bytes=None if peaks is None
                        else tuple(peaks[1][i] for i in order))
        if offload and link is not None:
            with torch.random.fork_rng(devices=devices):
                cost = _measured_offloads([modules[i] for i in order], cost, step_fn,
                                          max(1, warmup), min_offload_bytes, device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TargetUnreachable)
            plan = cls([modules[i] for i in order], cost, target_bytes=target_bytes,
                       fraction=fraction, min_offload_bytes=min_offload_bytes, device=device)
        for warning in caught:  # told at the caller's line
            warnings.warn(warning.message, stacklevel=2)
        return plan

    def retarget(self, *, target_bytes: Optional[int] = None, fraction: Optional[float] = None,
                 choices: Optional[Sequence[str]] = None) -> MemoryPlan:
        """A plan for the same regions and measured costs with another target (not applied)."""
        return MemoryPlan(self.regions, self.cost, target_bytes=target_bytes, fraction=fraction,
                          choices=choices, min_offload_bytes=self.min_offload_bytes,
                          device=self.device)

    @property
    def choices(self) -> Tuple[Choice, ...]:
        return self.decision.choices

    @property
    def target_bytes(self) -> int:
        return self.decision.target_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        return self.decision.peak_bytes

    @property
    def least_bytes(self) -> int:
        return self.decision.least_bytes

    @property
    def reachable(self) -> bool:
        return self.decision.reachable

    @property
    def predicted_extra_ms(self) -> float:
        return self.decision.extra_ms

    # -- applying --

    def apply(self) -> None:
        """Wraps the recomputed regions' forwards and hooks the regions (a no-op if applied)."""
        if self._applied:
            return
        for module, region in zip(self.regions, self.cost.regions):
            owner = _APPLIED.get(module)
            if owner is not None and owner is not self:
                raise PlanError(f"region {region.name} is under another plan: remove() that "
                                "plan first")
        if {"offload", "selective_offload"} & set(self.choices) and self._scope is None:
            self._scope = _RegionOffload(self.min_offload_bytes)
        self._watch = _RegionWatch(self.regions, _Clock(self.device), on_enter=self._enter,
                                   on_exit=self._exit, on_backward=self._backward)
        for i, choice in enumerate(self.choices):
            if choice in ("recompute", "selective", "selective_offload"):
                self._wrap(i)
        for module in self.regions:
            _APPLIED[module] = self
        self._applied = True

    def remove(self) -> None:
        """Gives the regions their own forwards back (a no-op if not applied). A backward still
        to run on a graph built under the plan still recomputes and uploads as planned."""
        if not self._applied:
            return
        for module, own in self._wrapped:
            _unwrap(module, own)
        self._wrapped = []
        if self._watch is not None:
            self._watch.remove()  # its spans stay readable for explain()
        if self._scope is not None:
            self._scope.exit()
        for module in self.regions:
            if _APPLIED.get(module) is self:
                del _APPLIED[module]
        self._applied = False

    def __enter__(self) -> MemoryPlan:
        self._entered_applied = not self._applied
        self.apply()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._entered_applied:
            self.remove()

    def _enter(self, i: int, inputs: Any) -> None:
        if self._scope is not None:
            self._scope.settle()  # lets go of the tensors whose copies out have landed
        watch = self._watch
        if i == 0 and watch is not None and len(watch.spans[0]) > 1:
            # The first region again: a new step; measure it afresh.
            latest = watch.spans[0][-1]
            watch.reset()
            watch.spans[0].append(latest)
            watch.entered.append(0)
        if self.choices[i] in ("offload", "selective_offload") and self._scope is not None:
            self._scope.enter(i, inputs, hooks=self.choices[i] == "offload")

    def _exit(self, i: int) -> None:
        if self._scope is not None:
            if self.choices[i] in ("offload", "selective_offload"):
                self._scope.exit()
            self._scope.settle()

    def _backward(self, i: int) -> None:
        if i and self.choices[i - 1] in ("offload", "selective_offload") \
                and self._scope is not None:
            self._scope.upload(i - 1)

    def _wrap(self, i: int) -> None:
        choice = self.choices[i]
        make = None
        if choice in ("selective", "selective_offload"):
            make = self._kept_maker(i, choice == "selective_offload")
        module = self.regions[i]
        self._wrapped.append((module, _wrap_recompute(module, self.cost.regions[i].name, make)))

    def _kept_maker(self, i: int, offloaded: bool) -> Callable[[], Kept]:
        """What gives each call of selective region ``i`` its ``Kept``: sharing the region's
        tally, its outputs sent through the offload scope where ``offloaded``."""
        tally = self._tallies.setdefault(i, Tally())
        scope = self._scope
        offload = None
        if offloaded and scope is not None:
            offload = (lambda t: scope.pack_kept(i, t), scope._unpack)
        return lambda: Kept(offload, tally)

    # -- explaining --

    def measured(self) -> Tuple[Tuple[Optional[float], Optional[float]], ...]:
        """Per region, the forward and backward ms of the last step run under the plan
        (recompute included in the backward; None: not run yet). Waits for a GPU's events."""
        watch = self._watch
        if watch is None:
            return tuple((None, None) for _ in self.regions)
        return tuple(watch.times(i) for i in range(len(self.regions)))

    def explain(self) -> str:
        cost, d = self.cost, self.decision
        link = ("none: keep or recompute only" if cost.link is None else
                f"{cost.link.to_host / 1e9:.1f} GB/s to host, "
                f"{cost.link.to_device / 1e9:.1f} GB/s to device")
        what = ("device bytes above the step's start" if cost.measured
                else "activation bytes")
        lines = [
            f"MemoryPlan over {len(self.regions)} regions; {what} at the peak: "
            f"target {_bytes(d.target_bytes)}, predicted {_bytes(d.peak_bytes)} (plain "
            f"{_bytes(cost.plain_bytes)}, least reachable {_bytes(d.least_bytes)}"
            + ("" if d.reachable else ": the target is below it") + ")",
            f"predicted extra {d.extra_ms:.2f} ms per step; link: {link}",
        ]
        header = ("region", "choice", "saved", "selective", "fwd ms", "bwd ms",
                  "pred. extra ms", "meas. fwd ms", "meas. bwd ms", "meas. extra ms")
        rows = [header]
        for region, choice, predicted, (mf, mb) in zip(cost.regions, d.choices,
                                                       d.region_extra_ms, self.measured()):
            extra = "-" if mf is None or mb is None else \
                f"{mf + mb - region.forward_ms - region.backward:.2f}"
            selective = "-" if region.selective_bytes is None else \
                f"{_bytes(region.selective_bytes)} +{region.selective_ms:.2f} ms"
            rows.append((region.name, choice, _bytes(region.saved_bytes), selective,
                         f"{region.forward_ms:.2f}",
                         f"{region.backward:.2f}" + ("*" if region.backward_ms is None else ""),
                         f"{predicted:.2f}", "-" if mf is None else f"{mf:.2f}",
                         "-" if mb is None else f"{mb:.2f}", extra))
        widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                  for row in rows]
        lines.append(f"outside the regions: {_bytes(cost.shared_bytes)} shared (region inputs, "
                     f"saved before them), {_bytes(cost.head_bytes)} after the last (kept)")
        if cost.forward_peak_bytes is not None and cost.backward_peak_bytes is not None:
            lines.append(
                "peaks predicted from the profiled step's device memory above its start: forward "
                f"{_bytes(cost.forward_peak_bytes)}; backward of each region (first to last) "
                + ", ".join(_bytes(b) for b in cost.backward_peak_bytes))
        if any(r.backward_ms is None for r in cost.regions):
            lines.append("* backward not measured: twice the forward assumed")
        if any(choice.startswith("selective") for choice in d.choices):
            lines.append("selective: the bytes held from the forward to the backward (the kept "
                         "outputs of matrix products and attention, and the unsaved input) and "
                         "the ms the recompute adds")
            fell_back = sum(tally.fell_back for tally in self._tallies.values())
            if fell_back:
                lines.append(f"selective: {fell_back} kept outputs were not reusable (written "
                             "in place, or a second backward) and were computed again")
        if self._scope is not None:
            stats = self._scope.stats
            lines.append("offload, last step: " + ", ".join(
                f"{k} {stats[k]}" for k in ("offloaded", "offloaded_bytes", "prefetched",
                                            "fetched_on_demand", "read_in_place")))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    def __repr__(self) -> str:
        return (f"MemoryPlan(choices={list(self.choices)}, target_bytes={self.target_bytes}, "
                f"predicted_peak_bytes={self.predicted_peak_bytes})")


def _wrap_recompute(module: nn.Module, name: str,
                    make_kept: Optional[Callable[[], Kept]]) -> Any:
    """Replaces ``module.forward`` on the instance by a recompute of it, selective where
    ``make_kept`` gives each call its ``Kept``; returns the instance's own ``forward`` (None:
    the class's) for ``_unwrap``. Under ``torch.no_grad`` the original runs as is. An input
    written in place between the forward and its recompute raises ``PlanError`` in backward
    instead of giving a wrong gradient."""
    own = module.__dict__.get("forward")
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        versions = [(t, t._version) for t in _tensors((args, kwargs))]
        calls = [0]

        def run(a: Tuple[Any, ...], k: Dict[str, Any]) -> Any:
            calls[0] += 1
            if calls[0] > 1 and any(t._version != v for t, v in versions):
                raise PlanError(
                    f"region {name}: an input was written in place after its forward ran, "
                    "so its recompute would read the new values; keep this region "
                    "(plan.retarget(choices=...)) or make that write out of place")
            return inner(*a, **k)

        return recomputed(run, args, kwargs, None if make_kept is None else make_kept())

    setattr(module, "forward", forward)
    return own


def _unwrap(module: nn.Module, own: Any) -> None:
    if own is None:
        module.__dict__.pop("forward", None)
    else:
        setattr(module, "forward", own)


def _measure_selective(modules: Sequence[nn.Module], names: Sequence[str],
                       step_fn: Callable[[], Any], device: torch.device,
                       recomputable: Sequence[bool],
                       warmup: int) -> List[Optional[Tuple[int, float, float]]]:
    """After ``warmup`` steps, one with every recomputable region selectively recomputed: per
    region, the bytes of the kept outputs its recompute used (each storage once, region inputs
    left out: they are shared; those after the recompute's early stop need not be kept), and
    its forward and backward ms (its recompute included); None for a region not run so, not
    timed, or whose recompute ran an op again (``Kept.fell_back``)."""
    n = len(modules)
    kept: List[List[Kept]] = [[] for _ in range(n)]
    inputs: set = set()
    held: List[Optional[int]] = [None] * n

    def enter(i: int, args: Any) -> None:
        inputs.update(_storage(t)[0] for t in _tensors(args))

    def maker(calls: List[Kept]) -> Callable[[], Kept]:
        def make() -> Kept:
            calls.append(Kept())
            return calls[-1]
        return make

    wrapped = [(m, _wrap_recompute(m, names[i], maker(kept[i])))
               for i, m in enumerate(modules) if recomputable[i]]
    try:
        for _ in range(warmup):  # the first step under dispatch modes pays one-time costs
            step_fn()
        for calls in kept:
            calls.clear()
        watch = _RegionWatch(modules, _Clock(device), on_enter=enter)
        try:
            step_fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        finally:
            watch.remove()
    finally:
        for module, own in wrapped:
            _unwrap(module, own)
    # What each region kept and its recompute used (each storage once; region inputs are
    # shared): all of it was alive at the end of the forward.
    seen: set = set()
    for i in range(n):
        if kept[i]:
            bytes_of: Dict[int, int] = {}
            for call in kept[i]:
                bytes_of.update(call.kept_bytes(inputs | seen))
            seen |= set(bytes_of)
            held[i] = sum(bytes_of.values())
    out: List[Optional[Tuple[int, float, float]]] = []
    for i in range(n):
        forward, backward = watch.times(i)
        ok = (recomputable[i] and kept[i] and held[i] is not None and forward is not None
              and backward is not None and not any(k.fell_back for k in kept[i]))
        out.append((held[i] or 0, forward or 0.0, backward or 0.0) if ok else None)
    return out


def _link_of(device: torch.device) -> Optional[Link]:
    """The measured link between ``device`` and pinned host memory; None off a GPU (or where
    ferry cannot reach it): nothing is offloaded then."""
    return _measure_link(device) if device.type == "cuda" and cuda_available() else None


def _measured_offloads(modules: Sequence[nn.Module], cost: StepCost,
                       step_fn: Callable[[], Any], warmup: int, min_offload_bytes: int,
                       device: torch.device) -> StepCost:
    """``cost`` with what offloading adds as measured: ``warmup`` steps and one more with every
    region that has bytes to move offloaded, the same with every region whose selective
    recompute was measured recomputed so, its kept outputs offloaded; per region, its forward
    and backward under the choice less the plain ones (at least 0). A step that could not run
    (out of memory, say) leaves its choice unmeasured: taken as hidden in compute."""
    regions = list(cost.regions)
    plain = [r.forward_ms + r.backward for r in regions]
    trials = {
        "offload": [r.offloadable > 0 for r in regions],
        "selective_offload": [r.recomputable and r.selective_bytes is not None
                              and r.selective_bytes > r.input_bytes for r in regions],
    }
    for choice, chosen in trials.items():
        if not any(chosen):
            continue
        choices = [choice if c else "keep" for c in chosen]
        try:
            plan = MemoryPlan(modules, cost, choices=choices,
                              min_offload_bytes=min_offload_bytes, device=device)
            with plan:
                for _ in range(warmup + 1):
                    step_fn()
            times = plan.measured()
        except (torch.OutOfMemoryError, PlanError, ValueError):
            continue
        for i, ((forward, backward), c) in enumerate(zip(times, chosen)):
            if not c or forward is None or backward is None:
                continue
            extra = max(0.0, forward + backward - plain[i])
            field_name = "offload_ms" if choice == "offload" else "selective_offload_ms"
            regions[i] = dataclasses.replace(regions[i], **{field_name: extra})
    return dataclasses.replace(cost, regions=tuple(regions))


def _with_selective(region: RegionCost, plain: Tuple[Optional[float], Optional[float]],
                    measured: Optional[Tuple[int, float, float]]) -> RegionCost:
    """``region`` with its selective recompute's held bytes (kept outputs and unsaved input)
    and extra ms (its step under it less the plain one, at least 0); as is where either step
    went unmeasured or the kept outputs would not free anything."""
    forward, backward = plain
    if measured is None or forward is None or backward is None:
        return region
    kept, sel_forward, sel_backward = measured
    held_bytes = kept + region.input_bytes
    if held_bytes >= region.saved_bytes:
        return region
    extra = max(0.0, sel_forward + sel_backward - forward - backward)
    return dataclasses.replace(region, selective_bytes=held_bytes, selective_ms=extra)


def _check_regions(modules: Sequence[nn.Module], names: Dict[nn.Module, str]) -> None:
    if not modules:
        raise ValueError("regions=[] is empty: pass the model's repeated blocks, or leave "
                         "regions out to take the children of its largest nn.ModuleList")
    for m in modules:
        if not isinstance(m, nn.Module) or m not in names:
            raise ValueError(f"region {m!r:.60} is not a submodule of the model: pass modules "
                             "of the model being profiled")
        if _APPLIED.get(m) is not None:
            raise PlanError(f"region {names[m]} is under a plan: remove() it to profile the "
                            "plain step")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("a module is given twice in regions")
    for a in modules:
        for b in modules:
            if a is not b and any(c is b for c in a.modules()):
                raise ValueError(f"region {names[b]} is inside region {names[a]}: regions must "
                                 "not nest; pass one level of blocks")
