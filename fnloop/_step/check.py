"""``check_step``: a compiled step's gradients and update, parameter by parameter, against the eager step's.

A compiler can be wrong without a warning: on torch 2.13 inductor trained the
routers of a mixture of experts on a gradient 100% off while the loss agreed to
1e-5 (``fnloop/_compile/known.py``). A loss cannot show it; the gradients can.
``check_step`` runs one step three ways on the same state and batch: compiled
(the step's own backend and options), as the traced graph run op by op
(``backend="graph"``), and eagerly (``compile=False``), and compares each
trained parameter's gradient, and what the step's own optimizer makes of it.
Where they differ it says whose the difference is: inductor's (the graph run
op by op agrees with eager) or the trace's (it does not).

The gradients are the step's own, taken from inside it: the same kernel, with
an update stage that returns the gradients in place of the new parameters
(``Kernel.transforms``), so no optimizer's arithmetic hides them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from fnloop._core.messages import got
from fnloop._core.state import TrainState
from fnloop._step.calls import ONE_RUN, call_of
from fnloop._step.determinism import VaryingOrder
from fnloop._step.kernel import Kernel, Updated, UpdateStage
from fnloop._step.layout import Layout
from fnloop._step.seeds import seeded
from fnloop._step.train import TrainStep

__all__ = ["ParameterCheck", "StepCheck", "check_step"]

RTOL = 1e-5
"""The default tolerance in float32: a difference of a parameter's gradient, over its norm."""

RTOL_AUTOCAST = 2e-2
"""The default tolerance of a step under ``autocast`` (bfloat16 or float16 kernels round at 3e-3 to 8e-3)."""

NOISE = 1e-5
"""Below this share of the model's gradient, a gradient is rounding noise: an attention's key bias,
whose true gradient is zero, came out at 1e-12 of a BERT's (its compiled and eager values differing
by as much) and differed by 2e-11 of a ViT's between the trace and eager. The smallest true gradient
met was an attention's query weight at initialization, 2e-5 of BERT's. A parameter's gradient is
judged against the larger of its norm and this share
of the whole model's; an element of it this small, against the model's largest, is left out of
the update's comparison (Adam turns noise into a full step of either sign)."""

UPDATE_RTOL = 1e-3
"""The default tolerance of an update, over the norm of the update. Looser than a gradient's: Adam
divides each gradient element by its magnitude plus ``eps``, so an element near ``eps`` turns a
last-bit difference of the gradient into a large one of its update (seen: 4e-5 on a mixture of
experts whose gradients agreed to 2e-7). A wrong update formula misses by far more."""


@attrs.frozen
class ParameterCheck:
    """One trained parameter, compiled against the reference (eager, or the graph run op by op).

    Attributes:
        name: the parameter's name in ``state.params``.
        gradient: ``||compiled - reference|| / ||reference||`` of its gradient
            (over ``NOISE`` times the model's gradient norm, where that is larger).
        update: ``||compiled - reference||`` of its value after one step of the
            step's own optimizer, over the norm of the reference's change (where
            the gradient is more than noise).
        trace: the gradient of the traced graph run op by op against eager's,
            as ``gradient``; ``None`` where they cannot be compared (the step
            draws random numbers, which eager draws otherwise).
        ok: both within the check's tolerances.
    """

    name: str
    gradient: float
    update: float
    trace: float | None
    ok: bool


_COMPILER = (
    "The traced graph run op by op (backend='graph') agrees with {reference}: the difference is the "
    "compiler's (inductor, torch {torch}). Fixes: a newer torch (docs/step.md#known-miscompiles lists "
    "the miscompiles fnloop knows and routes around), or build this step with train_step(..., "
    "backend='graph') (slower, right) or compile=False; and please report it with this table."
)
_TRACE = (
    "The traced graph run op by op (backend='graph') differs from eager too: the difference is in "
    "fnloop's trace of the step, not in the compiler. Run the step eagerly (compile=False) and please "
    "report it with this table."
)


@attrs.frozen
class StepCheck:
    """What ``check_step`` found: each trained parameter's gradient and update, compiled against the reference.

    ``str(check)`` is a table of the parameters off (or the worst few), with
    whose the difference is and the fix. ``ok`` is ``True`` when every
    parameter's gradient is within ``rtol`` and its update within ``update_rtol``.

    Attributes:
        parameters: one ``ParameterCheck`` per trained parameter, in the state's order.
        reference: ``"eager"`` (``compile=False``), or ``"the graph run op by op"``
            where the step draws random numbers (dropout), which the eager step
            draws from torch's generator instead.
        rtol: the gradients' tolerance the check judged by.
        update_rtol: the updates' tolerance.
        backend: the compiled step's backend (``"inductor"`` or ``"graph"``).
    """

    parameters: tuple[ParameterCheck, ...]
    reference: str
    rtol: float
    update_rtol: float
    backend: str

    @property
    def ok(self) -> bool:
        """Whether every parameter's gradient agrees within ``rtol``, and its update within ``update_rtol``."""
        return all(p.ok for p in self.parameters)

    @property
    def off(self) -> tuple[str, ...]:
        """The names of the parameters beyond the tolerance, in the state's order."""
        return tuple(p.name for p in self.parameters if not p.ok)

    @property
    def first(self) -> str | None:
        """The first parameter beyond the tolerance, or ``None``."""
        off = self.off
        return off[0] if off else None

    def __str__(self) -> str:
        off = [p for p in self.parameters if not p.ok]
        shown = off or sorted(self.parameters, key=lambda p: -p.gradient)[:5]
        width = max([len(p.name) for p in shown] + [9])
        lines = [
            f"the compiled step ({self.backend}) against {self.reference}, {len(self.parameters)} "
            f"trained parameters, rtol {self.rtol:g} (updates {self.update_rtol:g}): "
            + (f"{len(off)} off, the first {off[0].name!r}" if off else "every one agrees"),
            f"  {'parameter':<{width}}  gradient   update     graph vs eager",
        ]
        for p in shown:
            trace = "-" if p.trace is None else f"{p.trace:.2e}"
            mark = "  OFF" if not p.ok else ""
            lines.append(f"  {p.name:<{width}}  {p.gradient:.2e}   {p.update:.2e}   {trace}{mark}")
        if not off:
            lines.append(f"  (the {len(shown)} largest gradient differences)")
            return "\n".join(lines)
        traced = [p.trace for p in off if p.trace is not None]
        if self.reference != "eager" or (traced and max(traced) <= self.rtol):
            lines.append(_COMPILER.format(reference=self.reference, torch=torch.__version__.split("+")[0]))
        elif traced:
            lines.append(_TRACE)
        return "\n".join(lines)


def check_step(
    step: Any,
    state: TrainState,
    batch: Any,
    *,
    rtol: float | None = None,
    update_rtol: float = UPDATE_RTOL,
) -> StepCheck:
    """Compare one compiled step's gradients and update with the eager step's, parameter by parameter.

    Run it once per new model (or new torch): a compiler bug that trains a
    parameter on a wrong gradient leaves the loss nearly as it was, so only
    the gradients show it. The step runs on ``state`` and ``batch`` compiled,
    as its traced graph run op by op, and eagerly; ``state`` itself is never
    changed. Where a parameter differs, the check names it and says whose the
    difference is (inductor's, or the trace's) and the fix.

    Args:
        step: a compiled step from ``fnloop.train_step`` (the one you train with;
            for ``compile="model"``, the gradients are its own graph's).
        state: a single run's state, as ``fnloop.init`` makes it (in one process).
        batch: one batch, as the step takes it.
        rtol: the tolerance of a gradient: ``||compiled - reference|| /
            ||reference||`` (a gradient below 1e-5 of the model's, rounding
            noise, over that share: ``NOISE``). ``None``: ``1e-5``, or ``2e-2`` under ``autocast``.
        update_rtol: the tolerance of an update, the parameter after one step
            of the step's own optimizer: the difference over the norm of the
            reference's change (plus the parameter's own rounding). Looser than
            ``rtol`` (``UPDATE_RTOL``): Adam divides by a gradient's magnitude,
            which turns last bits of tiny gradients into larger ones.

    Returns:
        A ``StepCheck``: ``ok``, the first parameter off, and a table (``str``).

    Raises:
        TypeError: ``step`` is not a compiled ``TrainStep``.
        ValueError: ``state`` is a population's or sharded across ranks.

    Examples:
        >>> import fnloop as fl
        >>> model = torch.nn.Linear(3, 1)
        >>> def mse(forward, batch):
        ...     return ((forward(batch[0]) - batch[1]) ** 2).mean()
        >>> step = fl.train_step(model, mse, fl.optim.sgd(0.1), backend="graph")
        >>> state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
        >>> check = fl.check_step(step, state, (torch.ones(4, 3), torch.zeros(4, 1)))
        >>> check.ok, check.reference
        (True, 'eager')
    """
    step = _compiled_step(step)
    _check_state(state)
    kernel = step.kernel
    if rtol is None:
        rtol = RTOL if kernel.autocast is None else RTOL_AUTOCAST
    rtol, update_rtol = _tolerance("rtol", rtol), _tolerance("update_rtol", update_rtol)
    jit = step.jit if step.gradient is None else step.gradient.jit
    assert jit is not None
    backend = jit.backend

    def built(kernel: Kernel, how: str) -> TrainStep:
        from fnloop._step.build import step_of

        if how == "eager":
            made = step_of(
                attrs.evolve(kernel, eager=True),
                plan=step.plan,
                compile=False,
                deterministic=step.deterministic,
            )
        else:
            made = step_of(
                kernel,
                plan=step.plan,
                compile=True,
                options=jit.options,
                deterministic=step.deterministic,
                backend=backend if how == "compiled" else "graph",
            )
        assert isinstance(made, TrainStep)
        return made

    grads_of = attrs.evolve(kernel, transforms=(*kernel.transforms, _gradients_instead))
    trained = [k for k in state.params if k not in kernel.fixed]

    def ran(made: TrainStep) -> Mapping[str, torch.Tensor]:
        # A step of the check's own: the user's step warns of its run-to-run order, not each of these.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", VaryingOrder)
            return _params(made, state, batch, trained)

    if step.gradient is None:
        compiled_step = built(grads_of, "compiled")
        compiled = ran(compiled_step)
        assert compiled_step.jit is not None
        assert compiled_step.jit.last is not None
        random = compiled_step.jit.last.random
    else:  # compile="model": the step's own graph gives the gradients
        compiled, random = _outside(step, state, batch, trained)
    graph = compiled if backend == "graph" else ran(built(grads_of, "graph"))
    eager = ran(built(grads_of, "eager"))
    reference = graph if random else eager
    # The step's own update, compiled, against the reference's.
    after = _params(step, state, batch, trained)
    update_reference = ran(built(kernel, "graph" if random else "eager"))
    scale = math.sqrt(sum(reference[k].double().square().sum().item() for k in trained))
    largest = max((reference[k].abs().max().item() for k in trained if reference[k].numel()), default=0.0)
    rows = []
    floor = NOISE * scale
    for name in trained:
        want = reference[name]
        gradient = _relative(compiled[name], want, floor)
        ok = gradient <= rtol
        # The update where the gradient is more than noise: elsewhere Adam's step is a coin's toss.
        kept = want.abs() > NOISE * largest
        before, new = state.params[name][kept].double(), update_reference[name][kept].double()
        change = (new - before).norm().item()
        rounding = 8 * torch.finfo(state.params[name].dtype).eps * new.norm().item()
        missed = (after[name][kept].double() - new).norm().item()
        update = missed / change if change else (0.0 if missed == 0 else math.inf)
        ok = ok and missed <= update_rtol * change + rounding
        trace = None if random else _relative(graph[name], eager[name], floor)
        rows.append(ParameterCheck(name, gradient, update, trace, ok))
    return StepCheck(tuple(rows), "the graph run op by op" if random else "eager", rtol, update_rtol, backend)


def _outside(
    step: TrainStep, state: TrainState, batch: Any, names: list[str]
) -> tuple[dict[str, torch.Tensor], bool]:
    """The gradients of a ``compile="model"`` step's graph, seeded as its step on ``state``, and whether it draws."""
    assert step.gradient is not None
    device = next(iter(state.params.values())).device
    iteration = torch.tensor(state.iteration, device=device)
    scale = step.kernel.loss_scale(state.opt_state)
    with seeded(device, state.rng, state.iteration), warnings.catch_warnings():
        warnings.simplefilter("ignore", VaryingOrder)
        found, _ = step.gradient(dict(state.params), dict(state.buffers), batch, scale, Layout(), iteration)
    last = step.gradient.jit.last
    assert last is not None
    return {k: found.grads[k].to(state.params[k].dtype) for k in names}, last.random


def _tolerance(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"check_step({name}=...) must be a positive finite number ({got(value)}).")
    return float(value)


def _gradients_instead(update: UpdateStage) -> UpdateStage:
    """An update stage that returns each trained parameter's gradient as its new value, the optimizer unused."""

    def gradients(
        grads: dict, opt_state: Any, params: dict, iteration: torch.Tensor, total: Any = None
    ) -> Updated:
        return Updated({k: g.to(params[k].dtype) for k, g in grads.items()}, opt_state, {})

    return gradients


def _params(
    step: Callable[..., TrainState], state: TrainState, batch: Any, names: list[str]
) -> Mapping[str, torch.Tensor]:
    """The trained parameters after one step of ``step`` from ``state`` (which it does not write)."""
    new = step(state, batch)
    return {k: new.params[k] for k in names}


def _relative(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """``||a - b|| / max(||b||, floor)`` in double precision; 0 where both are zero."""
    miss = (a.double() - b.double()).norm().item()
    size = max(b.double().norm().item(), floor)
    if size == 0:
        return 0.0 if miss == 0 else math.inf
    return miss / size


def _compiled_step(step: object) -> TrainStep:
    inner = getattr(step, "step", None)  # train_step(..., donate=False) wraps the TrainStep
    found = step if isinstance(step, TrainStep) else inner if isinstance(inner, TrainStep) else None
    if found is None:
        raise TypeError(
            f"check_step() expected a step from fnloop.train_step ({got(step)}); it compares that "
            "step's compiled gradients with its eager run."
        )
    if found.jit is None and found.gradient is None:
        raise TypeError(
            "check_step() compares a compiled step with its eager run, and this step runs eagerly "
            "(train_step(..., compile=False)): pass the compiled step you train with."
        )
    return found


def _check_state(state: object) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"check_step() expected a fnloop.TrainState as its state ({got(state)}).")
    if call_of(state) is not ONE_RUN:
        raise ValueError(
            "check_step() checks a single run, and this state is a population's: check one "
            "member's, fnloop.member(state, i), with the same step."
        )
    if state.shards is not None and state.shards.world > 1:
        raise ValueError(
            f"check_step() runs in one process, and this state is sharded over {state.shards.world} "
            "ranks: check the model in one process, with fnloop.init(model, ...) without shard=."
        )
