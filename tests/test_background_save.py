"""Checkpoint saves off the training path: ``checkpoint(..., background=True)``.

The writer is slowed down or held on purpose by wrapping the atomic write of
``fnloop.checkpoint._writing`` (``write_atomically``): the temporary file is
open and the tensors' bytes not yet read while it waits, so a save held there
overlaps the steps after it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import Phase, TrainState, checkpoint, testing
from fnloop._core import background
from fnloop.checkpoint import _writing
from fnloop.hooks import BackgroundFailed

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 10.0
"""The longest a test waits for the writer: a test that fails never hangs."""


def start(max_iter: int) -> TrainState:
    return TrainState(max_iter=max_iter, params={"w": torch.zeros(4)})


def plus_one(state: TrainState, batch: object) -> TrainState:
    """A pure step: ``w`` counts the steps, so each checkpoint tells its iteration."""
    return attrs.evolve(state, params={"w": state.params["w"] + 1})


def saver(directory: Path, keep: int | None = None, every: int = 1) -> fl.Hook:
    return fl.every(every, fl.hooks.checkpoint(directory, keep=keep, background=True))


def iteration_of(path: Path) -> int:
    return int(path.name.split(".")[0].removeprefix("ckpt-"))


def names(directory: Path) -> list[int]:
    return [iteration_of(p) for p in checkpoint.checkpoints(directory)]


def temporaries(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if name.endswith(".tmp")]


Write = Callable[[int], object]


@pytest.fixture
def writers(monkeypatch) -> list[background.Writer]:
    """The writer threads of the runs the test starts (each run's ``Driver`` makes its own), in order."""
    made: list[background.Writer] = []
    real = background.Writer.__init__

    def init(self: background.Writer) -> None:
        real(self)
        made.append(self)

    monkeypatch.setattr(background.Writer, "__init__", init)
    return made


@pytest.fixture
def writer(monkeypatch, writers) -> Iterator[Callable[[Callable[[Path, Write], None]], None]]:
    """``writer(wrap)``: every atomic write goes through ``wrap(path, write)``, which calls the real one.

    At the end of the test the job in flight, if any, is waited for, so that
    none outlives its test; its failure, already checked or not, is dropped.
    """
    real = _writing.write_atomically

    def install(wrap: Callable[[Path, Write], None]) -> None:
        monkeypatch.setattr(_writing, "write_atomically", lambda path, write: wrap(path, write))

    yield install
    monkeypatch.setattr(_writing, "write_atomically", real)
    for made in writers:
        with contextlib.suppress(BackgroundFailed):
            made.wait()


class Gate:
    """Holds the writer of one iteration inside its temporary file until ``open()``."""

    def __init__(self, iteration: int) -> None:
        self.iteration = iteration
        self.entered = threading.Event()
        self.opened = threading.Event()

    def __call__(self, path: Path, write: Write) -> None:
        real = _REAL_WRITE
        if iteration_of(path) != self.iteration:
            return real(path, write)

        def held(fd: int) -> None:
            os.write(fd, b"half a checkpoint")  # a partial file under the temporary name
            self.entered.set()
            assert self.opened.wait(TIMEOUT), "the test never let the writer go on"
            write(fd)

        return real(path, held)

    def open(self) -> None:
        self.opened.set()


_REAL_WRITE = _writing.write_atomically


@pytest.fixture
def gate(writer) -> Iterator[Callable[[int], Gate]]:
    made: list[Gate] = []

    def make(iteration: int) -> Gate:
        g = Gate(iteration)
        made.append(g)
        writer(g)
        return g

    yield make
    for g in made:  # a test that failed still lets its writer go
        g.open()


# -- the hand-over -----------------------------------------------------------------------------------


def test_the_hand_over_returns_before_the_write_finishes(tmp_path, gate, writers):
    held = gate(1)
    states = fl.scan(start(3), plus_one, [None] * 3, [saver(tmp_path)])
    first = next(states)  # step 0 and its AFTER_STEP, whose save of iteration 1 is now held
    assert first.iteration == 1
    assert held.entered.wait(TIMEOUT), "the save of iteration 1 never started"
    assert not checkpoint.path_for(tmp_path, 1).exists()  # the fold went on with the save in flight
    assert writers[-1].reading(first)  # and knows the save reads this state's tensors
    held.open()
    final = list(states)[-1]
    assert final.iteration == 3
    assert names(tmp_path) == [3, 2, 1]
    for i in (1, 2, 3):
        loaded = checkpoint.load(checkpoint.path_for(tmp_path, i), like=start(3))
        assert loaded.iteration == i and torch.equal(loaded.params["w"], torch.full((4,), float(i)))


def test_one_save_at_a_time(tmp_path, writer):
    lock = threading.Lock()
    now, most, order = [0], [0], []

    def slow(path: Path, write: Write) -> None:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            time.sleep(0.03)
            _REAL_WRITE(path, write)
            order.append(iteration_of(path))
        finally:
            with lock:
                now[0] -= 1

    writer(slow)
    fl.run(start(6), plus_one, [None] * 6, [saver(tmp_path)])
    assert most[0] == 1, f"{most[0]} saves were in flight at once"
    assert order == [1, 2, 3, 4, 5, 6]  # each once, in order: AFTER_TRAIN found iteration 6 saved


def test_after_train_waits_for_the_save_in_flight(tmp_path, writer, writers):
    writes: list[int] = []

    def slow_last(path: Path, write: Write) -> None:
        if iteration_of(path) == 3:
            time.sleep(0.2)
        _REAL_WRITE(path, write)
        writes.append(iteration_of(path))

    seen: list[bool] = []

    def probe(state: TrainState, phase: Phase) -> TrainState:
        if phase is Phase.AFTER_TRAIN:  # before any effect of the phase: the final save's included
            seen.append(checkpoint.path_for(tmp_path, 3).exists())
        return state

    writer(slow_last)
    final = fl.run(start(3), plus_one, [None] * 3, [saver(tmp_path), probe])
    assert final.iteration == 3
    assert seen == [True], "AFTER_TRAIN began with the last save still in flight"
    assert writes == [1, 2, 3]  # and saved iteration 3 once, not a second time beside the writer
    assert len(writers) == 1 and writers[0].job is None


# -- failures ----------------------------------------------------------------------------------------


def test_a_failed_save_is_raised_at_the_next_phase_naming_the_iteration_and_the_file(tmp_path, writer):
    stepping, failed = threading.Event(), threading.Event()

    def full_disk(path: Path, write: Write) -> None:
        if iteration_of(path) != 4:
            return _REAL_WRITE(path, write)

        def partial(fd: int) -> None:
            os.write(fd, b"the first bytes")
            assert stepping.wait(TIMEOUT)  # fail while step 4 runs, after its unit's check
            failed.set()
            raise OSError(errno.ENOSPC, "No space left on device")

        return _REAL_WRITE(path, partial)

    called: list[int] = []

    def step(state: TrainState, batch: object) -> TrainState:
        called.append(state.iteration)
        if state.iteration == 4:  # the save of iteration 4 was handed over as step 3 ended
            stepping.set()
            assert failed.wait(TIMEOUT)
            for thread in threading.enumerate():
                if thread.name == "fnloop-background":
                    thread.join(TIMEOUT)
        return plus_one(state, batch)

    writer(full_disk)
    path = checkpoint.path_for(tmp_path, 4)
    with pytest.raises(BackgroundFailed, match=rf"iteration 4 into {path}.*OSError.*No space left") as caught:
        fl.run(start(8), step, [None] * 8, [saver(tmp_path, every=2)])
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.ENOSPC
    # Raised as the unit after the failure began, before its step: the state step 4 left.
    assert called == [0, 1, 2, 3, 4]
    assert caught.value.state.iteration == 5
    # The file before it stands; no partial file; AFTER_TRAIN saved the last consistent state.
    assert names(tmp_path) == [5, 2]
    assert temporaries(tmp_path) == []
    assert checkpoint.latest(tmp_path, like=start(8)).iteration == 5


def test_a_failed_save_is_raised_by_the_next_hand_over_at_the_latest(tmp_path, writer):
    def fails(path: Path, write: Write) -> None:
        if iteration_of(path) == 2 and threading.current_thread() is not threading.main_thread():
            raise OSError(errno.EIO, "Input/output error")
        _REAL_WRITE(path, write)

    writer(fails)
    with pytest.raises(BackgroundFailed, match="iteration 2") as caught:
        fl.run(start(6), plus_one, [None] * 6, [saver(tmp_path)])
    # Step 2 ran (before or after the failure); the save of 3 never started.
    assert caught.value.state.iteration in (2, 3)
    assert names(tmp_path) == [caught.value.state.iteration, 1]


def test_a_failed_save_found_at_the_hand_over_after_a_donating_step_keeps_the_run_s_state(
    tmp_path, writer, writers
):
    """The failure is raised after the next step wrote into its (owned) state: that state is whole all the same."""

    reached = threading.Event()

    def fails(path: Path, write: Write) -> None:
        if iteration_of(path) == 2:
            # Not before the unit of step 2 has begun: a failure ended by then is found at its start.
            assert reached.wait(TIMEOUT)
            raise OSError(errno.ENOSPC, "No space left on device")
        _REAL_WRITE(path, write)

    def settled(state: TrainState, phase: Phase) -> TrainState:
        # Before step 2: the failed save has ended but is not yet settled, so the step may donate.
        if phase is Phase.BEFORE_STEP and state.iteration == 2:
            reached.set()
            job = writers[-1].job
            assert job is not None and job.done.wait(TIMEOUT)
        return state

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(6)]

    def mse(forward, batch):
        x, y = batch
        return ((forward(x) - y) ** 2).mean()

    opt = fl.optim.sgd(0.1)
    state = fl.init(model, opt, seed=0, max_iter=6)
    writer(fails)
    with pytest.raises(BackgroundFailed, match="iteration 2") as caught:
        fl.run(state, fl.train_step(model, mse, opt, compile=False), data, [settled, saver(tmp_path)])
    # Raised by the hand-over of iteration 3's save, after step 2 had written into its state.
    reference = list(fl.scan(state, fl.train_step(model, mse, opt, compile=False), data))[2]
    assert caught.value.state is not None and caught.value.state.iteration == 3
    testing.assert_identical(caught.value.state.params, reference.params)
    assert names(tmp_path) == [3, 1]  # AFTER_TRAIN saved it


def test_a_failure_of_the_last_save_fails_the_run_and_after_train_saves_again(tmp_path, writer):
    tries: list[int] = []

    def fails_once(path: Path, write: Write) -> None:
        tries.append(iteration_of(path))
        if tries.count(3) == 1 and iteration_of(path) == 3:
            raise PermissionError(errno.EACCES, "Permission denied")
        _REAL_WRITE(path, write)

    writer(fails_once)
    with pytest.raises(BackgroundFailed, match="iteration 3") as caught:
        fl.run(start(3), plus_one, [None] * 3, [saver(tmp_path, keep=1)])
    assert caught.value.state.iteration == 3
    assert tries == [1, 2, 3, 3]  # the final save, in the training thread, after the failed one
    assert names(tmp_path) == [3]


def test_no_partial_file_is_ever_visible_to_latest(tmp_path, gate):
    held = gate(2)
    states = fl.scan(start(3), plus_one, [None] * 3, [saver(tmp_path)])
    next(states), next(states)
    assert held.entered.wait(TIMEOUT)
    assert temporaries(tmp_path), "the held save has no temporary file"
    # The half-written file is not a checkpoint to anyone reading the directory (a warning would fail here).
    assert names(tmp_path) == [1]
    assert checkpoint.latest(tmp_path, like=start(3)).iteration == 1
    held.open()
    list(states)
    assert names(tmp_path) == [3, 2, 1]
    assert temporaries(tmp_path) == []


def test_setting_aside_and_pruning_happen_after_the_file_lands_and_warn_in_the_training_thread(
    tmp_path, monkeypatch
):
    # A run restarted from scratch into the directory of one that reached iteration 5.
    checkpoint.save(attrs.evolve(start(5), iteration=5), checkpoint.path_for(tmp_path, 5))
    shown: list[tuple[str, str]] = []

    def show(message, category, *args, **kwargs) -> None:
        shown.append((str(message), threading.current_thread().name))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        monkeypatch.setattr(warnings, "showwarning", show)
        fl.run(start(3), plus_one, [None] * 3, [saver(tmp_path, keep=1)])
    assert len(shown) == 1 and "ckpt-00000005.safetensors is newer" in shown[0][0]
    assert shown[0][1] == threading.main_thread().name  # where the caller's filters and handlers apply
    assert names(tmp_path) == [3]
    assert (tmp_path / "ckpt-00000005.safetensors.abandoned").exists()


# -- donation ----------------------------------------------------------------------------------------


def _mlp_run(directory: Path, *, in_background: bool, every: int) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = fl.optim.adamw(1e-2)

    def loss_fn(forward, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(forward(x), y)

    step = fl.train_step(model, loss_fn, optimizer, compile=True)
    data = (torch.randn(64, 8, generator=torch.Generator().manual_seed(1)), torch.randn(64, 2))
    hook = fl.hooks.checkpoint(directory, keep=None, background=in_background)
    state = fl.init(model, optimizer, seed=0, max_iter=8)
    return fl.run(state, step, fl.data.batches(data, batch_size=16, seed=2), [fl.every(every, hook)])


@pytest.mark.parametrize("every", [1, 2])
def test_donation_changes_no_bit_of_what_a_background_save_writes(tmp_path, writer, every):
    def slow(path: Path, write: Write) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.05)  # the next steps run, donating where they may, before the bytes are read
        _REAL_WRITE(path, write)

    writer(slow)
    synchronous = _mlp_run(tmp_path / "sync", in_background=False, every=every)
    ptrs: list[int] = []
    real_apply = fl.TrainStep.apply

    def apply(self, state, batches, *, owned):
        ptrs.append(state.params["0.weight"].data_ptr() if owned else -1)
        return real_apply(self, state, batches, owned=owned)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fl.TrainStep, "apply", apply)
        off_path = _mlp_run(tmp_path / "background", in_background=True, every=every)

    testing.assert_identical(testing.without_clock(off_path), testing.without_clock(synchronous))
    files = checkpoint.checkpoints(tmp_path / "sync")
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "background")] == [p.name for p in files]
    assert len(files) == 8 // every
    like = fl.init(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)),
                   fl.optim.adamw(1e-2), seed=0, max_iter=8)  # fmt: skip
    for path in files:
        a = checkpoint.load(path, like=like)
        b = checkpoint.load(tmp_path / "background" / path.name, like=like)
        pairs = list(zip(_tensors(a), _tensors(b), strict=True))
        assert pairs and all(torch.equal(x, y) for x, y in pairs), f"{path.name} differs"
    if every == 2:
        # Between saves the step still donated: it wrote into the tensors of the state before.
        assert any(p >= 0 for p in ptrs[1:]), ptrs


def _tensors(state: TrainState) -> list[torch.Tensor]:
    from fnloop._core.tree import leaves

    return [t for _, t in leaves(testing.without_clock(state)) if isinstance(t, torch.Tensor)]


# -- a signal ----------------------------------------------------------------------------------------

WORKER = """
import itertools, sys, threading, time
import attrs, torch
import fnloop as fl
from fnloop.checkpoint import _writing

real = _writing.write_atomically

def slow(path, write):
    if threading.current_thread() is not threading.main_thread():  # the background saves alone
        print(f"writing {path.name}", flush=True)
        time.sleep(0.5)
    real(path, write)

_writing.write_atomically = slow

def step(state, batch):
    time.sleep(0.01)  # the run is mid-step, not waiting for the save, when the signal comes
    return attrs.evolve(state, params={"w": state.params["w"] + 1})

state = fl.TrainState(max_iter=10**7, params={"w": torch.zeros(1000)})
hooks = [fl.every(50, fl.hooks.checkpoint(sys.argv[1], keep=2, background=True))]
try:
    fl.run(state, step, itertools.repeat(None), hooks)
except fl.Preempted as exc:
    print(f"stopped at {exc.state.iteration}", flush=True)
    raise
"""


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name != "posix", reason="POSIX signals")
def test_sigterm_with_a_save_in_flight_ends_with_the_final_checkpoint(tmp_path):
    out = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's fnloop, wherever pytest runs from
    process = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    try:
        assert process.stdout.readline().strip() == "writing ckpt-00000050.safetensors"
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 128 + signal.SIGTERM, stderr
    stopped = int(stdout.strip().splitlines()[-1].removeprefix("stopped at "))
    # The run's last consistent state is the newest checkpoint: the save in flight landed first.
    assert names(out)[0] == stopped, (names(out), stdout, stderr)
    like = TrainState(max_iter=10**7, params={"w": torch.zeros(1000)})
    for path in checkpoint.checkpoints(out):
        state = checkpoint.load(path, like=like)
        assert torch.equal(state.params["w"], torch.full((1000,), float(state.iteration)))
    assert checkpoint.latest(out, like=like).iteration == stopped
    assert [name for name in os.listdir(out) if name.endswith((".tmp", ".abandoned"))] == []
