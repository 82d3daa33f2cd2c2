"""Populations: many runs of one model as one state, stepped together; ``population`` and ``member``.

A population's state is an ordinary ``TrainState`` whose tensors hold every
member's, stacked on a new first dimension, with ``state.population`` saying
who the members are. ``train_step`` steps all of them in one call (one
compiled graph, vmapped over the members: ``fnloop/_step/members.py``), the
fold, hooks and checkpoints take it as any state, and ``member(state, i)``
gives member ``i`` back as the plain state of a single run.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._core.messages import got
from fnloop._core.metrics import Metrics
from fnloop._core.population import Population, split_member_metric
from fnloop._core.state import TrainState

__all__ = ["member", "members", "population"]


def population(
    init: Callable[..., TrainState], *, seeds: Sequence[int], **hyperparams: Sequence[Any]
) -> TrainState:
    """The state of a population: member ``m`` is ``init(seeds[m], **{name: values[m]})``, all stacked.

    Each member is built as its own run would be, then the members' tensors
    are stacked, so that one step trains them all. What may differ between
    members is what their states hold: their tensors (weights from their
    seeds, an optimizer's hyperparameters injected into its state with
    ``fnloop.optim.inject``) and their seeds (``fnloop.init(..., seed=...)``:
    each member's dropout draws from its own). What may not is what one graph
    fixes: the names, shapes and dtypes of the tensors, the model's code, and
    every setting the step holds as a number. A hyperparameter that differs
    between members but not in their states would train every member with the
    step's one value, so it is refused.

    Args:
        init: ``init(seed, **hyperparams) -> TrainState``, a member's state from
            its seed and hyperparameters; the same arguments must build the same state.
        seeds: one seed per member, non-negative ints (``range(8)``), passed
            to ``init`` (and usually on to ``fnloop.init(..., seed=seed)`` and
            ``torch.manual_seed``). A seed may repeat only across members whose
            hyperparameters differ (the same initial weights, a controlled
            sweep): two members alike in both would be one run twice.
        **hyperparams: name -> one value per member, passed to ``init`` by name.

    Returns:
        The population's state, ``state.population`` its ``Population``; each
        member's label names its hyperparameters (``"lr=0.001"``).

    Raises:
        TypeError: ``init`` is not callable, or ``seeds`` is not a list (a
            single int, a str, a set).
        ValueError: no members, a seed that is not a non-negative int, two
            members alike in seed and hyperparameters, a hyperparameter
            without one value per member, members that do not
            fit one graph, ``init`` giving two states for the same arguments, or
            a hyperparameter that does not reach the state.

    Examples:
        >>> import fnloop as fl
        >>> def member(seed, lr):
        ...     torch.manual_seed(seed)
        ...     opt = fl.optim.inject(fl.optim.sgd, lr=lr)
        ...     return fl.init(torch.nn.Linear(3, 2), opt, seed=seed, max_iter=10)
        >>> pop = fl.population(member, seeds=[0, 1], lr=[0.1, 0.01])
        >>> pop.params["weight"].shape, pop.population.labels
        (torch.Size([2, 2, 3]), ('lr=0.1', 'lr=0.01'))
    """
    if not callable(init):
        raise TypeError(
            f"population(init, ...) expects init to be a function (seed, **hyperparams) -> TrainState, "
            f"a member's state ({got(init)})."
        )
    seeds = _seed_list(seeds)
    size = len(seeds)
    for name, values in hyperparams.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != size:
            raise ValueError(
                f"population(..., {name}=...) must give one value per member, {size} in all, as a list "
                f"({got(values)})."
            )
    settings = [{name: values[m] for name, values in hyperparams.items()} for m in range(size)]
    _check_distinct(seeds, settings)
    states = [_member_state(init, seed, setting) for seed, setting in zip(seeds, settings)]
    for m, state in enumerate(states[1:], 1):
        _check_fits(states[0], state, m)
    if not _same_tensors(states[0], _member_state(init, seeds[0], settings[0])):
        raise ValueError(
            f"population(init, ...): init({seeds[0]!r}, ...) built two different states from the same "
            "arguments, so a member could not be trained again alone to the same result. Make the "
            "state a function of the seed: seed the model's initialization (torch.manual_seed(seed) "
            "before building it)."
        )
    for name, values in hyperparams.items():
        other = next((m for m in range(size) if values[m] != values[0]), None)
        if other is None:
            continue
        probe = _member_state(init, seeds[0], {**settings[0], name: values[other]})
        if _same_tensors(states[0], probe):
            raise ValueError(
                f"population(..., {name}=...): the members' values of {name!r} differ, but the state "
                f"init builds is the same for {values[0]!r} and {values[other]!r}: the value does not "
                "reach the state, so the one step would train every member with one value. What "
                "differs by member must be a tensor of the state: inject an optimizer's settings "
                f"(fnloop.optim.inject(fnloop.optim.adamw, {name}={name}), say); a setting of the "
                "model's code (a dropout rate, a width) cannot differ within one population."
            )
    return _stacked(states, tuple(_label(setting, seed) for setting, seed in zip(settings, seeds)))


_SEEDS = (
    "population(init, seeds=...) expects one seed per member, a list of non-negative ints such as "
    "seeds=range(8)"
)


def _seed_list(seeds: object) -> list[Any]:
    """``seeds`` as a list, refused unless it is an ordered collection of non-negative ints."""
    if isinstance(seeds, (str, bytes, Mapping, Set)) or not isinstance(seeds, Iterable):
        raise TypeError(f"{_SEEDS} ({got(seeds)}).")
    listed = list(seeds)
    if not listed:
        raise ValueError(f"{_SEEDS}; it needs at least one (got an empty {type(seeds).__name__}).")
    for m, seed in enumerate(listed):
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"{_SEEDS}: 'seeds[{m}]' must be a non-negative int ({got(seed)}).")
    return listed


def _check_distinct(seeds: list[Any], settings: list[dict[str, Any]]) -> None:
    """Refuse two members alike in seed and hyperparameters: they would be one run, trained twice."""
    first: dict[str, int] = {}
    for m, (seed, setting) in enumerate(zip(seeds, settings)):
        key = repr((int(seed), sorted(setting.items())))
        if key in first:
            alike = f"seed {int(seed)}" + "".join(f", {k}={v!r}" for k, v in setting.items())
            raise ValueError(
                f"population(init, seeds=...): members {first[key]} and {m} are alike ({alike}), so they "
                "would be one run trained twice. Give each member its own seed (seeds=range(n)), or, to "
                "start members from the same weights, a hyperparameter that differs between them."
            )
        first[key] = m


def _member_state(init: Callable[..., TrainState], seed: int, setting: dict[str, Any]) -> TrainState:
    state = init(seed, **setting)
    if not isinstance(state, TrainState):
        raise TypeError(f"population(init, ...): init must return a fnloop.TrainState ({got(state)}).")
    if state.population is not None or state.shards is not None:
        raise ValueError(
            "population(init, ...): init must return a single run's whole state, not a population's "
            "or a sharded one."
        )
    return state


def _label(setting: dict[str, Any], seed: int) -> str:
    if not setting:
        return f"seed={seed}"
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in setting.items())


def _layout(state: TrainState) -> Any:
    leaves, spec = pytree.tree_flatten((state.params, state.buffers, state.opt_state))
    return spec, [(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else t for t in leaves]


def _check_fits(first: TrainState, other: TrainState, m: int) -> None:
    """Refuse member ``m`` unless it has member 0's layout and shares what members share."""
    problems = []
    if _layout(first) != _layout(other):
        problems.append("the names, shapes, dtypes or devices of its tensors (one graph fixes them)")
    for name in ("max_iter", "iteration", "data"):
        if getattr(first, name) != getattr(other, name):
            problems.append(f"{name} ({getattr(other, name)!r} against {getattr(first, name)!r})")
    if not _equal(first.extra, other.extra):
        problems.append("extra (the user's data of the state is shared by the members, not stacked)")
    if other.hooks or first.hooks or other.metrics.series or first.metrics.series:
        problems.append("a fresh start: a member's state must have no hook states and no metrics yet")
    if problems:
        raise ValueError(
            f"population(init, ...): member {m} differs from member 0 in "
            + "; ".join(problems)
            + ". Members may differ in their tensors' values and their seeds only."
        )


def _equal(a: Any, b: Any) -> bool:
    left, right = pytree.tree_flatten(a), pytree.tree_flatten(b)
    if left[1] != right[1]:
        return False
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        for x, y in zip(left[0], right[0])
    )


def _same_tensors(a: TrainState, b: TrainState) -> bool:
    left = pytree.tree_leaves((a.params, a.buffers, a.opt_state))
    right = pytree.tree_leaves((b.params, b.buffers, b.opt_state))
    return len(left) == len(right) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(left, right)
    )


def _stacked(states: list[TrainState], labels: tuple[str, ...]) -> TrainState:
    first = states[0]

    def stack(*tensors: Any) -> Any:
        return torch.stack(tensors) if isinstance(tensors[0], torch.Tensor) else tensors[0]

    return TrainState(
        max_iter=first.max_iter,
        iteration=first.iteration,
        params={k: torch.stack([s.params[k] for s in states]) for k in first.params},
        buffers={k: torch.stack([s.buffers[k] for s in states]) for k in first.buffers},
        opt_state=pytree.tree_map(stack, *[s.opt_state for s in states]),
        rng=first.rng,
        data=first.data,
        metrics=first.metrics,
        extra=first.extra,
        population=Population(seeds=tuple(s.rng for s in states), labels=labels, stopped=(-1,) * len(states)),
    )


def member(state: TrainState, i: int) -> TrainState:
    """Member ``i`` of a population's state, as the plain state of a single run.

    Its tensors are copies of the member's rows; ``rng`` is its seed; its
    metrics are its own (``loss/3`` becomes ``loss``) and the population's
    shared ones; a member that stopped is given at the iteration it stopped.
    ``fnloop.run`` can continue it alone, ``fnloop.state_dict`` exports it,
    a checkpoint saves it. The population's hook states are not the member's
    and are left out: a run of the member starts its hooks afresh.

    Raises:
        TypeError: ``state`` is not a population's state, or ``i`` is not an int.
        IndexError: no member ``i``.

    Examples:
        >>> import fnloop as fl
        >>> def init(seed):
        ...     torch.manual_seed(seed)
        ...     return fl.init(torch.nn.Linear(3, 2), fl.optim.sgd(0.1), seed=seed, max_iter=5)
        >>> pop = fl.population(init, seeds=[3, 4])
        >>> one = fl.member(pop, 1)
        >>> one.population, one.rng, torch.equal(one.params["weight"], init(4).params["weight"])
        (None, 4, True)
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"member(state, i) expects a population's fnloop.TrainState ({got(state)}).")
    population = state.population
    if population is None:
        raise TypeError(
            "member(state, i): the state is a single run's, not a population's (fnloop.population)."
        )
    if type(i) is not int:
        raise TypeError(
            f"member(state, i): i must be an int, a member's index from 0 to {population.size - 1} "
            f"({got(i)})."
        )
    if not 0 <= i < population.size:
        raise IndexError(
            f"member(state, i): the population has members 0 to {population.size - 1} ({got(i)})."
        )
    stopped = population.stopped[i]
    iteration = state.iteration if stopped < 0 else stopped
    series = {}
    for name, entries in state.metrics.series.items():
        split = split_member_metric(name, population.size)
        if split is None or split[1] == i:
            kept = tuple(e for e in entries if stopped < 0 or e[0] < stopped)
            if kept:
                series[name if split is None else split[0]] = kept
    return attrs.evolve(
        state,
        iteration=iteration,
        params={k: v[i].clone() for k, v in state.params.items()},
        buffers={k: v[i].clone() for k, v in state.buffers.items()},
        opt_state=pytree.tree_map(
            lambda t: t[i].clone() if isinstance(t, torch.Tensor) else t, state.opt_state
        ),
        rng=population.seeds[i],
        metrics=Metrics(window=state.metrics.window, series=series),
        hooks={},
        population=None,
        effects=(),
    )


def members(state: TrainState) -> list[TrainState]:
    """Every member of a population's state, in order (``member`` of each)."""
    if not isinstance(state, TrainState):
        raise TypeError(f"members(state) expects a population's fnloop.TrainState ({got(state)}).")
    if state.population is None:
        raise TypeError(
            "members(state): the state is a single run's, not a population's (fnloop.population)."
        )
    return [member(state, i) for i in range(state.population.size)]
