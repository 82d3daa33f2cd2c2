"""``fnloop diff A B``: where two checkpoints differ, leaf by leaf, and by how much.

Tensors are compared bit for bit (a NaN equals itself, ``-0.0`` differs from
``0.0``); ``--atol`` lets floats and float tensors differ a little. A long
series of plain data that differs in many places is reported in one line, so
are many differing tensors of one name -> tensor dict (``params``), and the
optimizer state is one line grouped by moment. Runs are compared, not clocks:
the driver's time, the timer's metrics and its hook state are left out unless
``--clock`` is given.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from fnloop.checkpoint import Record
from fnloop.checkpoint._raw import Row, children, dtype_name, many, read, short, table, tensor_stats

__all__ = ["differences", "run"]

_COLLAPSE = 4  # a series (list or tuple of plain data) with more differences is reported in one line

# What the machine measured into a state, its clock and its memory, which no two runs share
# (fnloop.testing.without_clock leaves the same out); files of earlier versions also hold state.time.
_CLOCK = (
    "state.time",
    "state.metrics.series['time']",
    "state.metrics.series['data_time']",
    "state.metrics.series['max_mem']",
    # fnloop.hooks.throughput's rates, off the same clock
    "state.metrics.series['samples_per_s']",
    "state.metrics.series['tokens_per_s']",
    "state.metrics.series['mfu']",
    "state.metrics.series['hook_time']",
)
_CLOCKED_STATES = (".TimerState", ".ThroughputState")
_LAST_KEY = re.compile(r"\[[^\[\]]*\]$")


def clock_paths(*trees: Any) -> tuple[str, ...]:
    """The paths of ``trees`` (raw states) the machine measured: time fields, clock and memory metrics, the timer's and throughput's states."""
    paths = dict.fromkeys(_CLOCK)
    for tree in trees:
        hooks = tree.get("hooks") if type(tree) is Record else None
        for name, value in hooks.items() if isinstance(hooks, dict) else ():
            if type(value) is Record and value.type.endswith(_CLOCKED_STATES):
                paths[f"state.hooks[{name!r}]"] = None
    return tuple(paths)


def _plain_sequence(node: Any) -> bool:
    """Whether ``node`` is a list or tuple of numbers, strings, tensors and such lists or tuples."""
    if not isinstance(node, (list, tuple)):
        return False
    return all(_plain_sequence(c) if isinstance(c, (list, tuple)) else not isinstance(c, dict) for c in node)


class _Diff:
    """The differences found walking two raw trees side by side."""

    def __init__(self, atol: float | None, ignore: Sequence[str], clock: Sequence[str] = ()) -> None:
        self.atol = atol
        self.clock = clock  # paths compared apart, into clock_found
        self.clock_found: _Diff | None = _Diff(atol, ignore) if clock else None
        self.diffs: dict[str, float] = {}  # path -> abs difference, of the leaves that have one
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
        if self.clock_found is not None and path in self.clock:
            self.clock_found.walk(a, b, path)
            return
        ka, kb = children(a), children(b)
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
        found = len(self.lines) - before[0]
        if found > _COLLAPSE and _plain_sequence(a) and _plain_sequence(b):
            self.lines[before[0] :] = [(path, self.collapsed(*before[1:4]))]
        elif found > _COLLAPSE and _tensor_dict(a) and _tensor_dict(b):
            self.lines[before[0] :] = [
                (path, self.tensors(path, before[0], len(steps_a.keys() | steps_b.keys())))
            ]
        elif found > 1 and path == "state.opt_state":
            self.lines[before[0] :] = [(path, self.grouped(path, before[0], *before[1:4]))]
        self.max_diff = max(self.max_diff, before[4])

    def largest(self, path: str, start: int) -> str:
        """`` (largest at <where>)``: the lines from ``start`` on, the one of the largest difference."""
        found = [(self.diffs.get(at, -1.0), at) for at, *_ in self.lines[start:]]
        gap, at = max(found)
        return f" (largest at {at.removeprefix(path)})" if gap > 0 else ""

    def tensors(self, path: str, start: int, total: int) -> str:
        """One line for the many differing tensors of a name -> tensor dict, from line ``start`` on."""
        what = f"{len(self.lines) - start} of {total} tensors differ"
        if self.max_diff:
            what += f", max abs diff {self.max_diff:.4g}{self.largest(path, start)}"
        return what

    def grouped(self, path: str, start: int, leaves: int, differ: int, only: dict[str, int]) -> str:
        """One line for an optimizer state's differences, counted per moment (``[0].mu``, ``[0].nu``)."""
        what = self.collapsed(leaves, differ, only, self.largest(path, start))
        relative = [at.removeprefix(path) for at, *_ in self.lines[start:]]
        groups = Counter(_LAST_KEY.sub("", at) or at for at in relative)
        return what + ": " + ", ".join(f"{group} {many(n, 'tensor')}" for group, n in groups.items())

    def clock_differences(self) -> list[str]:
        """The clock's entries that differ (compared apart, not counted in the summary)."""
        if self.clock_found is None:
            return []
        found = [at for at, *_ in self.clock_found.lines]
        return [p for p in self.clock if any(at == p or at.startswith((p + ".", p + "[")) for at in found)]

    def collapsed(self, leaves: int, differ: int, only: dict[str, int], where: str = "") -> str:
        what = f"{self.differ - differ} of {self.leaves - leaves} leaves differ"
        if self.max_diff:
            what += f", max abs diff {self.max_diff:.4g}{where}"
        for side in "AB":
            if self.only[side] > only[side]:
                what += f"; {many(self.only[side] - only[side], 'entry', 'entries')} only in {side}"
        return what

    def one_side(self, side: str, path: str, value: Any) -> None:
        self.only[side] += 1
        self.lines.append((path, f"only in {side}: {short(value, 60)}"))

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
            what, diff = (None, None) if same else (f"{short(a, 40)} != {short(b, 40)}", None)
        if what is None:
            return
        if diff is not None:
            if self.atol is not None and diff <= self.atol:
                self.close += 1
                return
            self.max_diff = max(self.max_diff, diff)
            self.diffs[path] = diff
        self.different(path, what)

    def summary(self) -> str:
        within = f" ({self.close} within atol {self.atol:g})" if self.close else ""
        if not self.lines:
            how = "bit for bit" if self.atol is None else f"within atol {self.atol:g}"
            return f"identical: {self.leaves} leaves, {how}{within}"
        largest = f", max abs diff {self.max_diff:.4g}" if self.max_diff else ""
        return (
            f"different: {self.differ} of {self.leaves} leaves differ{largest}{within}; "
            f"{many(self.only['A'], 'entry', 'entries')} only in A, {self.only['B']} only in B"
        )


def _tensor_dict(node: Any) -> bool:
    """Whether ``node`` is a non-empty name -> tensor dict (``params``, ``buffers``, a moment)."""
    return isinstance(node, dict) and bool(node) and all(isinstance(v, torch.Tensor) for v in node.values())


def _abs_diff(a: float, b: float) -> float:
    d = abs(float(a) - float(b))
    return math.inf if math.isnan(d) else d


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{dtype_name(value)} {tuple(value.shape)}"
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
        va, vb = (tensor_stats(t)["value"] for t in (a, b))
        what = f"{_kind(a)}: {va!r} != {vb!r}"
    else:
        where = tuple(int(i) for i in torch.nonzero(gap == diff)[0])
        what = f"{_kind(a)}: {n} of {a.numel()} elements differ, max abs diff {diff:.4g} (largest at {where})"
    # Integer tensors (counters, indices) are exact, as Python ints are: no tolerance, no "max abs diff".
    return what, diff if a.is_floating_point() or a.is_complex() else None


def differences(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> list[str]:
    """How the state files ``a`` and ``b`` differ, as ``fnloop diff`` prints it (the clock left out); empty if they do not."""
    _, _, tree_a = read(os.fspath(a))
    _, _, tree_b = read(os.fspath(b))
    found = _Diff(None, (), clock_paths(tree_a, tree_b))
    found.walk(tree_a, tree_b, "state")
    return [line.strip() for line in table(found.lines, indent="")]


def run(args: argparse.Namespace) -> int:
    """Print how the checkpoints ``args.a`` and ``args.b`` differ; return 0 if they do not, else 1."""
    path_a, _, a = read(args.a)
    path_b, _, b = read(args.b)
    print(f"A: {path_a} (iteration {short(a.get('iteration'))})")
    print(f"B: {path_b} (iteration {short(b.get('iteration'))})")
    found = _Diff(args.atol, args.ignore, () if args.clock else clock_paths(a, b))
    found.walk(a, b, "state")
    for line in table(found.lines, indent=""):
        print(line)
    if clock := found.clock_differences():
        print(f"not compared: what the machine measured ({', '.join(clock)} differ); --clock compares it")
    print(found.summary())
    return 1 if found.lines else 0
