"""The model summary: parameters per block, trainable and frozen, and their size, logged as a run starts."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import attrs
import torch

from fnloop._core.phase import Phase
from fnloop._core.state import TrainState, request
from fnloop.writers._console import _visible
from fnloop.writers._line import LOGGER

__all__ = ["ModelSummary", "model_summary", "summary"]


def _count(n: int) -> str:
    """``n`` as Lightning's summary shows counts: ``812``, ``12.3 K``, ``1.2 M``, ``7.0 B``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _rows(model: torch.nn.Module, depth: int) -> list[tuple[str, str, int, int, int]]:
    """(name, type, parameters, trainable, bytes) per module ``depth`` levels down, a tied tensor counted once."""
    modules = dict(model.named_modules())
    totals: dict[str, list[int]] = {}
    for name, p in model.named_parameters():  # each tensor once, under the first name it has
        parts = name.split(".")[:-1]
        block = ".".join(parts[:depth]) if parts else "(own)"
        while block not in modules and block != "(own)":
            block = block.rpartition(".")[0] or "(own)"
        found = totals.setdefault(block, [0, 0, 0])
        found[0] += p.numel()
        found[1] += p.numel() if p.requires_grad else 0
        found[2] += p.numel() * p.element_size()
    rows = []
    for block, (count, trainable, size) in totals.items():
        kind = type(model).__name__ if block == "(own)" else type(modules[block]).__name__
        rows.append((block, kind, count, trainable, size))
    return rows


def summary(model: torch.nn.Module, *, depth: int = 1) -> str:
    """A table of ``model``'s parameters per block, as Lightning's ``ModelSummary`` prints it.

    One row per module ``depth`` levels down holding parameters (its type,
    parameters, those trained, their size), then the totals: trainable
    (``requires_grad``, what ``fnloop.train_step`` trains), frozen, all, and
    their size in memory. A tensor shared by two modules (tied weights) is
    counted once, under the first. A model on the meta device is counted
    as it will be built.

    Examples:
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> _ = net[2].requires_grad_(False)
        >>> print(summary(net))
          name  type    params  trainable  size
          0     Linear  40      40         160 B
          2     Linear  18      0          72 B
        58 params: 40 trainable, 18 frozen; 232 B
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"summary() expected a torch.nn.Module, got {type(model).__name__}.")
    if type(depth) is not int or depth < 1:
        raise ValueError(f"summary(depth=...) must be a positive int: the module levels shown ({depth!r}).")
    rows = _rows(model, depth)
    table = [("name", "type", "params", "trainable", "size")]
    table += [(n, k, _count(c), _count(t), _bytes(s)) for n, k, c, t, s in rows]
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    lines = ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    count = sum(r[2] for r in rows)
    trainable = sum(r[3] for r in rows)
    size = sum(r[4] for r in rows)
    lines.append(
        f"{_count(count)} params: {_count(trainable)} trainable, {_count(count - trainable)} frozen; {_bytes(size)}"
    )
    return "\n".join(lines)


@attrs.frozen
class _Print:
    text: str

    def __call__(self, state: TrainState) -> None:
        logger = logging.getLogger(LOGGER)
        _visible(logger)  # seen where nobody configured logging, as the console writer's lines
        logger.info("model:\n%s", self.text)


@attrs.frozen(repr=False)
class ModelSummary:
    """Logs the model's summary as the run starts; build it with ``model_summary``."""

    acts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.BEFORE_TRAIN})
    """The phase it acts in."""

    text: str

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase is Phase.BEFORE_TRAIN:
            return request(state, _Print(self.text), "log the model summary")
        return state

    def __repr__(self) -> str:
        return f"model_summary(<{self.text.splitlines()[-1]}>)"


def model_summary(model: torch.nn.Module, *, depth: int = 1) -> Any:
    """A hook logging ``summary(model, depth=depth)`` to the ``"fnloop"`` logger as the run starts.

    Logged once, in ``BEFORE_TRAIN`` (a resumed run logs it again), on rank 0
    alone under ``torchrun``, through the console writer's logger (so it
    shows where the console lines do, above a progress bar). The table is
    made when the hook is built: the hook holds text, not the model.

    Examples:
        >>> import fnloop as fl
        >>> hook = model_summary(torch.nn.Linear(3, 2))
        >>> hook
        model_summary(<8 params: 8 trainable, 0 frozen; 32 B>)
    """
    return ModelSummary(summary(model, depth=depth))
