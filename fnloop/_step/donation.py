"""Whether a step may write into the tensors of a state the fold owns: nothing else in it may hold them.

The fold tells the step which states nobody outside it can see (``owned``).
Inside such a state, though, a hook may have kept a parameter in its hook
state, a metric may hold one (a hook recorded the optimizer's step count),
``extra`` may keep a whole container, or two fields may share a
tensor. A pure hook can keep things only in the state, so a walk of
``hooks``, ``extra`` and the metrics' values finds everything a donation
would change under someone's feet. The walks are skipped for what was
walked before: states are values, and the same object holds what it held.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fnloop._core.state import TrainState
from fnloop._core.tree import children, record_fields

__all__ = ["Targets", "opt_containers", "shared"]

_ATOMS = frozenset({int, float, bool, str, bytes, type(None)})


class Targets:
    """What a step would write into for one layout of a state, worked out once per layout.

    The layout is the very ``params``, ``buffers`` and ``opt_state`` objects:
    a donating step returns the same containers, so from step to step this is
    the same layout and nothing is recomputed. Holds the objects, so their
    ids stay theirs.
    """

    def __init__(self, state: TrainState, leaves: list[torch.Tensor], containers: set[int]) -> None:
        self.key = (state.params, state.buffers, state.opt_state)
        tensors = [*state.params.values(), *state.buffers.values(), *leaves]
        ids = [id(t) for t in tensors]
        self.distinct = len(set(ids)) == len(ids)
        """No tensor appears twice among the fields (a tie, or a parameter kept in ``opt_state``)."""
        self.ids = frozenset((id(state.params), id(state.buffers), *containers, *ids))
        self.clean: tuple[Any, Any] = (None, None)
        """The ``hooks`` and ``extra`` last found to hold none of them."""
        self.newest: dict[str, Any] = {}
        """Per metric, its newest entry last found clean: the entries up to it were checked."""

    def same(self, state: TrainState) -> bool:
        key = self.key
        return key[0] is state.params and key[1] is state.buffers and key[2] is state.opt_state


def shared(state: TrainState, targets: Targets) -> bool:
    """Whether anything in ``state`` besides its own fields holds what the step writes into."""
    if not targets.distinct:
        return True
    hooks, extra = state.hooks, state.extra
    walked = targets.clean[0] is hooks and targets.clean[1] is extra
    if not walked and _holds([*hooks.values(), extra], targets.ids):
        return True
    targets.clean = (hooks, extra)
    return _recorded(state.metrics.series, targets)


def _recorded(series: Any, targets: Targets) -> bool:
    """Whether a metric holds one of the tensors; only the entries newer than the last check are read.

    A metric's entries only ever grow at the end (``record``, ``merge``), and
    entries are values: the ones up to the newest entry found clean last time
    hold what they held then.
    """
    ids, newest = targets.ids, targets.newest
    found: dict[str, Any] = {}
    for name, entries in series.items():
        known = newest.get(name)
        for entry in reversed(entries):
            if entry is known:
                break
            if id(entry[1]) in ids:
                return True
        if entries:
            found[name] = entries[-1]
    targets.newest = found
    return False


def _holds(stack: list[Any], targets: frozenset[int]) -> bool:
    """Whether a node of ``stack``'s trees is one of ``targets``: the containers of ``fnloop._core.tree``, walked flat."""
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind in _ATOMS:
            continue
        if id(node) in targets:
            return True
        if kind is torch.Tensor:
            continue
        if kind is dict:
            stack.extend(node.values())
            continue
        if kind is tuple or kind is list:
            stack.extend(node)
            continue
        names = record_fields(kind)
        if names is not None:
            stack.extend([getattr(node, name) for name in names])
        elif isinstance(node, Mapping):
            stack.extend(node.values())
        elif isinstance(node, (tuple, list)):
            stack.extend(node)
    return False


def opt_containers(tree: Any) -> list[Any]:
    """Every container in ``tree`` (an optimizer state: mappings, tuples, lists), ``tree`` first."""
    kids = children(tree)
    return [] if kids is None else [tree, *(c for _, v in kids for c in opt_containers(v))]
