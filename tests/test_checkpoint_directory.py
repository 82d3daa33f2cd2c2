"""One live run per checkpoint directory, and pruning that survives files vanishing under it."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import time
import warnings

import attrs
import pytest
import torch

import fnloop as fl
import fnloop.checkpoint._transfer
from fnloop import TrainState, checkpoint, testing
from fnloop.checkpoint import CheckpointError, CheckpointWarning


def counting(state, batch):
    return attrs.evolve(state, extra=(state.extra or 0) + 1)


def hold(directory):
    """Hold ``directory``'s lock as another process would (another open file description)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".fnloop.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.write(fd, b"424242\n")
    return fd


def test_a_run_on_a_held_directory_is_refused_before_its_first_step_and_writes_nothing(tmp_path):
    fd = hold(tmp_path)
    steps = []

    def step(state, batch):
        steps.append(state.iteration)
        return state

    try:
        with pytest.raises(fl.hooks.DirectoryInUse, match=rf"{tmp_path}.*process 424242"):
            fl.run(TrainState(max_iter=3), step, [None] * 3, [fl.hooks.checkpoint(tmp_path)])
        with pytest.raises(fl.hooks.DirectoryInUse):
            fl.run(TrainState(max_iter=3), step, [None] * 3, [fl.hooks.best_checkpoint(tmp_path, "x")])
    finally:
        os.close(fd)
    assert steps == []
    assert sorted(os.listdir(tmp_path)) == [".fnloop.lock"]


def test_the_lock_is_released_when_the_run_ends_and_shared_by_the_hooks_of_one_run(tmp_path):
    hooks = [fl.hooks.checkpoint(tmp_path), fl.hooks.best_checkpoint(tmp_path, "x")]
    step = lambda s, b: fl.record(s, x=float(-s.iteration))  # noqa: E731
    fl.run(TrainState(max_iter=2), step, [None] * 2, hooks)
    os.close(hold(tmp_path))  # free again
    assert {p.name for p in checkpoint.checkpoints(tmp_path)} == {
        "ckpt-00000001.safetensors",
        "ckpt-00000002.safetensors",
    }
    assert (tmp_path / "best.safetensors").exists()


WORKER = textwrap.dedent(
    """
    import sys, attrs, fnloop as fl
    directory, tag, pause = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "pause"
    def step(state, batch):
        if pause and state.iteration == 2:
            print("paused", flush=True)
            sys.stdin.readline()
        return attrs.evolve(state, extra=tag)
    try:
        fl.run(fl.TrainState(max_iter=4), step, [None] * 4, [fl.hooks.checkpoint(directory)])
    except fl.hooks.DirectoryInUse as exc:
        print("refused:", exc, flush=True)
        sys.exit(3)
    print("done", flush=True)
    """
)


def test_a_second_process_is_refused_at_once_and_the_first_keeps_its_directory(tmp_path):
    run = [sys.executable, "-c", WORKER, str(tmp_path)]
    with subprocess.Popen(
        [*run, "1", "pause"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as first:
        try:
            assert first.stdout.readline().strip() == "paused"
            before = sorted(os.listdir(tmp_path))
            began = time.perf_counter()
            second = subprocess.run([*run, "2", "go"], capture_output=True, text=True, timeout=60)
            assert second.returncode == 3, second.stderr
            assert str(tmp_path) in second.stdout and f"process {first.pid}" in second.stdout
            assert time.perf_counter() - began < 30  # importing torch; no waiting for the first run
            assert sorted(os.listdir(tmp_path)) == before
            first.stdin.write("\n")
            first.stdin.flush()
            assert first.wait(timeout=60) == 0
        finally:
            first.kill()
    newest = checkpoint.latest(tmp_path, like=TrainState(max_iter=4, extra=0))
    assert (newest.iteration, newest.extra) == (4, 1)


def test_abandoned_files_obey_keep(tmp_path):
    ckpt = fl.hooks.checkpoint(tmp_path, keep=2)
    for restart in range(4):
        fl.run(TrainState(max_iter=6 + restart), counting, [None] * 9, [ckpt])
        with pytest.warns(CheckpointWarning, match="abandoned"):
            fl.run(TrainState(max_iter=1), counting, [None], [ckpt])
    assert len(list(tmp_path.glob("*.abandoned"))) <= 2


def test_renames_and_pruning_tolerate_files_vanishing(tmp_path, monkeypatch):
    from fnloop.hooks import _saving as module  # the periodic checkpoint hook's module

    for i in (1, 2, 5, 6):
        checkpoint.save(TrainState(max_iter=9, iteration=i), checkpoint.path_for(tmp_path, i))
    listed = module.checkpoints

    def listing_then_vanishing(directory):
        found = listed(directory)
        for path in found:
            if path.name != "ckpt-00000003.safetensors":
                path.unlink()  # another process (or a user) removes them right after the listing
        return found

    monkeypatch.setattr(module, "checkpoints", listing_then_vanishing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        fl.run(TrainState(max_iter=3, iteration=2), counting, [None], [fl.hooks.checkpoint(tmp_path, keep=1)])
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["ckpt-00000003.safetensors"]


def test_a_checkpoint_directory_that_is_a_file_is_refused_at_once(tmp_path):
    existing = tmp_path / "run.txt"
    existing.write_text("not a directory")
    with pytest.raises(ValueError, match=r"run\.txt.*is an existing file"):
        fl.hooks.checkpoint(existing)
    with pytest.raises(ValueError, match=r"run\.txt.*is an existing file"):
        fl.hooks.best_checkpoint(existing, "loss")


@pytest.mark.parametrize("make", [fl.hooks.checkpoint, lambda d: fl.hooks.best_checkpoint(d, "x")])
def test_the_locking_hooks_are_good_hooks(tmp_path, make):
    state = fl.record(TrainState(max_iter=3, iteration=1, params={"w": torch.ones(2)}), x=1.0)
    testing.check_hook(make(tmp_path), state)
    assert os.listdir(tmp_path) == []  # a hook only asks; the fold holds and writes


def test_a_symlink_loop_as_the_directory_is_a_checkpoint_error_and_named_as_such(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for call in (
        lambda: checkpoint.latest(loop, like=fl.TrainState(max_iter=1)),
        lambda: checkpoint.checkpoints(loop),
    ):
        with pytest.raises(CheckpointError, match=r"a loop of symbolic links"):
            call()
    with pytest.raises(ValueError, match=r"is a loop of symbolic links"):
        fl.hooks.checkpoint(loop)


FORKING = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from fnloop._atomic import claim

    claim(Path(sys.argv[1]))
    for _ in range(3):  # as DataLoader workers are forked once the run holds its directory
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
    print("holding", flush=True)
    time.sleep(60)
    """
)


def test_forked_children_of_a_killed_run_do_not_hold_its_directory(tmp_path):
    # They inherited the lock's descriptor and held the directory until they noticed their parent had
    # died: a restart straight after a SIGKILL got DirectoryInUse naming a dead process.
    with subprocess.Popen(
        [sys.executable, "-c", FORKING, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as holder:
        try:
            assert holder.stdout.readline().strip() == "holding"
            holder.kill()
            holder.wait(timeout=30)
            from fnloop._atomic import claim, release

            claim(tmp_path)  # the children still live, asleep
            release(tmp_path)
        finally:
            os.killpg(holder.pid, 9)


LOGGING = textwrap.dedent(
    """
    import sys, attrs, fnloop as fl
    ckpt, log, first, pause = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "pause"
    def step(state, batch):
        if pause and state.iteration == 6:
            print("paused", flush=True)
            sys.stdin.readline()
        return fl.record(state, loss=float(state.iteration))
    hooks = [fl.hooks.checkpoint(ckpt), fl.every(2, fl.hooks.log(fl.writers.jsonl(log)))]
    if first == "log":
        hooks.reverse()  # the log's start effect would run before the checkpoint's claim
    try:
        fl.run(fl.TrainState(max_iter=8), step, [None] * 8, hooks)
    except fl.hooks.DirectoryInUse as exc:
        print("refused:", exc, flush=True)
        sys.exit(3)
    """
)


@pytest.mark.parametrize(
    ("second_ckpt", "first"), [("same", "log"), ("same", "checkpoint"), ("other", "log")]
)
def test_a_refused_run_touches_none_of_the_live_runs_files(tmp_path, second_ckpt, first):
    # The refused run's log start effect cut the live run's JSON lines back (32 races in 50 went wrong).
    log = tmp_path / "run" / "metrics.jsonl"
    live = [sys.executable, "-c", LOGGING, str(tmp_path / "run"), str(log), "checkpoint", "pause"]
    with subprocess.Popen(live, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout.readline().strip() == "paused"
            before = log.read_text()
            assert before.count("\n") == 3  # iterations 2, 4 and 6
            ckpt = tmp_path / ("run" if second_ckpt == "same" else "elsewhere")
            second = subprocess.run(
                [sys.executable, "-c", LOGGING, str(ckpt), str(log), first, "go"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert second.returncode == 3, second.stdout + second.stderr
            assert f"process {holder.pid}" in second.stdout
            assert log.read_text() == before
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.wait(timeout=60) == 0
        finally:
            holder.kill()
    assert [line.split(",")[0] for line in log.read_text().splitlines()] == [
        f'{{"iteration": {i}' for i in (2, 4, 6, 8)
    ]
