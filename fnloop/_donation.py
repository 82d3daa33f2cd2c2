"""Whether a step may write into a state's tensors: nobody else may see them.

The fold owns the states it threads, but a hook may have kept a parameter in
its state, a metric may hold one, or a hook may keep a whole container. A pure
hook can keep things only in the state, so reference counts (for tensors kept
anywhere) and a scan of ``state.hooks`` and ``state.extra`` (for containers)
find everything a donation would change under someone's feet.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from fnloop._state import TrainState

__all__ = ["exclusive", "holds_containers", "opt_containers"]


def exclusive(tensors: list[torch.Tensor]) -> bool:
    """Whether nothing but one container (and ``tensors`` itself) refers to each tensor."""
    # The builtin on the loop's own name, never through a Python function of
    # ours: dynamo's frame hook, once installed, adds a reference to the
    # arguments of Python calls, which would change what a count means.
    for tensor in tensors:  # noqa: SIM110 - no generator frame between the count and the loop
        if sys.getrefcount(tensor) > _BASELINE:
            return False
    return True


def _baseline() -> int:
    held = {"probe": torch.zeros(())}
    for tensor in list(held.values()):
        return sys.getrefcount(tensor)
    raise AssertionError("unreachable")


_BASELINE = _baseline()


_ATOMS = frozenset({int, float, bool, str, bytes, type(None)})


def holds_containers(state: TrainState, containers: set[int]) -> bool:
    """Whether ``state.hooks`` or ``state.extra`` keeps one of the containers the step updates.

    A pure hook can keep things only in the state, so this and the tensors'
    reference counts together find everything that would see a donation.
    """
    if not state.hooks and state.extra is None:
        return False
    targets = {id(state.params), id(state.buffers), *containers}
    stack = [state.hooks, state.extra]
    while stack:
        node = stack.pop()
        if type(node) in _ATOMS:  # the common hook states, at the cost of one lookup
            continue
        if id(node) in targets:
            return True
        if isinstance(node, Mapping):
            stack.extend(v for v in node.values() if not isinstance(v, torch.Tensor))
        elif isinstance(node, (tuple, list)):
            stack.extend(v for v in node if not isinstance(v, torch.Tensor))
        elif attrs.has(type(node)):
            stack.extend(getattr(node, f.name) for f in attrs.fields(type(node)))
    return False


def opt_containers(tree: Any) -> list[Any]:
    """Every mapping, tuple and list in ``tree`` (an optimizer state), ``tree`` first."""
    if isinstance(tree, Mapping):
        return [tree, *(c for v in tree.values() for c in opt_containers(v))]
    if isinstance(tree, (tuple, list)):
        return [tree, *(c for v in tree for c in opt_containers(v))]
    return []
