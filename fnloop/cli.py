"""The ``fnloop`` command: look into checkpoints without the training code.

``fnloop inspect CKPT`` prints what a checkpoint holds, ``fnloop diff A B``
tells where two checkpoints differ, and ``fnloop replay ...`` replays a run
(``fnloop.replay``). Checkpoints are read with ``fnloop.checkpoint.read_raw``,
so neither the model nor the hooks are needed. See ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from fnloop.checkpoint import CheckpointError, Record, checkpoints, read_raw

__all__ = ["main", "parser"]

_SUMMARY = "Inspect, compare and replay fnloop checkpoints."
_EPILOG = "A CKPT may also be a checkpoint directory: its newest checkpoint is used."

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


def _read(name: str) -> tuple[Path, dict[str, str], Any]:
    path = _resolve(name)
    metadata, tree = read_raw(path)
    if type(tree) is not Record:
        raise CheckpointError(f"{path}: the file holds no TrainState record")
    return path, metadata, tree


def _children(node: Any) -> list[tuple[str, Any]] | None:
    """``(path step, child)`` of a container of a raw tree, or ``None`` for a leaf."""
    if type(node) is Record:
        return [(f".{k}", v) for k, v in node.items()]
    if isinstance(node, dict):
        return [(f"[{k!r}]", v) for k, v in node.items()]
    if isinstance(node, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(node)]
    return None


def _leaves(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf with its path; an empty container counts as a leaf, so none disappears."""
    kids = _children(node)
    if not kids:
        yield path, node
        return
    for step, child in kids:
        yield from _leaves(child, path + step)


# -- describing values -------------------------------------------------------------------------------


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _number(x: float | int) -> float | int | str:
    """``x`` for JSON: non-finite floats as strings."""
    return x if isinstance(x, int) or math.isfinite(x) else str(x)


def _stats(t: torch.Tensor) -> dict[str, Any]:
    """dtype, shape and a summary of ``t``: its value if it has one element, else norm/mean/min/max.

    >>> _stats(torch.tensor([3.0, 4.0]))["norm"]
    5.0
    """
    stats: dict[str, Any] = {"dtype": _dtype(t), "shape": list(t.shape), "numel": t.numel()}
    if t.numel() == 0:
        return stats
    if t.is_complex():
        x = t.to(torch.complex128)
        if t.numel() == 1:
            stats["value"] = str(complex(x.item()))
        stats["norm"] = _number(float(torch.linalg.vector_norm(x)))
        return stats
    x = t.to(torch.float64) if t.is_floating_point() else t.to(torch.int64)
    if t.dtype is torch.uint64:
        x = t.to(torch.float64)  # int64 would wrap; a summary may round
    if t.numel() == 1:
        value = x.item()
        stats["value"] = bool(value) if t.dtype is torch.bool else _number(value)
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


def _g(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _tensor_text(t: torch.Tensor) -> tuple[str, str, str]:
    """(dtype, shape, summary) columns for one tensor."""
    s = _stats(t)
    if "value" in s:
        summary = _g(s["value"])
    elif t.dtype is torch.bool:
        summary = f"{s['true']} true" if "true" in s else ""
    elif "nan" in s and "mean" not in s:
        summary = f"no finite values ({s['nan']} nan, {s['inf']} inf)"
    elif "mean" in s:
        summary = f"norm {_g(s['norm'])}  mean {_g(s['mean'])}  min {_g(s['min'])}  max {_g(s['max'])}"
        if "nan" in s:
            summary += f"  (of the finite values; {s['nan']} nan, {s['inf']} inf)"
    else:
        summary = f"norm {_g(s['norm'])}" if "norm" in s else "empty"
    return s["dtype"], str(tuple(t.shape)), summary


def _short(value: Any, limit: int = 100) -> str:
    """A one-line rendering of a raw value, records by their short class name, cut at ``limit``.

    >>> _short(Record({"value": 1.0, "iteration": 3}, kind="record", type="fnloop.hooks.Best"))
    'Best(value=1.0, iteration=3)'
    """
    text = _render(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _render(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return f"tensor({_g(_stats(value)['value'])}, {_dtype(value)})"
        return f"tensor({_dtype(value)}, {tuple(value.shape)})"
    if type(value) is Record:
        fields = ", ".join(f"{k}={_render(v)}" for k, v in value.items())
        return f"{value.type.rsplit('.', 1)[-1]}({fields})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_render(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_render(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(_render(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, float):
        return repr(value)
    return repr(value) if isinstance(value, str) else str(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _stats(value)
    if type(value) is Record:
        return {"__type__": value.type, **{k: _jsonable(v) for k, v in value.items()}}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return _number(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)  # a Phase


def _many(n: int, noun: str, plural: str = "") -> str:
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    raise AssertionError  # unreachable


# -- inspect -----------------------------------------------------------------------------------------

_HEAD_FIELDS = ("rng", "data", "time")


def _metric_rows(metrics: Any) -> tuple[int | None, list[tuple[str, int, Any, int]]] | None:
    """(window, [(name, iteration, latest value, entries kept)]) or ``None`` if not a Metrics record."""
    if type(metrics) is not Record or type(metrics.get("series")) is not dict:
        return None
    rows = []
    for name, entries in metrics["series"].items():
        if (
            type(entries) is not tuple
            or not entries
            or type(entries[-1]) is not tuple
            or len(entries[-1]) != 2
        ):
            return None
        iteration, value = entries[-1]
        if isinstance(value, torch.Tensor):
            value = _stats(value).get("value", value)
        rows.append((str(name), iteration, value, len(entries)))
    window = metrics.get("window")
    return (window if type(window) is int else None), rows


def _inspect_json(path: Path, metadata: dict[str, str], tree: Record) -> dict[str, Any]:
    out: dict[str, Any] = {
        "file": {
            "path": str(path),
            "size": path.stat().st_size,
            "format": metadata.get("fnloop.format"),
            "fnloop_version": metadata.get("fnloop.version"),
            "checksum": metadata.get("fnloop.checksum"),
        }
    }
    for name, value in tree.items():
        if name == "metrics" and (found := _metric_rows(value)) is not None:
            window, entries = found
            out[name] = {
                "window": window,
                "latest": {n: {"iteration": i, "value": _jsonable(v), "kept": k} for n, i, v, k in entries},
            }
        else:
            out[name] = _jsonable(value)
    return out


def _table(rows: Sequence[Row], indent: str = "  ") -> list[str]:
    """Rows of cells, each column but a row's last padded to the widest cell in it."""
    widths: dict[int, int] = {}
    for row in rows:
        for i, cell in enumerate(row[:-1]):
            widths[i] = max(widths.get(i, 0), len(cell))
    return [
        (indent + "  ".join([c.ljust(widths[i]) for i, c in enumerate(r[:-1])] + [r[-1]])).rstrip()
        for r in rows
    ]


def _section(named: Iterable[tuple[str, Any]]) -> tuple[str, list[Row]]:
    """A heading note and rows for ``(name, leaf)`` pairs: tensors with dtype, shape and summary."""
    rows: list[Row] = []
    count, numel, nbytes = 0, 0, 0
    for name, leaf in named:
        if isinstance(leaf, torch.Tensor):
            count, numel = count + 1, numel + leaf.numel()
            nbytes += leaf.numel() * leaf.element_size()
            rows.append((name, *_tensor_text(leaf)))
        else:
            rows.append((name, _short(leaf)))
    note = f"{_many(count, 'tensor')}, {_many(numel, 'element')}, {_size(nbytes)}" if count else ""
    return note, rows


def _named(value: Any, by_key: bool) -> Iterator[tuple[str, Any]]:
    """Leaves of a field, named by their path in it; ``by_key``: a name -> tensor dict's keys as they are."""
    if by_key and type(value) is dict and value:
        for key, child in value.items():
            yield from _leaves(child, str(key))
    else:
        yield from ((path.removeprefix(".") or "(all)", leaf) for path, leaf in _leaves(value))


def _inspect_text(path: Path, metadata: dict[str, str], tree: Record) -> list[str]:
    head = [
        ("file", f"{path}  ({_size(path.stat().st_size)})"),
        (
            "format",
            f"{metadata.get('fnloop.format')}, written by fnloop {metadata.get('fnloop.version')}, "
            f"{metadata.get('fnloop.checksum')}",
        ),
        ("iteration", f"{_short(tree.get('iteration'))} / {_short(tree.get('max_iter'))}"),
    ]
    head += [(name, _short(tree[name])) for name in _HEAD_FIELDS if name in tree]
    lines = _table(head, indent="")
    for name, value in tree.items():
        if name in ("iteration", "max_iter", *_HEAD_FIELDS):
            continue
        lines.append("")
        if name == "metrics" and (found := _metric_rows(value)) is not None:
            window, entries = found
            if not entries:
                lines.append(f"metrics: none recorded (window {window})")
                continue
            lines.append(f"metrics: {_many(len(entries), 'name')}, the last {window} entries of each kept")
            lines += _table([(n, _g(v), f"at iteration {i}", f"({k} kept)") for n, i, v, k in entries])
            continue
        if name == "hooks" and isinstance(value, dict) and value:
            lines.append(f"hooks: {_many(len(value), 'state')}")
            rows: list[Row] = []
            for hook, memory in value.items():
                text = _short(memory)
                if len(text) < 100 and not any(isinstance(v, torch.Tensor) for _, v in _leaves(memory)):
                    rows.append((hook, text))
                else:  # large: one row per leaf, under the hook's name
                    rows += _section(_leaves(memory, hook))[1]
            lines += _table(rows)
            continue
        note, rows = _section(_named(value, by_key=name in ("params", "buffers")))
        if len(rows) == 1 and rows[0][0] == "(all)" and len(rows[0]) == 2:
            lines.append(f"{name}: {rows[0][1]}")
            continue
        lines.append(f"{name}: {note}" if note else f"{name}:")
        lines += _table(rows)
    return lines


def _inspect(args: argparse.Namespace) -> int:
    path, metadata, tree = _read(args.ckpt)
    if args.json:
        print(json.dumps(_inspect_json(path, metadata, tree), indent=2))
    else:
        print("\n".join(_inspect_text(path, metadata, tree)))
    return 0


# -- diff --------------------------------------------------------------------------------------------


_COLLAPSE = 4  # a series (list or tuple of plain data) with more differences is reported in one line


def _plain_sequence(node: Any) -> bool:
    """Whether ``node`` is a list or tuple of numbers, strings, tensors and such lists or tuples."""
    if not isinstance(node, (list, tuple)):
        return False
    return all(_plain_sequence(c) if isinstance(c, (list, tuple)) else not isinstance(c, dict) for c in node)


class _Diff:
    """The differences found walking two raw trees side by side."""

    def __init__(self, atol: float | None, ignore: Sequence[str]) -> None:
        self.atol = atol
        self.ignore = [p if p.startswith("state") else "state." + p for p in ignore]
        self.leaves = 0
        self.differ = 0
        self.close = 0  # leaves that differ by at most atol
        self.only = {"A": 0, "B": 0}
        self.max_diff = 0.0
        self.lines: list[Row] = []

    def skipped(self, path: str) -> bool:
        return any(path == p or path.startswith((p + ".", p + "[")) for p in self.ignore)

    def walk(self, a: Any, b: Any, path: str) -> None:
        if self.skipped(path):
            return
        ka, kb = _children(a), _children(b)
        if ka is None and kb is None:
            self.leaves += 1
            self.leaf(a, b, path)
            return
        same_type = type(a) is type(b) and (type(a) is not Record or (a.kind, a.type) == (b.kind, b.type))
        if ka is None or kb is None or isinstance(a, dict) != isinstance(b, dict) or not (ka or kb):
            self.leaves += 1  # a leaf against a container, or two empty containers (one leaf, as in inspect)
            if not same_type:
                self.different(path, f"{_kind(a)} != {_kind(b)}")
            return
        if not same_type:  # a note; the entries are compared below
            self.lines.append((path, f"{_kind(a)} != {_kind(b)}"))
        before = (len(self.lines), self.leaves, self.differ, dict(self.only), self.max_diff)
        self.max_diff = 0.0
        steps_a, steps_b = dict(ka), dict(kb)
        for step, child in ka:
            if step in steps_b:
                self.walk(child, steps_b[step], path + step)
            elif not self.skipped(path + step):
                self.one_side("A", path + step, child)
        for step, child in kb:
            if step not in steps_a and not self.skipped(path + step):
                self.one_side("B", path + step, child)
        if len(self.lines) - before[0] > _COLLAPSE and _plain_sequence(a) and _plain_sequence(b):
            self.lines[before[0] :] = [(path, self.collapsed(*before[1:4]))]
        self.max_diff = max(self.max_diff, before[4])

    def collapsed(self, leaves: int, differ: int, only: dict[str, int]) -> str:
        what = f"{self.differ - differ} of {self.leaves - leaves} leaves differ"
        if self.max_diff:
            what += f", max abs diff {self.max_diff:.4g}"
        for side in "AB":
            if self.only[side] > only[side]:
                what += f"; {_many(self.only[side] - only[side], 'entry', 'entries')} only in {side}"
        return what

    def one_side(self, side: str, path: str, value: Any) -> None:
        self.only[side] += 1
        self.lines.append((path, f"only in {side}: {_short(value, 60)}"))

    def different(self, path: str, what: str) -> None:
        self.differ += 1
        self.lines.append((path, what))

    def leaf(self, a: Any, b: Any, path: str) -> None:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            what, diff = _tensor_difference(a, b)
        elif type(a) is float and type(b) is float:
            same = repr(a) == repr(b)  # bit for bit: -0.0 differs from 0.0, nan equals nan
            what, diff = (None, None) if same else (f"{a!r} != {b!r}", _abs_diff(a, b))
        else:
            same = type(a) is type(b) and a == b
            what, diff = (None, None) if same else (f"{_short(a, 40)} != {_short(b, 40)}", None)
        if what is None:
            return
        if diff is not None:
            if self.atol is not None and diff <= self.atol:
                self.close += 1
                return
            self.max_diff = max(self.max_diff, diff)
        self.different(path, what)

    def summary(self) -> str:
        within = f" ({self.close} within atol {self.atol:g})" if self.close else ""
        if not self.lines:
            how = "bit for bit" if self.atol is None else f"within atol {self.atol:g}"
            return f"identical: {self.leaves} leaves, {how}{within}"
        largest = f", max abs diff {self.max_diff:.4g}" if self.max_diff else ""
        return (
            f"different: {self.differ} of {self.leaves} leaves differ{largest}{within}; "
            f"{_many(self.only['A'], 'entry', 'entries')} only in A, {self.only['B']} only in B"
        )


def _abs_diff(a: float, b: float) -> float:
    d = abs(float(a) - float(b))
    return math.inf if math.isnan(d) else d


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{_dtype(value)} {tuple(value.shape)}"
    if type(value) is Record:
        return f"{value.type.rsplit('.', 1)[-1]} record"
    if isinstance(value, (dict, list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # every itemsize a checkpoint holds


def _tensor_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[str | None, float | None]:
    """A description of how ``a`` and ``b`` differ (``None``: the same bits) and their max abs difference."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{_kind(a)} != {_kind(b)}", None
    if a.numel() == 0:
        return None, 0.0
    bits = _INTS[a.element_size()]  # compare the bits: NaNs equal themselves, -0.0 differs from 0.0
    n = int((a.contiguous().view(bits) != b.contiguous().view(bits)).sum())
    if n == 0:
        return None, 0.0
    if a.is_complex():
        gap = (a.to(torch.complex128) - b.to(torch.complex128)).abs()
    else:
        x, y = a.to(torch.float64), b.to(torch.float64)
        gap = (x - y).abs()
        gap = torch.where(torch.isnan(x) & torch.isnan(y), 0.0, gap)
    gap = torch.nan_to_num(gap, nan=math.inf)
    diff = float(gap.max())
    if a.numel() == 1:
        va, vb = (_stats(t)["value"] for t in (a, b))
        what = f"{_kind(a)}: {va!r} != {vb!r}"
    else:
        where = tuple(int(i) for i in torch.nonzero(gap == diff)[0])
        what = f"{_kind(a)}: {n} of {a.numel()} elements differ, max abs diff {diff:.4g} (largest at {where})"
    # Integer tensors (counters, indices) are exact, as Python ints are: no tolerance, no "max abs diff".
    return what, diff if a.is_floating_point() or a.is_complex() else None


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number (got {text!r})")
    return value


def _diff(args: argparse.Namespace) -> int:
    path_a, _, a = _read(args.a)
    path_b, _, b = _read(args.b)
    print(f"A: {path_a} (iteration {_short(a.get('iteration'))})")
    print(f"B: {path_b} (iteration {_short(b.get('iteration'))})")
    found = _Diff(args.atol, args.ignore)
    found.walk(a, b, "state")
    for line in _table(found.lines, indent=""):
        print(line)
    print(found.summary())
    return 1 if found.lines else 0


# -- replay ------------------------------------------------------------------------------------------


def _replay(args: argparse.Namespace) -> int:
    try:
        replay = importlib.import_module("fnloop.replay")
    except ModuleNotFoundError as exc:
        if exc.name != "fnloop.replay":
            raise
        print("fnloop replay: error: this fnloop has no fnloop.replay module", file=sys.stderr)
        return 2
    return int(replay.main(list(args.args)) or 0)


# -- the command -------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``fnloop`` command."""
    from fnloop import __version__

    top = argparse.ArgumentParser(prog="fnloop", description=_SUMMARY, epilog=_EPILOG)
    top.add_argument("--version", action="version", version=f"fnloop {__version__}")
    sub = top.add_subparsers(dest="command", metavar="COMMAND", required=True)

    inspect = sub.add_parser(
        "inspect",
        help="show what a checkpoint holds",
        description="Show a checkpoint: iteration, format, every field, each tensor with its dtype, "
        "shape and a summary (norm, mean, min, max), hook states, the latest value of each "
        "metric, and the file's size. Needs no training code.",
        epilog=_EPILOG,
    )
    inspect.add_argument("ckpt", metavar="CKPT", help="a checkpoint file (or directory)")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of aligned text")
    inspect.set_defaults(run=_inspect)

    diff = sub.add_parser(
        "diff",
        help="compare two checkpoints, leaf by leaf",
        description="Compare two checkpoints leaf by leaf: which entries differ and by how much "
        "(max abs difference for tensors, both values for others), and which exist in one file "
        "only. Exit status: 0 identical (bit for bit, or within --atol), 1 different, 2 error.",
        epilog=_EPILOG,
    )
    diff.add_argument("a", metavar="A", help="a checkpoint file (or directory)")
    diff.add_argument("b", metavar="B", help="another one")
    diff.add_argument(
        "--atol", type=_tolerance, default=None, metavar="X",
        help="count floats and tensors whose max abs difference is at most X as equal (ints stay exact)",
    )  # fmt: skip
    diff.add_argument(
        "--ignore", action="append", default=[], metavar="PATH",
        help="skip an entry and everything under it, e.g. --ignore time (the driver's clock); repeatable",
    )  # fmt: skip
    diff.set_defaults(run=_diff)

    replay = sub.add_parser(
        "replay",
        help="replay a run and check it step by step (see 'fnloop replay --help')",
        description="Forwarded to fnloop.replay.",
        add_help=False,
    )
    replay.add_argument("args", nargs=argparse.REMAINDER, help="the arguments of fnloop replay")
    replay.set_defaults(run=_replay)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fnloop`` command with ``argv`` (default: ``sys.argv[1:]``); return its exit status.

    Exit status 0 on success (``diff``: the files are identical), 1 when
    ``diff`` finds a difference, 2 for an error: a damaged or missing
    checkpoint prints its ``CheckpointError`` message. ``--help`` and usage
    errors exit through ``SystemExit`` as with any argparse program.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["replay"]:
        # argparse would take options meant for replay (--help, -x) for its own.
        args = argparse.Namespace(command="replay", args=argv[1:], run=_replay)
    else:
        args = parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        code = run(args)
        sys.stdout.flush()
    except CheckpointError as exc:
        print(f"fnloop {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`fnloop inspect x | head`). As Python's docs advise: no traceback,
        # and no second error when the interpreter flushes stdout on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code
