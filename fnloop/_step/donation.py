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

from fnloop._core.state import TrainState

__all__ = ["Clean", "exclusive", "holds_containers", "opt_containers"]


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


class Clean:
    """Hook states found to hold none of the step's containers, kept to skip them next time.

    Hook states are values: one that is the very same object as at the last
    check, against the same containers, still holds none of them. Most hook
    states change only when their hook fires, so on most steps ``state.hooks``
    is the very dict of the last check and nothing is walked. The objects are
    held, so their ids stay theirs.
    """

    def __init__(self) -> None:
        self.key: tuple[Any, ...] = ()
        self.values: dict[int, Any] = {}
        self.seen: tuple[Any, Any] = (None, None)


def holds_containers(state: TrainState, containers: set[int], clean: Clean | None = None) -> bool:
    """Whether ``state.hooks`` or ``state.extra`` keeps one of the containers the step updates.

    A pure hook can keep things only in the state, so this and the tensors'
    reference counts together find everything that would see a donation.
    With ``clean``, hook states checked before (the same objects) are skipped.
    """
    if not state.hooks and state.extra is None:
        return False
    targets = None
    roots = [*state.hooks.values(), state.extra]
    if clean is None:
        return _holds(roots, frozenset((id(state.params), id(state.buffers), *containers)))
    # The same dicts and the same set of containers (the step caches it per optimizer state).
    now = (state.params, state.buffers, containers)
    last = clean.key
    same = len(last) == 3 and last[0] is now[0] and last[1] is now[1] and last[2] is now[2]
    seen = clean.seen
    if same and seen[0] is state.hooks and seen[1] is state.extra:
        return False  # the very hook states and extra of the last check
    known = clean.values if same else {}
    fresh: dict[int, Any] = {}
    for root in roots:
        if type(root) in _ATOMS:
            continue
        key = id(root)
        if known.get(key) is not root:
            if targets is None:
                targets = frozenset((id(state.params), id(state.buffers), *containers))
            if _holds([root], targets):
                return True
        fresh[key] = root
    clean.key, clean.values, clean.seen = now, fresh, (state.hooks, state.extra)
    return False


_FIELDS: dict[type, tuple[str, ...] | None] = {}
"""The field names of each attrs class met, ``None`` for other classes: one lookup per node."""


def _holds(stack: list[Any], targets: frozenset[int]) -> bool:
    fields = _FIELDS
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind in _ATOMS or kind is torch.Tensor:  # the common leaves, at the cost of one lookup
            continue
        if id(node) in targets:
            return True
        if kind is dict:
            stack.extend(node.values())
            continue
        if kind is tuple or kind is list:
            stack.extend(node)
            continue
        names = fields.get(kind, ())
        if names == ():
            names = fields[kind] = tuple(f.name for f in attrs.fields(kind)) if attrs.has(kind) else None
        if names is not None:
            stack.extend([getattr(node, name) for name in names])
        elif isinstance(node, Mapping):
            stack.extend(node.values())
        elif isinstance(node, (tuple, list)):
            stack.extend(node)
    return False


def opt_containers(tree: Any) -> list[Any]:
    """Every mapping, tuple and list in ``tree`` (an optimizer state), ``tree`` first."""
    if isinstance(tree, Mapping):
        return [tree, *(c for v in tree.values() for c in opt_containers(v))]
    if isinstance(tree, (tuple, list)):
        return [tree, *(c for v in tree for c in opt_containers(v))]
    return []
