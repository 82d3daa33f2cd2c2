"""The kernel of every training step, in three stages: the loss, its gradients, the update.

::

    Kernel.loss(params, buffers, batch)                    -> (loss, metrics)
    value_and_grad(loss)(params, buffers, batch)           -> Grads(grads, buffers, loss, metrics)
    Kernel.update(grads, opt_state, params, iteration)     -> Updated(trained, opt_state, metrics)

All three are pure functions of plain dicts of tensors (``buffers`` aside: the
forward writes running statistics into the dict it is given, which the step
makes fresh). Every feature of the step is a transformation of one of these
stages, each in its own module, and this one knows none of them: the
placement (``placement.py``) chooses them for a call's layout and composes
them (``composed.py``); several steps per call are a loop over the whole
step (``compiler.py``).

Gradients come from ``torch.autograd.grad`` on leaf copies of the
parameters, eager and traced alike: the trace records the ops autograd runs,
so the graph holds the backward torch's own engine would run
(``convolution_backward``, autocast's casts, the saved-tensor machinery),
where ``torch.func.grad_and_value`` failed under bf16 autocast with dropout
and its transform layer cost a fifth of a small CNN's eager step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._step.errors import _NUMBER_METRIC, GraphBreakError, _number
from fnloop._step.guard import all_finite
from fnloop._step.holding import holding, holding_all
from fnloop._step.remat import gradients, reentrant_refused
from fnloop.optim import Optimizer, learning_rates
from fnloop.optim._fused import fused_update, fused_update_

__all__ = [
    "Grads",
    "Kernel",
    "LossFn",
    "Stepped",
    "UpdateStage",
    "Updated",
    "frozen",
    "value_and_grad",
]

LossFn = Callable[[Callable[..., Any], Any], Any]
"""``loss_fn(model, batch) -> loss`` or ``(loss, metrics)``; ``model`` runs the forward on the state."""

Loss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""The loss stage: ``(params, buffers, batch) -> (loss, metrics)``."""


class Grads(NamedTuple):
    """What the gradient stage computes: each trained parameter's gradient, and the forward's results."""

    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


Gradient = Callable[..., Grads]
"""The gradient stage: ``(params, buffers, batch, scale=None) -> Grads``.

``scale``: a 0-d tensor (one per member, for a population) the loss is
multiplied by before the backward (``dynamic_loss_scale``); the gradients
are then the scaled loss's, the loss and metrics as they were.
"""


class Updated(NamedTuple):
    """What the update stage computes: the trained parameters' new values, the optimizer's state, metrics.

    ``metrics``: the learning rates the update applied (those that are
    tensors), and what a transformation of the stage adds; recorded like the loss.
    """

    trained: dict[str, torch.Tensor]
    opt_state: Any
    metrics: dict[str, torch.Tensor]


UpdateStage = Callable[..., Updated]
"""The update stage: ``(grads, opt_state, params, iteration, total=None) -> Updated``."""


class Stepped(NamedTuple):
    """What one step computes: the new params, buffers and optimizer state, before the guard.

    ``finite`` (a 0-d bool) says whether the loss and every gradient were
    finite; ``keep``, whether the new state is kept: where the step is finite,
    and for a population, per member that trains (``members.py``). The
    callers keep the old state where it is false.
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    opt_state: Any
    loss: torch.Tensor
    finite: torch.Tensor
    metrics: dict[str, torch.Tensor]
    keep: torch.Tensor


Update = Callable[..., Stepped]
"""A whole step, ``(params, buffers, opt_state, iteration, batch, *given) -> Stepped``, pure.

``given``: the inputs its layout names (``Layout.given``), none for a single run.
"""


@attrs.frozen(eq=False)
class Kernel:
    """The stages of one model's step: the loss (``loss``), the update (``update``), the guard (``finite``).

    Parameters the model marks ``requires_grad=False`` (``fixed``) get no
    gradient (their backward is not computed) and go to the optimizer not at
    all: they leave the step as they came, and ``opt_state`` is that of the
    others.
    """

    model: torch.nn.Module
    loss_fn: LossFn
    optimizer: Optimizer
    accumulate: int = 1
    autocast: torch.dtype | None = None
    eager: bool = False
    """Run op by op: the finiteness check is the one that is fast so."""
    transforms: tuple[Callable[[UpdateStage], UpdateStage], ...] = ()
    """Transformations of the update stage beyond fnloop's own, applied in order before them
    (see ``docs/architecture.md#adding-a-transformation``)."""
    stats: str | None = None
    """The statistics the step records beside the loss (``statistics.py``): ``None``, ``"model"``,
    ``"blocks"`` or ``"parameters"``."""
    fixed: frozenset[str] = attrs.field()
    _checked: list[bool] = attrs.field(factory=list, alias="_checked", eq=False)
    """Whether a forward has run: the first checks the model's activation checkpointing, and that the
    state gives every tensor the model uses (``holding_all``)."""

    @fixed.default
    def _fixed(self) -> frozenset[str]:
        return frozen(self.model, "train_step")

    def forward(self, params: dict, buffers: dict, batch: Any) -> tuple[torch.Tensor, dict]:
        """The loss and metrics of ``batch``, with the model holding ``params`` and ``buffers`` already."""
        device = _device(params).type
        context = torch.autocast(device, dtype=self.autocast) if self.autocast else contextlib.nullcontext()
        # Once: catching a warning resets Python's record of warnings shown, so each step would
        # show a model's warnings again.
        refused = contextlib.nullcontext() if self._checked else reentrant_refused()
        with refused, context:
            loss, metrics = _split(self.loss_fn(self.model, batch))
        if not self._checked:
            self._checked.append(True)
        return loss.float(), metrics

    def loss(self, params: dict, buffers: dict, batch: Any) -> tuple[torch.Tensor, dict]:
        """The loss stage: the loss and metrics of ``batch`` for ``params`` and ``buffers``."""
        with self.holding({**params, **buffers}):
            return self.forward(params, buffers, batch)

    def holding(self, tensors: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager[None]:
        """The model with ``tensors`` in place of its parameters and buffers for the block."""
        if self._checked:
            return holding(self.model, tensors)
        return holding_all(self.model, tensors)  # the first forward: every tensor the model uses given

    def update(
        self,
        grads: dict,
        opt_state: Any,
        params: dict,
        iteration: torch.Tensor,
        total: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Updated:
        """The update stage: the trained parameters after the optimizer's step, pure.

        ``total``: how a value computed from the tensors given is added over
        the ranks that hold the rest of the model, for transformations that
        reduce over the whole model (a global norm; ``Optimizer.summing``).
        """
        optimizer = self.optimizer.summing(total)
        with _matching(self.fixed):
            trained, new_state = optimizer.update(grads, opt_state, self.trained(params), iteration)
        return self._updated(optimizer, opt_state, trained, new_state, iteration)

    def fused(
        self, grads: dict, opt_state: Any, params: dict, iteration: torch.Tensor, total: Any = None
    ) -> Updated:
        """``update`` run op by op on a whole model: ``adam`` and ``adamw`` with torch's fused kernel, as ``update_``.

        Only where every tensor is whole (``total`` is then nothing to add):
        the kernel's vectorized body and its scalar tail round differently, so
        tensors cut elsewhere would part the bits (``fnloop/optim/_fused.py``).
        """
        with _matching(self.fixed):
            trained = self.trained(params)
            fused = fused_update(self.optimizer, grads, opt_state, trained, iteration)
            trained, new_state = (
                self.optimizer.update(grads, opt_state, trained, iteration) if fused is None else fused
            )
        return self._updated(self.optimizer, opt_state, trained, new_state, iteration)

    def _updated(
        self, optimizer: Optimizer, before: Any, trained: dict, after: Any, iteration: torch.Tensor
    ) -> Updated:
        return Updated(trained, after, {**self.rates(iteration, before), **optimizer.metrics(before, after)})

    def update_(self, grads: dict, opt_state: Any, params: dict, iteration: torch.Tensor) -> dict:
        """The update stage in place: ``params`` and ``opt_state`` written, as ``torch.optim`` writes them.

        ``adam`` and ``adamw`` update with torch's fused kernel where they can
        (``fnloop/optim/_fused.py``): the numbers of ``torch.optim.AdamW(fused=True)``.

        Returns the learning rates, as ``rates`` gives them (and a loss scale's metrics).
        """
        before = self.optimizer.snapshot(opt_state)
        with _matching(self.fixed):
            trained = self.trained(params)
            if not fused_update_(self.optimizer, grads, opt_state, trained, iteration):
                self.optimizer.update_(grads, opt_state, trained, iteration)
        return {**self.rates(iteration, opt_state), **self.optimizer.metrics(before, opt_state)}

    @property
    def scales_loss(self) -> bool:
        """Whether the optimizer scales the loss (``dynamic_loss_scale``): the step then multiplies it by ``loss_scale``."""
        return self.optimizer.scales_loss

    def loss_scale(self, opt_state: Any) -> torch.Tensor | None:
        """What the loss is multiplied by before the backward (``dynamic_loss_scale``'s state), or ``None``."""
        return self.optimizer.loss_scale(opt_state)

    def transformed_update(self, update: UpdateStage) -> UpdateStage:
        """``update`` (``update``, or ``fused``) with ``transforms`` applied."""
        for transform in self.transforms:
            update = transform(update)
        return update

    def rates(self, iteration: torch.Tensor, opt_state: Any) -> dict[str, torch.Tensor]:
        """The learning rates the update applies that are tensors: a schedule's, or the state's (``inject``).

        Fixed learning rates are recorded as the numbers they are, outside the graph (``TrainStep.fixed``).
        """
        found = learning_rates(self.optimizer, iteration, opt_state)
        return {k: v for k, v in found.items() if isinstance(v, torch.Tensor)}

    def finite(self, loss: torch.Tensor, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """A 0-d bool: the loss and every gradient element are finite.

        Under loss scaling, the loss alone: the optimizer skips a step whose
        scaled gradients overflowed, and backs the scale off (the fold's guard
        would drop that backoff with the rest of the step).
        """
        return all_finite(loss, {} if self.scales_loss else grads, self.eager)

    def trained(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``params`` without the frozen ones: what the optimizer sees."""
        fixed = self.fixed
        return {k: v for k, v in params.items() if k not in fixed} if fixed else params

    def merged(
        self, params: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``params`` with the trained ones replaced by ``trained``'s, in ``params``'s order."""
        fixed = self.fixed
        return {k: v if k in fixed else trained[k] for k, v in params.items()}


def value_and_grad(
    loss: Loss,
    fixed: frozenset[str],
    *,
    hold: Callable[[dict[str, torch.Tensor]], contextlib.AbstractContextManager[None]] | None = None,
    backward: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
) -> Gradient:
    """The gradient stage of ``loss``: its value, and its gradient for each trained parameter.

    A ``loss`` of several values (a population's, one per member) is summed
    first. ``hold`` keeps the model holding the leaves for the forward and
    the backward both: activation checkpointing runs part of the forward again
    in the backward, and it must see these parameters, not the module's own.
    ``backward`` wraps the gradient's computation (to translate its errors).
    """

    def gradient(params: dict, buffers: dict, batch: Any, scale: torch.Tensor | None = None) -> Grads:
        leaves = {
            k: v.detach().requires_grad_(k not in fixed and (v.is_floating_point() or v.is_complex()))
            for k, v in params.items()
        }
        held = hold({**leaves, **buffers}) if hold is not None else contextlib.nullcontext()
        with torch.enable_grad(), held:
            value, metrics = loss(leaves, buffers, batch)
            wanted = [v for v in leaves.values() if v.requires_grad]
            scaled = value if scale is None else value * scale
            with backward():
                found = gradients(scaled if scaled.ndim == 0 else scaled.sum(), wanted) if wanted else ()
        detached = {k: v.detach() for k, v in metrics.items()}
        return Grads(_by_name(leaves, fixed, found), buffers, value.detach(), detached)

    return gradient


def _split(out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        loss, metrics = out
    else:
        loss, metrics = out, {}
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"loss_fn must return a scalar loss tensor or (loss, metrics), got {type(loss).__name__} "
            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; reduce the loss to one "
            "value (for example .mean())."
        )
    for name, value in metrics.items():
        what = _number(value)
        if what is not None:
            raise GraphBreakError(_NUMBER_METRIC.format(name=name, what=what))
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise TypeError(
                f"loss_fn returned the metric {name!r} as a tensor of shape {tuple(value.shape)}; a "
                "metric is one number per step: reduce it (for example .mean()) or leave it out."
            )
    return loss.reshape(()), dict(metrics)


def _by_name(leaves: dict[str, torch.Tensor], fixed: frozenset[str], found: Any) -> dict[str, torch.Tensor]:
    """Each trained parameter's gradient by name, from ``found`` (those of the leaves that require grad, in order).

    A parameter autograd found no gradient for (unused, or not floating) gets zeros; frozen ones none.
    """
    found = iter(found)
    grads = {}
    for k, v in leaves.items():
        if k in fixed:
            continue
        g = next(found) if v.requires_grad else None
        grads[k] = torch.zeros_like(v) if g is None else g
    return grads


def frozen(model: torch.nn.Module, where: str) -> frozenset[str]:
    """The names of the parameters ``model`` marks ``requires_grad=False``: kept in the state, never trained.

    Raises ``ValueError`` (from ``where``) when that is every parameter.
    """
    named = dict(model.named_parameters())
    names = frozenset(k for k, p in named.items() if not p.requires_grad)
    if named and len(names) == len(named):
        raise ValueError(
            f"{where}(): every parameter of the model has requires_grad=False, so there is nothing "
            "to train. fnloop trains the parameters with requires_grad=True and keeps the others "
            "as they are, as torch.optim does; unfreeze the ones to train (p.requires_grad_(True), "
            "or module.requires_grad_(True)) before fnloop.init and train_step."
        )
    return names


@contextlib.contextmanager
def _matching(fixed: frozenset[str]) -> Iterator[None]:
    """The optimizer's complaint that ``opt_state`` is for other parameters, with the likely cause."""
    try:
        yield
    except KeyError as exc:
        now = f"this step's model freezes {sorted(fixed)}" if fixed else "this step's model freezes none"
        raise KeyError(
            f"{exc.args[0]} The state's opt_state was built for other parameters than this step "
            f"trains ({now}): fnloop.init builds it for the parameters with requires_grad=True, so "
            "set the model's requires_grad flags before both fnloop.init and train_step, the same "
            "for both."
        ) from exc


def state_of(stepped: Stepped) -> list[torch.Tensor]:
    """The new state's tensors, in the order of the flat form: params, buffers, optimizer state."""
    return [*stepped.params.values(), *stepped.buffers.values(), *pytree.tree_leaves(stepped.opt_state)]


def _device(params: Mapping[str, torch.Tensor]) -> torch.device:
    for tensor in params.values():
        return tensor.device
    return torch.device("cpu")
