"""The compiler room's errors: a function that is not one graph, one that draws where it cannot be seeded, a budget spent, inductor failing."""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
from types import TracebackType
from typing import Any

import torch

__all__ = [
    "CompileFailed",
    "OverBudget",
    "RandomInGraph",
    "TraceError",
    "TraceFailed",
    "op_of",
    "outside",
    "raised_by_torch",
    "user_frames",
]


class TraceError(RuntimeError):
    """The function cannot be one graph: it depends on a tensor's value in Python.

    ``where``: the line that asked for the value (the innermost frame outside
    torch, fnloop and Python's own library), if known; ``kind``: what it asked.
    """

    def __init__(self, message: str, where: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.where = where
        self.kind = kind


class TraceFailed(RuntimeError):
    """An op refused the fake tensors of the trace: ``op`` (if known), ``where`` the model called it, torch's ``message``."""

    def __init__(self, op: str | None, where: str | None, message: str) -> None:
        super().__init__(op, where, message)
        self.op = op
        self.where = where
        self.message = message


class RandomInGraph(TraceError):
    """The function draws from torch's generator where the caller cannot seed it (several steps per call)."""


class OverBudget(RuntimeError):
    """A call needs one more graph than the budget allows; nothing was traced or run.

    ``change`` says what differs from the previous call: ``(index, before,
    after)`` for the first tensor whose shape, strides, dtype or device
    changed, or ``(None, structure before, structure after)``.
    """

    def __init__(self, change: tuple[int | None, Any, Any]) -> None:
        super().__init__(change)
        self.change = change


class CompileFailed(RuntimeError):
    """Inductor failed to compile a traced graph: ``op`` and ``where`` (source lines) if known."""

    def __init__(self, op: str | None, where: str | None) -> None:
        super().__init__(op, where)
        self.op = op
        self.where = where


def user_frames(stack: str | None) -> str | None:
    """The innermost frames of ``stack`` outside fnloop and torch's machinery: the module's forward that made the op.

    The trace records, for an op made inside a module's ``forward``, where in
    that ``forward`` it was made (torch's own modules, such as ``linear.py``,
    count: they say which kind of layer it was).
    """
    if not stack:
        return None
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', stack)
    kept = [
        f
        for f in frames
        if "/fnloop/_" not in f[0] and ("/torch/" not in f[0] or "/torch/nn/modules/" in f[0])
    ]
    if not kept:
        return None
    return "; ".join(f"{path}:{line} in {fn}: {code.strip()}" for path, line, fn, code in kept[-2:])


_TORCH = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "")
_FNLOOP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
_STDLIB = os.path.join(os.path.abspath(sysconfig.get_paths()["stdlib"]), "")


def _machinery(filename: str) -> bool:
    """Whether ``filename`` is torch's, fnloop's or Python's own (never where a user's code is at fault)."""
    path = os.path.abspath(filename)
    if filename.startswith("<") or path.startswith((_TORCH, _FNLOOP)):
        return True
    return path.startswith(_STDLIB) and "-packages" not in path[len(_STDLIB) :]


def outside(tb: TracebackType | None) -> str | None:
    """The innermost frame of ``tb`` outside torch, fnloop and Python's library: ``file:line in function: code``."""
    for frame in reversed(traceback.extract_tb(tb)):
        if not _machinery(frame.filename):
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return None


def raised_by_torch(tb: TracebackType | None) -> bool:
    """Whether the innermost frame of ``tb`` is torch's: an op, not the user's code or fnloop's, raised."""
    frames = traceback.extract_tb(tb)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_TORCH)


def op_of(tb: TracebackType | None) -> str | None:
    """The op torch was running when ``tb`` was raised (a fake tensor's dispatch names it), if any."""
    found = None
    while tb is not None:
        func = tb.tb_frame.f_locals.get("func")
        if isinstance(func, torch._ops.OpOverload):
            found = str(func)
        tb = tb.tb_next
    return found
