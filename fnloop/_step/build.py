"""``init`` and ``train_step``: a state and a step built from a model, a loss and an optimizer."""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from fnloop._compile import default_backend
from fnloop._core.config import plain
from fnloop._core.messages import got
from fnloop._core.shards import MODES, Shards
from fnloop._core.state import TrainState
from fnloop._core.steps import Applied, Step
from fnloop._step.blocks import Blocks, units_of
from fnloop._step.compiler import compile_step
from fnloop._step.errors import (
    CompileError,
    GraphBreakError,
    NonFiniteLoss,
    RecompileError,
)
from fnloop._step.eval import plain_module
from fnloop._step.invariant import divisors
from fnloop._step.kernel import Kernel, LossFn, frozen
from fnloop._step.layout import in_place
from fnloop._step.materialize import InitWeights, is_meta, materialized
from fnloop._step.sharding import chunk
from fnloop._step.statistics import checked
from fnloop._step.train import TrainStep
from fnloop.distributed import _group, broadcast_tensors, mesh_groups, rank, world_size
from fnloop.optim import Optimizer
from fnloop.optim._base import fixed_learning_rates

__all__ = [
    "CompileError",
    "GraphBreakError",
    "NonFiniteLoss",
    "RecompileError",
    "TrainStep",
    "init",
    "train_step",
]


def init(
    model: torch.nn.Module,
    optimizer: Optimizer,
    *,
    seed: int,
    max_iter: int,
    extra: Any = None,
    config: Any = None,
    shard: str | None = None,
    replicate: int = 1,
    init_weights: InitWeights | None = None,
) -> TrainState:
    """A state for training ``model`` with ``optimizer`` from iteration 0.

    ``params`` and ``buffers`` are detached copies keyed like
    ``model.named_parameters()`` and ``model.named_buffers()``; the model itself
    is never changed by fnloop. ``opt_state`` is the optimizer's for the
    parameters to train: those the model marks ``requires_grad=False`` are
    kept in ``params`` and never trained (see ``train_step``).

    Args:
        model: the module whose parameters and buffers are trained (one
            wrapped by ``torch.compile`` is unwrapped: the names stay plain).
        optimizer: a pure optimizer (``fnloop.optim``); its ``init`` builds ``opt_state``.
        seed: the run's seed (``state.rng``); the step's randomness is a function
            of ``(seed, iteration)``.
        max_iter: how many steps the run takes.
        extra: your own data, kept in ``state.extra``.
        config: the run's configuration (an attrs record such as
            ``fnloop.config.parse`` gives, a dataclass or a mapping), kept in
            ``state.config`` as plain data: saved in every checkpoint, shown by
            ``fnloop inspect``, and compared by ``resume`` (see ``docs/config.md``).
        shard: split the state across the data-parallel ranks (``torchrun``):
            ``"full"`` shards parameters, gradients and optimizer state (as
            FSDP2's ``fully_shard``); ``"optimizer"`` shards gradients and
            optimizer state and keeps the parameters whole on every rank (ZeRO-2).
            Each parameter of at least one dimension is split on its first
            one; ``state.shards`` records how, and ``train_step`` reads it. See
            ``docs/distributed.md#sharded-training``. ``None``: every rank holds
            the whole state.
        replicate: with ``shard``, keep this many copies of the sharded state
            (HSDP, FSDP2's 2-D mesh; torchtitan's replicate degree): each
            block of ``world / replicate`` consecutive ranks (a machine's
            processes, say) shards one copy, and the copies are replicas of one
            another. Gradients are reduce-scattered within a block and
            all-reduced across blocks. See ``docs/distributed.md#a-2-d-mesh``.
        init_weights: for a model built on the meta device (its tensors have
            no memory yet), ``init_weights(module)`` fills a module's own
            tensors in place; without it, each module's ``reset_parameters()``.
            The tensors are made one module at a time, each kept only as the
            state needs it (this rank's rows, when sharded), from a seed of
            ``seed`` and the module's name. See
            ``docs/distributed.md#a-model-larger-than-one-process``.

    Examples:
        >>> import fnloop as fl
        >>> s = fl.init(torch.nn.Linear(3, 2), fl.optim.sgd(0.1), seed=0, max_iter=10)
        >>> sorted(s.params), s.params["weight"].requires_grad
        (['bias', 'weight'], False)
    """
    model = plain_module(model, "init")
    _refuse_fsdp(model)
    if not isinstance(optimizer, Optimizer):
        kind = type(optimizer)
        where = "torch.optim" if isinstance(optimizer, torch.optim.Optimizer) else kind.__module__
        raise TypeError(
            f"init() expected a fnloop.optim.Optimizer, got a {where}.{kind.__qualname__}; "
            "fnloop's optimizers are pure functions of the state: build one with "
            "fnloop.optim.sgd/adam/adamw (the same numbers as torch.optim's)."
        )
    if type(seed) is not int or seed < 0:
        raise ValueError(f"'seed' must be a non-negative int ({got(seed)}).")
    config = plain(config, "init(config=...)")  # refused before any tensor is made
    fixed = frozen(model, "init")
    if init_weights is not None and not callable(init_weights):
        raise TypeError(f"init(init_weights=...) must be a function of a module ({got(init_weights)}).")
    shards = _shards(shard, replicate, dict(model.named_parameters()))
    if is_meta(model):  # made here, module by module, each rank's part kept
        params, buffers, trained = _materialized(model, seed, init_weights, shards)
    else:
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        # Data parallel: every rank starts from rank 0's initialization, as DistributedDataParallel does.
        broadcast_tensors([*params.values(), *buffers.values()])
        trained = params
        if shards is not None:  # this rank's chunks: of the parameters, and of what the optimizer keeps
            split = shards.names
            trained = {k: chunk(v, shards, k) if k in split else v for k, v in params.items()}
            if shards.params:
                params = trained
    return TrainState(
        max_iter=max_iter,
        params=params,
        buffers=buffers,
        opt_state=optimizer.init({k: v for k, v in trained.items() if k not in fixed}),
        rng=seed,
        extra=extra,
        config=config,
        shards=shards,
    )


def _materialized(
    model: torch.nn.Module, seed: int, init_weights: InitWeights | None, shards: Shards | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The params, buffers and trained tensors of a model on the meta device, made module by module.

    Only with ``shard="full"`` is a parameter kept as this rank's chunk alone.
    """
    split = shards.names if shards is not None and shards.params else frozenset()

    def kept(name: str, whole: torch.Tensor) -> torch.Tensor:
        return chunk(whole, shards, name) if name in split else whole.clone()  # type: ignore[arg-type]

    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    for name, tensor, parameter in materialized(model, seed, init_weights, kept):
        (params if parameter else buffers)[name] = tensor
    params = {name: params[name] for name, _ in model.named_parameters()}
    trained = params
    if shards is not None and not shards.params:  # "optimizer": what the optimizer keeps is chunks
        trained = {k: chunk(v, shards, k) if k in shards.names else v for k, v in params.items()}
    return params, buffers, trained


def _refuse_fsdp(model: torch.nn.Module) -> None:
    """Refuse a module FSDP2's ``fully_shard`` wrapped (DTensor parameters), with the fix."""
    if "torch.distributed.tensor" not in sys.modules:  # nothing can be a DTensor yet
        return
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise TypeError(
                f"init(): the model's parameter {name!r} is a DTensor (the module was wrapped by "
                "fully_shard, or parallelized); fnloop shards the state itself, keeping the module "
                "plain. Build the model without fully_shard and pass "
                "fnloop.init(..., shard='full') (or 'optimizer'): see docs/distributed.md#sharded-training."
            )


def _shards(mode: str | None, replicate: int, params: dict[str, torch.Tensor]) -> Shards | None:
    """The layout ``init(..., shard=mode, replicate=replicate)`` gives ``params`` on this process's rank."""
    if type(replicate) is not int or replicate < 1:
        raise ValueError(
            f"init(replicate=...) must be a positive int: the copies of a sharded state ({got(replicate)})."
        )
    if mode is None:
        if replicate != 1:
            raise ValueError(
                f"init(replicate={replicate}) keeps copies of a sharded state, but shard is None: "
                "pass shard='full' (or 'optimizer') with it, or leave replicate out (data parallel "
                "replicates the whole state on every rank already)."
            )
        return None
    if mode not in MODES:
        raise ValueError(
            f"init(shard=...) must be None, or one of {MODES}: 'full' shards parameters, gradients "
            f"and optimizer state, 'optimizer' gradients and optimizer state ({got(mode)})."
        )
    rows = {k: v.shape[0] for k, v in params.items() if v.ndim and v.is_floating_point()}
    world, at = world_size(), rank()
    if world % replicate:
        raise ValueError(
            f"init(replicate={replicate}): the {world} rank(s) of this run do not split into "
            f"{replicate} equal blocks. Pass a replicate that divides the world size (the number "
            "of machines, say, with every machine's processes sharding one copy)."
        )
    if replicate == 1:
        return Shards(mode, world, at, rows)
    mesh_groups(replicate)  # made now, by every rank together (new_group is a collective)
    per = world // replicate
    return Shards(mode, per, at % per, rows, replicas=replicate, replica=at // per)


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


def _check_invariant(slices: object, accumulate: int) -> int:
    slices = _check_positive("invariant", slices)
    if accumulate != 1:
        raise ValueError(
            f"train_step(invariant={slices}, accumulate={accumulate}): under invariant, a rank runs its "
            "slices of the batch one after the other already, as micro-batches. Leave accumulate out, "
            "and raise invariant for smaller slices."
        )
    world = world_size()
    if slices % world:
        fit = divisors(slices)
        raise ValueError(
            f"train_step(invariant={slices}) at {world} ranks: the {slices} slices of a batch cannot be "
            f"shared out equally, so this run runs at world sizes {fit} only. Run at one of those, or "
            f"choose an invariant that every world size the run will meet divides (here "
            f"{math.lcm(slices, world)}, the same in every launch)."
        )
    return slices


def train_step(
    model: torch.nn.Module,
    loss_fn: LossFn,
    optimizer: Optimizer,
    *,
    compile: bool = True,
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
            must be divisible by ``G``, and the world size must divide it;
            batches from ``fnloop.data.batches``. ``None`` (the default): each
            rank's batch at once, averaged by an all-reduce. See
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
    accumulate = _check_positive("accumulate", accumulate)
    if type(recompiles) is not int or recompiles < 0:
        raise ValueError(f"'recompiles' must be an int >= 0 ({got(recompiles)}).")
    if type(skip_nonfinite) is not bool:
        raise TypeError(f"'skip_nonfinite' must be a bool ({got(skip_nonfinite)}).")
    steps_per_call = _check_positive("steps_per_call", steps_per_call)
    if type(deterministic) is not bool:
        raise TypeError(f"'deterministic' must be a bool ({got(deterministic)}).")
    if invariant is not None:
        invariant = _check_invariant(invariant, accumulate)
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
        slices=invariant,
        units=units_of(model, blocks),
    )
    return step_of(
        kernel,
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
    compile: bool,
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
    jit = multi = members = None
    if compile:  # one step per call, several, and a population's (traced when such a state first comes)
        jit, members = (compile_step(kernel, group, 1 + recompiles, options, 1, backend) for _ in range(2))
        if steps_per_call > 1:
            multi = compile_step(kernel, group, 1 + recompiles, options, steps_per_call, backend)
    step = TrainStep(
        kernel.model,
        kernel.loss_fn,
        kernel.optimizer,
        recompiles,
        kernel,
        in_place(kernel, group),
        jit,
        multi,
        members,
        skip_nonfinite,
        fixed_learning_rates(kernel.optimizer),
        rank(),
        world_size(),
        steps_per_call,
        deterministic,
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
