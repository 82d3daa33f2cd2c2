"""Scalars recorded during a run, as an immutable value (the seed's EventStorage)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence

import attrs
import torch

from fnloop._core.messages import got, positive_int

__all__ = ["STEP_STATISTICS", "Metrics", "Scalar"]

Scalar = int | float | torch.Tensor
"""A recorded value: a Python number or a one-element tensor (kept as is, no host sync)."""

STEP_STATISTICS = ("grad_norm", "param_norm", "update_norm", "update_ratio")
"""What ``train_step(stats=...)`` records: the model's as these names, a group's as ``<name>/<group>``."""

Entry = tuple[int, Scalar]

_new = object.__new__
_set = object.__setattr__


def _series_mapping(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"'{attribute.name}' must be a mapping from metric name to a tuple of "
            f"(iteration, value) pairs ({got(value)})."
        )


def to_floats(values: Iterable[Scalar]) -> list[float]:
    """Python floats for ``values``, with one host sync for all tensors among them."""
    values = list(values)
    tensors = [(i, v) for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    out = [math.nan if isinstance(v, torch.Tensor) else float(v) for v in values]
    if tensors:
        # Recorded values are 0-d already (one-element ones are reshaped); stack promotes dtypes, so
        # one stack and one conversion do for all: a tenth of the cost of converting each.
        parts = [t if t.dim() == 0 else t.reshape(()) for _, t in tensors]
        with torch.no_grad():
            stacked = torch.stack(parts).to(torch.float64)
        for (i, _), f in zip(tensors, stacked.tolist()):
            out[i] = f
    return out


@attrs.frozen(kw_only=True)
class Metrics:
    """Named scalars per iteration, the last ``window`` entries of each name.

    A value of this type lives in ``TrainState.metrics``. Recording returns a
    new value. Tensors are stored as they are, so recording never forces a
    host sync; a writer converts them when it reads (``latest_float``,
    ``median``, ``mean``, ``floats``), one sync per call.

    ``merge`` is associative, and the empty record ``Metrics(window=w)`` is
    its identity among records of window ``w``: merging two records
    concatenates each name's entries (``self`` first) and keeps the newest
    ``window``.

    Args:
        window: how many entries to keep per name (default 20). A run keeps
            the window of the state it starts from: ``attrs.evolve(state,
            metrics=Metrics(window=1000))``. The full history belongs on disk
            (``fnloop.writers.jsonl``, ``fnloop.writers.tensorboard``).
        series: name -> tuple of ``(iteration, value)`` pairs, oldest first.

    Examples:
        >>> m = Metrics().record(0, {"loss": 2.0}).record(1, {"loss": 1.0})
        >>> m.latest("loss")
        (1, 1.0)
        >>> m.mean("loss")
        1.5
    """

    window: int = attrs.field(default=20, validator=positive_int)
    series: Mapping[str, tuple[Entry, ...]] = attrs.field(factory=dict, validator=_series_mapping)

    def record(self, iteration: int, values: Mapping[str, Scalar]) -> Metrics:
        """A new record with ``values`` added at ``iteration``."""
        if not values:
            return self
        series = self.series.copy() if type(self.series) is dict else dict(self.series)
        keep = 1 - self.window
        for name, value in values.items():
            old = series.get(name, ())
            series[name] = (old[keep:] if keep else ()) + ((iteration, value),)
        # Built from this record's valid fields: no need to run the validators again (the step and
        # the timer record every step, and validation cost about 1.5 us of the 2.6 us).
        new = _new(Metrics)
        _set(new, "window", self.window)
        _set(new, "series", series)
        return new

    def record_pair(self, iteration: int, name: str, value: Scalar, other: str, second: Scalar) -> Metrics:
        """``record(iteration, {name: value, other: second})``, for two names known to differ.

        The timer records two numbers after every step; this is the same value
        built without a mapping to walk.
        """
        series = self.series.copy() if type(self.series) is dict else dict(self.series)
        keep = 1 - self.window
        old = series.get(name, ())
        series[name] = (old[keep:] if keep else ()) + ((iteration, value),)
        old = series.get(other, ())
        series[other] = (old[keep:] if keep else ()) + ((iteration, second),)
        new = _new(Metrics)
        _set(new, "window", self.window)
        _set(new, "series", series)
        return new

    def record_steps(self, first: int, values: Mapping[str, Sequence[Scalar]]) -> Metrics:
        """``record`` once per iteration from ``first``: ``values[name][j]`` at ``first + j``.

        The same value as recording the iterations one by one (a step of
        several iterations per call records them all at once).

        Examples:
            >>> Metrics().record_steps(4, {"loss": [2.0, 1.0]}).history("loss")
            ((4, 2.0), (5, 1.0))
        """
        series = self.series.copy() if type(self.series) is dict else dict(self.series)
        window = self.window
        for name, column in values.items():
            if not column:
                continue
            entries = tuple(zip(range(first, first + len(column)), column))
            series[name] = (series.get(name, ()) + entries)[-window:]
        new = _new(Metrics)
        _set(new, "window", window)
        _set(new, "series", series)
        return new

    def merge(self, other: Metrics) -> Metrics:
        """Entries of ``self`` then ``other``, the newest ``window`` per name.

        Raises:
            ValueError: both records hold entries but their windows differ.
        """
        if not self.series:
            return other
        if not other.series:
            return self
        if self.window != other.window:
            raise ValueError(
                f"cannot merge metrics with window {self.window} and window {other.window}; "
                "build both with the same Metrics(window=...)."
            )
        series = dict(self.series)
        for name, entries in other.series.items():
            series[name] = (series.get(name, ()) + entries)[-self.window :]
        return Metrics(window=self.window, series=series)

    @property
    def names(self) -> tuple[str, ...]:
        """The recorded names, in first-recorded order."""
        return tuple(self.series)

    def history(self, name: str, window: int | None = None) -> tuple[Entry, ...]:
        """The newest ``window`` (default: all kept) ``(iteration, value)`` pairs of ``name``."""
        entries = self._entries(name)
        return entries if window is None else entries[-window:]

    def latest(self, name: str) -> Entry:
        """The newest ``(iteration, value)`` of ``name``, the value as recorded."""
        return self._entries(name)[-1]

    def latest_float(self, name: str) -> tuple[int, float]:
        """The newest ``(iteration, value)`` of ``name``, the value as a float."""
        iteration, value = self.latest(name)
        return iteration, to_floats([value])[0]

    def floats(self, name: str, window: int | None = None) -> list[float]:
        """The newest ``window`` values of ``name`` as floats (one host sync)."""
        return to_floats(v for _, v in self.history(name, window))

    def median(self, name: str, window: int | None = None) -> float:
        """Median of the newest ``window`` values of ``name``."""
        return statistics.median(self.floats(name, window))

    def mean(self, name: str, window: int | None = None) -> float:
        """Mean of the newest ``window`` values of ``name``."""
        return statistics.fmean(self.floats(name, window))

    def _entries(self, name: str) -> tuple[Entry, ...]:
        try:
            return self.series[name]
        except KeyError:
            raise KeyError(
                f"no metric named {name!r} has been recorded; recorded names: {list(self.series)}"
            ) from None
