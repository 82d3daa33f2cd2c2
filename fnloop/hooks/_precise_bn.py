"""Precise BatchNorm statistics: recomputed over many batches with the current parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import attrs
import torch
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm

from fnloop._core.combinators import Hook
from fnloop._core.messages import got
from fnloop._core.phase import Phase
from fnloop._core.state import TrainState
from fnloop._core.stateful import stateful
from fnloop._export import whole_params
from fnloop._step.seeds import seeded
from fnloop.data import one_pass
from fnloop.hooks._evaluate import due

__all__ = ["PreciseBNState", "precise_bn"]

_SALT = 0xB4_7C_4E_0B
"""Mixed into the run's seed, so dropout here draws other numbers than the step's."""


def first_input(model: Callable[..., Any], batch: Any) -> Any:
    """Run ``model`` on the batch's input: ``batch[0]`` of a tuple or list, else the whole batch."""
    return model(batch[0] if isinstance(batch, (tuple, list)) else batch)


@attrs.frozen
class PreciseBNState:
    """How many completed steps the last recomputation saw (-1: none yet)."""

    steps: int = -1


def _norms(model: torch.nn.Module) -> list[tuple[str, _BatchNorm]]:
    return [
        (f"{prefix}." if prefix else "", m)
        for prefix, m in model.named_modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats
    ]


@attrs.frozen(eq=False, repr=False)
class _PreciseBN:
    acts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.AFTER_STEP, Phase.AFTER_TRAIN})
    """The phases the update changes anything in: the hook is not called in the others."""

    model: torch.nn.Module
    batches: Iterable[Any]
    num_iter: int | None
    forward: Callable[[Callable[..., Any], Any], Any]

    def __call__(
        self, state: TrainState, phase: Phase, memory: PreciseBNState
    ) -> tuple[TrainState, PreciseBNState]:
        steps = due(state, phase, memory.steps)
        if steps is None:
            return state, memory
        return attrs.evolve(state, buffers=self.recompute(state)), PreciseBNState(steps)

    def recompute(self, state: TrainState) -> dict[str, torch.Tensor]:
        """New buffers: BatchNorm statistics averaged over the batches, the others as they are."""
        # Fresh tensors throughout: the forward writes the statistics in place.
        buffers = {k: v.clone() for k, v in state.buffers.items()}
        norms = _norms(self.model)
        for prefix, _ in norms:
            for key, fresh in (
                ("running_mean", torch.zeros_like),
                ("running_var", torch.ones_like),
                ("num_batches_tracked", torch.zeros_like),
            ):
                if prefix + key not in buffers:
                    raise ValueError(
                        f"precise_bn: state.buffers has no {prefix + key!r} (buffers: {sorted(buffers)[:8]}). "
                        "Give precise_bn the model the state was built from (fnloop.init(model, ...))."
                    )
                buffers[prefix + key] = fresh(buffers[prefix + key])
        params = whole_params(state)  # a sharded state's, gathered: the model runs on all of them

        def model(*args: Any, **kwargs: Any) -> Any:
            return functional_call(self.model, (params, buffers), args, kwargs)

        tensors = [*state.params.values(), *state.buffers.values()]
        device = tensors[0].device if tensors else torch.device("cpu")
        momenta = [(m, m.momentum) for _, m in norms]
        was_training = self.model.training
        try:
            # momentum=None: BatchNorm keeps the plain average over the batches it sees.
            self.model.train()
            for m, _ in momenta:
                m.momentum = None
            with torch.no_grad(), seeded(device, state.rng ^ _SALT, state.iteration):
                done = 0
                for batch in one_pass(self.batches, self.num_iter):
                    self.forward(model, batch)
                    done += 1
        finally:
            for m, momentum in momenta:
                m.momentum = momentum
            self.model.train(was_training)
        if not done or (self.num_iter is not None and done < self.num_iter):
            raise ValueError(
                f"precise_bn: the batches ran out after {done} of num_iter={self.num_iter}. Pass "
                f"num_iter={done or 'None'} (None: one pass), or an endless fnloop.data.batches stream."
                if done
                else "precise_bn: the batches are empty; pass the training batches (or a part of them)."
            )
        return buffers

    def __repr__(self) -> str:
        return f"precise_bn({type(self.model).__name__}, num_iter={self.num_iter})"


def precise_bn(
    model: torch.nn.Module,
    batches: Iterable[Any],
    *,
    num_iter: int | None = 200,
    forward: Callable[[Callable[..., Any], Any], Any] = first_input,
    name: str = "precise_bn",
) -> Hook:
    """A hook recomputing the BatchNorm statistics over ``num_iter`` batches with the current parameters.

    detectron2's ``PreciseBN``: the running statistics a model keeps during
    training mix many old parameter values; before an evaluation, this
    replaces them with the plain average over ``num_iter`` batches of the
    statistics of the current parameters, as ``torch.optim.swa_utils.update_bn``
    and ``fvcore.nn.update_bn_stats`` do. It is a pure function of the state:
    it returns the state with new buffer tensors, reading ``batches`` from
    the start each time, and draws any randomness (dropout) from a generator
    seeded by the run's seed and iteration. Use it like ``evaluate``, placed
    before it: ``every(n, precise_bn(...))``; it runs at ``AFTER_STEP``, and
    at ``AFTER_TRAIN`` after a successful run whose last step it has not seen.

    The state holds no model, so ``precise_bn`` takes the module for its
    structure only (its own tensors are never read or written; during the
    pass it is put in training mode and its BatchNorm layers get
    ``momentum=None``, both restored after).

    Args:
        model: the module the state was built from (``fnloop.init(model, ...)``).
        batches: training batches: a ``fnloop.data.batches`` stream (read from
            cursor 0) or any iterable that can be iterated again.
        num_iter: how many batches to average over; ``None``: one pass (one epoch of a stream).
        forward: ``forward(model, batch)`` runs the model on a batch, where
            ``model(...)`` runs the module on the state's tensors; by default
            ``model(batch[0])`` for ``(inputs, targets)`` batches.
        name: where the hook keeps its state; unique among the run's hooks.

    Raises:
        TypeError: ``model`` is not a module, or ``forward`` not callable.
        ValueError: the model has no BatchNorm layer that tracks statistics, or a bad ``num_iter``;
            when it runs, the batches ran out before ``num_iter``.

    Examples:
        >>> import fnloop as fl
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        >>> x = torch.arange(8.0).reshape(4, 2)
        >>> state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
        >>> state = precise_bn(model, [(x, None)], num_iter=1)(state, fl.Phase.AFTER_STEP)
        >>> torch.allclose(state.buffers["1.running_mean"], model[0](x).mean(0).detach())
        True
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"precise_bn() expected the model, a torch.nn.Module ({got(model)}).")
    if not _norms(model):
        raise ValueError(
            f"precise_bn(): {type(model).__name__} has no BatchNorm layer that tracks running statistics, "
            "so there is nothing to recompute. Drop the hook for this model."
        )
    if num_iter is not None and (type(num_iter) is not int or num_iter < 1):
        raise ValueError(f"precise_bn() 'num_iter' must be a positive int or None ({got(num_iter)}).")
    if isinstance(batches, Iterator) or not isinstance(batches, Iterable):
        raise TypeError(
            f"precise_bn() needs batches it can read again each time, such as a list, a DataLoader or "
            f"fnloop.data.batches(...) ({got(batches)}); an iterator is used up after one pass."
        )
    if not callable(forward):
        raise TypeError(f"precise_bn() 'forward' must be callable (model, batch) -> output ({got(forward)}).")
    return stateful(name, PreciseBNState(), _PreciseBN(model, batches, num_iter, forward))
