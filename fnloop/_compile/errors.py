"""The compiler room's errors: a function that is not one graph, one that draws where it cannot be seeded, a budget spent, inductor failing."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["CompileFailed", "OverBudget", "RandomInGraph", "TraceError", "user_frames"]


class TraceError(RuntimeError):
    """The function cannot be one graph: it depends on a tensor's value in Python."""


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
