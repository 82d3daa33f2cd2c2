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
from fnloop.checkpoint._reading import read_streamed
from fnloop.checkpoint._transfer import _bytes

__all__ = [
    "Elided",
    "Row",
    "Summary",
    "children",
    "compact",
    "dtype_name",
    "is_tensor",
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


def read(name: str, *, summarized: bool = False) -> tuple[Path, dict[str, str], Any]:
    """``(path, metadata, tree)`` of the checkpoint a CKPT argument names: a file, or a directory's newest.

    ``summarized``: each tensor a ``Summary``, its bytes read through a buffer
    of one piece, so that a file of any size is read in little memory.
    """
    path = _resolve(name)
    if summarized and not _sharded(path):
        metadata, tree = read_streamed(path, Summary)
        metadata = {k: v for k, v in metadata.items() if k != "fnloop.skeleton"}
    else:  # a sharded checkpoint's tensors put together whole from its parts
        metadata, tree = read_raw(path)
        if summarized:
            tree = _summarized(tree)
    if type(tree) is not Record:
        raise CheckpointError(f"{path}: the file holds no TrainState record")
    return path, metadata, tree


def _sharded(path: Path) -> bool:
    from fnloop.checkpoint._files import _index

    return _index(path) is not None


def _summarized(node: Any) -> Any:
    """The raw tree with each tensor replaced by its ``Summary``."""
    if isinstance(node, torch.Tensor):
        summary = Summary(node.dtype, node.shape)
        if node.numel():
            summary.add(_bytes(node.contiguous()))
        return summary
    if type(node) is Record:
        return Record({k: _summarized(v) for k, v in node.items()}, kind=node.kind, type=node.type)
    if isinstance(node, dict):
        return {k: _summarized(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_summarized(v) for v in node)
    return node


def children(node: Any) -> list[tuple[str, Any]] | None:
    """``(path step, child)`` of a container of a raw tree, or ``None`` for a leaf."""
    if type(node) is Record:
        return [(f".{k}", v) for k, v in node.items()]
    if isinstance(node, dict):
        return [(f"[{k!r}]", v) for k, v in node.items()]
    if isinstance(node, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(node)]
    return None


def leaves(node: Any, path: str = "", most: int | None = None) -> Iterator[tuple[str, Any]]:
    """Every leaf with its path, in order; an empty container counts as a leaf, so none disappears.

    With ``most``, a list or tuple longer than that gives its first ``most``
    entries' leaves and then one ``Elided`` leaf (at ``path[most:]``) for the
    rest: what a reader is shown of a hook's log of two million numbers.
    Walked with a stack of its own, so a tree of any depth that a checkpoint holds is walked.
    """
    stack = [(path, node)]
    while stack:
        at, here = stack.pop()
        if most is not None and isinstance(here, (list, tuple)) and len(here) > most:
            stack.append((f"{at}[{most}:]", Elided(len(here) - most)))
            here = here[:most]  # the same paths for the entries shown, and none made for the rest
        kids = children(here)
        if not kids:
            yield at, here
            continue
        stack.extend((at + step, child) for step, child in reversed(kids))


class Elided:
    """The entries of a long list that ``leaves(..., most=)`` leaves out: how many."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __str__(self) -> str:
        return f"... {many(self.count, 'more entry', 'more entries')}"


# -- describing values -------------------------------------------------------------------------------


def dtype_name(t: Any) -> str:
    """``t``'s dtype without the ``torch.`` prefix."""
    return str(t.dtype).removeprefix("torch.")


def json_number(x: float | int) -> float | int | str:
    """``x`` for JSON: non-finite floats as strings."""
    return x if isinstance(x, int) or math.isfinite(x) else str(x)


_CHUNK = 1 << 20  # elements summarized at once: a summary's memory, whatever the tensor's size


class _Stats:
    """The summary ``tensor_stats`` gives, of values added chunk by chunk (flat tensors of one dtype)."""

    def __init__(self, dtype: torch.dtype, shape: Sequence[int], numel: int) -> None:
        self.head: dict[str, Any] = {
            "dtype": str(dtype).removeprefix("torch."),
            "shape": list(shape),
            "numel": numel,
        }
        self.dtype, self.numel = dtype, numel
        self.value: Any = None
        self.true = self.nan = self.inf = self.count = 0
        self.norms: list[float] = []
        self.total = 0.0
        self.low: Any = None
        self.high: Any = None

    def add(self, chunk: torch.Tensor) -> None:
        if chunk.is_complex():
            x = chunk.to(torch.complex128)
            if self.numel == 1:
                self.value = str(complex(x.item()))
            self.norms.append(float(torch.linalg.vector_norm(x)))
            return
        x = chunk.to(torch.float64) if chunk.is_floating_point() else chunk.to(torch.int64)
        if chunk.dtype is torch.uint64:
            x = chunk.to(torch.float64)  # int64 would wrap; a summary may round
        if self.numel == 1:
            value = x.item()
            self.value = bool(value) if chunk.dtype is torch.bool else json_number(value)
            return
        if chunk.dtype is torch.bool:
            self.true += int(x.sum())
            return
        floats = x.to(torch.float64)
        finite = torch.isfinite(floats)
        if not finite.all():  # the summary is of the finite values; the others are counted
            self.nan += int(torch.isnan(floats).sum())
            self.inf += int(torch.isinf(floats).sum())
            x, floats = x[finite], floats[finite]
        if not floats.numel():
            return
        self.norms.append(float(torch.linalg.vector_norm(floats)))
        self.total += float(floats.sum())
        self.count += floats.numel()
        low, high = x.min().item(), x.max().item()
        self.low = low if self.low is None else min(self.low, low)
        self.high = high if self.high is None else max(self.high, high)

    def result(self) -> dict[str, Any]:
        stats = dict(self.head)
        if self.numel == 0:
            return stats
        if self.dtype.is_complex:
            if self.value is not None:
                stats["value"] = self.value
            stats["norm"] = json_number(math.hypot(*self.norms))
            return stats
        if self.numel == 1:
            stats["value"] = self.value
            return stats
        if self.dtype is torch.bool:
            stats["true"] = self.true
            return stats
        if self.nan or self.inf:
            stats["nan"], stats["inf"] = self.nan, self.inf
            if not self.count:
                return stats
        stats["norm"] = math.hypot(*self.norms)
        stats["mean"] = self.total / self.count
        stats["min"], stats["max"] = self.low, self.high
        return stats


def tensor_stats(t: Any) -> dict[str, Any]:
    """dtype, shape and a summary of ``t``: its value if it has one element, else norm/mean/min/max.

    Computed a chunk at a time, so a summary takes little memory beside the
    tensor; a ``Summary`` (a tensor read piece by piece) gives its own.

    Examples:
        >>> tensor_stats(torch.tensor([3.0, 4.0]))["norm"]
        5.0
    """
    if type(t) is Summary:
        return t.stats()
    stats = _Stats(t.dtype, t.shape, t.numel())
    flat = t.reshape(-1)
    for at in range(0, flat.numel(), _CHUNK):
        stats.add(flat[at : at + _CHUNK])
    return stats.result()


class Summary:
    """A tensor of a checkpoint as ``fnloop inspect`` reads it: its dtype, shape and summary, not its values.

    A sink of ``fnloop.checkpoint._reading.read_streamed``: it is given the
    tensor's bytes piece by piece and keeps only the running summary.
    """

    def __init__(self, dtype: torch.dtype, shape: torch.Size) -> None:
        self.dtype, self.shape = dtype, shape
        self._stats = _Stats(dtype, shape, math.prod(shape))

    def add(self, piece: memoryview) -> None:
        """The next piece of the tensor's bytes (whole elements)."""
        values = torch.frombuffer(piece, dtype=self.dtype)
        for at in range(0, values.numel(), _CHUNK):
            self._stats.add(values[at : at + _CHUNK])

    def numel(self) -> int:
        return self._stats.numel

    def element_size(self) -> int:
        return self.dtype.itemsize

    def stats(self) -> dict[str, Any]:
        """What ``tensor_stats`` gives for the tensor."""
        return self._stats.result()


def is_tensor(leaf: Any) -> bool:
    """Whether ``leaf`` is a tensor of a raw tree: a ``torch.Tensor`` or a ``Summary`` of one."""
    return isinstance(leaf, torch.Tensor) or type(leaf) is Summary


def compact(value: Any) -> str:
    """``value`` as text, a float to 4 significant digits."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def short(value: Any, limit: int = 100) -> str:
    """A one-line rendering of a raw value, records by their short class name, cut at ``limit``.

    Examples:
        >>> short(Record({"value": 1.0, "iteration": 3}, kind="record", type="fnloop.hooks.Best"))
        'Best(value=1.0, iteration=3)'
    """
    text = _render(value, _DEEP, limit)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_DEEP = 24  # nesting shown in one line; deeper containers print as "..."


def _render(value: Any, depth: int, budget: int) -> str:
    """``value`` in one line; a container stops once its text passes ``budget`` characters."""
    if depth == 0 and children(value):
        return "..."
    depth -= 1
    if is_tensor(value):
        if value.numel() == 1:
            return f"tensor({compact(tensor_stats(value)['value'])}, {dtype_name(value)})"
        return f"tensor({dtype_name(value)}, {tuple(value.shape)})"
    if type(value) is Record:
        fields = _joined((f"{k}={_render(v, depth, budget)}" for k, v in value.items()), budget)
        return f"{value.type.rsplit('.', 1)[-1]}({fields})"
    if isinstance(value, dict):
        return "{" + _joined((f"{k!r}: {_render(v, depth, budget)}" for k, v in value.items()), budget) + "}"
    if isinstance(value, list):
        return "[" + _joined((_render(v, depth, budget) for v in value), budget) + "]"
    if isinstance(value, tuple):
        text = _joined((_render(v, depth, budget) for v in value), budget)
        return "(" + text + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, float):
        return repr(value)
    return repr(value) if isinstance(value, str) else str(value)


def _joined(texts: Iterator[str], budget: int) -> str:
    """The texts joined by commas, as many as ``budget`` characters take, then ``...``."""
    out, size = [], 0
    for text in texts:
        if size > budget:
            out.append("...")
            break
        out.append(text)
        size += len(text) + 2
    return ", ".join(out)


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
