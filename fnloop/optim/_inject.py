"""Hyperparameters held in the optimizer state, as tensors: ``inject`` (optax's ``inject_hyperparams``).

An optimizer's settings are Python numbers, so a compiled step holds them as
constants of its graph. ``inject(make, lr=1e-3)`` keeps them in the state
instead, as 0-d tensors the step reads: they can then differ between the
members of a population (``fnloop.population``), which one graph steps
together, and a hook can change them between steps.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import attrs
import torch

from fnloop._core.messages import got
from fnloop.optim._base import (
    GradientTransformation,
    Optimizer,
    OptState,
    Params,
    Sum,
    first_device,
    learning_rates,
    over_shards,
    update_in_place,
)

__all__ = ["InjectedState", "inject", "refuse_tensor_settings", "tensor_settings"]


class InjectedState(NamedTuple):
    """The state of an ``inject``ed optimizer: its hyperparameters and the optimizer's own state.

    Args:
        hyperparams: name -> 0-d float64 tensor, the value ``make`` is given.
        inner: the state of the optimizer ``make`` builds.
    """

    hyperparams: dict[str, torch.Tensor]
    inner: OptState


@attrs.frozen(repr=False)
class _Injected:
    make: Callable[..., Optimizer]
    defaults: tuple[tuple[str, float], ...]
    # A sharded step's sum over ranks (over_shards), passed on to what make builds.
    summed: Sum | None = attrs.field(default=None, eq=False)

    def built(self, hyperparams: Mapping[str, torch.Tensor]) -> GradientTransformation:
        built = self.make(**hyperparams).transform
        return built if self.summed is None else over_shards(built, self.summed)

    def over_shards(self, sum_: Sum, /) -> _Injected:
        return attrs.evolve(self, summed=sum_)

    def init(self, params: Params, /) -> InjectedState:
        device = first_device(params)
        hyper = {k: torch.tensor(v, dtype=torch.float64, device=device) for k, v in self.defaults}
        return InjectedState(hyper, self.built(hyper).init(params))

    def update(
        self, updates: Params, state: InjectedState, params: Params, iteration: torch.Tensor, /
    ) -> tuple[Params, InjectedState]:
        updates, inner = self.built(state.hyperparams).update(updates, state.inner, params, iteration)
        return updates, InjectedState(state.hyperparams, inner)

    def update_(
        self, updates: Params, state: InjectedState, params: Params, iteration: torch.Tensor, /
    ) -> Params:
        return update_in_place(self.built(state.hyperparams), updates, state.inner, params, iteration)

    def state_learning_rates(self, iteration: torch.Tensor, state: InjectedState, /) -> dict[str, Any]:
        # The rates are the state's (fnloop.optim._base.RatesInState): learning_rates asks with the state.
        return learning_rates(self.built(state.hyperparams), iteration)

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self.defaults)
        return f"inject({getattr(self.make, '__name__', self.make)!r}, {settings})"


def inject(make: Callable[..., Optimizer], **hyperparams: float) -> Optimizer:
    """The optimizer ``make(**hyperparams)``, with ``hyperparams`` kept in its state as 0-d tensors.

    ``make`` is called with the state's tensors in place of the numbers at
    every ``init`` and ``update``, so the values live in
    ``opt_state.hyperparams`` (an ``InjectedState``), not in the compiled
    graph: the members of a population (``fnloop.population``) each train with
    their own, in one graph, and a hook may set them between steps. The
    numbers are those of ``make(**hyperparams)``. Every fnloop optimizer,
    transformation and schedule takes an injected value where it takes a
    number; ``make`` may build any of them (``lambda lr: adamw(cosine(lr,
    1000))`` injects a cosine schedule's peak). A stage that a number of 0
    would leave out (``weight_decay=0``) is kept, since the value may change.

    Args:
        make: ``make(**hyperparams) -> Optimizer``, such as ``fnloop.optim.adamw``.
        **hyperparams: the keyword arguments of ``make`` to inject, as numbers.

    Raises:
        TypeError: ``make`` is not callable or does not build an ``Optimizer``,
            a value is not a number, or none is given.

    Examples:
        >>> import fnloop as fl
        >>> opt = fl.optim.inject(fl.optim.adamw, lr=1e-3, weight_decay=0.05)
        >>> state = opt.init({"w": torch.zeros(2)})
        >>> {k: float(v) for k, v in state.hyperparams.items()}
        {'lr': 0.001, 'weight_decay': 0.05}
    """
    if not callable(make):
        raise TypeError(f"inject(make, **hyperparams) expects make to be callable ({got(make)}).")
    if not hyperparams:
        raise TypeError(
            "inject(make) was given no hyperparameters to keep in the state; name them, "
            "for example inject(fnloop.optim.adamw, lr=1e-3)."
        )
    for name, value in hyperparams.items():
        if type(value) not in (int, float):
            raise TypeError(
                f"inject(..., {name}=...) expects a number, the starting value of the tensor the "
                f"state keeps ({got(value)}); a schedule goes inside make, with its settings injected."
            )
    built = make(**hyperparams)  # the settings checked as numbers, by the optimizer itself
    if not isinstance(built, Optimizer):
        raise TypeError(
            f"inject(make, ...): make(**hyperparams) must return a fnloop.optim.Optimizer ({got(built)})."
        )
    return Optimizer(_Injected(make, tuple((k, float(v)) for k, v in hyperparams.items())))


def tensor_settings(optimizer: Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """``(where, tensor)`` for each tensor that ``optimizer``'s own records hold as a setting.

    Walks the records, containers and functions of ``fnloop.optim`` that build
    ``optimizer`` (an ``adamw(lr=torch.tensor(1e-3))``'s ``lr``); an ``inject``
    and a transformation of your own are not walked: their tensors are the
    state's, or yours.
    """
    seen: set[int] = set()

    def walk(value: Any, where: str) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(value, torch.Tensor):
            yield where, value
            return
        if id(value) in seen or isinstance(value, _Injected):
            return
        seen.add(id(value))
        if type(value) in (tuple, list):
            for i, item in enumerate(value):
                yield from walk(item, f"{where}[{i}]")
        elif type(value) is dict:
            for key, item in value.items():
                yield from walk(item, f"{where}[{key!r}]")
        elif not _own(value):
            return
        elif attrs.has(type(value)):
            for field in attrs.fields(type(value)):
                yield from walk(getattr(value, field.name), f"{where}.{field.name}")
        elif isinstance(value, functools.partial):
            yield from walk((value.func, value.args, value.keywords), where)
        elif isinstance(value, types.FunctionType):
            for name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
                yield from walk(cell.cell_contents, f"{where}.<{name}>")
            yield from walk(value.__defaults__ or (), f"{where}.<defaults>")

    yield from walk(optimizer, "optimizer")


def _own(value: Any) -> bool:
    """Whether ``value`` (a record or a function) is one of ``fnloop.optim``'s."""
    function = isinstance(value, types.FunctionType)
    module = (value.__module__ if function else type(value).__module__) or ""
    return module.startswith("fnloop.optim")


def refuse_tensor_settings(optimizer: Optimizer, where: str) -> None:
    """Raise ``TypeError`` if ``optimizer`` holds a tensor as a setting, naming it and the fix."""
    for path, tensor in tensor_settings(optimizer):
        raise TypeError(
            f"{where}: the optimizer holds a tensor as a setting, at {path} ({got(tensor)}); a "
            "setting must be a float or a schedule, not a tensor. A tensor would be baked into the "
            "compiled graph and left out of checkpoints: give a float (lr=1e-3), a schedule "
            "(fnloop.optim.cosine(...)), or keep the value in the state with "
            "fnloop.optim.inject(make, lr=1e-3), which a hook may change."
        )
