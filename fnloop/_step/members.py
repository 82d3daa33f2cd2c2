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
from torch.utils import _pytree as pytree

from fnloop._step.kernel import (
    LossFn,
    Stepped,
    _all_finite,
    _by_name,
    _holding,
    _matching,
    _micro_batches,
    _split,
    _trained,
    frozen,
)
from fnloop._step.seeding import DrawOutsideMembers
from fnloop.optim import Optimizer, learning_rates

__all__ = ["PopulationUnbatchable", "PopulationUpdate", "population_kernel"]

PopulationUpdate = Callable[..., Stepped]
"""``update(params, buffers, opt_state, iteration, batch, shared) -> Stepped``, pure, on stacked members;
``shared`` (static): every member trains on ``batch``, else on its own row of it."""


def population_kernel(
    model: torch.nn.Module,
    loss_fn: LossFn,
    optimizer: Optimizer,
    accumulate: int,
    autocast: torch.dtype | None,
) -> PopulationUpdate:
    """The population's step as a pure function of stacked members (traced and compiled by the step).

    The loss, every metric, ``finite`` and the learning rates come out as 1-d
    tensors, one value per member.
    """
    from torch.func import vmap

    fixed = frozen(model, "train_step")

    def member_loss(params: dict, buffers: dict, batch: Any) -> tuple[torch.Tensor, dict]:
        device = next(iter(params.values())).device.type if params else "cpu"
        context = torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext()
        with _holding(model, {**params, **buffers}), context:
            loss, metrics = _split(loss_fn(model, batch))
        return loss.float(), metrics

    def gradients(leaves: dict, buffers: dict, batch: Any, shared: bool) -> tuple[dict, torch.Tensor, dict]:
        forward = vmap(member_loss, in_dims=(0, 0, None if shared else 0), randomness="different")
        wanted = [v for v in leaves.values() if v.requires_grad]
        with torch.enable_grad(), _batchable():
            losses, metrics = forward(leaves, buffers, batch)
            # Members share nothing: the gradient of the sum, for each member's tensors, is its own loss's.
            with _not_recomputed():
                found = torch.autograd.grad(losses.sum(), wanted, allow_unused=True) if wanted else ()
        return _by_name(leaves, fixed, found), losses.detach(), {k: v.detach() for k, v in metrics.items()}

    def member_update(grads: dict, opt_state: Any, params: dict, iteration: torch.Tensor) -> tuple:
        with _matching(fixed):
            trained, new_opt_state = optimizer.update(grads, opt_state, params, iteration)
        rates = learning_rates(optimizer, iteration, opt_state)
        return trained, new_opt_state, {k: v for k, v in rates.items() if isinstance(v, torch.Tensor)}

    def update(
        params: dict, buffers: dict, opt_state: Any, iteration: torch.Tensor, batch: Any, shared: bool
    ) -> Stepped:
        leaves = {
            k: v.detach().requires_grad_(k not in fixed and (v.is_floating_point() or v.is_complex()))
            for k, v in params.items()
        }
        new_buffers = {k: v.clone() for k, v in buffers.items()}  # the forward writes running statistics
        if accumulate == 1:
            grads, loss, metrics = gradients(leaves, new_buffers, batch, shared)
        else:
            grads, losses, parts = {}, [], []
            dim = 0 if shared else 1  # a member's rows are on the batch's second dimension
            for micro in _micro_split(batch, accumulate, dim):
                g, l_k, m_k = gradients(leaves, new_buffers, micro, shared)
                grads = {k: grads[k] + v for k, v in g.items()} if grads else g
                losses.append(l_k)
                parts.append(m_k)
            grads = {k: v / accumulate for k, v in grads.items()}
            loss = torch.stack(losses).mean(0)
            metrics = {k: torch.stack([m[k] for m in parts]).float().mean(0) for k in parts[0]}
        stepped = vmap(member_update, in_dims=(0, 0, 0, None), randomness="error")
        trained, new_opt_state, rates = stepped(grads, opt_state, _trained(params, fixed), iteration)
        new_params = {k: v if k in fixed else trained[k] for k, v in params.items()}
        finite = vmap(_all_finite)(loss, grads)
        return Stepped(new_params, new_buffers, new_opt_state, loss, finite, {**rates, **metrics})

    return update


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


def _micro_split(batch: Any, n: int, dim: int) -> list[Any]:
    if dim == 0:
        return _micro_batches(batch, n)
    flat, spec = pytree.tree_flatten(batch)
    moved = [leaf.transpose(0, 1) if isinstance(leaf, torch.Tensor) else leaf for leaf in flat]
    parts = _micro_batches(pytree.tree_unflatten(moved, spec), n)
    return [
        pytree.tree_map(lambda t: t.transpose(0, 1) if isinstance(t, torch.Tensor) else t, p) for p in parts
    ]


def kept_rows(keep: torch.Tensor, old: list[torch.Tensor], new: list[torch.Tensor]) -> list[torch.Tensor]:
    """``new`` for the members ``keep`` (a 1-d bool) marks, ``old`` for the others (row by row)."""
    out = []
    for o, n in zip(old, new):
        if n is o:
            out.append(o)
        else:
            out.append(torch.where(keep.reshape(-1, *([1] * (o.ndim - 1))), n, o))
    return out
