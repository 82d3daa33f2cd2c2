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
world-size-invariant step's are each tensor's whole sum, from ``RowSquares``);
the placement says which (``Squares``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from fnloop._core.messages import got
from fnloop._core.metrics import STEP_STATISTICS as FIGURES
from fnloop._step.kernel import Kernel, Updated, UpdateStage
from fnloop._step.units import Units

__all__ = ["FIGURES", "STATS", "Squares", "groups_of_parameters", "own_squares", "with_statistics"]

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


def own_squares(tensors: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """Each named tensor's sum of squares, float32, as it is here."""
    return {name: torch.linalg.vector_norm(tensors[name], dtype=torch.float32).square() for name in names}


def _as_it_is(sums: torch.Tensor) -> torch.Tensor:
    return sums


@attrs.frozen
class Squares:
    """How the statistics add squares over the whole model: each tensor's, then over the ranks.

    Args:
        each: ``(tensors, names) -> {name: 0-d float32}``: each named tensor's
            sum of squares as this rank counts it (a sharded step's whole
            tensors, the same on every rank, a world-size's share each).
        across: the stacked sums of every group added over the ranks
            (one all-reduce), or left as they are.

    The placement chooses them (``placement.py``): a whole state's, a
    sharded state's, a world-size-invariant step's (``RowSquares``).
    """

    each: Callable[[Mapping[str, torch.Tensor], list[str]], dict[str, torch.Tensor]] = own_squares
    across: Callable[[torch.Tensor], torch.Tensor] = _as_it_is


def groups_of_parameters(units: Units, names: list[str], by: str) -> dict[str, list[str]]:
    """The groups of the trained parameters ``names`` for ``by``: none, each block (``units``), or each one.

    With ``"blocks"``, a parameter outside every block is grouped with its
    module's others (``transformer.wte``, ``lm_head``).
    """
    if by == "model":
        return {}
    if by == "parameters":
        return {name: [name] for name in names}
    block_of = {p: block for block, inside in units.blocks for p in inside}
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(block_of.get(name, name.rpartition(".")[0] or name), []).append(name)
    return groups


def with_statistics(update: UpdateStage, kernel: Kernel, by: str, units: Units, sums: Squares) -> UpdateStage:
    """``update`` that also records the statistics ``by`` asks for (``"model"``, ``"blocks"``, ``"parameters"``).

    ``units``: the model's blocks (for ``"blocks"``); ``sums``: how squares
    are added over the model (``Squares``, chosen by the placement).
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
        grad = sums.each(grads, names)
        if scale is not None:  # the gradients of the scaled loss: unscaled, as the optimizer sees them
            grad = {k: v / scale.float().square() for k, v in grad.items()}
        param = sums.each(params, names)
        change = sums.each({k: found.trained[k] - params[k] for k in names}, names)
        groups = {"": names, **groups_of_parameters(units, names, by)}
        stacked = torch.stack(
            [
                torch.stack([torch.stack([s[n] for n in members]).sum() for members in groups.values()])
                for s in (grad, param, change)
            ]
        )
        norms = sums.across(stacked).sqrt()
        ratio = norms[2] / norms[1]
        metrics = {}
        for g, label in enumerate(groups):
            suffix = f"/{label}" if label else ""
            for figure, value in zip(FIGURES, (norms[0, g], norms[1, g], norms[2, g], ratio[g])):
                metrics[figure + suffix] = value
        return found._replace(metrics={**found.metrics, **metrics})

    return update_with_statistics
