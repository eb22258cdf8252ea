"""The costs ``ferry.plan`` measures and the planner's answers on them. The cost model and the
choice are ferry's one planner in Rust (``ferry::autograd::MemoryPlan``, reached through
``_ferry.plan_memory``); the functions here pass the costs to it and read its answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple

from . import _ferry

Choice = Literal["keep", "offload", "recompute", "selective", "selective_offload"]
CHOICES: Tuple[Choice, ...] = ("keep", "offload", "recompute", "selective", "selective_offload")


@dataclass(frozen=True)
class Link:
    """The link's rates, bytes per second, device to host and host to device."""

    to_host: float
    to_device: float

    def __post_init__(self) -> None:
        if not (self.to_host > 0 and self.to_device > 0):
            raise ValueError(f"link rates must be > 0 bytes/s, got {self}")


@dataclass(frozen=True)
class RegionCost:
    """One region as measured: its forward (and backward) milliseconds, the bytes of the
    storages that only it saves (``saved_bytes``), the part of those the offload scope moves
    (``offloadable_bytes``, None: all), the bytes of its inputs that a recompute holds and that
    nothing else saves (``input_bytes``), and of the gradients its backward gives its
    parameters (``grad_bytes``). ``backward_ms`` None: twice the forward. ``selective_bytes``
    and ``selective_ms``: what a selective recompute (the expensive ops' outputs kept, the rest
    rebuilt in backward) holds from the forward to the backward, its unsaved input included,
    and adds to the step; None where it was not measured (the plan then never chooses it).
    ``cached_bytes``: the part of ``saved_bytes`` that stays until the forward ends whatever
    is chosen (autocast's casts of the region's parameters, cached for the forward).
    ``offload_ms`` and ``selective_offload_ms``: what a step with the region offloaded, and
    with it selectively recomputed and its kept outputs offloaded, added to it as measured (the
    waits for the copies); None: not measured, the copies taken as hidden in compute."""

    name: str
    forward_ms: float
    saved_bytes: int
    backward_ms: Optional[float] = None
    offloadable_bytes: Optional[int] = None
    input_bytes: int = 0
    recomputable: bool = True
    grad_bytes: int = 0
    selective_bytes: Optional[int] = None
    selective_ms: Optional[float] = None
    cached_bytes: int = 0
    offload_ms: Optional[float] = None
    selective_offload_ms: Optional[float] = None

    def __post_init__(self) -> None:
        if self.forward_ms < 0 or (self.backward_ms is not None and self.backward_ms < 0):
            raise ValueError(f"region {self.name}: times must be >= 0")
        if min(self.saved_bytes, self.input_bytes, self.grad_bytes) < 0:
            raise ValueError(f"region {self.name}: bytes must be >= 0")
        offloadable = self.offloadable_bytes
        if offloadable is not None and not 0 <= offloadable <= self.saved_bytes:
            raise ValueError(f"region {self.name}: offloadable_bytes must be in [0, saved_bytes]")
        if (self.selective_bytes is None) != (self.selective_ms is None):
            raise ValueError(f"region {self.name}: give both selective_bytes and selective_ms, "
                             "or neither")
        if self.selective_bytes is not None and self.selective_bytes < 0:
            raise ValueError(f"region {self.name}: bytes must be >= 0")
        if not 0 <= self.cached_bytes <= self.saved_bytes:
            raise ValueError(f"region {self.name}: cached_bytes must be in [0, saved_bytes]")
        if any(ms is not None and not ms >= 0 for ms in (self.offload_ms,
                                                         self.selective_offload_ms)):
            raise ValueError(f"region {self.name}: offload_ms and selective_offload_ms must be "
                             ">= 0 ms, or None")

    @property
    def backward(self) -> float:
        """Its backward ms as the planner takes it: measured, else twice the forward."""
        return 2 * self.forward_ms if self.backward_ms is None else self.backward_ms

    @property
    def offloadable(self) -> int:
        return self.saved_bytes if self.offloadable_bytes is None else self.offloadable_bytes


@dataclass(frozen=True)
class StepCost:
    """A step as measured: its regions in forward order, the saved bytes no single region owns
    (``shared_bytes``: region inputs, what several regions or the code before them save; alive
    through the regions' backward), those saved after the last region (``head_bytes``: the
    loss's, freed before the regions' backward), the gradients of the parameters outside the
    regions (``outside_grad_bytes``, counted from the regions' backward on), the link (None: no
    offload) and the pinned host memory offload may take (None: no bound).

    ``forward_peak_bytes`` and ``backward_peak_bytes`` (both or neither): the device memory the
    profiled step took without a plan, above its start (gradients set to None before it): the
    most from its start until the last region's backward starts, and per region (forward
    order) the most from its backward's start until the next region's backward starts. Where
    given, the planner predicts peaks from them, and its bytes are device bytes above the step's
    start: everything the step allocates, not only the saved activations and gradients."""

    regions: Tuple[RegionCost, ...]
    shared_bytes: int = 0
    head_bytes: int = 0
    link: Optional[Link] = None
    host_bytes: Optional[int] = None
    outside_grad_bytes: int = 0
    forward_peak_bytes: Optional[int] = None
    backward_peak_bytes: Optional[Tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if not self.regions:
            raise ValueError("a step needs at least one region")
        if min(self.shared_bytes, self.head_bytes, self.outside_grad_bytes) < 0:
            raise ValueError("shared_bytes, head_bytes and outside_grad_bytes must be >= 0")
        if (self.forward_peak_bytes is None) != (self.backward_peak_bytes is None):
            raise ValueError("give both forward_peak_bytes and backward_peak_bytes, or neither")
        if self.backward_peak_bytes is not None and \
                len(self.backward_peak_bytes) != len(self.regions):
            raise ValueError(f"{len(self.backward_peak_bytes)} backward peaks for "
                             f"{len(self.regions)} regions: give one per region, in forward order")

    @property
    def measured(self) -> bool:
        """Whether the peaks are predicted from the step's measured device memory."""
        return self.forward_peak_bytes is not None

    @property
    def plain_bytes(self) -> int:
        """The activation bytes at the peak of the step without a plan."""
        return int(_planned(self, choices=("keep",) * len(self.regions))["plain_bytes"])


@dataclass(frozen=True)
class Decision:
    """A choice per region, the saved bytes at the peak it predicts, and its extra time (in all,
    and per region: a recompute's forward)."""

    choices: Tuple[Choice, ...]
    target_bytes: int
    peak_bytes: int
    least_bytes: int
    extra_ms: float
    region_extra_ms: Tuple[float, ...] = ()

    @property
    def reachable(self) -> bool:
        return self.target_bytes >= self.least_bytes


def _planned(cost: StepCost, *, target_bytes: Optional[int] = None,
             choices: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """The planner's answer for ``target_bytes``, or its prediction for ``choices``."""
    rows: List[Tuple[float, int, Optional[float], Optional[int], int, bool, int,
                     Optional[Tuple[int, float]], int, Optional[float], Optional[float]]] = [
        (r.forward_ms, r.saved_bytes, r.backward_ms, r.offloadable_bytes, r.input_bytes,
         r.recomputable, r.grad_bytes,
         None if r.selective_bytes is None or r.selective_ms is None
         else (r.selective_bytes, r.selective_ms), r.cached_bytes, r.offload_ms,
         r.selective_offload_ms) for r in cost.regions]
    link = None if cost.link is None else (cost.link.to_host, cost.link.to_device)
    measured = None if cost.forward_peak_bytes is None or cost.backward_peak_bytes is None \
        else (cost.forward_peak_bytes, list(cost.backward_peak_bytes))
    return _ferry.plan_memory(
        rows, target_bytes, None if choices is None else list(choices),
        shared_bytes=cost.shared_bytes, head_bytes=cost.head_bytes,
        outside_grad_bytes=cost.outside_grad_bytes, link=link, host_bytes=cost.host_bytes,
        measured=measured)


def _decision(answer: Dict[str, Any], target_bytes: int) -> Decision:
    return Decision(tuple(answer["choices"]), target_bytes, answer["peak_bytes"],
                    answer["least_bytes"], answer["extra_ms"], tuple(answer["region_extra_ms"]))


def predict_peak(cost: StepCost, choices: Sequence[Choice]) -> int:
    """The activation bytes on the device at the step's peak under ``choices``: saved tensors,
    and the parameter gradients backward has made so far (docs/memory-plan.md)."""
    return int(_planned(cost, choices=choices)["peak_bytes"])


def extra_ms(cost: StepCost, choices: Sequence[Choice]) -> float:
    """Predicted extra time: a forward per recomputed region, the measured extra of each
    selective one and of each offload measured (one not measured hides in compute)."""
    return float(_planned(cost, choices=choices)["extra_ms"])


def offload_fits(cost: StepCost, choices: Sequence[Choice]) -> bool:
    """Whether the link moves every offloaded region out inside the forward compute after it
    (one queue, in order of saving) and each back inside the backward of the region after it
    (its recompute included), within the host memory."""
    return bool(_planned(cost, choices=choices)["offload_fits"])


def choose(cost: StepCost, target_bytes: int) -> Decision:
    """Keep, offload or recompute each region so that the saved bytes at the peak are at most
    ``target_bytes`` at the least predicted extra time. A target below the least reachable peak
    plans for that least peak (``Decision.reachable`` is False). A target of 0 or less, above the
    plain step's peak, or regions that save nothing raise ValueError naming the fix."""
    return _decision(_planned(cost, target_bytes=target_bytes), target_bytes)


def forced(cost: StepCost, choices: Sequence[Choice]) -> Decision:
    """The decision of ``choices`` as given (checked by the caller), its target its peak."""
    answer = _planned(cost, choices=choices)
    return _decision(answer, int(answer["peak_bytes"]))
