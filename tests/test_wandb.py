"""The Weights & Biases writer: offline runs read back from W&B's own files, and a recorded double of
``wandb`` across a SIGKILL and a resume.

What these tests cannot see is W&B's server: the rewind itself (``resume_from``
cutting the run's history back) happens there. They check what the client is
asked to do and what it writes locally; ``_rewound`` applies the rewind as
W&B's client defines it (wandb-core's ``runbranch/rewind.go``: the run goes on
at the rewind step + 1) to the attempts' rows.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import attrs
import pytest

import fnloop as fl
from fnloop import testing
from fnloop.writers import _wandb

WORKER = Path(__file__).with_name("wandb_worker.py")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline and quiet, its directory under ``tmp_path``; the directory."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "default"))
    return tmp_path / "wb"


def _step(state, batch):
    state = fl.record(state, loss=1.0 / (state.iteration + 1))
    return fl.record(state, val=float(state.iteration)) if state.iteration % 4 == 3 else state


def _expected(iterations):
    """The rows of an uninterrupted run of ``_step`` logged every 2 iterations: step -> values."""
    rows = {n: {"loss": 1.0 / n} for n in range(2, iterations + 1, 2)}
    for n in range(4, iterations + 1, 4):
        rows[n]["val"] = float(n - 1)
    return rows


# -- reading W&B's own files ---------------------------------------------------------------------------

_BLOCK, _HEADER = 32768, 7  # W&B's transaction log: LevelDB's log format, in blocks of 32 KiB


def _records(path: Path) -> list:
    """The records of a run's ``.wandb`` file, as ``wandb_internal_pb2.Record``.

    wandb 0.31 ships no Python reader (its Go core reads the file): this reads
    the format its earlier ``wandb.sdk.internal.datastore`` read, a ``:W&B``
    header, then CRC-checked chunks in 32 KiB blocks, each a serialized Record.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:_HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path} is no W&B transaction log"
    records, pending, at = [], b"", _HEADER
    while at + _HEADER <= len(data):
        left = _BLOCK - at % _BLOCK
        if left < _HEADER:  # the block's tail, too short for a chunk, is padding
            at += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[at : at + _HEADER])
        if kind == 0:
            at += left
            continue
        body = data[at + _HEADER : at + _HEADER + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == checksum, f"{path}: a torn chunk at {at}"
        at += _HEADER + length
        pending = body if kind in (1, 2) else pending + body  # full, first; middle, last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


@attrs.frozen
class Attempt:
    """One ``wandb.init`` as W&B wrote it offline: its run record, config, rows and exit."""

    run_id: str
    project: str
    name: str
    config: dict
    rows: dict  # step -> {metric: value}
    exit_code: int | None


def _finished(path: Path, wait: float = 30.0) -> list:
    """The records of the finished run ``path``, once W&B has written its exit record.

    ``Run.finish`` returns once W&B's core has the run's exit, and the core
    writes the file's last block just after: a read at once can find a part.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            records = _records(path)
        except AssertionError:  # a chunk still being written
            records = []
        if any(record.WhichOneof("record_type") == "exit" for record in records):
            return records
        assert time.monotonic() < deadline, f"{path}: no exit record after {wait} s"
        time.sleep(0.05)


def _attempts(directory: Path) -> list[Attempt]:
    """Every offline run W&B wrote under ``directory / "wandb"``, in the order they began; each finished."""
    found = []
    for path in sorted((directory / "wandb").glob("offline-run-*/run-*.wandb")):
        run, config, rows, exit_code = None, {}, {}, None
        for record in _finished(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
                config.update({item.key: json.loads(item.value_json) for item in run.config.update})
            elif kind == "config":
                config.update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                items = {
                    ".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item
                }
                step = items.pop("_step")
                assert step == record.history.step.num
                rows[step] = {k: v for k, v in items.items() if k not in ("_runtime", "_timestamp")}
            elif kind == "exit":
                exit_code = record.exit.exit_code
        assert run is not None, f"{path} has no run record"
        started = run.start_time.seconds + run.start_time.nanos / 1e9
        found.append((started, Attempt(run.run_id, run.project, run.display_name, config, rows, exit_code)))
    return [attempt for _, attempt in sorted(found, key=lambda pair: pair[0])]


def _rewound(attempts: list[tuple[dict, dict]]) -> dict:
    """The rows W&B's rewind leaves from ``(init options, rows)`` attempts of one run: an attempt begun
    with ``resume_from="<id>?_step=<s>"`` keeps the rows up to ``s`` and adds its own from ``s + 1`` on."""
    history: dict = {}
    for options, rows in attempts:
        if "resume_from" in options:
            last = int(options["resume_from"].rpartition("?_step=")[2])
            history = {step: row for step, row in history.items() if step <= last}
        else:
            last = -1
        history.update({step: row for step, row in rows.items() if step > last})
    return history


# -- offline: what W&B writes --------------------------------------------------------------------------


@attrs.frozen
class Settings:
    lr: float
    layers: tuple[int, ...]
    optimizer: dict


def test_an_offline_run_holds_each_write_at_its_iteration_and_the_config(offline):
    config = Settings(lr=0.1, layers=(64, 64), optimizer={"name": "adamw", "betas": [0.9, 0.95]})
    writer = fl.writers.wandb("exp", name="a", dir=offline, config=config)
    fl.run(fl.TrainState(max_iter=8), _step, [None] * 8, [fl.every(2, fl.hooks.log(writer))])
    (attempt,) = _attempts(offline)
    assert (attempt.run_id, attempt.project, attempt.name) == (writer.run_id, "exp", "a")
    assert attempt.config == {
        "_wandb": {},
        "lr": 0.1,
        "layers": [64, 64],
        "optimizer": {"name": "adamw", "betas": [0.9, 0.95]},
    }
    assert attempt.rows == _expected(8)
    assert attempt.exit_code == 0
    record = json.loads(Path(writer.target).read_text())
    assert record == {"id": writer.run_id, "project": "exp", "entity": None, "name": "a"}


def test_an_offline_run_holds_non_finite_values_as_such(offline):
    step = lambda s, b: fl.record(s, a=math.nan, b=math.inf)  # noqa: E731
    fl.run(fl.TrainState(max_iter=1), step, [None], [fl.hooks.log(fl.writers.wandb("exp", dir=offline))])
    (attempt,) = _attempts(offline)
    assert math.isnan(attempt.rows[1]["a"]) and attempt.rows[1]["b"] == math.inf


def test_a_resumed_run_rewinds_the_same_w_and_b_run_to_the_iteration_before_it(offline, tmp_path):
    log = lambda name: fl.every(2, fl.hooks.log(fl.writers.wandb("exp", name=name, dir=offline)))  # noqa: E731
    hooks = [
        log("broken"),
        fl.every(3, fl.hooks.checkpoint(tmp_path / "ckpt")),
        testing.Fail(fl.Phase.AFTER_STEP, 8),
    ]
    with pytest.raises(testing.InjectedFailure):
        fl.run(fl.TrainState(max_iter=12), _step, fl.data.resumable([None] * 12), hooks)
    resumed = fl.checkpoint.resume(tmp_path / "ckpt", like=fl.TrainState(max_iter=12))
    k = resumed.iteration
    fl.run(resumed, _step, fl.data.resumable([None] * 12), [log("broken")])
    first, second = _attempts(offline)
    assert first.run_id == second.run_id == _wandb.derived_id("exp", "broken")
    assert max(first.rows) >= k  # the failed attempt logged the line the resume writes again
    assert second.config["_wandb"] == {"branch_point": {"run_id": first.run_id, "step": k - 1}}
    assert min(second.rows) == k
    history = _rewound([({}, first.rows), ({"resume_from": f"{first.run_id}?_step={k - 1}"}, second.rows)])
    assert history == _expected(12)


def test_the_client_drops_a_row_at_the_rewind_step_itself(offline):
    # Why the writer rewinds to k - 1, not k: W&B's client starts a rewound run at the step after
    # the rewind point, and silently drops a row logged at that point.
    import wandb

    options = {"project": "exp", "id": "x", "dir": str(offline), "reinit": "create_new"}
    run = wandb.init(**options)
    run.log({"loss": 1.0}, step=2)
    run.finish()
    run = wandb.init(**options, resume_from="x?_step=2")
    assert run.starting_step == 3
    run.log({"loss": 2.0}, step=2)
    run.log({"loss": 3.0}, step=3)
    run.finish()
    assert [a.rows for a in _attempts(offline)] == [{2: {"loss": 1.0}}, {3: {"loss": 3.0}}]


def test_a_restart_from_zero_rewinds_a_run_this_directory_began(offline):
    writer = fl.writers.wandb("exp", id="again", dir=offline)
    for _ in range(2):
        fl.run(fl.TrainState(max_iter=2), _step, [None] * 2, [fl.hooks.log(writer)])
    first, second = _attempts(offline)
    assert first.config["_wandb"] == {}
    assert second.config["_wandb"] == {"branch_point": {"run_id": "again", "step": 0}}
    assert first.rows == second.rows == {1: {"loss": 1.0}, 2: {"loss": 0.5}}


def test_a_resume_without_an_id_or_name_warns_and_starts_a_new_run(offline):
    state = fl.TrainState(max_iter=4, iteration=2)
    with pytest.warns(UserWarning, match=r"no id= or name=.*Give the writer the same id= \(or name=\)"):
        fl.run(state, _step, [None] * 2, [fl.hooks.log(fl.writers.wandb("exp", dir=offline))])
    (attempt,) = _attempts(offline)
    assert attempt.config["_wandb"] == {} and attempt.rows == {
        3: {"loss": 1 / 3},
        4: {"loss": 0.25, "val": 3.0},
    }
    assert not (offline / "wandb" / "fnloop").exists()  # nothing to hold or find again


# -- the recorded double, across processes -------------------------------------------------------------


def _calls(record: Path) -> list[dict]:
    return [json.loads(text) for text in record.read_text().splitlines()]


def _worker(out: Path, record: Path, *extra: str, **popen) -> subprocess.CompletedProcess:
    command = [sys.executable, str(WORKER), str(out), "--record", str(record), *extra]
    return subprocess.run(command, timeout=120, capture_output=True, text=True, **popen)


def _by_attempt(calls: list[dict]) -> list[tuple[dict, dict, list[dict]]]:
    """(init options, rows by step, every call) of each process, in order; a step logged twice fails."""
    attempts: dict[int, tuple[dict, dict, list[dict]]] = {}
    for call in calls:
        if call["call"] == "init":
            options = {k: v for k, v in call.items() if k not in ("pid", "call")}
            attempts[call["pid"]] = (options, {}, [])
        options, rows, seen = attempts[call["pid"]]
        seen.append(call)
        if call["call"] == "log":
            assert call["step"] not in rows, f"step {call['step']} logged twice by one attempt"
            rows[call["step"]] = call["data"]
    return list(attempts.values())


def test_a_run_killed_with_sigkill_and_run_again_continues_the_same_run_rewound(tmp_path):
    record = tmp_path / "calls.jsonl"
    straight = _worker(tmp_path / "straight", tmp_path / "straight.jsonl")
    assert straight.returncode == 0, straight.stderr
    killed = _worker(tmp_path / "out", record, "--kill", "7")
    assert killed.returncode == -9, killed.stderr  # lines at 2, 4 and 6 written, the checkpoint at 4
    again = _worker(tmp_path / "out", record)
    assert again.returncode == 0, again.stderr
    (first, first_rows, first_calls), (second, second_rows, second_calls) = _by_attempt(_calls(record))
    run_id = _wandb.derived_id("exp", "run")
    assert first["id"] == second["id"] == run_id
    assert "resume_from" not in first and second["resume_from"] == f"{run_id}?_step=3"
    assert first["config"] == second["config"] == {"lr": 0.1}
    assert first["reinit"] == second["reinit"] == "create_new"
    assert first["dir"] == second["dir"] == str(tmp_path / "out")
    assert sorted(first_rows) == [2, 4, 6] and first_calls[-1]["call"] == "log"  # killed: no finish
    assert sorted(second_rows) == [4, 6, 8, 10, 12]  # from the resumed iteration, the line at 4 again
    assert [c["call"] for c in second_calls].count("finish") == 1 and second_calls[-1]["exit_code"] is None
    ((_, uninterrupted, _),) = _by_attempt(_calls(tmp_path / "straight.jsonl"))
    history = _rewound([(first, first_rows), (second, second_rows)])
    assert history == uninterrupted == _expected(12)


def test_a_run_killed_before_its_first_checkpoint_restarts_the_run_rewound_to_zero(tmp_path):
    record = tmp_path / "calls.jsonl"
    assert _worker(tmp_path / "out", record, "--kill", "2").returncode == -9  # the line at 2, no checkpoint
    assert _worker(tmp_path / "out", record).returncode == 0
    (first, first_rows, _), (second, second_rows, _) = _by_attempt(_calls(record))
    assert "resume_from" not in first and sorted(first_rows) == [2]
    assert second["resume_from"] == f"{first['id']}?_step=0"
    assert _rewound([(first, first_rows), (second, second_rows)]) == _expected(12)


# -- one live writer per run ---------------------------------------------------------------------------


def test_a_run_another_live_process_writes_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    out, record = tmp_path / "out", tmp_path / "calls.jsonl"
    command = [sys.executable, str(WORKER), str(out), "--record", str(record), "--hold", "5"]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with subprocess.Popen(command, text=True, **pipes) as holder:
        try:
            assert holder.stdout.readline() == "holding\n"
            held = _calls(record)
            monkeypatch.setitem(sys.modules, "wandb", None)  # refused before W&B is even imported
            log = fl.every(2, fl.hooks.log(fl.writers.wandb("exp", name="run", dir=out)))
            for start in (fl.TrainState(max_iter=8, iteration=4), fl.TrainState(max_iter=8)):  # resumed, new
                with pytest.raises(
                    fl.hooks.DirectoryInUse,
                    match=rf"W&B run 'fnloop-\w+' \(project 'exp'.*live run \(process {holder.pid},.*another id=",
                ):
                    fl.run(start, _step, fl.data.resumable([None] * 8), [log])
            assert _calls(record) == held
            _, errors = holder.communicate("\n", timeout=120)
            assert holder.returncode == 0, errors
        finally:
            if holder.poll() is None:
                holder.kill()


def test_two_log_hooks_of_one_process_on_one_run_are_refused(offline):
    make = lambda: fl.writers.wandb("exp", id="twice", dir=offline)  # noqa: E731
    hooks = [fl.hooks.log(make(), name="a"), fl.hooks.log(make(), name="b")]
    with pytest.raises(fl.hooks.DirectoryInUse, match=r"W&B run 'twice' .*another log hook of this process"):
        fl.run(fl.TrainState(max_iter=2), _step, [None] * 2, hooks)
    assert _attempts(offline) == []  # refused before anything was written
    fl.run(fl.TrainState(max_iter=2), _step, [None] * 2, hooks[1:])  # nothing left held
    (attempt,) = _attempts(offline)
    assert attempt.run_id == "twice" and attempt.exit_code == 0


def test_two_writers_of_one_run_in_one_log_are_refused_when_it_is_built(tmp_path):
    same = [fl.writers.wandb("exp", id="x", dir=tmp_path), fl.writers.wandb("exp", id="x", dir=tmp_path)]
    with pytest.raises(ValueError, match=r"write to .*fnloop/x\.json: every line would be written twice"):
        fl.hooks.log(*same)
    named = fl.writers.wandb("exp", name="n", dir=tmp_path)
    fl.hooks.log(named, fl.writers.wandb("exp", name="m", dir=tmp_path))  # two runs: fine


# -- what it refuses -----------------------------------------------------------------------------------


def test_wandb_missing_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    writer = fl.writers.wandb("exp", dir=tmp_path)  # built without W&B: it is needed when the run starts
    with pytest.raises(
        ImportError,
        match=r'pip install "wandb>=0.19.10" \(from a checkout of fnloop: pip install -e "\.\[wandb\]"\)',
    ):
        writer.start(0)


def test_a_wandb_too_old_for_one_run_per_writer_is_refused(monkeypatch, tmp_path):
    import types

    old = types.ModuleType("wandb")
    old.__version__ = "0.17.3"
    monkeypatch.setitem(sys.modules, "wandb", old)
    with pytest.raises(
        ImportError, match=r"needs wandb 0\.19\.10 or later.*this is wandb 0\.17\.3.*pip install -U"
    ):
        fl.writers.wandb("exp", dir=tmp_path).start(0)


@pytest.mark.parametrize(
    ("given", "error", "match"),
    [
        ({"project": 7}, TypeError, r"'project' must be a non-empty str \(got 7 that is an int\)"),
        ({"project": ""}, ValueError, r"'project' must be a non-empty str \(got '' that is a str\)"),
        ({"project": "a/b"}, ValueError, r"'project' must hold none of the characters / .*got 'a/b'"),
        ({"name": 3}, TypeError, r"'name' must be a str or None \(got 3 that is an int\).*name='seed-0'"),
        ({"name": " "}, ValueError, r"'name' must be a non-empty str or None \(got ' '"),
        ({"id": 5}, TypeError, r"'id' must be a str or None \(got 5 that is an int\).*WandbLogger"),
        ({"id": ""}, ValueError, r"'id' must be a non-empty str or None"),
        ({"id": "a?b"}, ValueError, r"'id' must hold none of the characters .*\? .*W&B refuses them"),
        ({"id": " a"}, ValueError, r"'id' must hold .*no leading or trailing space \(got ' a'"),
        ({"entity": 1}, TypeError, r"'entity' must be a str or None \(got 1 that is an int\)"),
        ({"mode": "disabled"}, ValueError, r"'mode' must be 'online', 'offline' or None \(got 'disabled'"),
        ({"dir": 3}, TypeError, r"fnloop.writers.wandb\(\): 'dir' must be a str or os.PathLike \(got 3"),
        (
            {"config": [("lr", 0.1)]},
            TypeError,
            r"'config' must be a mapping, an attrs instance or None \(got",
        ),
        ({"config": {"lr": {1: 2}}}, TypeError, r"'config' keys must be str: config\['lr'\] has the key 1"),
        (
            {"config": {"data": {"path": Path("/x")}}},
            TypeError,
            r"config\['data'\]\['path'\] must be JSON data.*\(got PosixPath\('/x'\).*str\(path\)",
        ),
    ],
)
def test_every_argument_is_checked_when_the_writer_is_built(given, error, match):
    with pytest.raises(error, match=match):
        fl.writers.wandb(**{"project": "exp", **given})


def test_a_dir_the_run_cannot_write_is_refused_when_the_writer_is_built(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"fnloop.writers.wandb\(.*\): cannot write a directory there"):
        fl.writers.wandb("exp", dir=tmp_path / "file" / "wandb")


def test_the_record_pickles_compares_and_survives_evolve():
    import pickle

    writer = fl.writers.wandb("exp", name="a", config={"lr": 0.1})
    assert pickle.loads(pickle.dumps(writer)) == writer
    assert attrs.evolve(writer, name="b").config == writer.config
    assert fl.writers.wandb("exp", id="x").run_id == "x" and fl.writers.wandb("exp").run_id is None
    assert os.path.isabs(writer.root)
