"""The layout of one call of the step, and the kernel transformed for it.

A ``Layout`` says what a call of the step is made of: a single run or a
population's stacked members, a whole state or this rank's shards, one step
or several. ``transformed(kernel, layout, group)`` is the step for it: the
kernel's stages (``kernel.py``), each wrapped by the transformations the
layout asks for, in one order::

    gradient = value_and_grad(loss)          members: the loss vmapped  (members.py)
             -> accumulated | sliced         accumulate > 1 | invariant (accumulate.py, invariant.py)
             -> replicated | sharded         data parallel | sharded    (replicas.py, sharding.py;
                                             sliced: its mean is over every rank's slices, and
                                             of a sharded state's gradients this rank's chunks,
                                             the parameters gathered whole before it)
                 | block by block            sharded, the model in blocks (blocks.py)
                                             (HSDP: within one copy, then across the copies;
                                             sliced: each slice added over the ranks by its
                                             gathers' backward, G a power of two)
    update   = kernel.update                 members: vmapped           (members.py)
             -> given RowSquares             invariant: sums over the model (invariant.py)
             -> sharded                      sharded                    (sharding.py)
    step     = gradient, update, guard       members: those training    (members.py)

A population runs in one process on its whole state, so the members'
stages meet no replicas or shards. Several steps per call are a loop over
this whole step (``compiler.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._core.shards import Shards
from fnloop._step.accumulate import accumulated
from fnloop._step.blocks import blockwise_gradient, blockwise_sliced
from fnloop._step.invariant import RowSquares, power_of_two, sliced
from fnloop._step.kernel import Gradient, Kernel, Stepped, Update, UpdateStage, state_of, value_and_grad
from fnloop._step.members import member_finite, member_gradient, member_update, only_training
from fnloop._step.replicas import replicated
from fnloop._step.sharding import all_ranks, groups_of, on_whole_params, sharded_gradient, sharded_update
from fnloop._step.statistics import with_statistics

__all__ = ["Layout", "check_invariant", "in_place", "transformed"]


_WHOLE_UNDER_INVARIANT = (
    "train_step(invariant={slices}) on a shard='full' state: with a number of slices that is not a "
    "power of two, the slices run on the whole parameters, gathered all at once, not block by block, "
    "so a rank's peak holds the whole model (and its slices' gradients until they are exchanged). "
    "Choose invariant=2**k (for 1, 2, 4, ... ranks) to gather block by block, or pass "
    "train_step(..., blocks=()) to say that gathering at once is meant."
)


@attrs.frozen
class Layout:
    """What one call of the step is made of; hashable, part of a compiled graph's key.

    Args:
        members: a population's size (its tensors stacked, members first), or ``None``.
        shared: every member trains on the batch (else member ``m`` on row ``m``).
        shards: the state's layout across ranks, or ``None`` (whole on every rank).
        steps: how many steps one call runs (stacked batches, one loop).
        stop: a non-finite step stops the run (else it is skipped and counted).
        given: what the step is given beside the state, the iteration, the
            seeds and the batch, one tensor each, named for a message (a
            population's: which members train).
    """

    members: int | None = None
    shared: bool = True
    shards: Shards | None = None
    steps: int = 1
    stop: bool = True
    given: tuple[str, ...] = ()


def transformed(kernel: Kernel, layout: Layout, group: Any) -> Update:
    """The step of ``kernel`` for ``layout``: ``(params, buffers, opt_state, iteration, batch, *given) -> Stepped``, pure.

    ``group``: the data-parallel ranks (``None`` in one process). ``given``:
    the inputs ``layout.given`` names (a population's: which members train).
    """
    check_invariant(kernel, layout)
    if layout.members is not None:  # one process, the whole state: inputs.py refuses shards and ranks
        gradient = member_gradient(kernel, layout.shared)
        update = member_update(_watched(kernel, kernel.transformed_update(), None))
        step = _composed(kernel, gradient, update, member_finite(kernel))
        return only_training(step, layout.stop)
    shards = layout.shards
    gradient = _gradient(kernel, group, shards)
    update, finite = _watched(kernel, kernel.transformed_update(), shards), kernel.finite
    if kernel.slices is not None:  # sums over the model in one order at any world size (invariant.py)
        update = _given_total(update, RowSquares(shards, None if shards is None else group))
    if shards is not None:
        groups = groups_of(shards, group)
        blockwise = shards.params and groups is not None and bool(kernel.units)
        if kernel.slices is not None and blockwise and in_blocks(kernel, shards):
            assert groups is not None
            gradient = blockwise_sliced(kernel, kernel.units, shards, groups)
        elif kernel.slices is not None:  # sliced: its gradients this rank's chunks already
            if blockwise:
                warnings.warn(_WHOLE_UNDER_INVARIANT.format(slices=kernel.slices), stacklevel=2)
            gradient = on_whole_params(gradient, shards, groups)
        elif shards.params and groups is not None and kernel.units:  # block by block (blocks.py)
            gradient = blockwise_gradient(kernel, kernel.units, shards, groups)
        else:
            gradient = sharded_gradient(gradient, shards, groups)
        update = sharded_update(update, shards, groups)
        if group is not None:  # each rank saw its own chunks of the gradients
            finite = _on_every_rank(finite, group)
    elif group is not None and kernel.slices is None:
        gradient = replicated(gradient, group)
    return _composed(kernel, gradient, update, finite)


def _gradient(kernel: Kernel, group: Any, shards: Shards | None = None) -> Gradient:
    """The gradient stage of a single run's whole parameters: accumulated over micro-batches, or over invariant slices.

    Data parallel averages the first over the ranks (``replicated``); the
    slices' mean is over every rank's slices already (``invariant.py``), and of
    a sharded state's parameters this rank's chunks.
    """
    gradient = value_and_grad(kernel.forward, kernel.fixed, hold=kernel.holding)
    if kernel.slices is not None:
        return sliced(gradient, kernel.slices, group, shards, low_bits=in_blocks(kernel, shards))
    return accumulated(gradient, kernel.accumulate)


def in_blocks(kernel: Kernel, shards: Shards | None) -> bool:
    """Whether a world-size-invariant step adds its slices block by block, in ``slice_tree``'s order.

    A ``"full"`` state of a model with blocks, ``G`` a power of two: at any
    world size, in one process too, so that its runs are one run.
    """
    assert kernel.slices is not None
    return shards is not None and shards.params and bool(kernel.units) and power_of_two(kernel.slices)


def _given_total(update: UpdateStage, total: RowSquares) -> UpdateStage:
    """``update`` summing over the model with ``total`` (a world-size-invariant step's), whatever it is given."""

    def update_with_total(
        grads: dict, opt_state: Any, params: dict, iteration: torch.Tensor, _: Any = None
    ) -> Any:
        return update(grads, opt_state, params, iteration, total)

    return update_with_total


def check_invariant(kernel: Kernel, layout: Layout) -> None:
    """A world-size-invariant step runs a single run's whole state; refuse the rest, with the way out."""
    if kernel.slices is None:
        return
    if layout.members is not None:
        raise ValueError(
            f"train_step(invariant={kernel.slices}) on a population: a population runs in one "
            "process, where the world size never changes. Leave invariant out for it."
        )
    if layout.shards is not None and layout.shards.replicas > 1:
        raise ValueError(
            f"train_step(invariant={kernel.slices}) on a state sharded with init(..., "
            f"replicate={layout.shards.replicas}): the invariant mode runs whole states and states "
            "sharded over every rank, not several copies of a sharded one. Leave replicate out of "
            "init (shard over every rank), or invariant out of train_step."
        )


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


def _watched(kernel: Kernel, update: UpdateStage, shards: Shards | None) -> UpdateStage:
    """``update`` recording the statistics ``kernel.stats`` asks for (``statistics.py``), or as it is."""
    return update if kernel.stats is None else with_statistics(update, kernel, kernel.stats, shards)


def _on_every_rank(finite: Callable[..., torch.Tensor], group: Any) -> Callable[..., torch.Tensor]:
    return lambda loss, grads: all_ranks(finite(loss, grads), group)


def in_place(kernel: Kernel, group: Any) -> Callable[..., Any]:
    """The step run eagerly on a single run's state it may write into: ``(..., batch, shards) -> (loss, finite, metrics)``.

    Whether the step is finite is read on the host (free on a CPU; one sync
    per step on a GPU), and a finite one updates params and optimizer state
    in place (the optimizer's ``update_``): no second copy of the state is
    made, as ``torch.optim`` makes none. A sharded state, or a kernel with
    transformations of its own, runs the pure step, its results written into the state.
    """
    gradient = _gradient(kernel, group)
    if group is not None and kernel.slices is None:
        gradient = replicated(gradient, group)
    whole_step = kernel.transforms or kernel.stats or kernel.slices  # sums of its own over the model

    pures: dict[Shards | None, Update] = {}  # the pure step per layout, built once

    def step(
        params: dict,
        buffers: dict,
        opt_state: Any,
        iteration: torch.Tensor,
        batch: Any,
        shards: Shards | None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        if shards is not None or whole_step:  # the pure step, written into the state
            pure = pures.get(shards)
            if pure is None:
                pure = pures[shards] = transformed(kernel, Layout(shards=shards), group)
            stepped = pure(params, buffers, opt_state, iteration, batch)
            if stepped.finite:
                old = [*params.values(), *buffers.values(), *pytree.tree_leaves(opt_state)]
                for before, after in zip(old, state_of(stepped)):
                    if after is not before:
                        before.copy_(after)
            return stepped.loss, stepped.finite, stepped.metrics
        scale = kernel.loss_scale(opt_state)
        found = gradient(params, {k: v.clone() for k, v in buffers.items()}, batch, scale)
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
