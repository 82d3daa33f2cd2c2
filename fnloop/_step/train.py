"""The training step as a value: ``TrainStep``, one path from a call's layout to the state it records.

``apply`` reads the call's ``Layout`` (``inputs.py``), runs the kernel
transformed for it (``layout.py``) eagerly or compiled (``compiler.py``),
and records what it computed (``_recorded``): every call, whatever the
layout, goes this one way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._compile import Entry, Jit
from fnloop._core.failure import StepFailed, unwrapped
from fnloop._core.population import member_metric
from fnloop._core.state import TrainState, unchecked
from fnloop._core.steps import Applied
from fnloop._step.calls import Call, Inputs, Jits, Outputs, Recording, call_of
from fnloop._step.compiler import Form, leaf_name
from fnloop._step.determinism import deterministic_algorithms, warn_varying
from fnloop._step.donation import Targets, opt_containers, shared
from fnloop._step.gradients import CompiledGradient, entry_of
from fnloop._step.kernel import Kernel, LossFn, _device
from fnloop._step.layout import Layout
from fnloop._step.placement import Plan
from fnloop._step.pool import ScalarPool
from fnloop._step.seeds import seeded
from fnloop.optim import Optimizer

__all__ = ["TrainStep"]


class Memo:
    """What a step keeps between calls, never part of its meaning: input tensors refilled each call, names, homes.

    The iteration and seed inputs are one 0-d tensor per device, refilled
    each step (the compiled graph reads them only); ``targets`` is the last
    layout's donation targets (see ``TrainStep._targets``); the recorded loss
    and metrics live in long-lived homes (``fnloop/_step/pool.py``).
    """

    def __init__(self) -> None:
        self.inputs: dict[Any, torch.Tensor] = {}
        self.targets: list[Any] = []
        self.names: dict[tuple[str, int], str] = {}
        self.pool = ScalarPool()
        self.looked = False  # whether the step looked once at its graph's order of additions
        self.structures: set[pytree.TreeSpec] = (
            set()
        )  # the optimizer states' structures found the optimizer's

    def tensor(self, key: Any, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        found = self.inputs.get(key)
        if found is None:
            found = self.inputs[key] = make()
        return found

    def member_name(self, metric: str, m: int) -> str:
        """A population's metric name (``loss/3``), made once: a step records every member's."""
        key = (metric, m)
        found = self.names.get(key)
        if found is None:
            found = self.names[key] = member_metric(metric, m)
        return found


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
    kernel: Kernel
    plan: Plan
    """How the work is cut beside the call's layout: the blocks, the invariant slices (``placement.py``)."""
    function: Callable[..., Any]
    """The kernel run eagerly on a single run's state: ``(params, buffers, opt_state, iteration, batch, shards) -> (loss, finite, metrics)``."""
    jit: Jit | None = None
    """The kernel traced and compiled, one step per call, when ``compiled``."""
    multi: Jit | None = None
    """The kernel run ``steps_per_call`` times in one compiled graph, when compiled and ``steps_per_call > 1``."""
    members: Jit | None = None
    """The population's kernel (every member at once, vmapped), traced and compiled, when ``compiled``."""
    skip_nonfinite: bool = False
    """Skip non-finite steps and count them (metric ``skipped``) instead of raising ``NonFiniteLoss``."""
    fixed: dict[str, float] = attrs.field(factory=dict)
    """The optimizer's fixed learning rates, recorded every step as numbers (no graph output)."""
    rank: int = 0
    """This process's rank under torch.distributed: dropout draws differ per rank."""
    world: int = 1
    """How many processes train together, fixed when the step is built."""
    steps_per_call: int = 1
    """How many iterations the fold runs in one call (``steps``), at call boundaries."""
    deterministic: bool = False
    """Compile and run the step under torch's deterministic algorithms (``fnloop/_step/determinism.py``)."""
    gradient: CompiledGradient | None = None
    """The gradient stage compiled alone, which ``function`` runs before its update (``compile="model"``)."""
    _memo: Memo = attrs.field(factory=Memo, alias="_memo")
    _how: Recording = attrs.field(
        default=attrs.Factory(
            lambda self: Recording(self.fixed, self.skip_nonfinite, self._memo.pool, self._memo.member_name),
            takes_self=True,
        ),
        alias="_how",
    )

    _jits: Jits = attrs.field(
        init=False,
        default=attrs.Factory(lambda self: Jits(self.jit, self.multi, self.members), takes_self=True),
    )

    donates = True

    @property
    def per_call(self) -> int:  # type: ignore[override]
        return self.steps_per_call

    def __call__(self, state: TrainState, batch: Any, /) -> TrainState:
        return unwrapped(self.apply, state, [batch], owned=False)

    def finish(self) -> None:
        """Drop the layout of the run's states kept between steps (see ``_targets``)."""
        self._memo.targets.clear()

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
        return unwrapped(self.apply, state, batches, owned=False)

    def donating_steps(self, state: TrainState, batches: Sequence[Any], /) -> TrainState:
        """``steps``, reusing the storage of ``state``'s tensors, on the terms of ``donating``."""
        return unwrapped(self.apply, state, batches, owned=True)

    def apply(self, state: TrainState, batches: Sequence[Any], *, owned: bool) -> TrainState:
        """One step, or several in one call, writing into ``state``'s tensors if ``owned`` and nothing shares them.

        Raises ``StepFailed`` (see ``fnloop._core.failure``): whether the
        state given was torn, and, inside a call of several steps, the state
        reached before the step that failed.
        """
        if self.deterministic:
            with deterministic_algorithms():
                return self._applied(state, batches, owned=owned)
        return self._applied(state, batches, owned=owned)

    def _applied(self, state: TrainState, batches: Sequence[Any], *, owned: bool) -> TrainState:
        mine = False
        if owned:
            leaves, targets, ospec = self._targets(state)
            mine = not shared(state, targets)
        if not mine:
            state = _copied(state)
            leaves, ospec = pytree.tree_flatten(state.opt_state)
        if ospec not in self._memo.structures:
            _check_opt_state(self.optimizer, self.kernel, state, ospec)
            self._memo.structures.add(ospec)
        scan = self.multi is not None and len(batches) > 1
        call = call_of(state)
        layout = call.layout(
            state, batches, rank=self.rank, world=self.world, scan=scan, stop=not self.skip_nonfinite
        )
        self.plan.check(layout)
        if layout.steps == len(batches):
            return self._call(call, state, batches, leaves, ospec, layout, mine, within=False)
        # The steps one by one, each seeded as alone: eager, or a population's.
        i = state.iteration
        for j, batch in enumerate(batches):
            state = unchecked(state, iteration=i + j) if j else state
            state = self._call(call, state, [batch], leaves, ospec, layout, mine, within=True)
        return state

    def _call(
        self,
        call: Call,
        state: TrainState,
        batches: Sequence[Any],
        leaves: list[torch.Tensor],
        ospec: pytree.TreeSpec,
        layout: Layout,
        mine: bool,
        *,
        within: bool,
    ) -> TrainState:
        """One call of the kernel for ``layout`` on ``call``'s kind of state, writing into ``state``'s tensors (the caller's own when ``mine``).

        ``within``: the call is one step of several (the state reached is the
        one a non-finite step leaves).
        """
        if call.idle(state):  # every member has stopped: nothing trains, nothing is recorded
            return state
        if not self.model.training:
            self.model.train()
        i, params, buffers = state.iteration, state.params, state.buffers
        # The ranks splitting one copy of a layer draw alike: a whole tensor's dropout is one mask.
        rank = self.plan.seed_rank(self.rank if layout.tensor is None else self.rank // layout.tensor.degree)
        device = leaves[0].device if leaves else _device(params)
        iteration = self._memo.tensor(("iteration", device), lambda: _zero(device))
        iteration.fill_(i)
        donated = [*params.values(), *buffers.values(), *leaves]
        versions = [t._version for t in donated]
        try:
            if self.jit is None:
                out = call.eager(self.function, state, batches[0], iteration, rank, layout)
            else:
                given = call.inputs(state, batches, rank, layout, self._memo.tensor, device)
                seeds = self.plan.seeds(state.rng, i, layout.steps, device)  # every slice's, under invariant
                given = given if seeds is None else given._replace(seeds=seeds)
                jit = call.jit(self._jits, layout)
                assert jit is not None
                out = self._compiled(jit, state, donated, ospec, iteration, given, layout)
        except BaseException as exc:  # noqa: BLE001 - re-raised, wrapped for the fold
            # Stopped after writing into the state (an error or a forced Ctrl-C
            # between two kernels)? Then the state given is torn; the fold must know.
            raise StepFailed(exc, torn=mine and _wrote(donated, versions)) from None

        # Eager, a population's members step in turn: those before a non-finite one were written
        # (a single run's eager step writes nothing when it is not finite). Asked on failure only.
        def torn() -> bool:
            return self.jit is None and mine and _wrote(donated, versions)

        return call.recorded(state, layout, out, self._how, reached=state if within else None, torn=torn)

    def _compiled(
        self,
        jit: Jit,
        state: TrainState,
        donated: list[torch.Tensor],
        ospec: pytree.TreeSpec,
        iteration: torch.Tensor,
        given: Inputs,
        layout: Layout,
    ) -> Outputs:
        """The call's graph (``jit``'s, for ``layout``) on the flat form (``compiler.Form``)."""
        form = Form(tuple(state.params), tuple(state.buffers), ospec, given.structure, layout)
        flat = [*donated, iteration, given.seeds, *given.extra, *given.tensors]
        entry = self._entry(jit, form, flat, state.iteration)
        if entry.draws:  # an op the trace could not give the seed to draws from the generator
            self.plan.refuse_generator()
            with seeded(iteration.device, state.rng, state.iteration, self.rank):
                out = entry.compiled(*flat)
        else:
            out = entry.compiled(*flat)
        names = entry.context
        every = out[2 + len(names)] if len(out) > 2 + len(names) else None
        return Outputs(out[0], out[1], dict(zip(names, out[2:])), every)

    def _entry(self, jit: Jit, form: Form, flat: list[torch.Tensor], iteration: int) -> Entry:
        entry = entry_of(jit, form, flat, iteration, functools.partial(leaf_name, form))
        if entry.accumulates and not self._memo.looked:  # once a step: see fnloop/_step/determinism.py
            self._memo.looked = True
            warn_varying(entry.accumulates, flat[0].device)
        return entry

    def _targets(self, state: TrainState) -> tuple[list[torch.Tensor], Targets, pytree.TreeSpec]:
        # Donation keeps the same containers from step to step, so the optimizer
        # state's leaves, structure and what the step writes into are worked out
        # once per layout.
        cached = self._memo.targets
        if cached and cached[1].same(state):
            return cached[0], cached[1], cached[2]
        leaves, spec = pytree.tree_flatten(state.opt_state)
        containers = {id(c) for c in opt_containers(state.opt_state)}
        targets = Targets(state, leaves, containers)
        cached[:] = [leaves, targets, spec]
        return leaves, targets, spec

    @property
    def compiled(self) -> bool:
        """Whether the step is traced and compiled (``train_step(..., compile=True)``, or ``"model"``)."""
        return self.jit is not None or self.gradient is not None

    @property
    def compiles(self) -> int:
        """How many graphs the step has compiled: 1 over a healthy run, 0 when not compiled.

        A step that has trained both single runs and a population has compiled one graph for each.
        """
        jits = (self.jit, self.multi, self.members, None if self.gradient is None else self.gradient.jit)
        return sum(0 if jit is None else jit.compiles for jit in jits)

    def __repr__(self) -> str:
        return f"train_step({type(self.model).__name__}, {getattr(self.loss_fn, '__name__', self.loss_fn)!r}, {self.optimizer!r})"


def _check_opt_state(optimizer: Optimizer, kernel: Kernel, state: TrainState, spec: pytree.TreeSpec) -> None:
    """Refuse an optimizer state of another structure than the step's optimizer makes, naming both.

    A state built with one optimizer (``dynamic_loss_scale(adamw(...))`` in
    ``init``) and stepped with another (``adamw(...)`` in ``train_step``) would
    otherwise fail deep inside the update. The structure is the optimizer's
    ``init`` on meta tensors: nothing is allocated.
    """
    meta = {k: torch.empty_like(v, device="meta") for k, v in state.params.items() if k not in kernel.fixed}
    expected = pytree.tree_structure(optimizer.init(meta))
    # Only the optimizer's own structure: which parameters a dict holds is the update's to check,
    # which names the frozen ones (kernel.py's _matching).
    if _kinds(expected) == _kinds(spec):
        return
    raise TypeError(
        f"the state's opt_state (a {type(state.opt_state).__name__}) was not made by this step's optimizer, "
        f"{optimizer!r}, whose state is a {type(optimizer.init(meta)).__name__} of another structure. Build "
        "the state with the same optimizer as the step: fnloop.init(model, opt, ...) and "
        "fnloop.train_step(model, loss_fn, opt), a wrapper (dynamic_loss_scale, skip_spikes, inject) in both."
    )


def _kinds(spec: pytree.TreeSpec) -> Any:
    """The types of ``spec``'s nodes, nested, a dict's contents left out (which parameters it holds)."""
    if spec.type is dict:
        return dict
    return (spec.type, tuple(_kinds(spec.child(i)) for i in range(spec.num_children)))


def _zero(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


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


def _cloned(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)
