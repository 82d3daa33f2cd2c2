"""Walking the state as a tree: records, mappings, sequences, tensors and plain values."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

__all__ = ["children", "first_difference", "leaves"]


def children(node: Any) -> list[tuple[str, Any]] | None:
    """``(path step, child)`` pairs of a container, or ``None`` for a leaf.

    Containers are attrs records, named tuples, mappings, tuples and lists.
    Path steps read like Python: ``.field``, ``['key']``, ``[0]``.
    """
    if attrs.has(type(node)):
        # Fields left out of equality (a message's context, say) are no part of the value.
        return [(f".{f.name}", getattr(node, f.name)) for f in attrs.fields(type(node)) if f.eq]
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return [(f".{name}", value) for name, value in zip(node._fields, node)]
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
    ka, kb = children(a), children(b)
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
