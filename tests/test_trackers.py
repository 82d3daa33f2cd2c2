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
    with pytest.raises(ImportError, match=r'pip install mlflow-skinny .*pip install -e "\.\[mlflow\]"'):
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

writer = fl.writers.mlflow("exp", run_name=out, tracking_uri=uri, params={"lr": 0.1})
log = fl.every(2, fl.hooks.log(writer))
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


# -- one live writer per run ---------------------------------------------------------------------------

HOLDER = """
import sys
import fnloop as fl

def step(state, batch):
    return fl.record(state, loss=1.0 / (state.iteration + 1))

def hold(state, phase):  # after the lines at 2 and 4, until the test says to go on
    if phase is fl.Phase.AFTER_STEP and state.iteration == 5:
        print("holding", flush=True)
        sys.stdin.readline()
    return state

log = fl.every(2, fl.hooks.log(fl.writers.mlflow("exp", run_name="shared", tracking_uri=sys.argv[1])))
fl.run(fl.TrainState(max_iter=8), step, [None] * 8, [log, hold])
"""


def test_a_run_another_live_process_writes_is_refused_and_left_untouched(store, tmp_path):
    # A resume of a run's name took over the run another live process was writing: it copied that
    # run's history as its own and deleted it, and the other process then failed at its next write.
    import os
    import subprocess

    uri, client = store
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    env = {**os.environ, "MLFLOW_ALLOW_FILE_STORE": "true"}
    log = fl.every(2, fl.hooks.log(fl.writers.mlflow("exp", run_name="shared", tracking_uri=uri)))
    command = [sys.executable, str(script), uri]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with subprocess.Popen(command, text=True, env=env, **pipes) as holder:
        try:
            assert holder.stdout.readline() == "holding\n"
            (held,) = _runs(client)
            for start in (fl.TrainState(max_iter=8, iteration=2), fl.TrainState(max_iter=8)):  # resumed, new
                with pytest.raises(
                    fl.hooks.DirectoryInUse, match=rf"'shared' .* live run \(process {holder.pid}\)"
                ):
                    fl.run(start, _step, fl.data.resumable([None] * 8), [log])
            (still,) = _runs(client)
            assert still.info.run_id == held.info.run_id and still.info.status == "RUNNING"
            assert _history(client, still) == {"loss": [(2, 0.5), (4, 0.25)]}
            _, errors = holder.communicate("\n", timeout=120)
            assert holder.returncode == 0, errors
        finally:
            if holder.poll() is None:
                holder.kill()
    (done,) = _runs(client)
    assert done.info.status == "FINISHED" and [s for s, _ in _history(client, done)["loss"]] == [2, 4, 6, 8]
    # Once that run has ended, the name is free: the same resume continues it.
    fl.run(fl.TrainState(max_iter=8, iteration=8), _step, fl.data.resumable([None] * 8), [log])
    (continued,) = _runs(client)
    assert _history(client, continued)["loss"] == _history(client, done)["loss"][:3]


def test_a_run_written_on_another_machine_is_refused_until_ended_as_the_error_says(store):
    # A process of another machine cannot be checked from here: its run counts as live, and the
    # error gives the one call that ends it once that process is known to be gone.
    import re

    import mlflow

    uri, client = store
    log = fl.every(2, fl.hooks.log(fl.writers.mlflow("exp", run_name="far", tracking_uri=uri)))
    fl.run(fl.TrainState(max_iter=4), _step, [None] * 4, [log])
    (run,) = _runs(client)
    client.update_run(run.info.run_id, status="RUNNING")  # as that machine's process leaves it
    client.set_tag(run.info.run_id, "fnloop.owner", "4242@elsewhere/17")
    resumed = fl.TrainState(max_iter=4, iteration=3)
    with pytest.raises(
        fl.hooks.DirectoryInUse, match=r"'far' .*\(process 4242 on the machine elsewhere, which cannot be"
    ) as refused:
        fl.run(resumed, _step, fl.data.resumable([None] * 4), [log])
    (same,) = _runs(client)
    assert same.info == client.get_run(run.info.run_id).info and same.info.status == "RUNNING"
    fix = re.search(r"mlflow\.tracking\.MlflowClient\(.*'KILLED'\)", str(refused.value))
    eval(fix[0], {"mlflow": mlflow})  # the fix, as the message words it
    fl.run(resumed, _step, fl.data.resumable([None] * 4), [log])
    (continued,) = _runs(client)
    assert continued.info.run_id != run.info.run_id and continued.info.status == "FINISHED"
    assert _history(client, continued) == _expected(4)  # the line at 2 copied, the one at 4 written


def test_two_log_hooks_of_one_process_on_one_mlflow_run_are_refused(store):
    uri, client = store
    make = lambda: fl.writers.mlflow("exp", run_name="twice", tracking_uri=uri)  # noqa: E731
    hooks = [fl.hooks.log(make(), name="a"), fl.hooks.log(make(), name="b")]
    with pytest.raises(fl.hooks.DirectoryInUse, match=r"'twice' .* another log hook of this process"):
        fl.run(fl.TrainState(max_iter=2), _step, [None] * 2, hooks)
    assert client.get_experiment_by_name("exp") is None  # refused before anything was written
    fl.run(fl.TrainState(max_iter=2), _step, [None] * 2, hooks[1:])  # nothing left held
    (run,) = _runs(client)
    assert run.info.status == "FINISHED"


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


# -- kills at every point ------------------------------------------------------------------------------


class Killed(Exception):
    """The writer's process was killed: this call of MLflow's client and every later one never happen."""


class Mortal:
    """MLflow's client in a process killed at its ``at``-th call (``None``: not yet), as SIGKILL would."""

    def __init__(self, client, at=None):
        self.client, self.at, self.calls = client, at, 0

    def kill(self):
        self.at = self.calls + 1

    def __getattr__(self, name):
        method = getattr(self.client, name)

        def call(*args, **kwargs):
            self.calls += 1
            if self.at is not None and self.calls >= self.at:
                raise Killed(f"killed at call {self.calls}, {name}")
            return method(*args, **kwargs)

        return call


def _expected(iterations):
    """The history of an uninterrupted run of ``_step`` logged every 2 iterations."""
    return {
        "loss": [(n, 1.0 / n) for n in range(2, iterations + 1, 2)],
        "val": [(n, float(n - 1)) for n in range(4, iterations + 1, 4)],
    }


def test_a_kill_at_any_call_of_a_resume_leaves_what_the_next_attempt_completes(store, tmp_path, monkeypatch):
    # A kill between the new run's creation and the old one's deletion left a partial copy as the
    # newest run of the name: the next attempt copied from it, and the history stayed behind.
    import os
    import shutil
    import subprocess

    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    from fnloop.writers import _mlflow as _trackers

    uri, client = store
    fl.run(
        fl.TrainState(max_iter=4),
        _step,
        [None] * 4,
        [fl.hooks.log(fl.writers.mlflow("exp", tracking_uri=uri))],
    )
    (other,) = _runs(client)
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    name = str(tmp_path / "killed")
    env = {**os.environ, "MLFLOW_ALLOW_FILE_STORE": "true", "KILL": "1"}
    killed = subprocess.run([sys.executable, str(script), uri, name, "7"], env=env, timeout=120)
    assert killed.returncode == -9  # lines at 2, 4 and 6 logged, the checkpoint at 4, the run left RUNNING
    real = _trackers._client

    def attempt(uri, directory, hooks, at):
        """Resume from ``directory``, killed at the ``at``-th call of MLflow's client; whether it was."""
        mortal = Mortal(real(uri), at)
        monkeypatch.setattr(_trackers, "_client", lambda uri: mortal)
        try:
            state = fl.checkpoint.resume(directory, like=fl.TrainState(max_iter=12))
            fl.run(state, _step, fl.data.resumable([None] * 12), hooks)
        except Killed:
            return True
        finally:
            monkeypatch.setattr(_trackers, "_client", real)
        return False

    for at in range(1, 100):
        here = tmp_path / f"at-{at}"
        shutil.copytree(tmp_path / "mlruns", here / "mlruns")
        shutil.copytree(tmp_path / "killed" / "ckpt", here / "ckpt")
        uri = (here / "mlruns").as_uri()
        writer = fl.writers.mlflow("exp", run_name=name, tracking_uri=uri, params={"lr": 0.1})
        hooks = [fl.every(2, fl.hooks.log(writer)), fl.every(4, fl.hooks.checkpoint(here / "ckpt"))]
        if not attempt(uri, here / "ckpt", hooks, at):
            break  # the whole run made fewer calls: every point was tried
        attempt(uri, here / "ckpt", hooks, at)  # killed again at that call, from what the first left
        assert not attempt(uri, here / "ckpt", hooks, None)
        client = MlflowClient(tracking_uri=uri)
        runs = _runs(client)
        named = [r for r in runs if r.info.run_name == name]
        assert len(named) == 1, f"killed at call {at}: {[r.info.status for r in named]}"
        assert _history(client, named[0]) == _expected(12), f"killed at call {at}"
        assert named[0].info.status == "FINISHED" and named[0].data.params == {"lr": "0.1"}
        (same,) = [r for r in runs if r.info.run_id == other.info.run_id]  # the other run, untouched
        assert same.info == other.info and _history(client, same) == _history(client, other)
        assert len(runs) == 2
        experiment = client.get_experiment_by_name("exp").experiment_id
        deleted = client.search_runs([experiment], run_view_type=ViewType.DELETED_ONLY)
        assert {r.info.run_name for r in deleted} == {name}  # only the attempts of this run
    assert at > 10  # the loop reached a resume of so few calls that none was killed


def test_a_run_killed_before_its_first_checkpoint_and_run_again_leaves_one_run(store, monkeypatch):
    # The run of the killed attempt was left RUNNING beside the new one, as if both were live.
    from fnloop.writers import _mlflow as _trackers

    uri, client = store
    mortal = Mortal(_trackers._client(uri))

    def die(state, phase):
        if phase is fl.Phase.AFTER_STEP and state.iteration == 3:
            mortal.kill()
            raise Killed("at iteration 3")
        return state

    log = fl.every(2, fl.hooks.log(fl.writers.mlflow("exp", run_name="early", tracking_uri=uri)))
    with monkeypatch.context() as patch:
        patch.setattr(_trackers, "_client", lambda uri: mortal)
        with pytest.raises(Killed):
            fl.run(fl.TrainState(max_iter=8), _step, [None] * 8, [log, die])
    (left,) = _runs(client)
    assert left.info.status == "RUNNING" and list(_history(client, left)) == ["loss"]
    fl.run(fl.TrainState(max_iter=8), _step, [None] * 8, [log])
    (run,) = _runs(client)
    assert run.info.status == "FINISHED" and _history(client, run) == _expected(8)
