"""``find_lr``: a learning-rate range as one population run: Lightning's range test, and constant rates beside it.

Lightning's tuner (``Tuner.lr_find``) runs a range test: one run whose rate
grows step by step from ``min_lr`` to ``max_lr``, its loss smoothed, the
suggestion where that loss falls fastest against the rate; then it restores
the model. Here that range test is one member of a population
(``fnloop.population``), and ``num`` members beside it each train at a
constant rate of the range: one compiled step trains them all, from the same
start, on the same batches. Nothing is restored because nothing of the
caller's is changed: the members are copies.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch

from fnloop._core.fold import BatchesExhausted
from fnloop._core.messages import got
from fnloop._core.metrics import Metrics, to_floats
from fnloop._core.state import TrainState
from fnloop._population import population
from fnloop._run import run
from fnloop._step.build import init, train_step
from fnloop.optim import Optimizer, chain, inject, scale_by_learning_rate

__all__ = ["LRFinding", "find_lr"]

RULES = ("range", "steepest", "lowest")
"""How ``find_lr`` suggests a rate: Lightning's rule on the range test; where the constant rates'
final loss falls fastest; where it is lowest."""

SMOOTHING = 0.98
"""The range test's loss is smoothed as Lightning's ``lr_find`` smooths it (its ``beta``)."""

SKIP = (10, 1)
"""Lightning's ``suggestion(skip_begin=10, skip_end=1)``: the steps left out at each end."""

MOST_RATES = 256
"""The most rates ``find_lr`` tries: each is a member, a copy of the state, trained in one step."""

DIVERGED = 4.0
"""A member whose final loss is more than this many times the lowest is taken to have diverged
(Lightning's ``early_stop_threshold``)."""


@attrs.frozen
class LRFinding:
    """What ``find_lr`` found: each rate's losses, the final loss by rate, and the suggestion.

    Attributes:
        lrs: the learning rates tried, one member each, lowest first.
        losses: each member's loss at each step (``nan`` where a step was not finite).
        final: each member's mean loss over the last quarter of its steps; ``nan``
            where it diverged (not finite, or ``DIVERGED`` times the lowest at the
            rates up to its own).
        ramp: the range test, as Lightning records it: each step's rate and
            smoothed loss, up to the step where it diverged.
        suggestions: the rate each rule suggests (``None`` where it has none),
            ``("range", ...)``, ``("steepest", ...)``, ``("lowest", ...)``.
        rule: the rule chosen: ``"range"`` (Lightning's rule on the range
            test), ``"steepest"`` (where ``final`` falls fastest against
            ``log10(lr)``, before the first divergence) or ``"lowest"``.
    """

    lrs: tuple[float, ...]
    losses: tuple[tuple[float, ...], ...]
    final: tuple[float, ...]
    ramp: tuple[tuple[float, float], ...]
    suggestions: tuple[tuple[str, float | None], ...]
    rule: str

    @property
    def suggestion(self) -> float | None:
        """The rate ``rule`` suggests (``None`` where there were too few finite losses to choose)."""
        return dict(self.suggestions)[self.rule]

    def __str__(self) -> str:
        lines = [f"{'lr':>10}  {'final loss':>10}"]
        for lr, loss in zip(self.lrs, self.final):
            mark = "  <- suggested" if lr == self.suggestion else ""
            shown = "diverged" if math.isnan(loss) else f"{loss:.4g}"
            lines.append(f"{lr:>10.3g}  {shown:>10}{mark}")
        for rule, suggested in self.suggestions:
            said = "none" if suggested is None else f"{suggested:.3g}"
            chosen = "  <- the suggestion" if rule == self.rule else ""
            lines.append(f"suggested learning rate ({rule}): {said}{chosen}")
        return "\n".join(lines)

    def plot(self, path: str | None = None) -> Any:
        """A matplotlib ``Figure``: each rate's loss by step, and the final loss by rate, the suggestion marked.

        Needs matplotlib (``pip install -e ".[plot]"``). ``path``: also save it there.
        """
        import matplotlib

        if path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, (curves, by_rate) = plt.subplots(1, 2, figsize=(10, 4))
        colors = matplotlib.colormaps["viridis"]
        for m, (lr, losses) in enumerate(zip(self.lrs, self.losses)):
            curves.plot(losses, color=colors(m / max(1, len(self.lrs) - 1)), label=f"{lr:.2g}")
        curves.set(xlabel="step", ylabel="loss", yscale="log", title="each rate's loss")
        finite = [(lr, loss) for lr, loss in zip(self.lrs, self.final) if not math.isnan(loss)]
        if finite:
            by_rate.plot(*zip(*finite), marker="o", label=f"after {len(self.losses[0])} steps at each rate")
        if self.ramp:
            by_rate.plot(*zip(*self.ramp), color="gray", label="the range test, smoothed")
        if self.suggestion is not None:
            by_rate.axvline(
                self.suggestion, color="red", linestyle="--", label=f"suggested {self.suggestion:.2g}"
            )
        by_rate.legend()
        by_rate.set(xscale="log", xlabel="learning rate", ylabel="loss", title=f"rule: {self.rule}")
        figure.tight_layout()
        if path is not None:
            figure.savefig(path, dpi=100)
        return figure


def find_lr(
    model: torch.nn.Module,
    loss_fn: Callable[..., Any],
    optimizer: Callable[[float], Optimizer],
    batches: Iterable[Any],
    *,
    min_lr: float = 1e-6,
    max_lr: float = 1.0,
    num: int = 16,
    steps: int = 100,
    rule: str = "range",
    seed: int = 0,
    state: TrainState | None = None,
    **step_options: Any,
) -> LRFinding:
    """A range test and ``num`` constant rates from ``min_lr`` to ``max_lr``, as one population; suggest a rate.

    Every member starts from the same weights (``model``'s, or ``state``'s),
    sees the same batches and draws the same dropout (the same seed), and
    trains ``steps`` steps, its rate injected into its optimizer's state
    (``fnloop.optim.inject``): one compiled step trains them all.

    - **The range test** is Lightning's: one member whose rate grows
      exponentially from ``min_lr`` to ``max_lr`` over the ``steps`` (its
      updates scaled by ``growth ** iteration``), its loss smoothed as
      Lightning smooths it (``SMOOTHING``), stopped where the smoothed loss
      is ``DIVERGED`` times the lowest so far (``LRFinding.ramp``).
    - **The constant rates**: ``num`` members, log-spaced over the range; a
      member whose steps are not finite skips them (``skip_nonfinite``) and
      counts as diverged, as does one whose final loss is ``DIVERGED`` times
      the lowest at the rates up to its own (``LRFinding.final``).

    The suggestion (``rule``): ``"range"``, Lightning's rule on the range
    test (where its smoothed loss falls fastest against the rate, the first
    10 steps and the last left out; ``None`` with fewer than 13 steps);
    ``"steepest"``, where the constant rates' final loss falls fastest
    against ``log10(lr)``, among the rates before the first that diverged;
    ``"lowest"``, the constant rate of the lowest final loss. All three are in
    ``LRFinding.suggestions``. ``model`` and ``state`` are not changed. The
    memory is ``num + 1`` copies of the state.

    Args:
        model: the module to train (its structure and, without ``state``, its weights).
        loss_fn: as ``train_step``'s.
        optimizer: ``optimizer(lr) -> Optimizer``, for example ``fnloop.optim.adamw``
            or ``lambda lr: fl.optim.adamw(fl.optim.warmup(lr, 10))``.
        batches: what ``run`` takes; ``steps`` of them are used. A list (any
            ``Sequence``) is gone through again as often as needed, as epochs are.
        min_lr, max_lr: the range of rates, both positive, ``min_lr < max_lr``.
        num: how many constant rates (members beside the range test), 3 to
            ``MOST_RATES`` (256).
        steps: steps per member, at least 4 (Lightning's ``num_training``: 100).
        rule: ``"range"`` (Lightning's), ``"steepest"`` or ``"lowest"``.
        seed: the members' seed (dropout draws).
        state: a single run's state to start from (a checkpoint's, say) in
            place of ``model``'s weights; its optimizer state is not used.
        **step_options: passed to ``train_step`` (``compile``, ``autocast``, ``backend``...).

    Returns:
        An ``LRFinding``: ``suggestion``, the table (``str``), ``plot()``.

    Examples:
        >>> import fnloop as fl
        >>> model = torch.nn.Linear(4, 1)
        >>> data = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(20)]
        >>> def mse(forward, batch):
        ...     return ((forward(batch[0]) - batch[1]) ** 2).mean()
        >>> found = fl.find_lr(model, mse, fl.optim.sgd, data, steps=20, num=6, compile=False)
        >>> len(found.lrs), [rule for rule, _ in found.suggestions]
        (6, ['range', 'steepest', 'lowest'])
    """
    lrs = _rates(min_lr, max_lr, num)
    if type(steps) is not int or steps < 4:
        raise ValueError(f"find_lr(steps=...) must be an int of at least 4 ({got(steps)}).")
    if rule not in RULES:
        raise ValueError(f"find_lr(rule=...) must be one of {RULES} ({got(rule)}).")
    if not callable(optimizer):
        raise TypeError(
            f"find_lr(optimizer=...) expects a function of the learning rate, such as fnloop.optim.adamw "
            f"or lambda lr: fl.optim.adamw(lr, weight_decay=0.1) ({got(optimizer)})."
        )
    if state is not None and (not isinstance(state, TrainState) or state.population is not None):
        raise TypeError(f"find_lr(state=...) expects a single run's TrainState ({got(state)}).")
    start = None if state is None else ({k: v.clone() for k, v in state.params.items()}, state.buffers)

    ramped = _ramped(optimizer)
    growth = (max_lr / min_lr) ** (1 / steps)  # Lightning's exponential range, at max_lr in its last step

    def member(seed: int, lr: float, growth: float) -> TrainState:
        made = init(model, inject(ramped, lr=lr, growth=growth), seed=seed, max_iter=steps)
        if start is not None:
            made = attrs.evolve(made, params=dict(start[0]), buffers=dict(start[1]))
        return attrs.evolve(made, metrics=Metrics(window=steps))

    # The constant rates, then the range test: one more member, its rate growing step by step.
    first = lrs[0] * growth  # as Lightning's scheduler starts: one step into the range
    members = population(member, seeds=[seed] * (num + 1), lr=[*lrs, first], growth=[1.0] * num + [growth])
    made = inject(ramped, lr=lrs[0], growth=1.0)
    step = train_step(model, loss_fn, made, skip_nonfinite=True, **step_options)
    if isinstance(batches, Sequence):  # a list of batches is gone through again, as epochs go
        batches = itertools.islice(itertools.cycle(batches), steps)
    try:
        final = run(members, step, batches)
    except BatchesExhausted as exhausted:
        raise ValueError(
            f"find_lr(): the batches ran out before {steps} steps ({exhausted}); give a list of batches "
            f"(gone through again as often as needed), a stream of at least {steps}, or fewer steps."
        ) from exhausted
    losses = tuple(_losses(final, m, steps) for m in range(num))
    ends = _final(losses)
    ramp = _smoothed([lrs[0] * growth ** (t + 1) for t in range(steps)], _losses(final, num, steps))
    suggestions = (
        ("range", _lightning(ramp)),
        ("steepest", _suggested(lrs, ends, "steepest")),
        ("lowest", _suggested(lrs, ends, "lowest")),
    )
    return LRFinding(lrs, losses, ends, ramp, suggestions, rule)


def _ramped(optimizer: Callable[[float], Optimizer]) -> Callable[..., Optimizer]:
    """``optimizer(lr)`` with its updates scaled by ``growth ** iteration``: a rate growing as a range test's."""

    def make(lr: Any, growth: Any) -> Optimizer:
        built = optimizer(lr)
        if not isinstance(built, Optimizer):
            raise TypeError(
                f"find_lr(optimizer=...): optimizer(lr) must return a fnloop.optim.Optimizer ({got(built)})."
            )
        # Two scalings by -x: +growth**iteration (an update is the rate times a direction, weight decay too).
        grow = chain(scale_by_learning_rate(lambda it: growth**it), scale_by_learning_rate(1.0))
        return Optimizer(chain(built.transform, grow))

    return make


def _smoothed(lrs: Sequence[float], losses: Sequence[float]) -> tuple[tuple[float, float], ...]:
    """The range test as Lightning's ``_LRCallback`` records it: each rate and its smoothed loss, to the stop.

    The loss is averaged exponentially (``SMOOTHING``), corrected for its start as Lightning does
    (by the optimizer steps taken, one more than the index); the test stops after the step whose
    smoothed loss is ``DIVERGED`` times the lowest so far, or at a step that is not finite.
    """
    kept: list[tuple[float, float]] = []
    average, best = 0.0, 0.0
    for t, (lr, loss) in enumerate(zip(lrs, losses)):
        if not math.isfinite(loss):
            break
        average = SMOOTHING * average + (1 - SMOOTHING) * loss
        smoothed = average / (1 - SMOOTHING ** (t + 2))
        kept.append((lr, smoothed))
        if t > 0 and smoothed > DIVERGED * best:
            break
        if smoothed < best or t == 0:
            best = smoothed
    return tuple(kept)


def _lightning(ramp: Sequence[tuple[float, float]]) -> float | None:
    """Lightning's suggestion: where the smoothed loss falls fastest against the rate, its ends left out."""
    begin, end = SKIP
    window = ramp[begin:-end]
    if len(window) < 2:
        return None
    lrs = torch.tensor([lr for lr, _ in window], dtype=torch.float64)
    (slope,) = torch.gradient(torch.tensor([loss for _, loss in window], dtype=torch.float64), spacing=(lrs,))
    return window[int(slope.argmin())][0]


def _rates(low: object, high: object, num: object) -> tuple[float, ...]:
    for name, value in (("min_lr", low), ("max_lr", high)):
        if type(value) not in (int, float) or not 0 < value < math.inf:  # type: ignore[operator]
            raise ValueError(f"find_lr({name}=...) must be a positive finite number ({got(value)}).")
    if not low < high:  # type: ignore[operator]
        raise ValueError(f"find_lr(): min_lr ({low}) must be below max_lr ({high}).")
    if type(num) is not int or not 3 <= num <= MOST_RATES:
        raise ValueError(
            f"find_lr(num=...) must be an int from 3 to {MOST_RATES}: the rates tried, each a copy of "
            f"the state in memory ({got(num)})."
        )
    ends = math.log10(low), math.log10(high)  # type: ignore[arg-type]
    return tuple(float(x) for x in torch.logspace(*ends, num, dtype=torch.float64))


def _losses(state: TrainState, m: int, steps: int) -> tuple[float, ...]:
    """Member ``m``'s loss at each step (``nan`` where it was not finite), one host read."""
    entries = state.metrics.history(f"loss/{m}")
    found = dict(zip((i for i, _ in entries), to_floats(v for _, v in entries)))
    return tuple(v if math.isfinite(v) else math.nan for v in (found.get(i, math.nan) for i in range(steps)))


def _final(losses: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
    """Each member's mean loss over its last quarter; ``nan`` where a step there was not finite or it diverged.

    Diverged, as Lightning's range test stops (``early_stop_threshold``): a loss ``DIVERGED`` times
    the lowest at the rates up to it, the members taken from the lowest rate up.
    """
    ends, lowest = [], math.inf
    for curve in losses:
        tail = curve[-max(1, len(curve) // 4) :]
        end = sum(tail) / len(tail) if all(math.isfinite(v) for v in tail) else math.nan
        if not math.isnan(end):
            lowest = min(lowest, end)
            bound = DIVERGED * lowest if lowest > 0 else lowest + DIVERGED * abs(lowest)
            end = end if end <= bound else math.nan
        ends.append(end)
    return tuple(ends)


def _suggested(lrs: tuple[float, ...], ends: tuple[float, ...], rule: str) -> float | None:
    usable = []
    for lr, end in zip(lrs, ends):  # the rates before the first that diverged
        if math.isnan(end):
            break
        usable.append((lr, end))
    if len(usable) < 2:
        return None
    if rule == "lowest":
        return min(usable, key=lambda pair: pair[1])[0]
    x = torch.tensor([math.log10(lr) for lr, _ in usable], dtype=torch.float64)
    y = torch.tensor([end for _, end in usable], dtype=torch.float64)
    (slope,) = torch.gradient(y, spacing=(x,))
    return usable[int(slope.argmin())][0]
