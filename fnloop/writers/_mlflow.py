"""Writers to experiment trackers: MLflow. Re-exported by ``fnloop.writers``.

A tracker keeps a run's history on its own side, and MLflow cannot delete a
metric's points. So a resumed run does not write into the run it resumes:
it starts a new MLflow run under the same name, copies the history of the
iterations before the resumed one into it (and the params), and deletes the
run of the interrupted attempt (MLflow's soft delete: restorable, out of the
way). The live run's history is then the uninterrupted run's, with nothing
repeated or abandoned past the resume.

The MLflow runs of one name in one experiment are the attempts of one run.
The writer tags each with what a later attempt goes by:

* ``fnloop.run_key``, the name's digest, which MLflow's filter matches
  whatever quotes the name holds;
* ``fnloop.owner``, the process writing it (``pid@host/start``): a run that a
  live process writes is refused to every other writer, as a log file held
  by one is, and the run of a process that is gone (killed) is taken over;
* ``fnloop.history``, ``partial`` while an attempt copies the history into
  its new run, ``whole`` once the run holds it all: a partial run is never
  copied from;
* ``fnloop.resumed_from``, the run it continues.

An attempt deletes the runs it replaces only once its own run is whole, so a
kill at any point leaves the whole history in one run that the next attempt
continues, and no run of another name is ever touched.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from fnloop._atomic import _HOST, DirectoryInUse
from fnloop._core.messages import got
from fnloop.writers._mlflow_runs import (
    FROM,
    HISTORY,
    KEY,
    OWNER,
    PARTIAL,
    WHOLE,
    drop_run,
    newest_whole,
    replaced,
    run_key,
    this_process,
    writer_of,
)

__all__ = ["Mlflow", "mlflow"]


class _Line(Protocol):
    """What a tracker reads of a ``fnloop.writers.Line`` (which imports this module: no import back)."""

    iteration: int

    def values(self) -> dict[str, float]: ...


_BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics at a time


IN_USE = (
    "two writers of one run would copy and delete each other's history. Wait for that run to end or "
    "stop it, or give this run another run_name=."
)


def _client(tracking_uri: str | None) -> Any:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise ImportError(
            'fnloop.writers.mlflow needs MLflow: pip install mlflow-skinny (or mlflow; from a checkout of fnloop: pip install -e ".[mlflow]").'
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

_CLAIMS: dict[tuple[int, tuple[str | None, str, str]], list[Any]] = {}
"""(process id, (tracking URI, experiment, run name)) -> [claims, their owner or None]."""


@attrs.frozen
class Mlflow:
    """Logs metrics to an MLflow run; build it with ``fnloop.writers.mlflow``."""

    experiment: str = attrs.field(validator=_text)
    run_name: str | None = attrs.field(validator=_text)
    tracking_uri: str | None = attrs.field(validator=_text)
    params: tuple[tuple[str, str], ...] = attrs.field(converter=_params)

    @property
    def target(self) -> None:
        """No path: it writes to a tracking server's run (which ``claim`` holds)."""
        return None

    @property
    def _run(self) -> tuple[str | None, str, str]:
        return (self.tracking_uri, self.experiment, self.run_name or "")

    def claim(self, owner: object = None) -> None:
        """Hold this run for ``owner`` in this process: refused (``DirectoryInUse``) while another live
        process, or another owner in this one, writes it. A run without a name is never shared."""
        if self.run_name is None:
            return
        key = (os.getpid(), self._run)
        held = _CLAIMS.get(key)
        if held is None:
            client = _client(self.tracking_uri)
            found = client.get_experiment_by_name(self.experiment)
            if found is not None:
                self._check(self._attempts(client, found.experiment_id))
            _CLAIMS[key] = [1, owner]
            return
        if owner is not None and held[1] is not None and held[1] is not owner:
            raise DirectoryInUse(
                f"MLflow run {self.run_name!r} in experiment {self.experiment!r} is written by another log "
                "hook of this process: two log hooks on one run would write every line twice and delete "
                "each other's history on resume. Give each log hook its own run_name=, or put both "
                "writers' metrics in one log hook."
            )
        held[0] += 1
        if held[1] is None:
            held[1] = owner

    def release(self, owner: object = None) -> bool:
        """Give back one ``claim`` by ``owner``; whether one was (``True`` for a run without a name)."""
        if self.run_name is None:
            return True
        key = (os.getpid(), self._run)
        held = _CLAIMS.get(key)
        if held is None or (owner is not None and held[1] is not None and held[1] is not owner):
            return False
        held[0] -= 1
        if held[0] == 0:
            del _CLAIMS[key]
        return True

    def start(self, iteration: int) -> None:
        """Open this run's MLflow run: a new one, or, resumed at ``iteration``, one that continues its history.

        Raises:
            DirectoryInUse: another live process, or another writer of this one, writes the run.
        """
        self.close()
        client = _client(self.tracking_uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment = found.experiment_id if found is not None else client.create_experiment(self.experiment)
        attempts = self._attempts(client, experiment)
        self._check(attempts)
        source = newest_whole(attempts) if iteration > 0 else None
        tags = {OWNER: this_process(), HISTORY: PARTIAL}
        if self.run_name is not None:
            tags[KEY] = run_key(self.run_name)
        if source is not None:
            tags[FROM] = source.info.run_id
        run = client.create_run(experiment, run_name=self.run_name, tags=tags)
        run_id = run.info.run_id
        try:
            # Two attempts started at once both passed the check above; each sees the other now.
            self._check([a for a in self._attempts(client, experiment) if a.info.run_id != run_id])
            if source is None:
                self._begin(client, run_id, iteration)
            else:
                self._carry(client, source, run_id, iteration)
            client.set_tag(run_id, HISTORY, WHOLE)
        except BaseException:
            with contextlib.suppress(Exception):  # else the next attempt deletes it: it is partial
                drop_run(client, run)
            raise
        _LIVE[(os.getpid(), self)] = (client, run_id)
        for stale in replaced(attempts, source):
            drop_run(client, stale)

    def _attempts(self, client: Any, experiment: str) -> list[Any]:
        """This run's MLflow runs in ``experiment``, the deleted ones aside: those of its attempts."""
        if self.run_name is None:
            return []
        return list(
            client.search_runs([experiment], filter_string=f"tags.`{KEY}` = '{run_key(self.run_name)}'")
        )

    def _check(self, attempts: list[Any]) -> None:
        """Refuse to go on while a live process, or another writer of this one, writes one of ``attempts``."""
        me = os.getpid()
        mine = {run_id for (pid, writer), (_, run_id) in _LIVE.items() if pid == me and writer != self}
        for run in attempts:
            holder = writer_of(run, mine)
            if holder is None:
                continue
            pid, host = holder
            what = f"MLflow run {self.run_name!r} (id {run.info.run_id}, experiment {self.experiment!r})"
            if host != _HOST:
                fix = (
                    f" If that process is gone, end its run, then start this one again: "
                    f"mlflow.tracking.MlflowClient({self.tracking_uri!r}).set_terminated("
                    f"{run.info.run_id!r}, 'KILLED')."
                )
                raise DirectoryInUse(
                    f"{what} is in use by another live run (process {pid} on the machine {host}, which "
                    f"cannot be checked from here): {IN_USE}{fix}"
                )
            if pid == me:
                raise DirectoryInUse(f"{what} is written by another writer of this process: {IN_USE}")
            raise DirectoryInUse(f"{what} is in use by another live run (process {pid}): {IN_USE}")

    def _begin(self, client: Any, run_id: str, iteration: int) -> None:
        """Log the params into the new run ``run_id``; a resume with no earlier run to continue warns."""
        from mlflow.entities import Param

        if iteration > 0:
            warnings.warn(
                f"fnloop.writers.mlflow: this run resumes at iteration {iteration}, but no earlier "
                f"MLflow run named {self.run_name!r} is in experiment {self.experiment!r}, so its "
                "history before the resume is not in the new run. Give the writer the same "
                "run_name= in every attempt of a run.",
                stacklevel=3,
            )
        if self.params:
            client.log_batch(run_id, params=[Param(k, v) for k, v in self.params])

    def _carry(self, client: Any, source: Any, run_id: str, iteration: int) -> None:
        """Copy ``source``'s params and its history of iterations below ``iteration`` into ``run_id``."""
        from mlflow.entities import Metric, Param

        params = [Param(k, v) for k, v in source.data.params.items()]
        points = [
            Metric(name, m.value, m.timestamp, m.step)
            for name in source.data.metrics
            for m in client.get_metric_history(source.info.run_id, name)
            if m.step < iteration
        ]
        if params:
            client.log_batch(run_id, params=params)
        for at in range(0, len(points), _BATCH):
            client.log_batch(run_id, metrics=points[at : at + _BATCH])

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
    that name. MLflow cannot delete a metric's points, so the resumed attempt
    logs into a new MLflow run of the same name, holding the params and the
    history below ``k`` copied from the interrupted one, which is deleted
    (soft: ``mlflow gc`` or the UI's restore can act on it). A kill at any
    point of the copy leaves the history whole for the next attempt.

    A named run is held as a log file is: while a live process writes it, a
    run with a writer of that name in that experiment is refused before it
    writes anything (``fnloop.hooks.DirectoryInUse``, when the run starts).
    The run of a killed attempt is taken over by the next one, which ends it
    (KILLED) and deletes it once its own run holds the history, whether it
    resumes or starts again from iteration 0. A process on another machine
    cannot be checked from here: its run counts as live until it ends, and
    the error says how to end it when that process is gone.
    Needs MLflow (``pip install -e ".[mlflow]"`` from a checkout).

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
