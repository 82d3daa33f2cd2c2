"""Statistics inside the step: norms of the gradients, parameters and updates, and their ratio.

``train_step(..., stats=...)`` wraps the update stage: after the optimizer's
update it computes, in the same graph, for the whole model and (by choice)
per block or per parameter:

* ``grad_norm``: the L2 norm of the gradients the optimizer was given (under
  loss scaling, unscaled: the loss's own gradients);
* ``param_norm``: the L2 norm of the parameters the step started from;
* ``update_norm``: the L2 norm of what the step changed, new minus old;
* ``update_ratio``: ``update_norm / param_norm``.

A group's figure is named ``<figure>/<group>`` (``grad_norm/transformer.h.0``).
Frozen parameters take no part. Sums of squares are float32, one per group
and figure, stacked: a sharded step adds its ranks' in one all-reduce (a
world-size-invariant step's are each tensor's whole sum, from ``SquaresSum``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from fnloop._core.messages import got
from fnloop._core.metrics import STEP_STATISTICS as FIGURES
from fnloop._core.shards import Shards
from fnloop._step.kernel import Kernel, Updated, UpdateStage
from fnloop.optim._base import SquaresSum

__all__ = ["FIGURES", "STATS", "groups_of_parameters", "with_statistics"]

STATS = ("model", "blocks", "parameters")
"""What ``train_step(stats=...)`` takes: the whole model's figures, and each block's or parameter's."""


def checked(stats: object) -> str | None:
    """``stats`` as ``train_step`` takes it, or ``ValueError`` with the choices."""
    if stats is None or stats in STATS:
        return stats  # type: ignore[return-value]
    raise ValueError(
        f"train_step(stats=...) must be None, or one of {STATS}: the whole model's gradient, "
        "parameter and update norms and their ratio, and with 'blocks' or 'parameters' the same "
        f"per block or per parameter ({got(stats)})."
    )


def groups_of_parameters(kernel: Kernel, names: list[str], by: str) -> dict[str, list[str]]:
    """The groups of the trained parameters ``names`` for ``by``: none, each block (``kernel.units``), or each one.

    With ``"blocks"``, a parameter outside every block is grouped with its
    module's others (``transformer.wte``, ``lm_head``).
    """
    if by == "model":
        return {}
    if by == "parameters":
        return {name: [name] for name in names}
    block_of = {p: block for block, inside in kernel.units.blocks for p in inside}
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(block_of.get(name, name.rpartition(".")[0] or name), []).append(name)
    return groups


def with_statistics(update: UpdateStage, kernel: Kernel, by: str, shards: Shards | None) -> UpdateStage:
    """``update`` that also records the statistics ``by`` asks for (``"model"``, ``"blocks"``, ``"parameters"``).

    ``shards``: the state's layout; the update is then given this rank's
    chunks and ``total`` sums over the ranks (a whole tensor, the same on
    every rank, counts once).
    """

    def update_with_statistics(
        grads: dict,
        opt_state: Any,
        params: dict,
        iteration: torch.Tensor,
        total: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Updated:
        found = update(grads, opt_state, params, iteration, total)
        names = list(found.trained)
        scale = kernel.loss_scale(opt_state)
        every = float(shards.world) if shards is not None and total is not None else 1.0
        split = shards.names if shards is not None else frozenset()
        invariant = isinstance(total, SquaresSum)

        def squares(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if invariant:  # each tensor's whole sum, the same bits at any world size
                assert isinstance(total, SquaresSum)
                return dict(zip(names, total.squares({n: tensors[n] for n in names}, torch.float32).unbind()))
            out = {}
            for name in names:
                square = torch.linalg.vector_norm(tensors[name], dtype=torch.float32).square()
                out[name] = square if name in split or every == 1.0 else square / every
            return out

        grad = squares(grads)
        if scale is not None:  # the gradients of the scaled loss: unscaled, as the optimizer sees them
            grad = {k: v / scale.float().square() for k, v in grad.items()}
        param = squares(params)
        change = squares({k: found.trained[k] - params[k] for k in names})
        groups = {"": names, **groups_of_parameters(kernel, names, by)}
        sums = torch.stack(
            [
                torch.stack([torch.stack([s[n] for n in members]).sum() for members in groups.values()])
                for s in (grad, param, change)
            ]
        )
        if total is not None and not invariant:
            sums = total(sums)
        norms = sums.sqrt()
        ratio = norms[2] / norms[1]
        metrics = {}
        for g, group in enumerate(groups):
            suffix = f"/{group}" if group else ""
            for figure, value in zip(FIGURES, (norms[0, g], norms[1, g], norms[2, g], ratio[g])):
                metrics[figure + suffix] = value
        return found._replace(metrics={**found.metrics, **metrics})

    return update_with_statistics
