"""``checked``: hooks guarded against writing into the state's tensors in place (``run(debug=True)``)."""

from __future__ import annotations

from typing import Any

import attrs

from fnloop._core.combinators import Chain, Hook, _Wrapper, chain
from fnloop._core.messages import describe
from fnloop._core.phase import Phase
from fnloop._core.state import TrainState
from fnloop._core.tree import leaves

__all__ = ["Checked", "checked"]


def _versions(state: TrainState) -> list[tuple[str, Any, int]]:
    return [(p, t, t._version) for p, t in leaves(state) if hasattr(t, "_version")]


@attrs.frozen(repr=False)
class Checked(_Wrapper):
    """``hook``, failing loudly if it writes into a tensor of the state it is given."""

    hook: Hook

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        before = _versions(state)
        out = self.hook(state, phase)
        for path, tensor, version in before:
            if tensor._version != version:
                raise RuntimeError(
                    f"hook {describe(self.hook)} wrote into {path} in place in {phase!r}. Hooks must "
                    "not mutate the state they are given: the tensor may be shared with a saved or "
                    "yielded state. Build a new tensor (x = x + 1, not x += 1) and return a new state."
                )
        return out

    def __repr__(self) -> str:
        return f"checked({describe(self.hook)})"


def checked(hook: Hook) -> Hook:
    """``hook`` (each hook of a chain) guarded against writing into the state's tensors in place.

    A debugging aid: it compares every tensor's version counter before and
    after each call, and names the hook and the tensor's path. ``run(...,
    debug=True)`` applies it to every hook.

    Examples:
        >>> def bad(state, phase):
        ...     for p in state.params.values():
        ...         p.add_(1)
        ...     return state
        >>> import torch
        >>> checked(bad)(TrainState(max_iter=1, params={"w": torch.zeros(1)}), Phase.BEFORE_STEP)
        Traceback (most recent call last):
        RuntimeError: hook bad wrote into state.params['w'] in place in Phase.BEFORE_STEP. ...
    """
    hooks = hook.hooks if isinstance(hook, Chain) else (hook,)
    return chain(*[Checked(h) for h in hooks])
