"""Nested state dicts as named tensors plus one JSON description of everything else: what
``ferry.save_async`` writes for ``{"model": model.state_dict(), "optim": opt.state_dict()}`` and
``ferry.load`` rebuilds.

Each tensor is named by its path: the dict keys and list indices (as decimal numbers) joined
with ``"."``, so ``optim.state.0.exp_avg`` and ``model.layers.0.weight`` (a key holding dots
keeps them, as ``torch.distributed.checkpoint`` names its items). Two paths that would give one
name (``{"a.b": x, "a": {"b": y}}``) are refused: a name never stands for two tensors. The
description records every path exactly, so keys with dots, int keys and tuples come back as
they were.

The description, stored under :data:`STRUCTURE_KEY` in the file's ``__metadata__``, is the JSON
text of ``{"format": 1, "tree": NODE}``, a NODE being one of

* ``{"tensor": NAME}``: the tensor stored under NAME;
* ``{"dict": [[KEY, NODE], ...]}``: a dict in its order, each KEY a string or an int (an
  optimizer's ``state`` is keyed by parameter index);
* ``{"list": [NODE, ...]}`` or ``{"tuple": [NODE, ...]}``;
* ``{"float": "nan"}``, ``"inf"`` or ``"-inf"``: the floats JSON numbers cannot write;
* ``null``, ``true``/``false``, a number or a string: that value (``1`` comes back an int,
  ``1.0`` a float).

Dicts come back as plain dicts (an ``OrderedDict``'s ``_metadata``, torch's module versions, is
not kept, as ``safetensors`` does not keep it either), tuple subclasses (``torch.Size``) as
tuples, and subclasses of int, float and str (numpy scalars, enums) as the built-in values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from ._ferry import FerryError

STRUCTURE_KEY = "ferry.structure"
FORMAT = 1

_JSON_LEAVES = "None, a bool, an int, a float, a str, or a dict, list or tuple of them"


def _name(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def is_flat(state: Any, is_tensor: Callable[[Any], bool]) -> bool:
    """Whether ``state`` is a dict of str to tensor: such a state is written as it always was,
    with no description."""
    return isinstance(state, Mapping) and all(
        type(k) is str and is_tensor(v) for k, v in state.items()
    )


def flatten(
    state: Mapping, is_tensor: Callable[[Any], bool], what: str = "save_async"
) -> tuple[list[tuple[str, Any]], str]:
    """The tensors of ``state`` with their names, in the order met, and the JSON description of
    the tree. Raises TypeError for a leaf or key the description cannot hold, ValueError for
    two paths with one name or a container that holds itself; both name the path."""
    tensors: list[tuple[str, Any]] = []
    paths: dict[str, tuple] = {}
    open_containers: set[int] = set()

    # Each node's name is built from its parent's as the walk goes (a path's join, once).
    def node(value: Any, path: tuple, name: str) -> Any:
        if is_tensor(value):
            if name in paths:
                raise ValueError(
                    f"{what}: the paths {paths[name]!r} and {path!r} would both be stored as "
                    f"{name!r} (the parts of a path are joined with '.'): rename one of the keys"
                )
            paths[name] = path
            tensors.append((name, value))
            return {"tensor": name}
        if value is None or type(value) is bool:
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            value = float(value)
            if math.isfinite(value):
                return value
            return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if isinstance(value, str):
            return str(value)
        if isinstance(value, (Mapping, list, tuple)):
            if id(value) in open_containers:
                raise ValueError(f"{what}: {_name(path)!r} holds itself: a state must be a tree")
            open_containers.add(id(value))
            try:
                prefix = name + "." if path else ""
                if isinstance(value, Mapping):
                    return {
                        "dict": [
                            [_key(k, path), node(v, path + (k,), prefix + str(k))]
                            for k, v in value.items()
                        ]
                    }
                kind = "tuple" if isinstance(value, tuple) else "list"
                return {
                    kind: [node(v, path + (i,), prefix + str(i)) for i, v in enumerate(value)]
                }
            finally:
                open_containers.discard(id(value))
        raise TypeError(
            f"{what}: {_name(path)!r} is a {type(value).__module__}.{type(value).__qualname__}, "
            f"not a torch.Tensor nor a value the file's JSON description can hold "
            f"({_JSON_LEAVES}): convert it (a str, a number, a list), or keep it out of the "
            "state and save it with torch.save"
        )

    def _key(key: Any, path: tuple) -> str | int:
        if type(key) is str or (isinstance(key, int) and not isinstance(key, bool)):
            return key if type(key) is str else int(key)
        raise TypeError(
            f"{what}: the key {key!r} under {_name(path) or 'the top level'!r} is a "
            f"{type(key).__name__}: only str and int keys can be saved; use a str"
        )

    tree = node(state, (), "")
    text = json.dumps({"format": FORMAT, "tree": tree}, separators=(",", ":"), allow_nan=False)
    return tensors, text


def rebuild(text: str, tensors: Mapping[str, Any], where: str) -> Any:
    """The tree the description ``text`` describes, its tensors taken from ``tensors``. A
    damaged description is a FerryError naming ``where`` (the file)."""

    def damaged(why: str) -> FerryError:
        return FerryError(
            f"{where}: its {STRUCTURE_KEY!r} entry, which describes the saved state, is "
            f"damaged: {why}; the file's tensors are readable by name with safetensors, or use "
            "another checkpoint"
        )

    try:
        doc = json.loads(text)
    except ValueError as e:
        raise damaged(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or "tree" not in doc:
        raise damaged("it has no tree")
    if doc.get("format") != FORMAT:
        raise FerryError(
            f"{where}: its state is described in format {doc.get('format')!r}, which this ferry "
            f"(format {FORMAT}) does not read: load it with a newer ferry"
        )

    def build(node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if not isinstance(node, dict) or len(node) != 1:
            raise damaged(f"{node!r} is not a node")
        ((kind, body),) = node.items()
        if kind == "tensor":
            if body not in tensors:
                raise damaged(f"it refers to a tensor {body!r} the file does not hold")
            return tensors[body]
        if kind == "dict" and isinstance(body, list):
            out = {}
            for pair in body:
                if not (
                    isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (str, int))
                ):
                    raise damaged(f"{pair!r} is not a [key, node] pair")
                out[pair[0]] = build(pair[1])
            return out
        if kind in ("list", "tuple") and isinstance(body, list):
            items = [build(v) for v in body]
            return tuple(items) if kind == "tuple" else items
        if kind == "float" and body in ("nan", "inf", "-inf"):
            return float(body)
        raise damaged(f"{node!r} is not a node")

    return build(doc["tree"])
