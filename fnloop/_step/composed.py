"""The whole step of a placement: its gradient, update and guard stages put together, and its eager twin.

``transformed(kernel, placement)`` is the pure step of one layout, compiled
or run op by op; ``in_place(kernel, plan, group)`` runs a single run's step
eagerly, writing into the state where the placement allows it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fnloop._step.kernel import Gradient, Grads, Kernel, Stepped, Update, UpdateStage, state_of
from fnloop._step.layout import Layout
from fnloop._step.members import only_training
from fnloop._step.placement import Placement, Plan

__all__ = ["in_place", "transformed"]


def transformed(kernel: Kernel, placement: Placement) -> Update:
    """The step of ``kernel`` placed by ``placement``: ``(params, buffers, opt_state, iteration, batch, *given) -> Stepped``, pure.

    ``given``: the inputs ``placement.layout.given`` names (a population's: which members train).
    """
    step = _composed(kernel, placement.gradient(kernel), placement.update(kernel), placement.finite(kernel))
    layout = placement.layout
    return step if layout.members is None else only_training(step, layout.stop)


def _composed(
    kernel: Kernel, gradient: Gradient, update: UpdateStage, finite: Callable[..., torch.Tensor]
) -> Update:
    """The whole step from its three stages: the gradient, the update, and the guard."""

    def step(params: dict, buffers: dict, opt_state: Any, iteration: torch.Tensor, batch: Any) -> Stepped:
        # The forward writes running statistics into the buffers it is given.
        scale = kernel.loss_scale(opt_state)
        found = gradient(params, {k: v.clone() for k, v in buffers.items()}, batch, scale)
        opt_state = kernel.optimizer.given_loss(opt_state, found.loss)  # for one that judges it
        trained, new_opt_state, metrics = update(found.grads, opt_state, params, iteration)
        ok = finite(found.loss, found.grads)
        return Stepped(
            kernel.merged(params, trained),
            found.buffers,
            new_opt_state,
            found.loss,
            ok,
            {**metrics, **found.metrics},
            ok,
        )

    return step


def in_place(
    kernel: Kernel, plan: Plan, group: Any, compiled: Callable[..., tuple[Grads, torch.Tensor]] | None = None
) -> Callable[..., Any]:
    """The step run eagerly on a single run's state it may write into: ``(..., batch, layout) -> (loss, finite, metrics)``.

    Whether the step is finite is read on the host (free on a CPU; one sync
    per step on a GPU), and a finite one updates params and optimizer state
    in place (the optimizer's ``update_``): no second copy of the state is
    made, as ``torch.optim`` makes none. Where the placement does not allow
    that (``Placement.writes_in_place``: a sharded state, a kernel with sums
    of its own over the model), the pure step runs, its results written
    into the state.

    ``compiled``: the gradient stage and the guard compiled
    (``gradients.CompiledGradient``, ``train_step(..., compile="model")``),
    run in place of the eager ones; a layout that cannot update in place is
    then refused, naming what to do instead.
    """
    # Per layout, built once: whether the step writes in place, and what it runs (the gradient
    # stage then, else the pure step).
    places: dict[Layout, tuple[bool, Callable[..., Any]]] = {}

    def placed(key: Layout) -> tuple[bool, Callable[..., Any]]:
        found = places.get(key)
        if found is None:
            placement = Placement.of(plan, key, group)
            writes = placement.writes_in_place(kernel)
            found = places[key] = (
                writes,
                placement.gradient(kernel) if writes else transformed(kernel, placement),
            )
        return found

    def step(
        params: dict,
        buffers: dict,
        opt_state: Any,
        iteration: torch.Tensor,
        batch: Any,
        layout: Layout,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        key = Layout(shards=layout.shards, tensor=layout.tensor)  # what the eager step depends on
        writes, run = placed(key)
        if not writes and compiled is not None:
            raise ValueError(_NOT_IN_PLACE)
        if not writes:  # the pure step, written into the state
            stepped = run(params, buffers, opt_state, iteration, batch)
            if stepped.finite:
                old = [*params.values(), *buffers.values(), *pytree.tree_leaves(opt_state)]
                for before, after in zip(old, state_of(stepped)):
                    if after is not before:
                        before.copy_(after)
            return stepped.loss, stepped.finite, stepped.metrics
        scale = kernel.loss_scale(opt_state)
        if compiled is not None:
            found, finite = compiled(params, buffers, batch, scale, key, iteration)
        else:
            found = run(params, {k: v.clone() for k, v in buffers.items()}, batch, scale)
            finite = kernel.finite(found.loss, found.grads)
        if not finite:
            return found.loss, finite, {**kernel.rates(iteration, opt_state), **found.metrics}
        slot = kernel.optimizer.loss_slot(opt_state)
        if slot is not None:
            slot.copy_(found.loss)
        rates = kernel.update_(found.grads, opt_state, params, iteration)
        if buffers:
            torch._foreach_copy_(list(buffers.values()), [found.buffers[k] for k in buffers])
        return found.loss, finite, {**rates, **found.metrics}

    return step


_NOT_IN_PLACE = (
    "train_step(..., compile='model') compiles the forward and backward and runs the update outside "
    "the graph, in place, which needs a state held whole or replicated on each rank and no "
    "transformation of the update summing over the model, where this state is held in parts across "
    "the ranks (init(..., shard=...) or init(..., tensor=...)). Build the step with compile=True: the "
    "whole step in one graph, which places every layout."
)
