"""Recompute for ``ferry.plan``'s regions, whole or selective. A whole recompute is
``torch.utils.checkpoint`` (non-reentrant, RNG state preserved) around the region's forward. A
selective one runs under the same checkpoint with two dispatch modes as its ``context_fn``: in
the forward, the outputs of the expensive ops (matrix products, attention, convolutions) are
kept; in the recompute, those ops hand back what was kept instead of running again, so backward
reruns only the cheap ops (norms, activations, element-wise), from the kept outputs and the
region's inputs. What autograd saved in the region is dropped as in a whole recompute. The kept
outputs may go to pinned host memory as they are kept and come back for the recompute
(``Kept(offload=...)``, the plan's ``selective_offload``)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import checkpoint

from .offload import _Saved


def _packets(names: Tuple[str, ...]) -> Set[Any]:
    """The aten op packets of ``names`` this torch has (some attention kernels are newer)."""
    return {getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n)}


# The ops whose outputs a selective recompute keeps: compute-bound, so running them again costs
# most of a whole recompute, while their outputs are a part of what the region saves.
KEPT_OPS = _packets((
    "mm", "addmm", "_addmm_activation", "bmm", "baddbmm", "_scaled_mm", "convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward",
))

_KEEPS: Dict[Any, bool] = {}


def _keeps(func: Any) -> bool:
    """Whether ``func`` (an op overload) is one whose output is kept: an op of ``KEPT_OPS``
    that writes none of its arguments (not an ``out=`` form)."""
    keeps = _KEEPS.get(func)
    if keeps is None:
        writes = any(a.alias_info is not None and a.alias_info.is_write
                     for a in func._schema.arguments)
        keeps = _KEEPS[func] = func.overloadpacket in KEPT_OPS and not writes
    return keeps


def _tensors_in(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _tensors_in(item)


def _versions(tree: Any) -> Tuple[Optional[int], ...]:
    """The version of each tensor leaf of ``tree``; None for other leaves (a record on its way
    to the host among them)."""
    return tuple(x._version if isinstance(x, torch.Tensor) else None for x in tree_leaves(tree))


def _alias(t: torch.Tensor) -> torch.Tensor:
    """``t`` without autograd's history, sharing its memory and its version counter (so an
    in-place write after the keep shows). The output itself gets a grad_fn once returned, and
    holding that would tie the graph to the kept list in a reference cycle. Below autograd a
    plain ``detach`` would start a version counter of its own: the in-place-or-view key, which
    shares it, is let through for it (as torch's own selective checkpointing does). A torch
    without that guard keeps ``t`` itself: the same values, freed by the collector rather than
    at once where a graph is dropped without its backward."""
    guard = getattr(torch._C, "_SetExcludeDispatchKeyGuard", None)
    if guard is None:
        return t
    with guard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


class Tally:
    """What a region's calls have learnt: how many kept outputs a recompute could not reuse
    (``fell_back``), and how many of its kept ops the recompute used (``needed``): a recompute
    stops once it has rebuilt what backward reads (torch's early stop), so the outputs of the ops
    after those need not be kept at all."""

    __slots__ = ("fell_back", "needed")

    def __init__(self) -> None:
        self.fell_back = 0
        self.needed: Optional[int] = None


class Kept:
    """The outputs one call of a region's forward kept, in the order its ops ran, with each
    tensor's version. In the recompute each is handed back once, if it is still what the
    forward computed; where it is not (written in place since, a recompute that runs other ops,
    a second backward after the first let go), the op runs again, as in a whole recompute, and
    ``fell_back`` counts it. With a ``tally`` that has learnt how many ops a recompute uses, only
    those are kept. With ``offload`` (a pack and an unpack), each kept tensor goes to host memory
    as the forward keeps it and comes back in the recompute."""

    def __init__(self, offload: Optional[Tuple[Callable[[torch.Tensor], Any],
                                               Callable[[Any], torch.Tensor]]] = None,
                 tally: Optional[Tally] = None):
        self.offload = offload
        self.tally = tally
        self.limit = None if tally is None else tally.needed
        self.outputs: List[Optional[Tuple[Any, Tuple[Optional[int], ...]]]] = []
        self.ops: List[Any] = []
        # Per kept op, its tensors' storages and bytes as kept (for the profile's count).
        self.sizes: List[List[Tuple[int, int]]] = []
        self.taken = 0
        self.used = 0
        self.fell_back = 0

    def keep(self, func: Any, out: Any) -> None:
        if self.limit is not None and len(self.ops) >= self.limit:
            return
        out = tree_map(lambda x: _alias(x) if isinstance(x, torch.Tensor) else x, out)
        self.sizes.append([(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                           for t in _tensors_in(out)])
        if self.offload is not None:
            pack = self.offload[0]
            out = tree_map(lambda x: pack(x) if isinstance(x, torch.Tensor) else x, out)
        self.outputs.append((out, _versions(out)))
        self.ops.append(func)

    def take(self, func: Any) -> Any:
        """What the forward's ``func`` gave, or None where the op must run again."""
        index = self.taken
        if index >= len(self.outputs) and self.limit is not None:
            return None  # past what this region's recomputes were seen to use: not kept
        if index >= len(self.outputs) or self.ops[index] is not func:
            self.taken = len(self.outputs)  # out of step: nothing after this is reused either
            self._fall_back()
            return None
        self.taken += 1
        entry, self.outputs[index] = self.outputs[index], None  # the recompute holds it now
        if entry is None or _versions(entry[0]) != entry[1]:
            self._fall_back()
            return None
        unpack = None if self.offload is None else self.offload[1]

        def back(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.detach()
            if isinstance(x, _Saved) and unpack is not None:
                return unpack(x).detach()
            return x

        return tree_map(back, entry[0])

    def _fall_back(self) -> None:
        self.fell_back += 1
        if self.tally is not None:
            self.tally.fell_back += 1

    def release(self) -> None:
        """After a recompute: what it stopped short of (early stop) is not needed either, now
        or, the tally learns, in the region's later calls."""
        self.used = max(self.used, self.taken)
        if self.tally is not None:
            self.tally.needed = max(self.tally.needed or 0, self.taken)
        self.outputs = [None] * len(self.outputs)
        self.taken = 0

    def kept_bytes(self, leave_out: Set[int]) -> Dict[int, int]:
        """The storages of the ops a recompute used (all, before one has run), and their bytes,
        bar those in ``leave_out``."""
        used = self.used if self.used else len(self.sizes)
        return {key: nbytes for sizes in self.sizes[:used] for key, nbytes in sizes
                if key not in leave_out}


class _Keep(TorchDispatchMode):
    def __init__(self, kept: Kept):
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _keeps(func):
            self.kept.keep(func, out)
        return out


class _Reuse(TorchDispatchMode):
    def __init__(self, kept: Kept):
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        if _keeps(func):
            out = self.kept.take(func)
            if out is not None:
                return out
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self.kept.release()


def recomputed(run: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
               kept: Optional[Kept]) -> Any:
    """``run(args, kwargs)`` under a non-reentrant checkpoint; selective where ``kept`` is given
    (it then receives the kept outputs). ``(args, kwargs)`` go as two arguments so checkpoint
    finds the devices of tensors passed by keyword too and restores their RNG state."""
    if kept is None:
        return checkpoint(run, args, kwargs, use_reentrant=False, preserve_rng_state=True)
    return checkpoint(run, args, kwargs, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: (_Keep(kept), _Reuse(kept)))
