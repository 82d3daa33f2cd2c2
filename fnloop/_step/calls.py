"""What a call of the step runs on: one run's state (``ONE_RUN``), or a population's stacked members (``MEMBERS``).

``call_of(state)`` picks one of the two, the one place that asks whether a
state is a population's. The step and the evaluation ask the kind what
differs outside the kernel's transformations: the call's ``layout``, which
compiled kernel runs it (``jit``), how the step runs eagerly (``eager``),
what the compiled graph is given beside the state (``inputs``), what is
recorded (``recorded``), and how an evaluation runs and names its values
(``evaluated``, ``named``). Everything else (donation, the call, eager or
compiled, and the report of a failure) is the step's one path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch.utils import _pytree as pytree

from fnloop._compile import Jit, flatten_batch
from fnloop._core.failure import StepFailed
from fnloop._core.metrics import Metrics, Scalar
from fnloop._core.population import member_metric
from fnloop._core.state import TrainState, unchecked
from fnloop._step.errors import NonFiniteLoss, _nonfinite_message
from fnloop._step.inputs import member_batch, members_layout, one_run_layout, stacked
from fnloop._step.layout import Layout
from fnloop._step.members import each_member
from fnloop._step.pool import ScalarPool
from fnloop._step.seeds import seeded, step_seed

__all__ = ["MEMBERS", "ONE_RUN", "Call", "Inputs", "Jits", "Outputs", "Recording", "call_of"]


class Outputs(NamedTuple):
    """What a call computed, one value per step (``steps > 1``) and per member (a population).

    ``every``: whether every step of a call that stops at a non-finite one was finite.
    """

    loss: torch.Tensor
    finite: torch.Tensor
    metrics: dict[str, torch.Tensor]
    every: torch.Tensor | None = None


class Inputs(NamedTuple):
    """What the compiled graph is given after the state and the iteration: seeds, other inputs, the batch."""

    seeds: torch.Tensor
    extra: list[torch.Tensor]
    tensors: list[torch.Tensor]
    structure: Any


class Recording(NamedTuple):
    """How the step records: its fixed rates, whether it skips non-finite steps, its homes and names."""

    fixed: dict[str, float]
    skip_nonfinite: bool
    pool: ScalarPool
    member_name: Callable[[str, int], str]


Eager = Callable[..., tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]
"""The kernel run eagerly on one run's tensors: ``(params, buffers, opt_state, iteration, batch, layout)``."""

_WHOLE = Layout()
"""The layout of a member's eager step: a single run's, whole."""

Tensor = Callable[[Any, Callable[[], torch.Tensor]], torch.Tensor]
"""A long-lived input tensor by key, made once (``Memo.tensor``)."""

Evaluation = Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor], Any], dict[str, torch.Tensor]]
"""An evaluation of one model's params and buffers on a batch: ``(params, buffers, batch) -> metrics``."""


class Call(Protocol):
    """One of the two kinds of state a step runs on."""

    def layout(
        self, state: TrainState, batches: Sequence[Any], *, rank: int, world: int, scan: bool, stop: bool
    ) -> Layout:
        """The layout of a call on ``state`` and ``batches``, checked (``inputs.py``).

        ``scan``: the call's steps may run as one graph; ``stop``: a non-finite step stops the run.
        """

    def idle(self, state: TrainState) -> bool:
        """Whether nothing of ``state`` trains any more (the call then changes nothing)."""

    def jit(self, jits: Jits, layout: Layout) -> Jit | None:
        """Which of the step's compiled kernels runs ``layout`` (``None``: the step is eager)."""

    def eager(
        self,
        function: Eager,
        state: TrainState,
        batch: Any,
        iteration: torch.Tensor,
        rank: int,
        layout: Layout,
    ) -> Outputs:
        """One step run op by op."""

    def inputs(
        self,
        state: TrainState,
        batches: Sequence[Any],
        rank: int,
        layout: Layout,
        tensor: Tensor,
        device: torch.device,
    ) -> Inputs:
        """What the compiled graph is given beside the state and the iteration, on ``device``."""

    def recorded(
        self,
        state: TrainState,
        layout: Layout,
        out: Outputs,
        how: Recording,
        *,
        reached: Any,
        torn: Callable[[], bool],
    ) -> TrainState:
        """``state`` with the call's loss and metrics recorded, each step's at its own iteration.

        A non-finite step raises ``StepFailed`` (``NonFiniteLoss``, unless
        skipped), with the state reached before it and whether ``state`` was torn
        (``torn()``, asked only then).
        """

    def evaluated(self, evaluation: Evaluation) -> Evaluation:
        """``evaluation`` (of one model's tensors) run on this kind's state."""

    def named(self, state: TrainState, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The values an evaluation of ``state`` computed, under the names it reports them by."""


class Jits(NamedTuple):
    """A step's compiled kernels, each ``None`` where it has none: one step, several per call, the members."""

    one: Jit | None
    several: Jit | None
    members: Jit | None


class _OneRun:
    """A single run's state: one seed, the step's own names."""

    def __repr__(self) -> str:  # part of a compiled graph's structure: no address
        return "ONE_RUN"

    def layout(
        self, state: TrainState, batches: Sequence[Any], *, rank: int, world: int, scan: bool, stop: bool
    ) -> Layout:
        return one_run_layout(state, batches, rank=rank, world=world, scan=scan, stop=stop)

    def idle(self, state: TrainState) -> bool:
        return False

    def jit(self, jits: Jits, layout: Layout) -> Jit | None:
        return jits.several if layout.steps > 1 else jits.one

    def eager(
        self,
        function: Eager,
        state: TrainState,
        batch: Any,
        iteration: torch.Tensor,
        rank: int,
        layout: Layout,
    ) -> Outputs:
        with seeded(iteration.device, state.rng, state.iteration, rank):
            return Outputs(*function(state.params, state.buffers, state.opt_state, iteration, batch, layout))

    def inputs(
        self,
        state: TrainState,
        batches: Sequence[Any],
        rank: int,
        layout: Layout,
        tensor: Tensor,
        device: torch.device,
    ) -> Inputs:
        i, rng = state.iteration, state.rng
        if layout.steps > 1:
            seeds = torch.tensor([step_seed(rng, i + j, rank) for j in range(layout.steps)], device=device)
            return Inputs(seeds, [], *stacked(batches, i))
        seed = tensor(("seed", device), lambda: torch.zeros((), dtype=torch.int64, device=device))
        seed.fill_(step_seed(rng, i, rank))  # what the graph's random ops draw from
        return Inputs(seed, [], *flatten_batch(batches[0]))

    def recorded(
        self,
        state: TrainState,
        layout: Layout,
        out: Outputs,
        how: Recording,
        *,
        reached: Any,
        torn: Callable[[], bool],
    ) -> TrainState:
        i, n, metrics = state.iteration, layout.steps, state.metrics
        if not how.skip_nonfinite and not (out.finite if out.every is None else out.every).item():
            j = int((~out.finite.reshape(n)).nonzero()[0])  # one flag read per call, above
            error = NonFiniteLoss(_nonfinite_message(i + j, out.loss.reshape(n)[j]), i + j)
            if n > 1:
                done = {name: column[:j] for name, column in _columns(out, how, n, metrics).items()}
                reached = unchecked(state, metrics=metrics.record_steps(i, done), iteration=i + j)
            raise StepFailed(error, reached=reached)
        if n > 1:
            return unchecked(
                state, iteration=i + n - 1, metrics=metrics.record_steps(i, _columns(out, how, n, metrics))
            )
        keep = how.pool.keep
        values: dict[str, Scalar] = {"loss": keep(out.loss), **how.fixed}
        values.update({name: keep(value) for name, value in out.metrics.items()})
        if how.skip_nonfinite:
            values["skipped"] = keep((~out.finite).to(torch.int64) + _count(metrics, "skipped"))
        return unchecked(state, metrics=metrics.record(i, values))

    def evaluated(self, evaluation: Evaluation) -> Evaluation:
        return evaluation

    def named(self, state: TrainState, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return out


def _columns(out: Outputs, how: Recording, n: int, metrics: Metrics) -> dict[str, Sequence[Scalar]]:
    """The ``n`` steps' values of each name, in the order single steps record them."""
    columns: dict[str, Sequence[Scalar]] = {
        "loss": out.loss.unbind(0),
        **{k: [v] * n for k, v in how.fixed.items()},
        **{k: v.unbind(0) for k, v in out.metrics.items()},
    }
    if how.skip_nonfinite:
        columns["skipped"] = (_count(metrics, "skipped") + (~out.finite).to(torch.int64).cumsum(0)).unbind(0)
    return columns


class _Members:
    """A population's stacked members: a seed each, which ones still train, their metrics under ``name/m``."""

    def __repr__(self) -> str:
        return "MEMBERS"

    def layout(
        self, state: TrainState, batches: Sequence[Any], *, rank: int, world: int, scan: bool, stop: bool
    ) -> Layout:
        return members_layout(state, batches, world=world, stop=stop)

    def idle(self, state: TrainState) -> bool:
        assert state.population is not None
        return not any(state.population.training)

    def jit(self, jits: Jits, layout: Layout) -> Jit | None:
        return jits.members

    def eager(
        self,
        function: Eager,
        state: TrainState,
        batch: Any,
        iteration: torch.Tensor,
        rank: int,
        layout: Layout,
    ) -> Outputs:
        """Each member in turn, on its own rows, seeded as its solo run: that run's numbers, bit for bit."""
        i, population = state.iteration, state.population
        assert population is not None
        inner = member_batch(batch, population, i)
        rows: list[Outputs | None] = []
        for m, seed in enumerate(population.seeds):
            if not population.training[m]:
                rows.append(None)
                continue
            own = inner if layout.shared else _rows(inner, m)
            mine = _rows(state.params, m), _rows(state.buffers, m), _rows(state.opt_state, m)
            with seeded(iteration.device, seed, i, rank):
                rows.append(Outputs(*function(*mine, iteration, own, _WHOLE)))
        return _by_member(rows)

    def inputs(
        self,
        state: TrainState,
        batches: Sequence[Any],
        rank: int,
        layout: Layout,
        tensor: Tensor,
        device: torch.device,
    ) -> Inputs:
        i, population = state.iteration, state.population
        assert population is not None
        seeds = torch.tensor(
            [step_seed(s, i, rank) for s in population.seeds], dtype=torch.int64, device=device
        )
        # One tensor per pattern of members still training, kept: a run has very few.
        training = tensor(
            ("training", device, population.training),
            lambda: torch.tensor(population.training, device=device),
        )
        return Inputs(seeds, [training], *flatten_batch(member_batch(batches[0], population, i)))

    def recorded(
        self,
        state: TrainState,
        layout: Layout,
        out: Outputs,
        how: Recording,
        *,
        reached: Any,
        torn: Callable[[], bool],
    ) -> TrainState:
        i, population, metrics, pool, name = (
            state.iteration,
            state.population,
            state.metrics,
            how.pool,
            how.member_name,
        )
        assert population is not None
        training = population.training
        flags = out.finite.tolist()  # one read for every member
        bad = [m for m, f in enumerate(flags) if training[m] and not f]
        if bad and not how.skip_nonfinite:
            m = bad[0]
            message = _nonfinite_message(i, out.loss[m])
            error = NonFiniteLoss(f"member {m} ({population.labels[m]}) of the population: {message}", i)
            raise StepFailed(error, torn=torn(), reached=reached)
        # Each value of the call (one per member) in one home, recorded row by row.
        homes = {k: pool.keep_rows(v) for k, v in {"loss": out.loss, **out.metrics}.items()}
        values: dict[str, Scalar] = {}
        for m in range(population.size):
            if not training[m]:  # a stopped member records nothing more
                continue
            values.update({name(k, m): v for k, v in how.fixed.items()})
            values.update({name(k, m): column[m] for k, column in homes.items()})
            if how.skip_nonfinite:
                skipped = name("skipped", m)
                values[skipped] = pool.keep((~out.finite[m]).to(torch.int64) + _count(metrics, skipped))
        return unchecked(state, metrics=metrics.record(i, values))

    def evaluated(self, evaluation: Evaluation) -> Evaluation:
        return each_member(evaluation)

    def named(self, state: TrainState, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every member's values, each under its own name (``loss/3``)."""
        assert state.population is not None
        return {member_metric(k, m): v[m] for k, v in out.items() for m in range(state.population.size)}


ONE_RUN: Call = _OneRun()
MEMBERS: Call = _Members()


def call_of(state: TrainState) -> Call:
    """The kind of ``state``: a population's members, or a single run."""
    return ONE_RUN if state.population is None else MEMBERS


def _count(metrics: Metrics, name: str) -> Any:
    """The running count ``name`` last recorded (0 before): it lives in the metrics, so it survives a resume."""
    series = metrics.series.get(name)
    return series[-1][1] if series else 0


def _by_member(rows: list[Outputs | None]) -> Outputs:
    """The members' eager results as a population's compiled step gives them: one row per member.

    A member that no longer trains gets a finite placeholder, recorded nowhere.
    """
    first = next(row for row in rows if row is not None)
    true = torch.ones((), dtype=torch.bool, device=first.finite.device)
    placeholder = Outputs(
        torch.zeros_like(first.loss), true, {k: torch.zeros_like(v) for k, v in first.metrics.items()}
    )
    filled = [row or placeholder for row in rows]
    return Outputs(
        torch.stack([row.loss for row in filled]),
        torch.stack([torch.as_tensor(row.finite, device=true.device).reshape(()) for row in filled]),
        {k: torch.stack([row.metrics[k] for row in filled]) for k in first.metrics},
    )


def _rows(tree: Any, m: int) -> Any:
    """Member ``m``'s rows of a stacked tree: views, so an eager step writing into them writes the population's."""
    return pytree.tree_map(lambda t: t[m] if isinstance(t, torch.Tensor) else t, tree)
