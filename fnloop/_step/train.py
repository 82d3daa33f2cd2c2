"""The training step as a value: ``TrainStep``, one step or several per call, in place where the fold owns the state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._core.failure import StepFailed, unwrapped
from fnloop._core.metrics import Scalar
from fnloop._core.population import PerMember, Population, member_metric
from fnloop._core.shards import Shards
from fnloop._core.state import TrainState, unchecked
from fnloop._core.steps import Applied
from fnloop._step.batching import flatten_batch
from fnloop._step.donation import Targets, opt_containers, shared
from fnloop._step.errors import (
    _GRAPH_BREAK,
    _RECOMPILED,
    CompileError,
    CompileFailed,
    GraphBreakError,
    NonFiniteLoss,
    RecompileError,
    _compile_failed,
    _nonfinite_message,
)
from fnloop._step.jit import (
    Entry,
    Jit,
    OverBudget,
    RandomInGraph,
    TraceError,
)
from fnloop._step.kernel import (
    LossFn,
    _cloned,
    _device,
    _leaf_name,
)
from fnloop._step.pool import ScalarPool
from fnloop._step.seeding import _seeded, step_seed
from fnloop.distributed import world_size
from fnloop.optim import Optimizer

__all__ = ["TrainStep"]


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
    members: Jit | None = None
    """The population's kernel (every member at once, vmapped), traced and compiled, when ``compiled``."""
    _counters: dict[torch.device, torch.Tensor] = attrs.field(factory=dict)
    _seeds: dict[torch.device, torch.Tensor] = attrs.field(factory=dict)
    _layout: list[Any] = attrs.field(factory=list)
    _training: dict[Any, torch.Tensor] = attrs.field(factory=dict)
    _names: dict[tuple[str, int], str] = attrs.field(factory=dict)
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
        if state.population is not None:
            return self._members(state, batch, leaves, ospec, mine)
        _not_per_member(batch)
        params, buffers, opt_state = state.params, state.buffers, state.opt_state
        if not self.model.training:
            self.model.train()
        i = state.iteration
        shards = _layout(state, self.rank)
        device = leaves[0].device if leaves else _device(params)
        iteration = self._iteration(device)
        iteration.fill_(i)
        donated = [*params.values(), *buffers.values(), *leaves]
        versions = [t._version for t in donated]
        jit = self.jit
        try:
            if jit is None:
                with _seeded(device, state.rng, i, self.rank):
                    loss, finite, metrics = self.function(
                        params, buffers, opt_state, iteration, batch, shards
                    )
            else:
                tensors, batch_structure = flatten_batch(batch)
                structure = (tuple(params), tuple(buffers), ospec, batch_structure, shards)
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

    def _skipped(self, state: TrainState, finite: torch.Tensor, name: str = "skipped") -> torch.Tensor:
        # The running count lives in the metrics (saved with the state), so it survives a resume.
        series = state.metrics.series.get(name)
        before = series[-1][1] if series else 0
        return (~finite).to(torch.int64) + before

    def _members(
        self, state: TrainState, batch: Any, leaves: list[torch.Tensor], ospec: pytree.TreeSpec, mine: bool
    ) -> TrainState:
        """One step of every member of a population that still trains (see ``fnloop/_step/members.py``)."""
        population = _population_of(state, self.rank)
        params, buffers, opt_state = state.params, state.buffers, state.opt_state
        if not self.model.training:
            self.model.train()
        i, size, training = state.iteration, population.size, population.training
        if not any(training):  # every member has stopped: nothing trains, nothing is recorded
            return state
        shared = type(batch) is not PerMember
        inner = batch if shared else _member_rows(batch, size, i)
        device = leaves[0].device if leaves else _device(params)
        iteration = self._iteration(device)
        iteration.fill_(i)
        donated = [*params.values(), *buffers.values(), *leaves]
        versions = [t._version for t in donated]
        columns: dict[str, list[Any]] = {}  # name -> each member's value (None: stopped)
        try:
            if self.members is None:  # eager: each member's own step on its rows, as its solo run steps
                for m, seed in enumerate(population.seeds):
                    if not training[m]:
                        continue
                    rows = _rows(params, m), _rows(buffers, m), _rows(opt_state, m)
                    own = inner if shared else _rows(inner, m)
                    with _seeded(device, seed, i, self.rank):
                        loss, finite, metrics = self.function(*rows, iteration, own, None)
                    for name, value in {"loss": loss, "finite": finite, **metrics}.items():
                        columns.setdefault(name, [None] * size)[m] = value
                finite_all = torch.stack([f for f in columns["finite"] if f is not None])
            else:
                tensors, batch_structure = flatten_batch(inner)
                structure = (
                    tuple(params),
                    tuple(buffers),
                    ospec,
                    batch_structure,
                    size,
                    shared,
                    not self.skip_nonfinite,
                )
                seeds = torch.tensor(
                    [step_seed(s, i, self.rank) for s in population.seeds], dtype=torch.int64, device=device
                )
                trains = self._trains(device, training)
                flat = [*donated, iteration, seeds, trains, *tensors]
                entry = self._entry(self.members, structure, flat, i)
                outputs = entry.compiled(*flat)
                finite_all = outputs[1] | ~trains
                # Each value of the graph's (one per member) in one home, recorded row by row.
                keep_rows = self._pool.keep_rows
                for name, column in zip(("loss", "finite", *entry.context), outputs):
                    columns[name] = keep_rows(column) if name != "finite" else list(column.unbind(0))
        except BaseException as exc:  # noqa: BLE001 - re-raised, wrapped for the fold
            raise StepFailed(exc, torn=mine and _wrote(donated, versions)) from None
        finite_column = columns.pop("finite")
        if not self.skip_nonfinite and not finite_all.all().item():  # one flag read for every member
            m = next(m for m, f in enumerate(finite_column) if training[m] and not f.item())
            message = _nonfinite_message(i, columns["loss"][m])
            error = NonFiniteLoss(f"member {m} ({population.labels[m]}) of the population: {message}", i)
            # Compiled, the graph left every member as it was. Eager, the members before this one
            # were written: a state the step owned is torn.
            torn = self.members is None and mine and _wrote(donated, versions)
            raise StepFailed(error, torn=torn)
        names = self._member_names(size)
        recorded: dict[str, Scalar] = {}
        keep = self._pool.keep
        for m in range(size):
            if not training[m]:  # a stopped member records nothing more
                continue
            recorded.update({names(k, m): v for k, v in self.fixed.items()})
            for name, values in columns.items():
                value = values[m]
                recorded[names(name, m)] = keep(value) if self.members is None else value
            if self.skip_nonfinite:
                skipped = names("skipped", m)
                recorded[skipped] = keep(self._skipped(state, finite_column[m], skipped))
        return unchecked(state, metrics=state.metrics.record(i, recorded))

    def _member_names(self, size: int) -> Callable[[str, int], str]:
        # A population's metric names (loss/3), made once: a step records every member's.
        cache = self._names

        def name(metric: str, m: int) -> str:
            key = (metric, m)
            found = cache.get(key)
            if found is None:
                found = cache[key] = member_metric(metric, m)
            return found

        return name

    def _trains(self, device: torch.device, training: tuple[bool, ...]) -> torch.Tensor:
        # One tensor per pattern of members still training, kept: a run has very few.
        key = (device, training)
        tensor = self._training.get(key)
        if tensor is None:
            tensor = self._training[key] = torch.tensor(training, dtype=torch.bool, device=device)
        return tensor

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
        if multi is None or state.population is not None:  # the steps one by one, each seeded as alone
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
        for batch in batches:
            _not_per_member(batch)
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
            shards = _layout(state, self.rank)
            structure = (
                tuple(params),
                tuple(buffers),
                ospec,
                batch_structure,
                n,
                not self.skip_nonfinite,
                shards,
            )
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
        """How many graphs the step has compiled: 1 over a healthy run, 0 when not compiled.

        A step that has trained both single runs and a population has compiled one graph for each.
        """
        return sum(0 if jit is None else jit.compiles for jit in (self.jit, self.multi, self.members))

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


def _layout(state: TrainState, rank: int) -> Shards | None:
    """The state's ``Shards``, checked against the process group this process is in."""
    shards = state.shards
    if shards is None:
        return None
    world = world_size()
    if shards.world != world or shards.rank != rank:
        raise ValueError(
            f"the state is rank {shards.rank}'s part of a state sharded over {shards.world} rank(s), "
            f"but this process is rank {rank} of {world}. A sharded state trains on the ranks it was "
            "built for: build it with fnloop.init(..., shard=...) on each rank, or load a checkpoint "
            "with a template built so (fnloop.checkpoint.resume reshards it to this world size)."
        )
    return shards


def _population_of(state: TrainState, rank: int) -> Population:
    """The state's ``Population``, refused where a population's step does not run yet."""
    population = state.population
    assert population is not None
    if state.shards is not None or world_size() > 1:
        raise ValueError(
            "a population's step runs in a single process: its members are the batch of one step, "
            "not shards or replicas of one another. Train the population without torchrun and "
            "without fnloop.init(..., shard=...)."
        )
    return population


def _member_rows(batch: PerMember, size: int, i: int) -> Any:
    """The tensors of a per-member batch, refused unless each has one row per member, members first."""
    for path, leaf in pytree.tree_flatten_with_path(batch.batch)[0]:
        if isinstance(leaf, torch.Tensor) and (leaf.ndim == 0 or leaf.shape[0] != size):
            n = leaf.shape[0] if leaf.ndim else 0
            rows = "no member dimension" if leaf.ndim == 0 else f"rows for {n} member{'s' * (n != 1)}"
            raise ValueError(
                f"train_step at iteration {i}: a PerMember batch gives member m the row m of each of its "
                f"tensors, and the population has {size} members, but its tensor "
                f"batch{pytree.keystr(path)} of shape {tuple(leaf.shape)} has {rows}. Give "
                f"fnloop.data.per_member one stream per member, {size} in all, in the members' order."
            )
    return batch.batch


def _not_per_member(batch: Any) -> None:
    """Refuse a per-member batch given to a single run's step."""
    if type(batch) is PerMember:
        raise ValueError(
            "train_step: a PerMember batch (fnloop.data.per_member) gives each member of a population its own batch, "
            "but this state is a single run's (state.population is None). Give the run one stream itself "
            "(streams[m] of the list given to per_member), or train a population (fnloop.population)."
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
