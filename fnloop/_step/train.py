"""A pure training step built from a model, a loss and an optimizer, compiled as one graph."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch
from torch.func import functional_call, grad_and_value
from torch.utils import _pytree as pytree

from fnloop._core.loop import Step
from fnloop._core.messages import got
from fnloop._core.metrics import Scalar
from fnloop._core.state import TrainState, replace
from fnloop._step.donation import Clean, exclusive, holds_containers, opt_containers
from fnloop._step.eval import plain_module
from fnloop._step.jit import Entry, Flat, Jit, OverBudget, TraceError, flatten_batch, unflatten_batch
from fnloop._step.pool import ScalarPool
from fnloop.optim import Optimizer, learning_rates
from fnloop.optim._base import fixed_learning_rates

__all__ = ["GraphBreakError", "NonFiniteLoss", "RecompileError", "TrainStep", "init", "train_step"]

LossFn = Callable[[Callable[..., Any], Any], Any]
"""``loss_fn(model, batch) -> loss`` or ``(loss, metrics)``; ``model`` runs the forward on the state."""


class RecompileError(RuntimeError):
    """The compiled step would need another graph, beyond its budget; nothing of that call ran."""


class GraphBreakError(RuntimeError):
    """The step is not one graph of tensor operations; the message names the cause and the fix.

    Raised when ``loss_fn`` needs a tensor's value in Python while it is traced
    (``.item()``, ``float(t)``, ``if loss > 0:``, printing such a value), and,
    compiled or eager alike, when it returns a metric that is not a tensor (a
    Python number, or the result of ``.item()``).
    """


class NonFiniteLoss(FloatingPointError):
    """A step's loss or a gradient was not finite; the step left the state unchanged.

    Raised by a ``train_step`` built without ``skip_nonfinite=True``. The fold
    then runs ``AFTER_TRAIN`` and re-raises it with ``exc.state``, the state
    before that step, whose tensors are all finite (so a checkpoint hook saves a
    clean state). ``iteration`` is the index of the failed step.
    """

    def __init__(self, message: str, iteration: int) -> None:
        super().__init__(message)
        self.iteration = iteration


def _nonfinite_message(iteration: int, loss: torch.Tensor) -> str:
    value = loss.item()
    what = (
        f"the loss was {value}"
        if not math.isfinite(value)
        else f"a gradient was not finite (loss {value:.6g})"
    )
    return (
        f"step {iteration}: {what} (metric 'loss'). The step left params, buffers and optimizer state "
        "unchanged, and the run stops with the state before it. Typical fixes: a lower learning rate "
        "or a warm-up, gradient clipping (fnloop.optim.clip_by_global_norm), checking the batch for "
        "bad values; or train_step(..., skip_nonfinite=True) to skip such steps and count them in the "
        "metric 'skipped'."
    )


_GRAPH_BREAK = (
    "the training step must compile into one graph (forward, backward and update together), but "
    "tracing it stopped where Python needs a tensor's value; the tracer's message follows. Typical "
    "causes in loss_fn: .item(), float(tensor), or branching on a tensor's value (if loss > 0). "
    "Return metrics as tensors instead, use torch.where for branches, or use train_step(..., "
    "compile=False) to run eagerly."
)

_NUMBER_METRIC = (
    "loss_fn returned the metric {name!r} as {what}, not a tensor. A metric must stay a tensor, "
    "compiled or eager: the step is one graph traced once (a Python number is not an output of it, "
    "and its value would be frozen at the trace), and converting a tensor to a number forces a host "
    "sync every step. Return the tensor itself, for example {{{name!r}: acc}} instead of "
    "{{{name!r}: acc.item()}}, or torch.tensor(value) for a number; writers convert metrics to "
    "numbers only when they write."
)


def _number(value: object) -> str | None:
    """How a metric that is a Python number (or a traced one) is described, or None for a tensor."""
    if isinstance(value, (torch.SymFloat, torch.SymInt, torch.SymBool)):
        return "the result of .item() or float()/int() of a tensor (a number known only when the step runs)"
    if isinstance(value, (bool, int, float)):
        return f"a Python {type(value).__name__} ({value!r})"
    return None


_RECOMPILED = (
    "the compiled step would be compiled again at iteration {i} ({n} recompiles, budget {budget}): "
    "{change}. The step is traced once per signature (the structure of the state and batch, and "
    "each tensor's shape, strides, dtype and device). A batch of another shape (the last, smaller "
    "batch of an epoch? use drop_last=True) or a changed state compiles a new graph. Nothing of this "
    "iteration ran. Allow it with train_step(..., recompiles=N)."
)


def init(
    model: torch.nn.Module, optimizer: Optimizer, *, seed: int, max_iter: int, extra: Any = None
) -> TrainState:
    """A state for training ``model`` with ``optimizer`` from iteration 0.

    ``params`` and ``buffers`` are detached copies keyed like
    ``model.named_parameters()`` and ``model.named_buffers()``; the model itself
    is never changed by fnloop.

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
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    return TrainState(
        max_iter=max_iter,
        params=params,
        buffers=buffers,
        opt_state=optimizer.init(params),
        rng=seed,
        extra=extra,
    )


_MASK = (1 << 64) - 1


def step_seed(seed: int, iteration: int) -> int:
    """The seed of step ``iteration`` of a run seeded ``seed`` (splitmix64 of the pair).

    Examples:
        >>> step_seed(0, 1) != step_seed(1, 0)
        True
    """
    z = (seed * 0x9E3779B97F4A7C15 + iteration + 1) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int, iteration: int) -> Iterator[None]:
    """The device's generator seeded for step ``iteration``, and put back as it was after."""
    # torch.manual_seed seeds every device (~110 us); one generator's own
    # manual_seed costs ~1 us.
    generator = _generator(device)
    saved = generator.get_state()
    generator.manual_seed(step_seed(seed, iteration))
    try:
        yield
    finally:
        generator.set_state(saved)


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


def _micro_batches(batch: Any, n: int) -> list[Any]:
    flat, spec = pytree.tree_flatten(batch)
    for leaf in flat:
        if isinstance(leaf, torch.Tensor) and leaf.shape[0] % n:
            raise ValueError(
                f"cannot split a batch of {leaf.shape[0]} rows into accumulate={n} equal micro-batches; "
                "choose a batch size divisible by accumulate."
            )
    chunks = [leaf.chunk(n) if isinstance(leaf, torch.Tensor) else [leaf] * n for leaf in flat]
    return [pytree.tree_unflatten([c[k] for c in chunks], spec) for k in range(n)]


def _all_finite(loss: torch.Tensor, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A 0-d bool: the loss and every gradient element are finite (one reduction per tensor, no sync)."""
    flags = [torch.isfinite(loss).reshape(())]
    flags += [torch.isfinite(g).all() for g in grads.values()]
    return torch.stack(flags).all()


def _kernel(
    model: torch.nn.Module,
    loss_fn: LossFn,
    optimizer: Optimizer,
    accumulate: int,
    autocast: torch.dtype | None,
) -> Callable[..., Any]:
    """The traced function: forward, backward and update on plain dicts, writing results into its inputs.

    It returns ``(loss, finite, metrics)``. A step whose loss or any gradient is
    not finite writes the old values back (``finite`` is false): decided in the
    graph, so no host sync is needed to keep the state clean.
    """

    def loss_of(params: dict, buffers: dict, batch: Any) -> tuple[torch.Tensor, dict]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return functional_call(model, (params, buffers), args, kwargs)

        device = _device(params).type
        context = torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext()
        with context:
            loss, metrics = _split(loss_fn(forward, batch))
        return loss.float(), metrics

    def kernel(params: dict, buffers: dict, opt_state: Any, iteration: torch.Tensor, batch: Any) -> Any:
        # functional_call writes running statistics into the buffers it is given.
        new_buffers = {k: v.clone() for k, v in buffers.items()}
        if accumulate == 1:
            grads, (loss, metrics) = grad_and_value(loss_of, has_aux=True)(params, new_buffers, batch)
        else:
            grads, losses, parts = {}, [], []
            for micro in _micro_batches(batch, accumulate):
                g, (l_k, m_k) = grad_and_value(loss_of, has_aux=True)(params, new_buffers, micro)
                grads = {k: grads[k] + v for k, v in g.items()} if grads else g
                losses.append(l_k)
                parts.append(m_k)
            grads = {k: v / accumulate for k, v in grads.items()}
            loss = torch.stack(losses).mean()
            metrics = {k: torch.stack([m[k] for m in parts]).float().mean() for k in parts[0]}
        new_params, new_opt_state = optimizer.update(grads, opt_state, params, iteration)
        finite = _all_finite(loss, grads)
        # Donation: the new values go into the input storage, so the compiled
        # graph updates in place and keeps no second copy alive. A non-finite
        # step writes the old values back: the state is never poisoned.
        for k, p in params.items():
            p.copy_(torch.where(finite, new_params[k], p))
        for k, b in buffers.items():
            b.copy_(torch.where(finite, new_buffers[k], b))
        for old, new in zip(pytree.tree_leaves(opt_state), pytree.tree_leaves(new_opt_state)):
            old.copy_(torch.where(finite, new, old))
        # Fixed learning rates are recorded as the numbers they are, outside the graph (TrainStep.fixed).
        rates = {k: v for k, v in learning_rates(optimizer, iteration).items() if isinstance(v, torch.Tensor)}
        return loss, finite, {**rates, **{k: v.detach() for k, v in metrics.items()}}

    return kernel


def _jit_kernel(kernel: Callable[..., Any], budget: int, options: Mapping[str, Any] | None) -> Jit:
    """The kernel as a function of flat tensors: params, buffers, optimizer state, iteration, batch."""

    def make(structure: Any) -> tuple[Flat, list[str]]:
        pkeys, bkeys, ospec, bstructure = structure
        names: list[str] = []
        a, b = len(pkeys), len(pkeys) + len(bkeys)
        c = b + ospec.num_leaves

        def flat(*leaves: torch.Tensor) -> list[torch.Tensor]:
            params = dict(zip(pkeys, leaves[:a]))
            buffers = dict(zip(bkeys, leaves[a:b]))
            opt_state = pytree.tree_unflatten(list(leaves[b:c]), ospec)
            batch = unflatten_batch(leaves[c + 1 :], bstructure)
            loss, finite, metrics = kernel(params, buffers, opt_state, leaves[c], batch)
            names[:] = metrics
            return [loss, finite, *metrics.values()]

        return flat, names

    return Jit(make, budget, options)


def _leaf_name(structure: Any, index: int) -> str:
    pkeys, bkeys, ospec, _ = structure
    if index < len(pkeys):
        return f"params[{pkeys[index]!r}]"
    index -= len(pkeys)
    if index < len(bkeys):
        return f"buffers[{bkeys[index]!r}]"
    index -= len(bkeys)
    if index < ospec.num_leaves:
        return f"opt_state leaf {index}"
    index -= ospec.num_leaves
    return "the iteration" if index == 0 else f"the batch's tensor {index - 1}"


def _device(params: Mapping[str, torch.Tensor]) -> torch.device:
    for tensor in params.values():
        return tensor.device
    return torch.device("cpu")


def _cloned(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


@attrs.frozen(eq=False, repr=False)
class TrainStep:
    """The pure step ``(state, batch) -> state``; build it with ``train_step``.

    Calling it never touches the tensors of the state it is given. The fold
    calls ``donating`` instead for states it owns: the same computation, in
    the same compiled graph, writing the results into the state's own storage.
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
    _counters: dict[torch.device, torch.Tensor] = attrs.field(factory=dict)
    _opt_cache: list[Any] = attrs.field(factory=list)
    # The recorded loss and metrics live in long-lived homes: see fnloop/_step/pool.py.
    _pool: ScalarPool = attrs.field(factory=ScalarPool)
    _clean: Clean = attrs.field(factory=Clean)

    def __call__(self, state: TrainState, batch: Any, /) -> TrainState:
        fresh = replace(
            state,
            params=_cloned(state.params),
            buffers=_cloned(state.buffers),
            opt_state=_cloned(state.opt_state),
        )
        return self.donating(fresh, batch)

    def donating(self, state: TrainState, batch: Any, /) -> TrainState:
        """The step, reusing the storage of ``state``'s params, buffers and optimizer state.

        Only for a state nobody else can see. If anything else still refers to
        one of those tensors (a hook kept a parameter, a metric recorded one), or
        ``state.hooks``/``extra`` keeps one of their containers, the step copies
        instead, so what was kept never changes. Otherwise the returned state
        keeps the same containers, whose structure is then known without a walk.
        """
        params, buffers, opt_state = state.params, state.buffers, state.opt_state
        leaves, containers, ospec = self._flat(opt_state)
        owned = exclusive(list(params.values())) and exclusive(list(buffers.values())) and exclusive(leaves)
        if not owned or holds_containers(state, containers, self._clean):
            return self(state, batch)
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
                with _seeded(device, state.rng, i):
                    loss, finite, metrics = self.function(params, buffers, opt_state, iteration, batch)
            else:
                tensors, batch_structure = flatten_batch(batch)
                structure = (tuple(params), tuple(buffers), ospec, batch_structure)
                flat = [*donated, iteration, *tensors]
                entry = self._entry(jit, structure, flat, i)
                if entry.random:
                    with _seeded(device, state.rng, i):
                        outputs = entry.compiled(*flat)
                else:  # no random op in the graph: the generator need not be touched
                    outputs = entry.compiled(*flat)
                loss, finite, metrics = outputs[0], outputs[1], dict(zip(entry.context, outputs[2:]))
        except BaseException as exc:
            # Stopped after writing into the state (an error or a forced Ctrl-C
            # between two kernels)? Then that state is torn; the fold must know.
            exc.torn = any(t._version != v for t, v in zip(donated, versions))  # type: ignore[attr-defined]
            raise
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
            raise NonFiniteLoss(_nonfinite_message(i, loss), i)
        return replace(state, metrics=state.metrics.record(i, recorded))

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
        except TraceError as trace:
            raise GraphBreakError(f"{_GRAPH_BREAK}\n\n{trace}") from trace.__cause__

    def _flat(self, opt_state: Any) -> tuple[list[torch.Tensor], set[int], pytree.TreeSpec]:
        # Donation keeps the same opt_state object from step to step, so its
        # leaves, containers and structure are worked out once per object.
        cached = self._opt_cache
        if cached and cached[0] is opt_state:
            return cached[1], cached[2], cached[3]
        leaves, spec = pytree.tree_flatten(opt_state)
        containers = {id(c) for c in opt_containers(opt_state)}
        self._opt_cache[:] = [opt_state, leaves, containers, spec]
        return leaves, containers, spec

    @property
    def compiled(self) -> bool:
        """Whether the step is traced and compiled (``train_step(..., compile=True)``)."""
        return self.jit is not None

    @property
    def compiles(self) -> int:
        """How many graphs the step has compiled: 1 over a healthy run, 0 when not compiled."""
        return 0 if self.jit is None else self.jit.compiles

    def _iteration(self, device: torch.device) -> torch.Tensor:
        # One 0-d tensor per device, refilled each step: the compiled graph reads it only.
        tensor = self._counters.get(device)
        if tensor is None:
            tensor = self._counters[device] = torch.zeros((), dtype=torch.int64, device=device)
        return tensor

    def __repr__(self) -> str:
        return f"train_step({type(self.model).__name__}, {getattr(self.loss_fn, '__name__', self.loss_fn)!r}, {self.optimizer!r})"


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
) -> Step:
    """The pure step ``(state, batch) -> state`` for ``model``, ``loss_fn`` and ``optimizer``.

    Forward, backward and the optimizer update run as one function on the
    state's tensors (``torch.func.functional_call`` + ``grad_and_value``),
    traced once, like ``jax.jit``, into one graph that inductor compiles; each
    call then checks only the inputs' structure, shapes, strides, dtypes and
    devices. Python in ``loss_fn`` runs once, at trace time. The iteration
    enters as a 0-d tensor, so schedules never recompile. The loss, the
    learning rate the optimizer applied (``lr``, or ``lr/<group>`` for a
    ``partition``) and the metrics ``loss_fn`` returns are recorded in
    ``state.metrics`` as tensors, at the step's index. Randomness (dropout) is seeded from ``(state.rng, iteration)``
    for each step, so a step replays identically after a resume.

    Args:
        model: the module; only its structure and forward are used, never its tensors.
            One wrapped by ``torch.compile`` is unwrapped: fnloop compiles the whole step itself.
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
            them, over fnloop's defaults (``{"cpp_wrapper": True}``).
        skip_nonfinite: what to do after a step whose loss or any gradient is
            not finite. Either way that step leaves params, buffers and
            optimizer state unchanged (decided inside the graph). ``False``:
            raise ``NonFiniteLoss`` (reading one flag per step). ``True``: go on,
            counting such steps in the metric ``skipped`` (no host sync).

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
    kernel = _kernel(model, loss_fn, optimizer, _check_positive("accumulate", accumulate), autocast)
    if type(recompiles) is not int or recompiles < 0:
        raise ValueError(f"'recompiles' must be an int >= 0 ({got(recompiles)}).")
    jit = _jit_kernel(kernel, 1 + recompiles, options) if compile else None
    if type(skip_nonfinite) is not bool:
        raise TypeError(f"'skip_nonfinite' must be a bool ({got(skip_nonfinite)}).")
    fixed = fixed_learning_rates(optimizer)
    step = TrainStep(model, loss_fn, optimizer, recompiles, kernel, jit, skip_nonfinite, fixed)
    return step if donate else _Undonated(step)


@attrs.frozen(repr=False)
class _Undonated:
    step: TrainStep

    def __call__(self, state: TrainState, batch: Any, /) -> TrainState:
        return self.step(state, batch)

    def __repr__(self) -> str:
        return f"{self.step!r} (no donation)"
