"""A pure training step built from a model, a loss and an optimizer, compiled as one graph."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._core.failure import StepFailed, unwrapped
from fnloop._core.messages import got
from fnloop._core.metrics import Scalar
from fnloop._core.state import TrainState, unchecked
from fnloop._core.steps import Applied, Step
from fnloop._step.donation import Targets, opt_containers, shared
from fnloop._step.errors import (
    _GRAPH_BREAK,
    _RECOMPILED,
    CompileError,
    GraphBreakError,
    NonFiniteLoss,
    RecompileError,
    _compile_failed,
    _nonfinite_message,
)
from fnloop._step.eval import plain_module
from fnloop._step.jit import (
    CompileFailed,
    Entry,
    Jit,
    OverBudget,
    RandomInGraph,
    TraceError,
    flatten_batch,
)
from fnloop._step.kernel import (
    LossFn,
    _cloned,
    _device,
    _jit_kernel,
    _jit_steps,
    _kernel,
    _leaf_name,
    _trained,
    frozen,
)
from fnloop._step.pool import ScalarPool
from fnloop._step.seeding import _seeded, step_seed
from fnloop.distributed import broadcast_tensors, rank
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
    model: torch.nn.Module, optimizer: Optimizer, *, seed: int, max_iter: int, extra: Any = None
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

    Examples:
        >>> import fnloop as fl
        >>> s = fl.init(torch.nn.Linear(3, 2), fl.optim.sgd(0.1), seed=0, max_iter=10)
        >>> sorted(s.params), s.params["weight"].requires_grad
        (['bias', 'weight'], False)
    """
    model = plain_module(model, "init")
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
    fixed = frozen(model, "init")
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    # Data parallel: every rank starts from rank 0's initialization, as DistributedDataParallel does.
    broadcast_tensors([*params.values(), *buffers.values()])
    return TrainState(
        max_iter=max_iter,
        params=params,
        buffers=buffers,
        opt_state=optimizer.init(_trained(params, fixed)),
        rng=seed,
        extra=extra,
    )


@attrs.frozen(eq=False, repr=False)
class TrainStep(Applied):
    """The pure step ``(state, batch) -> state``; build it with ``train_step``.

    Calling it never touches the tensors of the state it is given. The fold
    passes it the states it owns with ``owned=True`` (``apply``): the same
    computation, in the same compiled graph, writing the results into the
    state's own storage, unless something else in that state holds one of
    those tensors (see ``fnloop/_step/donation.py``).
    """

    model: torch.nn.Module
    loss_fn: LossFn
    optimizer: Optimizer
    recompiles: int
    function: Callable[..., Any]
    """The kernel, ``(params, buffers, opt_state, iteration, batch) -> (loss, finite, metrics)``, run eagerly."""
    jit: Jit | None = None
    """The kernel traced and compiled, when ``compiled``."""
    skip_nonfinite: bool = False
    """Skip non-finite steps and count them (metric ``skipped``) instead of raising ``NonFiniteLoss``."""
    fixed: dict[str, float] = attrs.field(factory=dict)
    """The optimizer's fixed learning rates, recorded every step as numbers (no graph output)."""
    rank: int = 0
    """This process's rank under torch.distributed: dropout draws differ per rank."""
    steps_per_call: int = 1
    """How many iterations the fold runs in one call (``steps``), at call boundaries."""
    multi: Jit | None = None
    """The kernel run ``steps_per_call`` times in one compiled graph, when compiled and ``steps_per_call > 1``."""
    _counters: dict[torch.device, torch.Tensor] = attrs.field(factory=dict)
    _seeds: dict[torch.device, torch.Tensor] = attrs.field(factory=dict)
    _layout: list[Any] = attrs.field(factory=list)
    # The recorded loss and metrics live in long-lived homes: see fnloop/_step/pool.py.
    _pool: ScalarPool = attrs.field(factory=ScalarPool)

    donates = True

    @property
    def per_call(self) -> int:  # type: ignore[override]
        return self.steps_per_call

    def __call__(self, state: TrainState, batch: Any, /) -> TrainState:
        return unwrapped(self.apply, state, [batch], owned=False)

    def finish(self) -> None:
        """Drop the layout of the run's states kept between steps (see ``_targets``)."""
        self._layout.clear()

    def donating(self, state: TrainState, batch: Any, /) -> TrainState:
        """The step, reusing the storage of ``state``'s params, buffers and optimizer state.

        Only for a state nobody else can see. If something in the state itself
        still holds one of those tensors (a hook kept a parameter, a metric
        recorded one), or ``state.hooks``/``extra`` keeps one of their
        containers, the step copies instead, so what was kept never changes.
        Otherwise the returned state keeps the same containers.
        """
        return unwrapped(self.apply, state, [batch], owned=True)

    def steps(self, state: TrainState, batches: Sequence[Any], /) -> TrainState:
        """``len(batches)`` steps in one call, from ``state.iteration``; never touches ``state``'s tensors.

        The result is what as many single steps give, bit for bit, with each
        step's loss and metrics recorded at its own iteration; its
        ``iteration`` is the last step's index (the fold advances it).
        """
        return unwrapped(self._several, _copied(state), batches, mine=False)

    def donating_steps(self, state: TrainState, batches: Sequence[Any], /) -> TrainState:
        """``steps``, reusing the storage of ``state``'s tensors, on the terms of ``donating``."""
        return unwrapped(self.apply, state, batches, owned=True)

    def apply(self, state: TrainState, batches: Sequence[Any], *, owned: bool) -> TrainState:
        """One step, or several in one call, writing into ``state``'s tensors if ``owned`` and nothing shares them.

        Raises ``StepFailed`` (see ``fnloop._core.failure``): whether the
        state given was torn, and, inside a call of several steps, the state
        reached before the step that failed.
        """
        mine = False
        if owned:
            leaves, targets, ospec = self._targets(state)
            mine = not shared(state, targets)
        if not mine:
            state = _copied(state)
            leaves, ospec = pytree.tree_flatten(state.opt_state)
        if len(batches) == 1:
            return self._single(state, batches[0], leaves, ospec, mine)
        return self._several(state, batches, mine=mine)

    def _single(
        self, state: TrainState, batch: Any, leaves: list[torch.Tensor], ospec: pytree.TreeSpec, mine: bool
    ) -> TrainState:
        """One step writing into ``state``'s tensors (the caller's own when ``mine``, else copies)."""
        params, buffers, opt_state = state.params, state.buffers, state.opt_state
        if not self.model.training:
            self.model.train()
        i = state.iteration
        device = leaves[0].device if leaves else _device(params)
        iteration = self._iteration(device)
        iteration.fill_(i)
        donated = [*params.values(), *buffers.values(), *leaves]
        versions = [t._version for t in donated]
        jit = self.jit
        try:
            if jit is None:
                with _seeded(device, state.rng, i, self.rank):
                    loss, finite, metrics = self.function(params, buffers, opt_state, iteration, batch)
            else:
                tensors, batch_structure = flatten_batch(batch)
                structure = (tuple(params), tuple(buffers), ospec, batch_structure)
                seed = self._seed(device)
                seed.fill_(step_seed(state.rng, i, self.rank))  # what the graph's random ops draw from
                flat = [*donated, iteration, seed, *tensors]
                entry = self._entry(jit, structure, flat, i)
                if entry.draws:  # an op the trace could not give the seed to draws from the generator
                    with _seeded(device, state.rng, i, self.rank):
                        outputs = entry.compiled(*flat)
                else:
                    outputs = entry.compiled(*flat)
                loss, finite, metrics = outputs[0], outputs[1], dict(zip(entry.context, outputs[2:]))
        except BaseException as exc:  # noqa: BLE001 - re-raised, wrapped for the fold
            # Stopped after writing into the state (an error or a forced Ctrl-C
            # between two kernels)? Then the state given is torn; the fold must know.
            raise StepFailed(exc, torn=mine and _wrote(donated, versions)) from None
        keep = self._pool.keep
        recorded: dict[str, Scalar] = {
            "loss": keep(loss),
            **self.fixed,
            **{name: keep(value) for name, value in metrics.items()},
        }
        if self.skip_nonfinite:
            recorded["skipped"] = keep(self._skipped(state, finite))
        elif not finite.item():
            # One flag read per step: cheap on a CPU, a sync on a GPU (skip_nonfinite=True has none).
            raise StepFailed(NonFiniteLoss(_nonfinite_message(i, loss), i))
        return unchecked(state, metrics=state.metrics.record(i, recorded))

    def _skipped(self, state: TrainState, finite: torch.Tensor) -> torch.Tensor:
        # The running count lives in the metrics (saved with the state), so it survives a resume.
        series = state.metrics.series.get("skipped")
        before = series[-1][1] if series else 0
        return (~finite).to(torch.int64) + before

    def _entry(self, jit: Jit, structure: Any, flat: list[torch.Tensor], iteration: int) -> Entry:
        try:
            return jit.entry(structure, flat)
        except OverBudget as over:
            index, before, after = over.change
            what = (
                "the structure of the state or batch changed"
                if index is None
                else f"{_leaf_name(structure, index)} was {before}, is now {after}"
            )
            raise RecompileError(
                _RECOMPILED.format(i=iteration, n=jit.compiles, budget=self.recompiles, change=what)
            ) from None
        except RandomInGraph as random:
            raise ValueError(str(random)) from None
        except CompileFailed as failed:
            raise CompileError(_compile_failed(failed.op, failed.where)) from failed.__cause__
        except TraceError as trace:
            raise GraphBreakError(f"{_GRAPH_BREAK}\n\n{trace}") from trace.__cause__

    def _targets(self, state: TrainState) -> tuple[list[torch.Tensor], Targets, pytree.TreeSpec]:
        # Donation keeps the same containers from step to step, so the optimizer
        # state's leaves, structure and what the step writes into are worked out
        # once per layout.
        cached = self._layout
        if cached and cached[1].same(state):
            return cached[0], cached[1], cached[2]
        leaves, spec = pytree.tree_flatten(state.opt_state)
        containers = {id(c) for c in opt_containers(state.opt_state)}
        targets = Targets(state, leaves, containers)
        self._layout[:] = [leaves, targets, spec]
        return leaves, targets, spec

    def _several(self, state: TrainState, batches: Sequence[Any], *, mine: bool) -> TrainState:
        """``len(batches)`` steps writing into ``state``'s tensors (the caller's own when ``mine``)."""
        params, buffers, opt_state = state.params, state.buffers, state.opt_state
        i, n = state.iteration, len(batches)
        multi = self.multi
        if multi is None:  # eager: the steps one by one, each seeded as a single step is
            leaves, spec = pytree.tree_flatten(opt_state)
            for j, batch in enumerate(batches):
                at = unchecked(state, iteration=i + j) if j else state
                try:
                    state = self._single(at, batch, leaves, spec, mine)
                except StepFailed as failed:
                    if isinstance(failed.error, NonFiniteLoss):
                        failed.reached = at
                    raise
            return state
        if not self.model.training:
            self.model.train()
        leaves, ospec = pytree.tree_flatten(opt_state)
        device = leaves[0].device if leaves else _device(params)
        iteration = self._iteration(device)
        iteration.fill_(i)
        donated = [*params.values(), *buffers.values(), *leaves]
        versions = [t._version for t in donated]
        try:
            tensors, batch_structure = _stacked(batches, i)
            structure = (tuple(params), tuple(buffers), ospec, batch_structure, n, not self.skip_nonfinite)
            seeds = torch.tensor(
                [step_seed(state.rng, i + j, self.rank) for j in range(n)], dtype=torch.int64, device=device
            )
            flat = [*donated, iteration, seeds, *tensors]
            entry = self._entry(multi, structure, flat, i)
            outputs = entry.compiled(*flat)
        except BaseException as exc:  # noqa: BLE001 - re-raised, wrapped for the fold
            raise StepFailed(exc, torn=mine and _wrote(donated, versions)) from None
        return self._recorded(state, outputs, entry.context, n)

    def _recorded(
        self, state: TrainState, outputs: Sequence[torch.Tensor], names: Sequence[str], n: int
    ) -> TrainState:
        """``state`` with each of the ``n`` steps' loss and metrics recorded at its own iteration."""
        i = state.iteration
        losses = outputs[0].unbind(0)
        columns: dict[str, Sequence[Scalar]] = {
            "loss": losses,
            **{name: [value] * n for name, value in self.fixed.items()},
            **{name: values.unbind(0) for name, values in zip(names, outputs[2:])},
        }
        metrics = state.metrics
        if self.skip_nonfinite:
            series = metrics.series.get("skipped")
            before = series[-1][1] if series else 0
            columns["skipped"] = ((~outputs[1]).to(torch.int64).cumsum(0) + before).unbind(0)
        elif not outputs[-1].item():  # one flag read per call: were all the steps finite?
            j = int((~outputs[1]).nonzero()[0])
            error = NonFiniteLoss(_nonfinite_message(i + j, losses[j]), i + j)
            done = {name: column[:j] for name, column in columns.items()}
            reached = unchecked(state, metrics=metrics.record_steps(i, done), iteration=i + j)
            raise StepFailed(error, reached=reached)
        return unchecked(state, iteration=i + n - 1, metrics=metrics.record_steps(i, columns))

    @property
    def compiled(self) -> bool:
        """Whether the step is traced and compiled (``train_step(..., compile=True)``)."""
        return self.jit is not None

    @property
    def compiles(self) -> int:
        """How many graphs the step has compiled: 1 over a healthy run, 0 when not compiled."""
        single = 0 if self.jit is None else self.jit.compiles
        return single + (0 if self.multi is None else self.multi.compiles)

    def _iteration(self, device: torch.device) -> torch.Tensor:
        # One 0-d tensor per device, refilled each step: the compiled graph reads it only.
        tensor = self._counters.get(device)
        if tensor is None:
            tensor = self._counters[device] = torch.zeros((), dtype=torch.int64, device=device)
        return tensor

    def _seed(self, device: torch.device) -> torch.Tensor:
        tensor = self._seeds.get(device)
        if tensor is None:
            tensor = self._seeds[device] = torch.zeros((), dtype=torch.int64, device=device)
        return tensor

    def __repr__(self) -> str:
        return f"train_step({type(self.model).__name__}, {getattr(self.loss_fn, '__name__', self.loss_fn)!r}, {self.optimizer!r})"


def _wrote(tensors: list[torch.Tensor], versions: list[int]) -> bool:
    """Whether any of ``tensors`` was written since ``versions`` were read."""
    return any(t._version != v for t, v in zip(tensors, versions))


def _copied(state: TrainState) -> TrainState:
    """``state`` with copies of its params, buffers and optimizer state, for a step to write into."""
    return unchecked(
        state,
        params=_cloned(state.params),
        buffers=_cloned(state.buffers),
        opt_state=_cloned(state.opt_state),
    )


def _stacked(batches: Sequence[Any], iteration: int) -> tuple[list[torch.Tensor], Any]:
    """The batches' tensors stacked position by position, and their common structure."""
    flats = [flatten_batch(batch) for batch in batches]
    tensors, structure = flats[0]
    shapes = [t.shape for t in tensors]
    for j, (other, other_structure) in enumerate(flats[1:], 1):
        if other_structure != structure or [t.shape for t in other] != shapes:
            raise ValueError(
                f"steps_per_call={len(batches)}: the batches of one call are stacked into one input, so "
                f"they must share one structure and shapes, but the batch for iteration {iteration + j} "
                f"({_described(other, other_structure)}) differs from iteration {iteration}'s "
                f"({_described(tensors, structure)}). Give batches of one size (drop_last=True for a "
                "DataLoader)."
            )
    return [torch.stack(column) for column in zip(*(t for t, _ in flats))], structure


def _described(tensors: list[torch.Tensor], structure: Any) -> str:
    return f"{structure!r:.60}, shapes {[tuple(t.shape) for t in tensors]}"


def _check_positive(name: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"'{name}' must be a positive int ({got(value)}).")
    return value


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
) -> Step:
    """The pure step ``(state, batch) -> state`` for ``model``, ``loss_fn`` and ``optimizer``.

    Forward, backward and the optimizer update run as one function on the
    state's tensors (``torch.func.functional_call`` + ``torch.autograd.grad``),
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
            (for example ``torch.bfloat16``).
        recompiles: how many graphs beyond the first the step may compile before
            ``RecompileError`` (a signature seen before reuses its graph).
        options: inductor settings, as ``torch.compile(options=...)`` takes
            them, over fnloop's defaults (``fnloop._step.jit.default_options``:
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
    update, in_place = _kernel(model, loss_fn, optimizer, accumulate, autocast, eager=not compile)
    if type(recompiles) is not int or recompiles < 0:
        raise ValueError(f"'recompiles' must be an int >= 0 ({got(recompiles)}).")
    jit = _jit_kernel(update, 1 + recompiles, options) if compile else None
    if type(skip_nonfinite) is not bool:
        raise TypeError(f"'skip_nonfinite' must be a bool ({got(skip_nonfinite)}).")
    steps_per_call = _check_positive("steps_per_call", steps_per_call)
    multi = None
    if compile and steps_per_call > 1:
        multi = _jit_steps(update, steps_per_call, 1 + recompiles, options)
    fixed = fixed_learning_rates(optimizer)
    step = TrainStep(
        model,
        loss_fn,
        optimizer,
        recompiles,
        in_place,
        jit,
        skip_nonfinite,
        fixed,
        rank(),
        steps_per_call,
        multi,
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
