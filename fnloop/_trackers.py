"""Writers to experiment trackers: MLflow. Re-exported by ``fnloop.writers``.

A tracker keeps a run's history on its own side, and MLflow cannot delete a
metric's points. So a resumed run does not write into the run it resumes:
it starts a new MLflow run under the same name, copies the history of the
iterations before the resumed one into it (and the params), and deletes the
run of the interrupted attempt (MLflow's soft delete: restorable, out of the
way). The live run's history is then the uninterrupted run's, with nothing
repeated or abandoned past the resume.
"""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from fnloop._core.messages import got

__all__ = ["Mlflow", "mlflow"]


class _Line(Protocol):
    """What a tracker reads of a ``fnloop.writers.Line`` (which imports this module: no import back)."""

    iteration: int

    def values(self) -> dict[str, float]: ...


_KEY = "fnloop.run_key"
_BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics at a time


def _key(run_name: str) -> str:
    """The digest of ``run_name`` that tags its runs: MLflow's filter takes it whatever quotes the name holds."""
    return hashlib.sha256(run_name.encode("utf-8")).hexdigest()


def _client(tracking_uri: str | None) -> Any:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise ImportError(
            'fnloop.writers.mlflow needs MLflow: pip install "fnloop[mlflow]" (or mlflow itself).'
        ) from exc
    return MlflowClient(tracking_uri=tracking_uri)


# -- what the writer is built from ---------------------------------------------------------------------

_WHAT = {
    "experiment": "the MLflow experiment's name, such as 'digits'",
    "run_name": (
        "the name every attempt of a run shares, such as run_name='seed-0'; a resumed run finds the "
        "history of its earlier attempts by it"
    ),
    "tracking_uri": (
        "where MLflow keeps its runs, such as 'http://localhost:5000' or 'file:///home/me/mlruns'; "
        "None for MLflow's default"
    ),
}


def _text(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """attrs validator: a non-empty str, or ``None`` for every field but ``experiment``."""
    optional = attribute.name != "experiment"
    if value is None and optional:
        return
    if not isinstance(value, str):
        wanted = "a str or None" if optional else "a non-empty str"
        raise TypeError(f"'{attribute.name}' must be {wanted} ({got(value)}): {_WHAT[attribute.name]}.")
    if not value:
        wanted = "a non-empty str or None" if optional else "a non-empty str"
        raise ValueError(f"'{attribute.name}' must be {wanted} ({got(value)}): {_WHAT[attribute.name]}.")


def _params(value: object) -> tuple[tuple[str, str], ...]:
    """``params`` as the record keeps them: (name, value) pairs of str, in the mapping's order."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        return tuple((str(k), str(v)) for k, v in value.items())
    if isinstance(value, tuple) and all(
        isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(x, str) for x in pair) for pair in value
    ):
        return value  # the record's own (attrs.evolve)
    raise TypeError(
        f"'params' must be a mapping of names to values or None ({got(value)}): the run's settings, "
        "such as params={'lr': 0.1, 'seed': 0}, logged once as the MLflow run's params."
    )


_LIVE: dict[tuple[int, Any], tuple[Any, str]] = {}
"""(process id, the writer) -> its MLflow client and the id of the run it writes."""


@attrs.frozen
class Mlflow:
    """Logs metrics to an MLflow run; build it with ``fnloop.writers.mlflow``."""

    experiment: str = attrs.field(validator=_text)
    run_name: str | None = attrs.field(validator=_text)
    tracking_uri: str | None = attrs.field(validator=_text)
    params: tuple[tuple[str, str], ...] = attrs.field(converter=_params)

    def start(self, iteration: int) -> None:
        """Open this run's MLflow run: a new one, or, resumed at ``iteration``, one that continues its history."""
        self.close()
        client = _client(self.tracking_uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment = found.experiment_id if found is not None else client.create_experiment(self.experiment)
        before = self._previous(client, experiment) if iteration > 0 else None
        tags = {_KEY: _key(self.run_name)} if self.run_name is not None else {}
        if before is not None:
            tags["fnloop.resumed_from"] = before.info.run_id
        run = client.create_run(experiment, run_name=self.run_name, tags=tags)
        run_id = run.info.run_id
        _LIVE[(os.getpid(), self)] = (client, run_id)
        if before is None:
            from mlflow.entities import Param

            if iteration > 0:
                warnings.warn(
                    f"fnloop.writers.mlflow: this run resumes at iteration {iteration}, but no earlier "
                    f"MLflow run named {self.run_name!r} is in experiment {self.experiment!r}, so its "
                    "history before the resume is not in the new run. Give the writer the same "
                    "run_name= in every attempt of a run.",
                    stacklevel=2,
                )
            if self.params:
                client.log_batch(run_id, params=[Param(k, v) for k, v in self.params])
            return
        self._carry(client, before, run_id, iteration)

    def _previous(self, client: Any, experiment: str) -> Any:
        """The newest live run of this name in ``experiment``, or ``None`` (no name: none to find)."""
        if self.run_name is None:
            return None
        runs = client.search_runs(
            [experiment],
            filter_string=f"tags.`{_KEY}` = '{_key(self.run_name)}'",
            order_by=["attributes.start_time DESC"],
        )
        return runs[0] if runs else None

    def _carry(self, client: Any, before: Any, run_id: str, iteration: int) -> None:
        """Copy ``before``'s params and its history of iterations below ``iteration`` into ``run_id``, then
        delete ``before``: the live run reads as one uninterrupted run."""
        from mlflow.entities import Metric, Param

        params = [Param(k, v) for k, v in before.data.params.items()]
        points = [
            Metric(name, m.value, m.timestamp, m.step)
            for name in before.data.metrics
            for m in client.get_metric_history(before.info.run_id, name)
            if m.step < iteration
        ]
        if params:
            client.log_batch(run_id, params=params)
        for at in range(0, len(points), _BATCH):
            client.log_batch(run_id, metrics=points[at : at + _BATCH])
        client.delete_run(before.info.run_id)

    def write(self, line: _Line) -> None:
        """Log the newest value of each metric at step ``line.iteration``."""
        from mlflow.entities import Metric

        client, run_id = _LIVE.get((os.getpid(), self)) or (None, None)
        if client is None:  # written without a start (a writer used on its own)
            self.start(0)
            client, run_id = _LIVE[(os.getpid(), self)]
        stamp = int(time.time() * 1000)
        metrics = [Metric(k, v, stamp, line.iteration) for k, v in line.values().items()]
        for at in range(0, len(metrics), _BATCH):
            client.log_batch(run_id, metrics=metrics[at : at + _BATCH])

    def close(self) -> None:
        """End the MLflow run (FINISHED), if this process has it open."""
        client, run_id = _LIVE.pop((os.getpid(), self), (None, None))
        if client is not None:
            client.set_terminated(run_id)


def mlflow(
    experiment: str = "fnloop",
    *,
    run_name: str | None = None,
    tracking_uri: str | None = None,
    params: Mapping[str, Any] | None = None,
) -> Mlflow:
    """A writer of metrics to an MLflow run, in ``experiment`` at ``tracking_uri`` (MLflow's default if None).

    Each write logs the newest value of each metric at step ``iteration``
    (the JSON lines' numbers); ``params`` (the run's settings) are logged once,
    when the run begins. Give every attempt of a run the same ``run_name``:
    a run resumed at iteration ``k`` then continues the history of the run of
    that name, as MLflow allows. MLflow cannot delete a metric's points, so
    the resumed attempt logs into a new MLflow run of the same name, holding
    the params and the history below ``k`` copied from the interrupted one,
    which is deleted (soft: ``mlflow gc`` or the UI's restore can act on it).
    Needs ``pip install "fnloop[mlflow]"``.

    Raises:
        TypeError: an argument of the wrong type (``run_name`` not a str,
            ``params`` not a mapping, ...).
        ValueError: ``experiment``, ``run_name`` or ``tracking_uri`` is empty.

    Examples:
        >>> writer = mlflow("digits", run_name="seed-0", params={"lr": 0.1})
        >>> writer.params
        (('lr', '0.1'),)
    """
    return Mlflow(experiment=experiment, run_name=run_name, tracking_uri=tracking_uri, params=params)
