"""Recompute for ``ferry.plan``'s regions, whole or selective. A whole recompute is
``torch.utils.checkpoint`` (non-reentrant, RNG state preserved) around the region's forward. A
selective one runs under the same checkpoint with two dispatch modes as its ``context_fn``: in
the forward, the outputs of the expensive ops (matrix products, attention, convolutions) are
kept; in the recompute, those ops hand back what was kept instead of running again, so backward
reruns only the cheap ops (norms, activations, element-wise), from the kept outputs and the
region's inputs. What autograd saved in the region is dropped as in a whole recompute."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint


def _packets(names: Tuple[str, ...]) -> Set[Any]:
    """The aten op packets of ``names`` this torch has (some attention kernels are newer)."""
    return {getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n)}


# The ops whose outputs a selective recompute keeps: compute-bound, so running them again costs
# most of a whole recompute, while their outputs are a part of what the region saves.
KEPT_OPS = _packets((
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution",
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


class Kept:
    """The outputs one call of a region's forward kept, in the order its ops ran, with each
    tensor's version. In the recompute each is handed back once, if it is still what the
    forward computed; where it is not (written in place since, a recompute that runs other ops,
    a second backward after the first let go), the op runs again, as in a whole recompute, and
    ``fell_back`` counts it."""

    def __init__(self) -> None:
        self.outputs: List[Optional[Tuple[Any, Tuple[int, ...]]]] = []
        self.ops: List[Any] = []
        self.taken = 0
        self.fell_back = 0

    def keep(self, func: Any, out: Any) -> None:
        self.outputs.append((out, tuple(t._version for t in _tensors_in(out))))
        self.ops.append(func)

    def tensors(self) -> List[torch.Tensor]:
        return [t for entry in self.outputs if entry is not None for t in _tensors_in(entry[0])]

    def take(self, func: Any) -> Any:
        """What the forward's ``func`` gave, or None where the op must run again."""
        index = self.taken
        if index >= len(self.outputs) or self.ops[index] is not func:
            self.taken = len(self.outputs)  # out of step: nothing after this is reused either
            self.fell_back += 1
            return None
        self.taken += 1
        entry, self.outputs[index] = self.outputs[index], None  # the recompute holds it now
        if entry is None or tuple(t._version for t in _tensors_in(entry[0])) != entry[1]:
            self.fell_back += 1
            return None
        return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, entry[0])

    def release(self) -> None:
        """After a recompute: what it stopped short of (early stop) is not needed either."""
        self.outputs = [None] * len(self.outputs)
        self.taken = 0


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
