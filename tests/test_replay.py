"""Replay: record fingerprints, replay from any checkpoint, find the first divergent step and tensor."""

from __future__ import annotations

import pytest

import fnloop as fl
from fnloop import replay
from tests import replay_job


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """A recorded run: its fingerprint log and a checkpoint after every step."""
    monkeypatch.delenv("FNLOOP_TEST_NOISE", raising=False)
    state, step, batches, hooks = replay_job.job()
    log = tmp_path / "fingerprints.jsonl"
    ckpt = tmp_path / "ckpt"
    fl.run(state, step, batches, [*hooks, replay.fingerprints(log), fl.hooks.checkpoint(ckpt, keep=None)])
    return log, ckpt, state


def test_a_deterministic_run_replays_identically_from_the_start_and_from_a_checkpoint(recorded):
    log, ckpt, template = recorded
    _, step, batches, hooks = replay_job.job()
    report = replay.replay(template, step, batches, hooks, log)
    assert report.identical and report.compared == 12
    midway = fl.load(fl.checkpoint.path_for(ckpt, 5), like=template)
    report = replay.replay(midway, step, batches, hooks, log)
    assert report.identical and report.compared == 7
    assert str(report) == "identical: 7 recorded steps replayed bit for bit"


@pytest.mark.parametrize("start", [0, 4])
def test_injected_nondeterminism_is_reported_at_its_step_and_tensor(recorded, monkeypatch, start):
    log, ckpt, template = recorded
    monkeypatch.setenv("FNLOOP_TEST_NOISE", "1")
    _, step, batches, hooks = replay_job.job()
    state = template if start == 0 else fl.load(fl.checkpoint.path_for(ckpt, start), like=template)
    report = replay.replay(state, step, batches, hooks, log)
    assert not report.identical
    assert report.divergence.step == 7
    assert report.divergence.path == "state.params['0.weight']"
    assert report.compared == 8 - start
    assert str(report).startswith("diverged at step 7: state.params['0.weight'] sums to ")


def test_the_command_line_replays_a_job(recorded, monkeypatch, capsys):
    log, ckpt, _ = recorded
    assert replay.main(["tests.replay_job:job", "--log", str(log)]) == 0
    assert "identical: 12 recorded steps" in capsys.readouterr().out
    monkeypatch.setenv("FNLOOP_TEST_NOISE", "1")
    checkpoint = str(fl.checkpoint.path_for(ckpt, 3))
    assert replay.main(["tests.replay_job:job", "--log", str(log), "--checkpoint", checkpoint]) == 1
    assert "diverged at step 7" in capsys.readouterr().out
    assert (
        replay.main(["tests.replay_job:job", "--log", str(log), "--checkpoint", checkpoint, "--steps", "4"])
        == 0
    )


def test_a_bad_log_line_is_named(tmp_path):
    log = tmp_path / "bad.jsonl"
    log.write_text('{"step": 0, "fingerprint": {}}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a fingerprint record"):
        replay.read_log(log)
