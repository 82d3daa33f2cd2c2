"""``train_step``: a step built from a model, a loss and an optimizer (``init``, the state, is ``init.py``'s)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import torch

from fnloop._compile import default_backend
from fnloop._core.messages import got
from fnloop._core.state import TrainState
from fnloop._core.steps import Applied, Step
from fnloop._step.compiler import compile_step
from fnloop._step.composed import in_place
from fnloop._step.errors import (
    CompileError,
    GraphBreakError,
    NonFiniteLoss,
    RecompileError,
)
from fnloop._step.eval import plain_module
from fnloop._step.gradients import CompiledGradient
from fnloop._step.init import init
from fnloop._step.invariant import checked_slices
from fnloop._step.kernel import Kernel, LossFn
from fnloop._step.placement import Plan
from fnloop._step.statistics import checked
from fnloop._step.train import TrainStep
from fnloop._step.units import Blocks, units_of
from fnloop.distributed import _group, rank, world_size
from fnloop.optim import Optimizer
from fnloop.optim._base import fixed_learning_rates
from fnloop.optim._inject import refuse_tensor_settings

__all__ = [
    "CompileError",
    "GraphBreakError",
    "NonFiniteLoss",
    "RecompileError",
    "TrainStep",
    "init",
    "train_step",
]


def _check_positive(name: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"'{name}' must be a positive int ({got(value)}).")
    return value


AUTOCAST = (torch.bfloat16, torch.float16)
"""The dtypes ``train_step(autocast=...)`` takes: what ``torch.autocast`` runs matrix products in."""


def _check_autocast(autocast: object) -> torch.dtype | None:
    if autocast is not None and autocast not in AUTOCAST:
        raise TypeError(
            f"train_step(autocast=...) must be None, torch.bfloat16 or torch.float16 ({got(autocast)}); "
            "the parameters stay float32, the forward's matrix products run in that dtype."
        )
    return autocast  # type: ignore[return-value]


def train_step(
    model: torch.nn.Module,
    loss_fn: LossFn,
    optimizer: Optimizer,
    *,
    compile: bool | Literal["model"] = True,
    donate: bool = True,
    accumulate: int = 1,
    autocast: torch.dtype | None = None,
    recompiles: int = 0,
    options: Mapping[str, Any] | None = None,
    skip_nonfinite: bool = False,
    steps_per_call: int = 1,
    deterministic: bool = False,
    blocks: Blocks = None,
    stats: str | None = None,
    invariant: int | None = None,
    backend: str | None = None,
) -> Step:
    """The pure step ``(state, batch) -> state`` for ``model``, ``loss_fn`` and ``optimizer``.

    Forward, backward and the optimizer update run as one function on the
    state's tensors (swapped into the module, as ``torch.func.functional_call``
    does, for the forward and the backward both; ``torch.autograd.grad``),
    traced once, like ``jax.jit``, into one graph that inductor compiles; each
    call then checks only the inputs' structure, shapes, strides, dtypes and
    devices. Python in ``loss_fn`` runs once, at trace time. The iteration
    enters as a 0-d tensor, so schedules never recompile. The loss and the
    metrics ``loss_fn`` returns are recorded in ``state.metrics`` as tensors,
    at the step's index, and so is the learning rate the optimizer applied
    (``lr``, or ``lr/<group>`` for a ``partition``): a schedule's value as a
    tensor from the graph, a fixed learning rate as its float. Randomness
    (dropout) is seeded from ``(state.rng, iteration)`` for each step, so a
    step replays identically after a resume.

    Args:
        model: the module; only its structure, its forward and which parameters
            have ``requires_grad=False`` (frozen: no gradient, no update, as under
            torch.optim) are used, never its tensors. One wrapped by
            ``torch.compile`` is unwrapped: fnloop compiles the whole step itself.
        loss_fn: ``loss_fn(forward, batch)``, where ``forward(*args)`` runs the
            model on the state's params and buffers; returns a scalar loss, or
            ``(loss, metrics)`` with ``metrics`` a dict of scalar tensors.
        optimizer: a pure optimizer from ``fnloop.optim``.
        compile: trace the step once into one graph and compile it with
            inductor (see ``docs/step.md``); ``False`` runs it eagerly.
            ``"model"`` compiles the forward and the backward (and the check
            that the loss and gradients are finite) and runs the update
            outside the graph, in place, as ``torch.compile(model)`` with
            ``AdamW(fused=True)`` does: ``adam`` and ``adamw`` with torch's
            fused kernels. Its first compile is shorter (the update's
            element-wise ops are most of what inductor's scheduler works on,
            on a CPU); once compiled the two ran level on the benchmarks'
            models. A step reads whether it was finite on the host (on a GPU,
            a sync), where the whole step's graph decides inside.
            It needs a state held whole or replicated (no ``shard=`` or
            ``tensor=``, no ``invariant`` or ``stats``). See
            ``docs/step.md#compiling-the-model-alone``.
        donate: offer the fold an in-place variant for the states it owns
            (bit-identical results, no second copy of params and optimizer state).
        accumulate: split each batch into this many micro-batches and average
            their gradients (one optimizer update per batch).
        autocast: run the forward under ``torch.autocast`` with this dtype
            (for example ``torch.bfloat16``). For ``torch.float16``, wrap the
            optimizer in ``fnloop.optim.dynamic_loss_scale`` (as
            ``torch.amp.GradScaler``): the step then scales the loss by the
            scale its state holds (see ``docs/watching.md#float16``).
        recompiles: how many graphs beyond the first the step may compile before
            ``RecompileError`` (a signature seen before reuses its graph).
        options: inductor settings, as ``torch.compile(options=...)`` takes
            them, over fnloop's defaults (``fnloop._compile.default_options``:
            the C++ wrapper for a single step's graph, and on the CPU no
            layout optimization).
        skip_nonfinite: what to do after a step whose loss or any gradient is
            not finite. Either way that step leaves params, buffers and
            optimizer state unchanged (decided inside the graph). ``False``:
            raise ``NonFiniteLoss`` (reading one flag per step). ``True``: go on,
            counting such steps in the metric ``skipped`` (no host sync).
        steps_per_call: run this many iterations in one compiled call (Keras's
            ``steps_per_execution``): ``fnloop.run`` then calls hooks only at
            call boundaries, and checks before the run that every hook's
            iterations fall on them (``every(n, ...)`` with ``n`` a multiple of
            it). Each iteration's loss and metrics are still recorded, and the
            results are bit for bit those of single steps, dropout included
            (each step draws from its own seed inside the graph). See ``docs/step.md``.
        deterministic: compile and run the step under
            ``torch.use_deterministic_algorithms(True)``, so that it gives the
            same bits run after run at any thread count (on a GPU, also set
            ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` before the process starts).
            Without it, a compiled step whose graph adds into tensors at
            indices known only when it runs (an embedding's gradient) varies
            in the last bits on a CPU with several threads or on a GPU, and
            warns once when it is first compiled. See ``docs/replay.md``.
        blocks: for a state sharded with ``init(..., shard="full")``, the
            modules whose parameters are gathered only while they run, one
            block at a time (FSDP2's ``fully_shard`` per layer): module names
            or classes. ``None`` finds them (a ``transformers`` model's layers,
            else each child of an ``nn.ModuleList``); ``()`` gathers every
            parameter before the forward. See
            ``docs/distributed.md#block-by-block``.
        stats: record statistics of the step, computed in its graph:
            ``"model"``, the whole model's ``grad_norm``, ``param_norm``,
            ``update_norm`` and ``update_ratio`` (L2 norms of the gradients,
            the parameters the step started from, and what it changed, and
            the last two's ratio); ``"blocks"``, also each block's (as
            ``blocks`` finds them), named ``grad_norm/<block>`` and so on;
            ``"parameters"``, also each parameter's. ``None`` (the default)
            computes none. See ``docs/watching.md#statistics``.
        invariant: make the run the same bits at any world size that divides
            this number ``G``: each global batch is cut into ``G`` slices, each
            run alone at the same shape, its dropout drawn from the slice's
            seed, and the slices' gradients, losses, metrics and buffers are
            averaged in one fixed order across the ranks. The global batch size
            must be divisible by ``G``, and the world size (under tensor
            parallelism, the number of copies of the split model) must divide
            it, checked at the first step; batches from
            ``fnloop.data.batches``. ``None`` (the default): each rank's batch
            at once, averaged by an all-reduce. See
            ``docs/distributed.md#the-same-run-at-any-world-size``.
        backend: what runs the traced step: ``"inductor"`` compiles it (the
            default); ``"graph"`` runs the traced graph as it is, op by op,
            without inductor (as ``torch.compile(backend="aot_eager")``): built
            in seconds, slower to run. A result that differs between the two
            is the compiler's; one that differs from ``compile=False`` too is
            the trace's. ``None``: ``$FNLOOP_BACKEND`` if set, else
            ``"inductor"``. See ``docs/step.md#backends``.

    Returns:
        The step. With ``donate=False`` it has no ``donating`` variant.

    Examples:
        >>> import fnloop as fl
        >>> model = torch.nn.Linear(2, 1)
        >>> def loss_fn(forward, batch):
        ...     x, y = batch
        ...     return ((forward(x) - y) ** 2).mean()
        >>> step = fl.train_step(model, loss_fn, fl.optim.sgd(0.1), compile=False)
        >>> state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
        >>> new = step(state, (torch.ones(4, 2), torch.zeros(4, 1)))
        >>> new.metrics.names, torch.equal(state.params["weight"], model.weight.detach())
        (('loss', 'lr'), True)
    """
    model = plain_module(model, "train_step")
    if not isinstance(optimizer, Optimizer):
        kind = optimizer if isinstance(optimizer, type) else type(optimizer)
        where = "torch.optim" if issubclass(kind, torch.optim.Optimizer) else kind.__module__
        article = "the class" if kind is optimizer else "a"
        raise TypeError(
            f"train_step() expected a fnloop.optim.Optimizer, got {article} {where}.{kind.__qualname__}; "
            "build one with fnloop.optim.sgd/adam/adamw (the same numbers as torch.optim's)."
        )
    refuse_tensor_settings(optimizer, "train_step")
    accumulate = _check_positive("accumulate", accumulate)
    if type(recompiles) is not int or recompiles < 0:
        raise ValueError(f"'recompiles' must be an int >= 0 ({got(recompiles)}).")
    if type(skip_nonfinite) is not bool:
        raise TypeError(f"'skip_nonfinite' must be a bool ({got(skip_nonfinite)}).")
    steps_per_call = _check_positive("steps_per_call", steps_per_call)
    if type(deterministic) is not bool:
        raise TypeError(f"'deterministic' must be a bool ({got(deterministic)}).")
    if type(compile) is not bool and compile != "model":
        raise ValueError(
            f"'compile' must be True (the whole step in one graph), 'model' (the forward and backward "
            f"compiled, the update outside the graph) or False (eager) ({got(compile)})."
        )
    if compile == "model" and (stats is not None or invariant is not None):
        which = f"stats={stats!r}" if stats is not None else f"invariant={invariant!r}"
        raise ValueError(
            f"train_step(..., compile='model') runs the update outside the graph, in place, and cannot "
            f"take {which}, which the whole step's graph computes; use compile=True."
        )
    if invariant is not None:
        invariant = checked_slices(invariant, accumulate)
    backend = default_backend(backend)
    autocast = _check_autocast(autocast)
    if autocast is torch.float16 and not optimizer.scales_loss:
        warnings.warn(
            "train_step(autocast=torch.float16) without loss scaling: float16 gradients below "
            "about 6e-8 become zero. Wrap the optimizer, fnloop.optim.dynamic_loss_scale(opt) "
            "(torch.amp.GradScaler's rules), in both fnloop.init and train_step; or use "
            "autocast=torch.bfloat16 where the hardware has it.",
            stacklevel=2,
        )
    kernel = Kernel(
        model,
        loss_fn,
        optimizer,
        accumulate,
        autocast,
        eager=not compile,
        stats=checked(stats),
    )
    return step_of(
        kernel,
        plan=Plan(units_of(model, blocks), invariant),
        compile=compile,
        donate=donate,
        recompiles=recompiles,
        options=options,
        skip_nonfinite=skip_nonfinite,
        steps_per_call=steps_per_call,
        deterministic=deterministic,
        backend=backend,
    )


def step_of(
    kernel: Kernel,
    *,
    plan: Plan | None = None,
    compile: bool | Literal["model"],
    donate: bool = True,
    recompiles: int = 0,
    options: Mapping[str, Any] | None = None,
    skip_nonfinite: bool = False,
    steps_per_call: int = 1,
    deterministic: bool = False,
    backend: str = "inductor",
) -> Step:
    """The step of ``kernel``, on the terms of ``train_step`` (whose arguments are checked there).

    The process group the step averages over, this process's rank and the
    world size are read now, and fixed with the step.
    """
    group = _group()
    plan = Plan() if plan is None else plan
    jit = multi = members = gradient = None
    if compile == "model":  # the gradient stage alone compiled, the update in place after it
        gradient = CompiledGradient(kernel, plan, group, 1 + recompiles, options, backend)
    elif compile:  # one step per call, several, and a population's (traced when such a state first comes)
        jit, members = (
            compile_step(kernel, plan, group, 1 + recompiles, options, 1, backend) for _ in range(2)
        )
        if steps_per_call > 1:
            multi = compile_step(kernel, plan, group, 1 + recompiles, options, steps_per_call, backend)
    step = TrainStep(
        kernel.model,
        kernel.loss_fn,
        kernel.optimizer,
        recompiles,
        kernel,
        plan,
        in_place(kernel, plan, group, gradient),
        jit,
        multi,
        members,
        skip_nonfinite,
        fixed_learning_rates(kernel.optimizer),
        rank(),
        world_size(),
        steps_per_call,
        deterministic,
        gradient,
    )
    return step if donate else _Undonated(step)


@attrs.frozen(repr=False)
class _Undonated(Applied):
    """A ``TrainStep`` that never writes into the state it is given (``train_step(..., donate=False)``)."""

    step: TrainStep

    @property
    def per_call(self) -> int:  # type: ignore[override]
        return self.step.steps_per_call

    def apply(self, state: TrainState, batches: Sequence[Any], *, owned: bool) -> TrainState:
        return self.step.apply(state, batches, owned=False)

    def finish(self) -> None:
        self.step.finish()

    def __call__(self, state: TrainState, batch: Any, /) -> TrainState:
        return self.step(state, batch)

    def steps(self, state: TrainState, batches: Sequence[Any], /) -> TrainState:
        return self.step.steps(state, batches)

    @property
    def steps_per_call(self) -> int:
        return self.step.steps_per_call

    def __repr__(self) -> str:
        return f"{self.step!r} (no donation)"
