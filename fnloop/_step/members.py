"""The step of a population: every member's forward, backward and update in one function, vmapped.

A population's state holds each member's tensors stacked on a new first
dimension (``fnloop.population``). The step runs the model once over all of
them with ``torch.func.vmap``: one trace, one graph whatever the number of
members, its matrix products batched. ``vmap`` cannot take gradients itself
(``torch.autograd.grad`` inside it is refused), so the forward is vmapped, the
gradient of the sum of the members' losses is taken outside (the members
share no tensor, so each one's gradient is that of its own loss), and the
update is vmapped again: each member's optimizer sees its own state, its
injected hyperparameters (``fnloop.optim.inject``) among them.

Each member draws its random numbers from its own seed: the traced step's
random ops are drawn row by row from the members' seeds (``fnloop::drawn``
with a 1-d seed), so a member's dropout masks are those of its solo run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fnloop._compile import DrawOutsideMembers
from fnloop._step.kernel import (
    Gradient,
    Kernel,
    Stepped,
    Update,
    Updated,
    UpdateStage,
    all_finite,
    value_and_grad,
)

__all__ = [
    "PopulationUnbatchable",
    "each_member",
    "member_finite",
    "member_gradient",
    "member_rows",
    "member_update",
    "only_training",
]


def member_gradient(kernel: Kernel, shared: bool) -> Gradient:
    """The gradient stage of stacked members: the loss stage vmapped, the gradient of their sum outside.

    ``shared``: every member trains on the batch; else member ``m`` on row
    ``m`` of each of its tensors (and micro-batches split the second
    dimension). The loss and every metric come out as 1-d tensors, one value
    per member. Accumulated, micro-batches cut the members' rows
    (``member_rows``).
    """
    from torch.func import vmap

    forward = vmap(kernel.loss, in_dims=(0, 0, None if shared else 0), randomness="different")

    def loss(params: dict, buffers: dict, batch: Any) -> tuple[torch.Tensor, dict]:
        with _batchable():
            return forward(params, buffers, batch)

    # Members share nothing: the gradient of the sum, for each member's tensors, is its own loss's.
    return value_and_grad(loss, kernel.fixed, backward=_not_recomputed)


def member_rows(shared: bool) -> int:
    """The dimension of a population's batch that holds its rows: the first when shared, else the second."""
    return 0 if shared else 1


def member_update(update: UpdateStage) -> UpdateStage:
    """The update stage vmapped over the members: each one's optimizer sees its own state and rates."""
    from torch.func import vmap

    def one(grads: dict, opt_state: Any, params: dict, iteration: torch.Tensor) -> tuple:
        return tuple(update(grads, opt_state, params, iteration))

    stepped = vmap(one, in_dims=(0, 0, 0, None), randomness="error")

    def every_member(
        grads: dict, opt_state: Any, params: dict, iteration: torch.Tensor, total: Any = None
    ) -> Updated:
        return Updated(*stepped(grads, opt_state, params, iteration))

    return every_member


def member_finite(kernel: Kernel) -> Any:
    """The guard vmapped: one 0-d bool per member (under loss scaling, of the loss alone: ``Kernel.finite``)."""
    from torch.func import vmap

    if kernel.scales_loss:
        return vmap(lambda loss, grads: all_finite(loss, {}))
    return vmap(all_finite)


def only_training(step: Update, stop: bool) -> Update:
    """A population's ``step``, given which members train (a 1-d bool): the others keep their state.

    ``stop``: a non-finite member stops the run, so the step then leaves
    every member as it was (else that member's step is skipped alone).
    """

    def step_of_those_training(
        params: dict,
        buffers: dict,
        opt_state: Any,
        iteration: torch.Tensor,
        batch: Any,
        training: torch.Tensor,
    ) -> Stepped:
        new = step(params, buffers, opt_state, iteration, batch)
        keep = new.finite & training
        if stop:
            keep = keep & (new.finite | ~training).all()
        return new._replace(keep=keep)

    return step_of_those_training


def each_member(evaluation: Callable[..., dict[str, torch.Tensor]]) -> Callable[..., dict[str, torch.Tensor]]:
    """An evaluation ``(params, buffers, batch) -> metrics`` over stacked members, vmapped: one value per member."""
    from torch.func import vmap

    def each(params: dict, buffers: dict, batch: Any) -> dict[str, torch.Tensor]:
        out = vmap(lambda p, b: _tensors(evaluation(p, b, batch)), in_dims=(0, 0))(params, buffers)
        return dict(out)

    return each


def _tensors(out: dict[str, Any]) -> dict[str, torch.Tensor]:
    for name, value in out.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"eval_step on a population: the metric {name!r} is {type(value).__name__}, not a "
                "tensor; each member's metrics come out of one vmapped call, so return tensors "
                "(for example the loss itself, or torch.tensor(x))."
            )
    return out


class PopulationUnbatchable(TypeError):
    """The model runs an op ``torch.func.vmap`` has no batching rule for, so a population's graph cannot hold it."""


@contextlib.contextmanager
def _batchable() -> Iterator[None]:
    """The model's forward under ``vmap``; an op it cannot batch is refused with the fix."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc)
        if "Batching rule not implemented" not in text:
            raise
        op = text.split("for ")[1].split(".")[0:2] if "for " in text else ["an op"]
        raise PopulationUnbatchable(
            f"a population's compiled step runs the model once for every member, under "
            f"torch.func.vmap, and vmap cannot batch {'.'.join(op).strip()} (torch: {text.splitlines()[0]}). "
            "Train this population with train_step(..., compile=False): each member then steps in "
            "turn, with the numbers of its solo run; or replace the op with one vmap batches (for "
            "an LSTM, a loop over time of torch.nn.LSTMCell)."
        ) from None


@contextlib.contextmanager
def _not_recomputed() -> Iterator[None]:
    """The backward; activation checkpointing, which would run the forward again outside vmap, refused."""
    from torch.utils.checkpoint import CheckpointError

    try:
        yield
    except (CheckpointError, DrawOutsideMembers) as exc:
        raise PopulationUnbatchable(
            "a population's compiled step cannot checkpoint activations: torch.utils.checkpoint "
            "runs the checkpointed part of the forward again in the backward, outside the vmap "
            "over the members, where it sees one member's shapes. Train the population without "
            "activation checkpointing (its members are small models, or it would not fit), or with "
            f"train_step(..., compile=False), where each member steps in turn. (torch: {str(exc).splitlines()[0]})"
        ) from None
