"""Walking the state as a tree: what a container is, once for every walk over fnloop's values.

The rule: a container is an attrs record or a ``NamedTuple`` (its children
are its fields), a mapping (its values, by key), a tuple or a list (its
items); anything else, tensors included, is a leaf. Every walk sees every
field of a record: the checkpoint's codec and ``fill``, the donation check,
the background save's copy, ``leaves``. A field declared ``eq=False`` takes
no part in ``==``, and nothing more: ``first_difference``, which answers
``==`` bit for bit, leaves those out as ``==`` does (``compared=True``).
Optimizer states are the same containers, and walked with torch's pytree
where a step flattens them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

__all__ = ["children", "first_difference", "leaves", "record_fields"]


_FIELDS: dict[tuple[type, bool], tuple[str, ...] | None] = {}


def record_fields(kind: type, compared: bool = False) -> tuple[str, ...] | None:
    """The field names of a record class (attrs or ``NamedTuple``), in order; ``None`` for any other class.

    ``compared``: only the fields ``==`` compares (an attrs field's ``eq``).

    Examples:
        >>> from fnloop import Clock
        >>> record_fields(Clock), record_fields(dict)
        (('time', 'data_time', 'step_time'), None)
    """
    found = _FIELDS.get((kind, compared), ())
    if found == ():  # a class not met before (one lookup per node after that)
        if attrs.has(kind):
            found = tuple(f.name for f in attrs.fields(kind) if f.eq or not compared)
        else:
            found = tuple(kind._fields) if issubclass(kind, tuple) and hasattr(kind, "_fields") else None
        _FIELDS[kind, compared] = found
    return found


def children(node: Any, *, compared: bool = False) -> list[tuple[str, Any]] | None:
    """``(path step, child)`` pairs of a container, or ``None`` for a leaf (see the module's rule).

    Path steps read like Python: ``.field``, ``['key']``, ``[0]``. ``compared``:
    a record's fields that ``==`` compares only.
    """
    names = record_fields(type(node), compared)
    if names is not None:
        return [(f".{name}", getattr(node, name)) for name in names]
    if isinstance(node, Mapping):
        return [(f"[{key!r}]", value) for key, value in node.items()]
    if isinstance(node, (tuple, list)):
        return [(f"[{i}]", value) for i, value in enumerate(node)]
    return None


def leaves(tree: Any, path: str = "state") -> Iterator[tuple[str, Any]]:
    """Every ``(path, leaf)`` of ``tree``, depth first, in field and insertion order."""
    kids = children(tree)
    if kids is None:
        yield path, tree
        return
    for step, child in kids:
        yield from leaves(child, path + step)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_leaf(a: Any, b: Any) -> str | None:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype:
            return f"dtype {a.dtype} != {b.dtype}"
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
        if a.device != b.device:
            return f"device {a.device} != {b.device}"
        if not torch.equal(_bits(a.cpu()), _bits(b.cpu())):
            diff = (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0
            return f"values differ (max abs difference {diff:.3g})"
        return None
    if type(a) is not type(b):
        return f"type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if a == b else f"{a!r:.60} != {b!r:.60}"


def first_difference(a: Any, b: Any, path: str = "state") -> str | None:
    """Where ``a`` and ``b`` first differ, bit for bit, as ``"path: what"``; ``None`` if identical.

    Examples:
        >>> first_difference({"w": torch.zeros(2)}, {"w": torch.tensor([0.0, 1.0])})
        "state['w']: values differ (max abs difference 1)"
    """
    ka, kb = children(a, compared=True), children(b, compared=True)
    if ka is None or kb is None:
        if (ka is None) != (kb is None):
            return f"{path}: {type(a).__name__} != {type(b).__name__}"
        what = _same_leaf(a, b)
        return None if what is None else f"{path}: {what}"
    if type(a) is not type(b) and not (isinstance(a, Mapping) and isinstance(b, Mapping)):
        return f"{path}: type {type(a).__name__} != {type(b).__name__}"
    steps_a, steps_b = [s for s, _ in ka], [s for s, _ in kb]
    if steps_a != steps_b:
        only_a = [s for s in steps_a if s not in steps_b]
        only_b = [s for s in steps_b if s not in steps_a]
        return f"{path}: entries differ (only in first: {only_a}, only in second: {only_b})"
    for (step, ca), (_, cb) in zip(ka, kb):
        found = first_difference(ca, cb, path + step)
        if found is not None:
            return found
    return None
