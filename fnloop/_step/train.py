"""The training step as a value: ``TrainStep``, one path from a call's layout to the state it records.

``apply`` reads the call's ``Layout`` (``inputs.py``), runs the kernel
transformed for it (``layout.py``) eagerly or compiled (``compiler.py``),
and records what it computed (``_recorded``): every call, whatever the
layout, goes this one way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._compile import CompileFailed, Entry, Jit, OverBudget, RandomInGraph, TraceError, flatten_batch
from fnloop._core.failure import StepFailed, unwrapped
from fnloop._core.metrics import Scalar
from fnloop._core.population import member_metric
from fnloop._core.state import TrainState, unchecked
from fnloop._core.steps import Applied
from fnloop._step.compiler import Form, leaf_name
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
from fnloop._step.inputs import layout_of, member_batch, stacked
from fnloop._step.kernel import Kernel, LossFn, _device
from fnloop._step.layout import Layout
from fnloop._step.pool import ScalarPool
from fnloop._step.seeds import seeded, step_seed
from fnloop.optim import Optimizer

__all__ = ["TrainStep"]


class Outputs(NamedTuple):
    """What a call computed, one value per step (``steps > 1``) and per member (a population).

    ``every``: whether every step of a call that stops at a non-finite one was finite.
    """

    loss: torch.Tensor
    finite: torch.Tensor
    metrics: dict[str, torch.Tensor]
    every: torch.Tensor | None = None


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
    _memo: Memo = attrs.field(factory=Memo, alias="_memo")

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
        mine = False
        if owned:
            leaves, targets, ospec = self._targets(state)
            mine = not shared(state, targets)
        if not mine:
            state = _copied(state)
            leaves, ospec = pytree.tree_flatten(state.opt_state)
        scan = self.multi is not None and len(batches) > 1
        layout = layout_of(
            state, batches, rank=self.rank, world=self.world, scan=scan, stop=not self.skip_nonfinite
        )
        if layout.steps == len(batches):
            return self._call(state, batches, leaves, ospec, layout, mine, within=False)
        # The steps one by one, each seeded as alone: eager, or a population's.
        i = state.iteration
        for j, batch in enumerate(batches):
            state = unchecked(state, iteration=i + j) if j else state
            state = self._call(state, [batch], leaves, ospec, layout, mine, within=True)
        return state

    def _call(
        self,
        state: TrainState,
        batches: Sequence[Any],
        leaves: list[torch.Tensor],
        ospec: pytree.TreeSpec,
        layout: Layout,
        mine: bool,
        *,
        within: bool,
    ) -> TrainState:
        """One call of the kernel for ``layout``, writing into ``state``'s tensors (the caller's own when ``mine``).

        ``within``: the call is one step of several (the state reached is the
        one a non-finite step leaves).
        """
        population = state.population
        if population is not None and not any(population.training):
            return state  # every member has stopped: nothing trains, nothing is recorded
        if not self.model.training:
            self.model.train()
        params, buffers = state.params, state.buffers
        device = leaves[0].device if leaves else _device(params)
        iteration = self._memo.tensor(("iteration", device), lambda: _zero(device))
        iteration.fill_(state.iteration)
        donated = [*params.values(), *buffers.values(), *leaves]
        versions = [t._version for t in donated]
        try:
            if self.jit is None:
                outputs = self._eager(state, batches[0], iteration, device, layout)
            else:
                outputs = self._compiled(state, batches, donated, ospec, iteration, device, layout)
        except BaseException as exc:  # noqa: BLE001 - re-raised, wrapped for the fold
            # Stopped after writing into the state (an error or a forced Ctrl-C
            # between two kernels)? Then the state given is torn; the fold must know.
            raise StepFailed(exc, torn=mine and _wrote(donated, versions)) from None
        # Eager, a population's members step in turn: those before a non-finite one were written.
        torn = self.jit is None and population is not None and mine and _wrote(donated, versions)
        return self._recorded(state, layout, outputs, reached=state if within else None, torn=torn)

    def _eager(
        self, state: TrainState, batch: Any, iteration: torch.Tensor, device: torch.device, layout: Layout
    ) -> Outputs:
        """One step run op by op; a population's members each in turn, as their solo runs step."""
        i, population = state.iteration, state.population
        if population is None:
            with seeded(device, state.rng, i, self.rank):
                return Outputs(
                    *self.function(
                        state.params, state.buffers, state.opt_state, iteration, batch, layout.shards
                    )
                )
        inner = member_batch(batch, population, i)
        rows: list[Outputs | None] = []
        for m, seed in enumerate(population.seeds):
            if not population.training[m]:
                rows.append(None)
                continue
            own = inner if layout.shared else _rows(inner, m)
            mine = _rows(state.params, m), _rows(state.buffers, m), _rows(state.opt_state, m)
            with seeded(device, seed, i, self.rank):
                rows.append(Outputs(*self.function(*mine, iteration, own, None)))
        return _by_member(rows)

    def _compiled(
        self,
        state: TrainState,
        batches: Sequence[Any],
        donated: list[torch.Tensor],
        ospec: pytree.TreeSpec,
        iteration: torch.Tensor,
        device: torch.device,
        layout: Layout,
    ) -> Outputs:
        """The call's compiled graph for ``layout``, on the flat form (``compiler.Form``)."""
        i, population = state.iteration, state.population
        rng, rank = state.rng, self.rank
        extra: list[torch.Tensor] = []
        if population is not None:
            jit = self.members
            tensors, structure = flatten_batch(member_batch(batches[0], population, i))
            seeds = torch.tensor(
                [step_seed(s, i, rank) for s in population.seeds], dtype=torch.int64, device=device
            )
            key = ("training", device, population.training)
            extra = [self._memo.tensor(key, lambda: torch.tensor(population.training, device=device))]
        elif layout.steps > 1:
            jit = self.multi
            tensors, structure = stacked(batches, i)
            seeds = torch.tensor([step_seed(rng, i + j, rank) for j in range(layout.steps)], device=device)
        else:
            jit = self.jit
            tensors, structure = flatten_batch(batches[0])
            seeds = self._memo.tensor(("seed", device), lambda: _zero(device))
            seeds.fill_(step_seed(rng, i, rank))  # what the graph's random ops draw from
        assert jit is not None
        form = Form(tuple(state.params), tuple(state.buffers), ospec, structure, layout)
        flat = [*donated, iteration, seeds, *extra, *tensors]
        entry = self._entry(jit, form, flat, i)
        if entry.draws:  # an op the trace could not give the seed to draws from the generator
            with seeded(device, rng, i, rank):
                out = entry.compiled(*flat)
        else:
            out = entry.compiled(*flat)
        names = entry.context
        every = out[2 + len(names)] if len(out) > 2 + len(names) else None
        return Outputs(out[0], out[1], dict(zip(names, out[2:])), every)

    def _recorded(
        self, state: TrainState, layout: Layout, out: Outputs, *, reached: TrainState | None, torn: bool
    ) -> TrainState:
        """``state`` with the call's loss and metrics recorded, each step's at its own iteration.

        A non-finite step raises ``NonFiniteLoss`` (unless ``skip_nonfinite``),
        with the state reached before it.
        """
        i, n, population = state.iteration, layout.steps, state.population
        pool, metrics = self._memo.pool, state.metrics
        values = {"loss": out.loss, **out.metrics}
        columns: dict[str, Sequence[Scalar]] = {}
        if population is None:
            rows = {k: [pool.keep(v)] if n == 1 else v.unbind(0) for k, v in values.items()}
            columns = {"loss": rows.pop("loss"), **{k: [v] * n for k, v in self.fixed.items()}, **rows}
            if self.skip_nonfinite:
                counts = _count(metrics, "skipped") + (~out.finite).to(torch.int64).reshape(n).cumsum(0)
                columns["skipped"] = [pool.keep(counts[0])] if n == 1 else counts.unbind(0)
            elif not (out.finite if out.every is None else out.every).item():  # one flag read per call
                j = int((~out.finite.reshape(n)).nonzero()[0])
                error = NonFiniteLoss(_nonfinite_message(i + j, out.loss.reshape(n)[j]), i + j)
                if n > 1:
                    done = {name: column[:j] for name, column in columns.items()}
                    reached = unchecked(state, metrics=metrics.record_steps(i, done), iteration=i + j)
                raise StepFailed(error, reached=reached)
        else:
            training, name = population.training, self._memo.member_name
            flags = out.finite.tolist()  # one read for every member
            bad = [m for m, f in enumerate(flags) if training[m] and not f]
            if bad and not self.skip_nonfinite:
                m = bad[0]
                message = _nonfinite_message(i, out.loss[m])
                error = NonFiniteLoss(f"member {m} ({population.labels[m]}) of the population: {message}", i)
                raise StepFailed(error, torn=torn, reached=reached)
            # Each value of the call (one per member) in one home, recorded row by row.
            homes = {k: pool.keep_rows(v) for k, v in values.items()}
            for m in range(population.size):
                if not training[m]:  # a stopped member records nothing more
                    continue
                columns.update({name(k, m): [v] for k, v in self.fixed.items()})
                columns.update({name(k, m): [column[m]] for k, column in homes.items()})
                if self.skip_nonfinite:
                    skipped = name("skipped", m)
                    columns[skipped] = [
                        pool.keep((~out.finite[m]).to(torch.int64) + _count(metrics, skipped))
                    ]
        if n == 1:
            return unchecked(state, metrics=metrics.record(i, {k: v[0] for k, v in columns.items()}))
        return unchecked(state, iteration=i + n - 1, metrics=metrics.record_steps(i, columns))

    def _entry(self, jit: Jit, form: Form, flat: list[torch.Tensor], iteration: int) -> Entry:
        try:
            return jit.entry(form, flat)
        except OverBudget as over:
            index, before, after = over.change
            what = (
                "the structure of the state or batch changed"
                if index is None
                else f"{leaf_name(form, index)} was {before}, is now {after}"
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
        """Whether the step is traced and compiled (``train_step(..., compile=True)``)."""
        return self.jit is not None

    @property
    def compiles(self) -> int:
        """How many graphs the step has compiled: 1 over a healthy run, 0 when not compiled.

        A step that has trained both single runs and a population has compiled one graph for each.
        """
        return sum(0 if jit is None else jit.compiles for jit in (self.jit, self.multi, self.members))

    def __repr__(self) -> str:
        return f"train_step({type(self.model).__name__}, {getattr(self.loss_fn, '__name__', self.loss_fn)!r}, {self.optimizer!r})"


def _zero(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


def _count(metrics: Any, name: str) -> Any:
    """The running count ``name`` last recorded (0 before): it lives in the metrics, so it survives a resume."""
    series = metrics.series.get(name)
    return series[-1][1] if series else 0


def _by_member(rows: list[Outputs | None]) -> Outputs:
    """The members' eager results as a population's compiled step gives them: one row per member.

    A member that no longer trains gets a finite placeholder, recorded nowhere.
    """
    first = next(row for row in rows if row is not None)
    true = torch.ones((), dtype=torch.bool, device=first.finite.device)
    filled = [
        row
        or Outputs(
            torch.zeros_like(first.loss), true, {k: torch.zeros_like(v) for k, v in first.metrics.items()}
        )
        for row in rows
    ]
    return Outputs(
        torch.stack([row.loss for row in filled]),
        torch.stack([torch.as_tensor(row.finite, device=true.device).reshape(()) for row in filled]),
        {k: torch.stack([row.metrics[k] for row in filled]) for k in first.metrics},
    )


def _rows(tree: Any, m: int) -> Any:
    """Member ``m``'s rows of a stacked tree: views, so an eager step writing into them writes the population's."""
    return pytree.tree_map(lambda t: t[m] if isinstance(t, torch.Tensor) else t, tree)


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
