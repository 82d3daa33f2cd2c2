"""Evaluation during a run: a function of the state, its results recorded as metrics."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._core.combinators import Hook
from fnloop._core.messages import got
from fnloop._core.metrics import Scalar
from fnloop._core.phase import Phase
from fnloop._core.state import TrainState
from fnloop._core.stateful import stateful
from fnloop.data import one_pass
from fnloop.hooks._ema import ema_params

__all__ = ["Evaluated", "MeanOver", "evaluate", "mean_over"]


def _name(hook: str, fn: object) -> str:
    what = getattr(fn, "__qualname__", None) or repr(fn)
    return f"evaluate {hook!r} ({what:.60})"


def _scalar(where: str, key: str, value: object) -> Scalar:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(
                f"{where}: metric {key!r} must be a number or a 0-d tensor (got a tensor of shape "
                f"{tuple(value.shape)}). Reduce it to one value (.mean(), .sum()), or return one "
                "metric per value under names of their own."
            )
        return value.detach().reshape(())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return value if type(value) is int else float(value)
    raise TypeError(
        f"{where}: metric {key!r} must be a number or a 0-d tensor ({got(value)}). Return a float, "
        "an int or a one-element tensor for each name."
    )


def checked_results(where: str, results: object) -> dict[str, Scalar]:
    """``results`` as a dict of recordable scalars, or a ``TypeError`` saying what is wrong and the fix."""
    if not isinstance(results, Mapping):
        raise TypeError(
            f"{where}: fn must return a mapping from metric name to a number or a 0-d tensor "
            f"({got(results)}). Return a dict such as {{'val_loss': loss}}."
        )
    out: dict[str, Scalar] = {}
    for key, value in results.items():
        if type(key) is not str:
            raise TypeError(
                f"{where}: metric names must be str (the key {got(key)}). Name each metric with a "
                "str, such as 'val_loss'."
            )
        out[key] = _scalar(where, key, value)
    return out


def due(state: TrainState, phase: Phase, last: int) -> int | None:
    """The completed steps a periodic evaluation acts for in ``phase``, or ``None`` when it does not act.

    At ``AFTER_STEP`` of step ``i``: ``i + 1``. At ``AFTER_TRAIN``: the run's
    steps, but only after success (a failed run's last state was never meant
    to be evaluated). ``None`` as well when ``last``, the count acted for
    before, is the same: 30 steps with ``every(15, ...)`` act twice, as
    detectron2's ``EvalHook`` does, and 31 three times.
    """
    if phase is Phase.AFTER_STEP:
        steps = state.iteration + 1
    elif phase is Phase.AFTER_TRAIN and state.iteration == state.max_iter:
        steps = state.iteration
    else:
        return None
    return None if steps == last else steps


@attrs.frozen
class Evaluated:
    """How many completed steps the last evaluation saw (-1: none yet)."""

    steps: int = -1


@attrs.frozen(repr=False)
class _Evaluate:
    acts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.AFTER_STEP, Phase.AFTER_TRAIN})
    """The phases the update changes anything in: the hook is not called in the others."""

    fn: Callable[[TrainState], Mapping[str, Any]]
    name: str
    ema: str | None

    def __call__(self, state: TrainState, phase: Phase, memory: Evaluated) -> tuple[TrainState, Evaluated]:
        steps = due(state, phase, memory.steps)
        if steps is None:
            return state, memory
        seen = state if self.ema is None else attrs.evolve(state, params=ema_params(state, self.ema))
        values = checked_results(_name(self.name, self.fn), self.fn(seen))
        recorded = attrs.evolve(state, metrics=state.metrics.record(state.iteration, values))
        return recorded, Evaluated(steps)

    def __repr__(self) -> str:
        ema = "" if self.ema is None else f", ema={self.ema!r}"
        return f"evaluate({getattr(self.fn, '__qualname__', self.fn)!s:.60}{ema})"


def evaluate(
    fn: Callable[[TrainState], Mapping[str, Any]], *, name: str = "eval", ema: str | None = None
) -> Hook:
    """A hook recording ``fn(state)``, a dict of metrics, into ``state.metrics``.

    The results are recorded at ``state.iteration`` under the names ``fn``
    returns (nothing is prefixed), so writers, ``best_checkpoint`` and
    ``early_stop`` placed after this hook see them in the same phase. Wrap it
    to choose the period, as detectron2's ``EvalHook``:

    * ``every(n, evaluate(fn))`` evaluates at ``AFTER_STEP`` of steps
      ``n-1, 2n-1, ...`` (the parameters after ``i + 1`` completed steps), and
      at ``AFTER_TRAIN`` after a successful run unless the last step was just
      evaluated: 30 steps with ``n=15`` evaluate twice, 31 steps three times.
    * ``on(Phase.AFTER_TRAIN, evaluate(fn))`` evaluates once, at the end.

    The number of completed steps last evaluated is kept in
    ``state.hooks[name]`` (an ``Evaluated``), so a resumed run does not evaluate
    the same parameters twice. Values may be numbers or 0-d tensors; tensors are
    recorded as they are, with no host sync.

    Args:
        fn: ``fn(state) -> {name: number or 0-d tensor}``, run on the current
            parameters; ``mean_over`` builds one from an eval step and a
            validation set.
        name: where the hook keeps its state; unique among the run's hooks.
        ema: evaluate the average kept by the ``ema`` hook of that name
            (``fnloop.hooks.ema(decay, name=...)``) instead of the live
            parameters: ``fn`` gets the state with ``params`` replaced by
            ``ema_params(state, ema)``. The results are recorded on the real
            state.

    Raises:
        TypeError (when it evaluates): ``fn`` returned something other than a
            mapping of str to numbers or one-element tensors.
        KeyError (when it evaluates): ``ema`` names no average in the state.

    Examples:
        >>> import fnloop as fl
        >>> def fn(state):
        ...     return {"seen": float(state.iteration)}
        >>> final = fl.run(fl.TrainState(max_iter=31), lambda s, b: s, [None] * 31, [fl.every(15, evaluate(fn))])
        >>> final.metrics.history("seen")
        ((14, 14.0), (29, 29.0), (31, 31.0))
    """
    if not callable(fn):
        raise TypeError(f"evaluate() expected fn, a callable state -> dict of metrics ({got(fn)}).")
    if ema is not None and (type(ema) is not str or not ema):
        raise TypeError(f"evaluate() 'ema' must be the name of an ema hook, a str, or None ({got(ema)}).")
    return stateful(name, Evaluated(), _Evaluate(fn, name, ema))


def _leading(batch: Any) -> int:
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise TypeError(
        f"mean_over: cannot tell how many examples the batch holds (no tensor with a leading "
        f"dimension in a {type(batch).__name__}). Pass size=, a function batch -> number of examples."
    )


def _accumulator(value: torch.Tensor) -> torch.dtype:
    # Sums over a large validation set lose digits in float32; float64 where the device has it.
    return torch.float64 if value.device.type in ("cpu", "cuda") else torch.float32


@attrs.frozen(eq=False, repr=False)
class MeanOver:
    """``state -> {prefix + name: mean over examples}``; build it with ``mean_over``."""

    step: Callable[[TrainState, Any], Mapping[str, Any]]
    batches: Iterable[Any]
    prefix: str = ""
    size: Callable[[Any], int] = _leading

    def __call__(self, state: TrainState) -> dict[str, Scalar]:
        where = f"mean_over({getattr(self.step, '__qualname__', type(self.step).__name__)})"
        totals: dict[str, Any] = {}
        examples = 0
        for seen, batch in enumerate(one_pass(self.batches)):
            n = self.size(batch)
            values = checked_results(where, self.step(state, batch))
            if seen and values.keys() != totals.keys():
                raise ValueError(
                    f"{where}: a batch gave the metrics {sorted(values)}, an earlier one "
                    f"{sorted(totals)}. Every batch must give the same names to be averaged."
                )
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    term: Any = value.to(_accumulator(value)) * n
                else:
                    term = float(value) * n
                totals[key] = totals[key] + term if seen else term
            examples += n
        if not examples:
            raise ValueError(
                f"{where}: the validation batches held no example. Pass a non-empty list, loader or "
                "stream (each evaluation iterates it again from the start)."
            )
        return {self.prefix + key: total / examples for key, total in totals.items()}

    def __repr__(self) -> str:
        return f"mean_over({getattr(self.step, '__qualname__', self.step)!s:.60}, prefix={self.prefix!r})"


def mean_over(
    step: Callable[[TrainState, Any], Mapping[str, Any]],
    batches: Iterable[Any],
    *,
    prefix: str = "",
    size: Callable[[Any], int] = _leading,
) -> MeanOver:
    """An ``evaluate`` function: each metric of ``step`` averaged over all examples of ``batches``.

    ``step(state, batch) -> {name: per-example mean over the batch}`` is
    typically ``fnloop.eval_step(model, fn)``, compiled or eager. Each batch
    counts by its number of examples, so a smaller last batch weighs what it
    holds. Sums stay on the device (in float64 where it has it); the means are
    returned as 0-d tensors, so evaluating costs no host sync until something
    reads them.

    ``batches`` is read from the start at every evaluation: a list, a
    ``DataLoader``, or a ``fnloop.data.batches`` stream, of which one epoch is
    read from cursor 0 (build it with ``shuffle=False, drop_last=False`` to
    see every example once).

    Args:
        step: ``(state, batch) -> {name: number or 0-d tensor}``.
        batches: the validation set, an iterable that can be iterated again.
        prefix: put before every name, as ``"val_"``.
        size: ``batch -> number of examples``; by default the leading
            dimension of the batch's first tensor.

    Raises:
        TypeError: ``batches`` is a one-shot iterator (a generator), or not iterable.
        ValueError (when called): the batches are empty, or give different names.

    Examples:
        >>> import fnloop as fl
        >>> model = torch.nn.Linear(1, 1)
        >>> step = fl.eval_step(model, lambda f, b: {"loss": (f(b[0]) - b[1]).pow(2).mean()}, compile=False)
        >>> x = torch.arange(5.0).reshape(5, 1)
        >>> val = [(x[:4], x[:4]), (x[4:], x[4:])]  # a last, smaller batch
        >>> fn = mean_over(step, val, prefix="val_")
        >>> state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
        >>> one = (model(x) - x).pow(2).mean()
        >>> torch.allclose(fn(state)["val_loss"].float(), one)
        True
    """
    if isinstance(batches, Iterator) or not isinstance(batches, Iterable):
        raise TypeError(
            f"mean_over() needs batches it can read again at every evaluation, such as a list, a "
            f"DataLoader or fnloop.data.batches(...) ({got(batches)}); an iterator is used up after "
            "one pass. Pass list(...) of it, or the loader itself."
        )
    if type(prefix) is not str:
        raise TypeError(f"mean_over() 'prefix' must be a str ({got(prefix)}).")
    return MeanOver(step, batches, prefix, size)
