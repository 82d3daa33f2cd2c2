"""An exponential moving average of the parameters, kept in the state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import attrs
import torch

from fnloop._core.messages import got, non_empty_str
from fnloop._core.phase import Phase
from fnloop._core.shards import Shards
from fnloop._core.state import TrainState, Unclaimed
from fnloop._core.stateful import recall, remember
from fnloop.checkpoint._codec import CheckpointMismatch

__all__ = ["EmaState", "ema", "ema_params"]


@attrs.frozen
class EmaState:
    """The averaged parameters (name -> tensor, keyed like ``state.params``) and how many steps they saw."""

    params: Mapping[str, torch.Tensor]
    updates: int = 0


def _decay(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if type(value) not in (int, float) or not 0.0 <= value < 1.0:  # type: ignore[operator]
        raise ValueError(
            f"'{attribute.name}' must be a float in [0, 1) ({got(value)}); typical values are "
            "0.999 or 0.9999 (the average then spans about 1 / (1 - decay) steps; at 1 it would "
            "never move from the first parameters)."
        )


def _copy(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Own tensors, never aliases: a donating step overwrites the params in place.
    return {k: p.detach().clone() for k, p in params.items()}


def _template(params: Mapping[str, torch.Tensor]) -> EmaState:
    return EmaState({k: torch.empty_like(p) for k, p in params.items()})


EMA_RESHARDED = (
    "ema {name!r}: the average in {where} was saved by {saved}, and the state it is read into {now}. "
    "The EMA of a shard='full' run averages each rank's chunk of the parameters, so it resumes only "
    "at the world size that saved it: read at another, it would hold rank 0's chunk alone. Resume "
    "with {ranks}, or start the average afresh from the loaded state: attrs.evolve(state, "
    "hooks={{k: v for k, v in state.hooks.items() if k != {name!r}}})."
)
"""Why an EMA read from a checkpoint of another layout of the parameters is refused."""


def _chunks(shards: Shards | None) -> int:
    """Over how many ranks an EMA of a state in the layout ``shards`` is split (1: it is whole)."""
    return shards.world if shards is not None and shards.params else 1


def _same_layout(value: Unclaimed, state: TrainState, name: str) -> None:
    """Refuse an EMA read from a checkpoint whose parameters were split otherwise than ``state``'s."""
    saved, now = _chunks(value.shards), _chunks(state.shards)
    if saved == now:
        return
    was = f"a shard='full' run over {saved} ranks" if saved > 1 else "a run whose parameters were whole"
    is_now = f"splits the parameters over {now} ranks" if now > 1 else "holds the parameters whole"
    ranks = f"{saved} ranks and shard='full'" if saved > 1 else "whole parameters (no shard='full')"
    raise CheckpointMismatch(
        EMA_RESHARDED.format(name=name, where=value.where, saved=was, now=is_now, ranks=ranks)
    )


def _current(state: TrainState, name: str) -> EmaState | None:
    """The EMA kept under ``name`` (claiming one read from a checkpoint), or ``None``."""
    value = state.hooks.get(name)
    if type(value) is Unclaimed:
        _same_layout(value, state, name)
    if value is not None and type(value) is not EmaState:  # read from a checkpoint: built like the params
        value = recall(state, name, None, like=_template(state.params))
    if value is None:
        return None
    if type(value) is not EmaState:
        raise TypeError(
            f"state.hooks[{name!r}] holds {type(value).__name__}, not an EMA (fnloop.hooks.EmaState); "
            f"another hook keeps its state under {name!r}. Give the ema hook another name=."
        )
    return value


@attrs.frozen(repr=False)
class Ema:
    """An EMA of the parameters in ``state.hooks[name]``; build it with ``ema``."""

    acts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.BEFORE_TRAIN, Phase.AFTER_STEP})
    """The phases it may change the state in; the fold does not call it in the others."""

    decay: float = attrs.field(validator=_decay)
    name: str = attrs.field(default="ema", validator=non_empty_str)

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase is Phase.BEFORE_TRAIN:
            old = _current(state, self.name)
            if old is None:
                return self._keep(state, EmaState(_copy(state.params)))
            if list(old.params) != list(state.params):
                raise ValueError(
                    f"ema {self.name!r}: the average holds {sorted(old.params)} but the state's params "
                    f"are {sorted(state.params)}. The EMA must come from the same model; start it afresh "
                    f"by dropping state.hooks[{self.name!r}], or give this hook another name=."
                )
            return state if old is state.hooks[self.name] else self._keep(state, old)
        if phase is not Phase.AFTER_STEP:
            return state
        old = _current(state, self.name)
        if old is None:
            old = EmaState(_copy(state.params))
        names = list(state.params)
        averaged = old.params
        # One fused kernel over all tensors; the out-of-place form leaves the old
        # average intact for whoever still holds the previous state.
        new = torch._foreach_lerp(
            [averaged[k] for k in names], [state.params[k].detach() for k in names], 1.0 - self.decay
        )
        return self._keep(state, EmaState(dict(zip(names, new)), old.updates + 1))

    def _keep(self, state: TrainState, value: EmaState) -> TrainState:
        return remember(state, self.name, value)

    @property
    def state_names(self) -> tuple[str, ...]:
        return (self.name,)

    def __repr__(self) -> str:
        return f"ema({self.decay!r}, name={self.name!r})"


def ema(decay: float, *, name: str = "ema") -> Ema:
    """A hook keeping an exponential moving average of the parameters in ``state.hooks[name]``.

    At ``BEFORE_TRAIN`` the average starts as a copy of ``state.params``
    (unless the state, say one loaded from a checkpoint, holds one already).
    After every step, ``average = decay * average + (1 - decay) * params``, as
    one fused ``torch._foreach_lerp`` over all tensors, the update
    ``torch.optim.swa_utils.get_ema_multi_avg_fn`` applies. The average is
    new tensors each step, never written in place and never sharing storage
    with the params; it is saved with the state (an ``EmaState``). Read it with
    ``ema_params``; ``evaluate(fn, ema=name)`` evaluates it. Buffers (BatchNorm
    statistics) are not averaged.

    The average of a ``shard="full"`` state holds each rank's chunk of the
    parameters, so it resumes only at the world size that saved it: read from
    a checkpoint of another layout, it is refused when the hook claims it.

    Args:
        decay: in ``[0, 1)``; the average spans about ``1 / (1 - decay)`` steps.
        name: where the average is kept; unique among the run's hooks.

    Raises:
        ValueError: ``decay`` is outside ``[0, 1)`` or ``name`` is empty.
        CheckpointMismatch (when the run begins): the average was read from a
            checkpoint whose parameters were split over another number of ranks.

    Examples:
        >>> import fnloop as fl
        >>> step = lambda s, b: attrs.evolve(s, params={"w": s.params["w"] + 1})
        >>> start = fl.TrainState(max_iter=2, params={"w": torch.zeros(())})
        >>> final = fl.run(start, step, [None] * 2, [ema(0.5)])
        >>> final.params["w"].item(), ema_params(final)["w"].item()  # 0 -> (0 + 1) / 2 -> (0.5 + 2) / 2
        (2.0, 1.25)
    """
    return Ema(decay, name)


def ema_params(state: TrainState, name: str = "ema") -> dict[str, torch.Tensor]:
    """The averaged parameters kept by the ``ema`` hook called ``name``, shaped like ``state.params``.

    Works on a state loaded from a checkpoint too. To evaluate the average,
    use ``evaluate(fn, ema=name)``, or ``attrs.evolve(state,
    params=ema_params(state))``; ``fnloop.state_dict`` of that state loads into
    the model.

    Raises:
        KeyError: the state holds no average under ``name``.
        TypeError: ``state`` is not a ``TrainState``, ``name`` not a str, or
            ``state.hooks[name]`` is another hook's state.
        CheckpointMismatch: the average was read from a checkpoint whose
            parameters were split over another number of ranks (see ``ema``).

    Examples:
        >>> import fnloop as fl
        >>> state = fl.TrainState(max_iter=1, params={"w": torch.ones(2)})
        >>> ema_params(ema(0.9)(state, fl.Phase.BEFORE_TRAIN))
        {'w': tensor([1., 1.])}
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"ema_params(state, name) expects a fnloop.TrainState ({got(state)}).")
    if type(name) is not str or not name:
        raise TypeError(
            f"ema_params(state, name): name must be the name= of an ema hook, a non-empty str ({got(name)})."
        )
    found = _current(state, name)
    if found is None:
        raise KeyError(
            f"no EMA named {name!r} in this state (hook states present: {sorted(state.hooks)}). "
            f"Add fnloop.hooks.ema(decay, name={name!r}) to the run's hooks, or pass the name= "
            "the ema hook was given."
        )
    return dict(found.params)
