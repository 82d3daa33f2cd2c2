"""A checkpoint as the ``fnloop`` command sees it: read without its code, walked, described in text.

``read`` opens a CKPT argument (a file, or a directory's newest checkpoint)
with ``fnloop.checkpoint.read_raw``; ``children`` and ``leaves`` walk the
plain tree it returns; the rest renders its values for ``fnloop inspect``
(``fnloop.cli._inspect``) and ``fnloop diff`` (``fnloop.cli._diff``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from fnloop.checkpoint import CheckpointError, Record, checkpoints, read_raw

__all__ = [
    "Row",
    "children",
    "compact",
    "dtype_name",
    "json_number",
    "leaves",
    "many",
    "read",
    "short",
    "table",
    "tensor_stats",
]

Row = tuple[str, ...]
"""A line of a table: its cells."""


# -- reading -----------------------------------------------------------------------------------------


def _resolve(name: str) -> Path:
    path = Path(name)
    if path.is_dir():
        found = checkpoints(path)
        if not found:
            raise CheckpointError(f"{path}: a directory without checkpoints (ckpt-*.safetensors)")
        return found[0]
    return path


def read(name: str) -> tuple[Path, dict[str, str], Any]:
    """``(path, metadata, tree)`` of the checkpoint a CKPT argument names: a file, or a directory's newest."""
    path = _resolve(name)
    metadata, tree = read_raw(path)
    if type(tree) is not Record:
        raise CheckpointError(f"{path}: the file holds no TrainState record")
    return path, metadata, tree


def children(node: Any) -> list[tuple[str, Any]] | None:
    """``(path step, child)`` of a container of a raw tree, or ``None`` for a leaf."""
    if type(node) is Record:
        return [(f".{k}", v) for k, v in node.items()]
    if isinstance(node, dict):
        return [(f"[{k!r}]", v) for k, v in node.items()]
    if isinstance(node, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(node)]
    return None


def leaves(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf with its path, in order; an empty container counts as a leaf, so none disappears.

    Walked with a stack of its own, so a tree of any depth that a checkpoint holds is walked.
    """
    stack = [(path, node)]
    while stack:
        at, here = stack.pop()
        kids = children(here)
        if not kids:
            yield at, here
        else:
            stack.extend((at + step, child) for step, child in reversed(kids))


# -- describing values -------------------------------------------------------------------------------


def dtype_name(t: torch.Tensor) -> str:
    """``t``'s dtype without the ``torch.`` prefix."""
    return str(t.dtype).removeprefix("torch.")


def json_number(x: float | int) -> float | int | str:
    """``x`` for JSON: non-finite floats as strings."""
    return x if isinstance(x, int) or math.isfinite(x) else str(x)


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """dtype, shape and a summary of ``t``: its value if it has one element, else norm/mean/min/max.

    Examples:
        >>> tensor_stats(torch.tensor([3.0, 4.0]))["norm"]
        5.0
    """
    stats: dict[str, Any] = {"dtype": dtype_name(t), "shape": list(t.shape), "numel": t.numel()}
    if t.numel() == 0:
        return stats
    if t.is_complex():
        x = t.to(torch.complex128)
        if t.numel() == 1:
            stats["value"] = str(complex(x.item()))
        stats["norm"] = json_number(float(torch.linalg.vector_norm(x)))
        return stats
    x = t.to(torch.float64) if t.is_floating_point() else t.to(torch.int64)
    if t.dtype is torch.uint64:
        x = t.to(torch.float64)  # int64 would wrap; a summary may round
    if t.numel() == 1:
        value = x.item()
        stats["value"] = bool(value) if t.dtype is torch.bool else json_number(value)
        return stats
    if t.dtype is torch.bool:
        stats["true"] = int(x.sum())
        return stats
    floats = x.to(torch.float64)
    finite = torch.isfinite(floats)
    if not finite.all():  # the summary is of the finite values; the others are counted
        stats["nan"] = int(torch.isnan(floats).sum())
        stats["inf"] = int(torch.isinf(floats).sum())
        if not finite.any():
            return stats
        x, floats = x[finite], floats[finite]
    stats["norm"] = float(torch.linalg.vector_norm(floats))
    stats["mean"] = float(floats.mean())
    stats["min"] = x.min().item()
    stats["max"] = x.max().item()
    return stats


def compact(value: Any) -> str:
    """``value`` as text, a float to 4 significant digits."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def short(value: Any, limit: int = 100) -> str:
    """A one-line rendering of a raw value, records by their short class name, cut at ``limit``.

    Examples:
        >>> short(Record({"value": 1.0, "iteration": 3}, kind="record", type="fnloop.hooks.Best"))
        'Best(value=1.0, iteration=3)'
    """
    text = _render(value, _DEEP)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_DEEP = 24  # nesting shown in one line; deeper containers print as "..."


def _render(value: Any, depth: int) -> str:
    if depth == 0 and children(value):
        return "..."
    depth -= 1
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return f"tensor({compact(tensor_stats(value)['value'])}, {dtype_name(value)})"
        return f"tensor({dtype_name(value)}, {tuple(value.shape)})"
    if type(value) is Record:
        fields = ", ".join(f"{k}={_render(v, depth)}" for k, v in value.items())
        return f"{value.type.rsplit('.', 1)[-1]}({fields})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_render(v, depth)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_render(v, depth) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(_render(v, depth) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, float):
        return repr(value)
    return repr(value) if isinstance(value, str) else str(value)


def many(n: int, noun: str, plural: str = "") -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``many(2, "entry", "entries")``."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def table(rows: Sequence[Row], indent: str = "  ") -> list[str]:
    """Rows of cells, each column but a row's last padded to the widest cell in it."""
    widths: dict[int, int] = {}
    for row in rows:
        for i, cell in enumerate(row[:-1]):
            widths[i] = max(widths.get(i, 0), len(cell))
    return [
        (indent + "  ".join([c.ljust(widths[i]) for i, c in enumerate(r[:-1])] + [r[-1]])).rstrip()
        for r in rows
    ]
