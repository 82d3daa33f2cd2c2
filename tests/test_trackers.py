"""Experiment trackers as writers: MLflow, read back with MLflow's own client from a local store."""

from __future__ import annotations

import math
import sys

import pytest

import fnloop as fl
from fnloop import testing


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A local MLflow store (the file store, which MLflow 3 keeps only behind this flag) and its client."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    return uri, MlflowClient(tracking_uri=uri)


def _step(state, batch):
    state = fl.record(state, loss=1.0 / (state.iteration + 1))
    return fl.record(state, val=float(state.iteration)) if state.iteration % 4 == 3 else state


def _runs(client, name="exp"):
    experiment = client.get_experiment_by_name(name)
    return client.search_runs([experiment.experiment_id])


def _history(client, run) -> dict[str, list[tuple[int, float]]]:
    return {
        name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        for name in sorted(run.data.metrics)
    }


def test_mlflow_logs_each_write_at_its_iteration_and_the_params_once(store):
    uri, client = store
    writer = fl.writers.mlflow("exp", run_name="a", tracking_uri=uri, params={"lr": 0.1, "seed": 0})
    fl.run(fl.TrainState(max_iter=8), _step, [None] * 8, [fl.every(2, fl.hooks.log(writer))])
    (run,) = _runs(client)
    assert run.info.status == "FINISHED" and run.info.run_name == "a"
    assert run.data.params == {"lr": "0.1", "seed": "0"}
    history = _history(client, run)
    assert history["loss"] == [(2, 0.5), (4, 0.25), (6, 1 / 6), (8, 0.125)]
    assert history["val"] == [(4, 3.0), (8, 7.0)]


def test_a_resumed_run_continues_the_named_mlflow_run_with_nothing_repeated_or_abandoned(store, tmp_path):
    uri, client = store
    log = lambda name: fl.every(2, fl.hooks.log(fl.writers.mlflow("exp", run_name=name, tracking_uri=uri)))  # noqa: E731
    fl.run(fl.TrainState(max_iter=12), _step, [None] * 12, [log("straight")])
    hooks = [
        log("broken"),
        fl.every(3, fl.hooks.checkpoint(tmp_path / "ckpt")),
        testing.Fail(fl.Phase.AFTER_STEP, 8),
    ]
    with pytest.raises(testing.InjectedFailure):
        fl.run(fl.TrainState(max_iter=12), _step, fl.data.resumable([None] * 12), hooks)
    resumed = fl.checkpoint.resume(tmp_path / "ckpt", like=fl.TrainState(max_iter=12))
    assert 0 < resumed.iteration < 9  # the crashed attempt logged past the resumed iteration
    fl.run(resumed, _step, fl.data.resumable([None] * 12), [log("broken")])
    runs = {run.info.run_name: run for run in _runs(client)}
    assert sorted(runs) == ["broken", "straight"]  # the interrupted attempt's run is deleted
    assert _history(client, runs["broken"]) == _history(client, runs["straight"])
    assert runs["broken"].data.tags["fnloop.resumed_from"] != runs["broken"].info.run_id


def test_a_resume_without_a_run_name_warns_that_the_history_before_is_not_there(store):
    uri, _ = store
    state = fl.TrainState(max_iter=4, iteration=2)
    with pytest.warns(UserWarning, match="Give the writer the same run_name="):
        fl.run(state, _step, [None] * 2, [fl.hooks.log(fl.writers.mlflow("exp", tracking_uri=uri))])


def test_non_finite_values_are_logged_as_such(store):
    uri, client = store
    step = lambda s, b: fl.record(s, a=math.nan, b=math.inf)  # noqa: E731
    fl.run(
        fl.TrainState(max_iter=1), step, [None], [fl.hooks.log(fl.writers.mlflow("exp", tracking_uri=uri))]
    )
    (run,) = _runs(client)
    history = _history(client, run)
    assert math.isnan(history["a"][0][1]) and history["b"] == [(1, math.inf)]


def test_mlflow_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    writer = fl.writers.mlflow("exp")
    with pytest.raises(ImportError, match=r'pip install "fnloop\[mlflow\]"'):
        writer.start(0)


KILLED = """
import os, signal, sys
import fnloop as fl

uri, out, kill = sys.argv[1], sys.argv[2], int(sys.argv[3])

def step(state, batch):
    state = fl.record(state, loss=1.0 / (state.iteration + 1))
    return fl.record(state, val=float(state.iteration)) if state.iteration % 4 == 3 else state

def die(state, phase):
    if phase is fl.Phase.AFTER_STEP and state.iteration == kill and os.environ.get("KILL") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return state

log = fl.every(2, fl.hooks.log(fl.writers.mlflow("exp", run_name=out, tracking_uri=uri)))
template = fl.TrainState(max_iter=12)
state = fl.checkpoint.resume(os.path.join(out, "ckpt"), like=template)
fl.run(state, step, fl.data.resumable([None] * 12), [log, fl.every(4, fl.hooks.checkpoint(os.path.join(out, "ckpt"))), die])
"""


def test_a_run_killed_with_sigkill_and_run_again_leaves_the_history_of_one_uninterrupted_run(store, tmp_path):
    import os
    import subprocess

    uri, client = store
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = {**os.environ, "MLFLOW_ALLOW_FILE_STORE": "true"}
    run = lambda out, kill: subprocess.run(  # noqa: E731
        [sys.executable, str(script), uri, str(tmp_path / out), "7"], env={**env, "KILL": kill}, timeout=120
    )
    assert run("straight", "0").returncode == 0
    assert run("killed", "1").returncode == -9  # SIGKILL at iteration 7: its MLflow run left RUNNING
    (killed,) = [r for r in _runs(client) if r.info.run_name.endswith("killed")]
    assert killed.info.status == "RUNNING"
    assert _history(client, killed)["loss"][-1][0] == 6  # logged past the checkpoint at 4
    assert run("killed", "0").returncode == 0
    runs = {r.info.run_name.rsplit("/", 1)[-1]: r for r in _runs(client)}
    assert sorted(runs) == ["killed", "straight"]
    assert _history(client, runs["killed"]) == _history(client, runs["straight"])
    assert runs["killed"].info.status == "FINISHED"


def test_a_name_with_quotes_finds_its_earlier_run(store, tmp_path):
    # MLflow's filter took the name's backslash-escaped apostrophe as part of the text: a resume
    # never found the run, warned, and left the interrupted attempt's run beside the new one.
    uri, client = store
    name = """O'Brien's "best" run"""
    log = fl.every(2, fl.hooks.log(fl.writers.mlflow("exp", run_name=name, tracking_uri=uri)))
    hooks = [log, fl.every(3, fl.hooks.checkpoint(tmp_path / "ckpt")), testing.Fail(fl.Phase.AFTER_STEP, 8)]
    with pytest.raises(testing.InjectedFailure):
        fl.run(fl.TrainState(max_iter=12), _step, fl.data.resumable([None] * 12), hooks)
    resumed = fl.checkpoint.resume(tmp_path / "ckpt", like=fl.TrainState(max_iter=12))
    fl.run(resumed, _step, fl.data.resumable([None] * 12), [log])
    (run,) = _runs(client)
    assert run.info.run_name == name
    assert [s for s, _ in _history(client, run)["loss"]] == [2, 4, 6, 8, 10, 12]


@pytest.mark.parametrize(
    ("given", "error", "match"),
    [
        ({"experiment": 7}, TypeError, r"'experiment' must be a non-empty str \(got 7 that is an int\)"),
        ({"experiment": ""}, ValueError, r"'experiment' must be a non-empty str \(got '' that is a str\)"),
        (
            {"run_name": 123},
            TypeError,
            r"'run_name' must be a str or None \(got 123 that is an int\).*run_name=",
        ),
        ({"run_name": ""}, ValueError, r"'run_name' must be a non-empty str or None \(got ''"),
        ({"tracking_uri": 5}, TypeError, r"'tracking_uri' must be a str or None \(got 5 that is an int\)"),
        ({"tracking_uri": ""}, ValueError, r"'tracking_uri' must be a non-empty str or None"),
        (
            {"params": [("lr", 0.1)]},
            TypeError,
            r"'params' must be a mapping of names to values or None \(got",
        ),
    ],
)
def test_every_argument_is_checked_when_the_writer_is_built(given, error, match):
    with pytest.raises(error, match=match):
        fl.writers.mlflow(**{"experiment": "exp", **given})
