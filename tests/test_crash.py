"""Crashes: a run killed with SIGKILL at random moments, or stopped by SIGTERM, loses nothing.

The training runs in real processes (``tests/crash_worker.py``): a small MLP
trained with AdamW, a learning-rate schedule, dropout and a resumable data
stream, checkpointing into a directory and resuming from ``latest``. To pay
for importing torch once rather than twenty times, one server process
imports it and forks a child per run (``crash_worker.py --serve``); the test
SIGKILLs the child. The reference is an uninterrupted run of the same worker,
which records a fingerprint (a digest of every bit but the clock) of the state
after each step.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

import fnloop as fl
from fnloop import checkpoint, testing
from fnloop.checkpoint import DamagedCheckpoint

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="the worker server forks"),
]

WORKER = Path(__file__).with_name("crash_worker.py")
_spec = importlib.util.spec_from_file_location("crash_worker", WORKER)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)
MAX_ITER = 200
KILLS = 20
TEMP = re.compile(r"\.ckpt-(\d+)\.safetensors\.\d+(?:@[A-Za-z0-9_-]*)?\.[0-9a-f]{8}\.tmp")


class Lines:
    """The lines a process prints, read by a thread, so that waiting for one can time out."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.queue.put(line.rstrip("\n"))
        self.queue.put(None)

    def expect(self, prefix: str, timeout: float) -> str:
        """The rest of the next line starting with ``prefix``; other lines are skipped."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise AssertionError(f"no line starting with {prefix!r} within {timeout} s") from None
            if line is None:
                raise AssertionError(f"the process ended before printing {prefix!r}")
            if line.startswith(prefix):
                return line[len(prefix) :]

    def close(self) -> None:
        """Once the process has ended: wait for the reader to see the end, and close the pipe."""
        self.reader.join(30)
        self.stream.close()

    def ended(self) -> int | None:
        """The exit status of the server's current child if it has ended, without waiting."""
        with contextlib.suppress(queue.Empty):
            while True:
                line = self.queue.get_nowait()
                if line is None or line.startswith("exit "):
                    return -1 if line is None else int(line[5:])
        return None


class Server:
    """``crash_worker.py --serve``: starts worker runs as forked children."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.lines = Lines(self.process.stdout)
        self.lines.expect("ready", timeout=120)
        self.child: int | None = None

    def start(self, *args: object) -> int:
        assert self.child is None, "one run at a time"
        self.process.stdin.write(shlex.join(str(a) for a in args) + "\n")
        self.process.stdin.flush()
        self.child = int(self.lines.expect("pid ", timeout=30))
        return self.child

    def wait(self, timeout: float = 120) -> int:
        code = int(self.lines.expect("exit ", timeout))
        self.child = None
        return code

    def kill(self) -> int:
        """SIGKILL the running child; its exit status (-9, or another if it ended first)."""
        ended = self.lines.ended()
        if ended is not None:
            self.child = None
            return ended
        os.kill(self.child, signal.SIGKILL)
        return self.wait(30)

    def close(self) -> None:
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, signal.SIGKILL)
        self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.lines.close()


@pytest.fixture(scope="module")
def server():
    server = Server()
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference(server, tmp_path_factory):
    """Fingerprints of the uninterrupted run after each step, and its final state."""
    out = tmp_path_factory.mktemp("reference")
    server.start(out, MAX_ITER, "--every", 10**6, "--record", out / "prints.json")
    assert server.wait() == 0
    prints = {int(i): digest for i, digest in json.loads((out / "prints.json").read_text()).items()}
    assert sorted(prints) == list(range(1, MAX_ITER + 1))
    final = checkpoint.load(checkpoint.path_for(out, MAX_ITER), like=worker.template(MAX_ITER))
    return prints, final


def newest(directory: Path) -> int:
    found = checkpoint.checkpoints(directory)
    return int(found[0].stem.removeprefix("ckpt-")) if found else 0


def temporaries(directory: Path) -> list[Path]:
    if not directory.exists():
        return []
    return [directory / name for name in os.listdir(directory) if TEMP.fullmatch(name)]


def wait_until(condition: Callable[[], object], server: Server, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert server.lines.ended() is None, "the worker ended before it was killed"
        assert time.monotonic() < deadline, "the worker made no progress"
        time.sleep(0.001)


def without_clock(state: fl.TrainState) -> fl.TrainState:
    return attrs.evolve(state, clock=fl.Clock())


def test_sigkill_at_random_moments_loses_nothing(server, reference, tmp_path):
    prints, uninterrupted = reference
    like = worker.template(MAX_ITER)
    out = tmp_path / "run"
    rng = random.Random(1880)
    done, mid_write = 0, 0
    for attempt in range(KILLS):
        server.start(out, MAX_ITER)
        # Let it resume and save at least once, then kill it: mostly after a random number of
        # steps plus a random delay, every fourth time as soon as a save has begun (mid-write).
        during_save = attempt % 4 == 3
        goal = done + 1 + (0 if during_save else rng.randint(0, 5))
        wait_until(lambda goal=goal: newest(out) >= goal, server)
        if during_save:
            wait_until(lambda: temporaries(out), server)
            time.sleep(rng.uniform(0, 0.003))
        else:
            time.sleep(rng.uniform(0, 0.03))
        assert server.kill() == -signal.SIGKILL

        left = temporaries(out)
        mid_write += bool(left)
        # Every file named as a checkpoint is whole and is the uninterrupted run's state at its iteration.
        files = checkpoint.checkpoints(out)
        assert 1 <= len(files) <= 3  # keep=2, plus one if killed between a save and the pruning
        for path in files:
            state = checkpoint.load(path, like=like)
            assert path == checkpoint.path_for(out, state.iteration)
            assert worker.fingerprint(state) == prints[state.iteration], (
                f"{path} differs from the run's state"
            )
        # An interrupted save left its temporary file: it does not load, or loads as the right state.
        for path in left:
            try:
                state = checkpoint.load(path, like=like)
            except DamagedCheckpoint:
                continue
            assert worker.fingerprint(state) == prints[state.iteration] and path.name.startswith(
                f".ckpt-{state.iteration:08d}."
            )
        resumed = checkpoint.latest(out, like=like)  # a CheckpointWarning would fail the test
        assert resumed is not None
        assert resumed.iteration >= goal > done, "a resumed run went back"
        done = resumed.iteration
    assert mid_write >= 1, "no kill landed while a checkpoint was being written"
    assert done < MAX_ITER

    server.start(out, MAX_ITER)
    assert server.wait() == 0
    final = checkpoint.load(checkpoint.path_for(out, MAX_ITER), like=like)
    testing.assert_identical(without_clock(final), without_clock(uninterrupted))


def test_sigterm_saves_the_last_consistent_state_off_period_and_exits_143(server, reference, tmp_path):
    prints, uninterrupted = reference
    like = worker.template(MAX_ITER)
    out = tmp_path / "run"
    # A plain process, not a forked child: the exit status is Python's own for fnloop.Preempted.
    process = subprocess.Popen(
        [sys.executable, str(WORKER), str(out), str(MAX_ITER), "--every", "50", "--pause-at", "61"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines = Lines(process.stdout)
    try:
        lines.expect("paused", timeout=120)  # inside AFTER_STEP of step 61
        process.send_signal(signal.SIGTERM)
        process.stdin.write("go on\n")
        process.stdin.flush()
        assert process.wait(60) == 128 + signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdin.close()
        lines.close()

    # Step 61 finished; AFTER_TRAIN saved its state although every(50) had not come.
    assert [p.name for p in checkpoint.checkpoints(out)] == [
        "ckpt-00000062.safetensors",
        "ckpt-00000050.safetensors",
    ]
    stopped = checkpoint.latest(out, like=like)
    assert stopped.iteration == 62
    assert worker.fingerprint(stopped) == prints[62]

    server.start(out, MAX_ITER, "--every", 50)
    assert server.wait() == 0
    final = checkpoint.load(checkpoint.path_for(out, MAX_ITER), like=like)
    testing.assert_identical(without_clock(final), without_clock(uninterrupted))
