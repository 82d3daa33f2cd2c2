"""The log hook in runs: when it writes, what, and how its files read after a resume or a kill.

Also the other hooks that show a run: progress, memory and profile.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import Phase, TrainState, testing, writers
from fnloop.hooks import LogState, log, memory, profile, progress, timer, trace_path
from tests.test_crash import Lines, Server, newest, wait_until


class Clock:
    """A clock that moves only when the step moves it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def stepping(clock: Clock, seconds: float = 0.5):
    def step(state: TrainState, batch: object) -> TrainState:
        clock.now += seconds
        return fl.record(state, loss=torch.tensor(1.0 / (state.iteration + 1)), lr=torch.tensor(0.1))

    return step


def lines(path: Path) -> list[dict]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def record_at_end(name: str, value: float):
    def hook(state: TrainState, phase: Phase) -> TrainState:
        return fl.record(state, **{name: value}) if phase is Phase.AFTER_TRAIN else state

    return hook


# -- detectron2's writer test, rewritten ---------------------------------------------------------------


@pytest.mark.parametrize("eval_first", [True, False], ids=["eval-before-log", "eval-after-log"])
def test_detectron2_writer_test(tmp_path, caplog, eval_first):
    caplog.set_level(logging.INFO, logger="fnloop")
    clock = Clock()
    path = tmp_path / "metrics.json"
    evaluation = fl.on(Phase.AFTER_TRAIN, fl.hooks.evaluate(lambda state: {"metric": 100}))
    writer = fl.every(20, log(writers.console(), writers.jsonl(path)))
    hooks = [timer(), evaluation, writer] if eval_first else [timer(), writer, evaluation]
    fl.run(TrainState(max_iter=50), stepping(clock), range(50), hooks, clock=clock)

    data = lines(path)
    assert [x["iteration"] for x in data] == [20, 40, 50]
    assert "metric" in data[-1], "Eval metric must be in last line of JSON!"
    assert all("metric" not in x for x in data[:-1])
    output = [r.getMessage() for r in caplog.records if r.name == "fnloop"]
    assert len(output) == 3
    for text, iteration in zip(output, [20, 40, 50]):
        assert f"iter: {iteration}" in text
    assert output[0].startswith("eta: 0:00:15  iter: 20  loss: ")
    assert "eta: 0:00:00" in output[-1], "Last ETA must be 0!"


def test_each_line_holds_the_newest_value_of_what_was_recorded_since(tmp_path):
    path = tmp_path / "m.jsonl"
    step = lambda s, b: fl.record(s, loss=float(b), **({"acc": b / 10} if b % 4 == 0 else {}))  # noqa: E731
    fl.run(TrainState(max_iter=10), step, range(10), [fl.every(3, log(writers.jsonl(path)))])
    assert lines(path) == [
        {"iteration": 3, "loss": 2.0, "acc": 0.0},
        {"iteration": 6, "loss": 5.0, "acc": 0.4},
        {"iteration": 9, "loss": 8.0, "acc": 0.8},
        {"iteration": 10, "loss": 9.0},
    ]


def test_no_end_line_when_nothing_new_and_an_own_line_for_a_late_metric(tmp_path):
    quiet, late = tmp_path / "quiet.jsonl", tmp_path / "late.jsonl"
    fl.run(TrainState(max_iter=50), stepping(Clock()), range(50), [fl.every(25, log(writers.jsonl(quiet)))])
    assert [x["iteration"] for x in lines(quiet)] == [25, 50]
    hooks = [fl.every(25, log(writers.jsonl(late))), record_at_end("metric", 7.0)]
    fl.run(TrainState(max_iter=50), stepping(Clock()), range(50), hooks)
    # The evaluation came after the line at 50 was written: it gets a line of its own.
    assert lines(late)[1:] == [lines(quiet)[1], {"iteration": 50, "metric": 7.0}]


def test_a_failed_run_writes_what_it_recorded_up_to_its_last_consistent_state(tmp_path):
    path = tmp_path / "m.jsonl"
    hooks = [fl.every(4, log(writers.jsonl(path))), testing.Fail(Phase.AFTER_STEP, 6)]
    with pytest.raises(testing.InjectedFailure):
        fl.run(TrainState(max_iter=10), stepping(Clock()), range(10), hooks)
    assert [x["iteration"] for x in lines(path)] == [4, 6]


def test_log_state_counts_what_was_written():
    final = fl.run(TrainState(max_iter=7), stepping(Clock()), range(7), [fl.every(3, log(writers.console()))])
    assert final.hooks["log"] == LogState(done=7, line=7, start=6)


# -- resume --------------------------------------------------------------------------------------------


def hooks_for(path: Path, ckpt: Path | None = None) -> list:
    return [
        timer(warmup=0),
        fl.every(4, fl.hooks.checkpoint(ckpt)) if ckpt is not None else None,
        fl.every(3, log(writers.jsonl(path), name="metrics")),
    ]


def test_resumed_run_has_the_hook_states_and_log_lines_of_an_uninterrupted_one(tmp_path):
    clock = Clock()
    straight = fl.run(
        TrainState(max_iter=10), stepping(clock), range(10), hooks_for(tmp_path / "a.jsonl"), clock=clock
    )

    clock = Clock()
    path = tmp_path / "b.jsonl"
    fold = fl.scan(TrainState(max_iter=10), stepping(clock), range(10), hooks_for(path), clock=clock)
    for state in fold:
        if state.iteration == 6:
            fl.save(state, tmp_path / "mid.safetensors")
        if state.iteration == 8:
            break
    fold.close()  # stopped at 8, as by a signal: AFTER_TRAIN wrote a line the resumed run must drop
    assert [x["iteration"] for x in lines(path)] == [3, 6, 8]

    loaded = fl.load(tmp_path / "mid.safetensors", like=TrainState(max_iter=10))
    clock = Clock(loaded.time)
    resumed = fl.run(loaded, stepping(clock), range(6, 10), hooks_for(path), clock=clock)
    assert lines(path) == lines(tmp_path / "a.jsonl")
    assert [x["iteration"] for x in lines(path)] == [3, 6, 9, 10]
    # Each run remembers its own first iteration, where its timer's warm-up began; all else is equal.
    assert resumed.hooks["timer"] == attrs.evolve(straight.hooks["timer"], start=6)
    assert resumed.hooks["metrics"] == straight.hooks["metrics"]
    testing.assert_identical(resumed.metrics, straight.metrics)


def test_a_line_lost_between_a_checkpoint_and_its_write_is_written_again(tmp_path):
    def hooks_in(folder: Path) -> list:
        return [fl.every(3, fl.hooks.checkpoint(folder)), fl.every(3, log(writers.jsonl(folder / "m.jsonl")))]

    fl.run(TrainState(max_iter=9), stepping(Clock()), range(9), hooks_in(tmp_path / "straight"))
    reference = lines(tmp_path / "straight" / "m.jsonl")
    ckpt = tmp_path / "run"
    path, hooks = ckpt / "m.jsonl", hooks_in(ckpt)
    fold = fl.scan(TrainState(max_iter=9), stepping(Clock()), range(9), hooks)
    for state in fold:
        if state.iteration == 6:
            break
    fold.close()
    # As a kill after the save of ckpt-6 and before the write of line 6 would leave it:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines(path)[:-1]))
    loaded = fl.checkpoint.latest(ckpt, like=TrainState(max_iter=9))
    assert loaded.iteration == 6
    fl.run(loaded, stepping(Clock()), range(6, 9), hooks)
    assert lines(path) == reference


# -- a kill at a random moment ---------------------------------------------------------------------------

LOG_WORKER = Path(__file__).with_name("log_worker.py")


class LogServer(Server):
    """crash_worker's server, running ``tests/log_worker.py``'s training."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(LOG_WORKER), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines = Lines(self.process.stdout)
        self.lines.expect("ready", timeout=120)
        self.child = None


def written(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the worker server forks")
def test_json_lines_after_random_kills_and_resumes_read_as_one_run(tmp_path):
    max_iter, every, period = 90, 7, 5
    server = LogServer()
    try:
        straight = tmp_path / "straight"
        server.start(straight, max_iter, "--every", every, "--log", period)
        assert server.wait() == 0
        out = tmp_path / "run"
        rng = random.Random(8)
        ahead = 0  # kills that left lines past the newest checkpoint, for the resume to cut
        for _ in range(6):
            server.start(out, max_iter, "--every", every, "--log", period)
            goal = written(out / "metrics.jsonl") + rng.randint(1, 3)
            wait_until(lambda goal=goal: written(out / "metrics.jsonl") >= goal, server)
            time.sleep(rng.uniform(0, 0.02))
            assert server.kill() == -signal.SIGKILL
            whole = (out / "metrics.jsonl").read_text().split("\n")[:-1]  # a torn last line left out
            ahead += json.loads(whole[-1])["iteration"] > newest(out)
        assert ahead >= 1
        server.start(out, max_iter, "--every", every, "--log", period)
        assert server.wait() == 0
    finally:
        server.close()
    iterations = [x["iteration"] for x in lines(out / "metrics.jsonl")]
    assert iterations == sorted(set(iterations)), "repeated or out-of-order iterations"
    assert iterations[-1] == max_iter
    # The resumed state is bit for bit the uninterrupted one, so its log is too.
    assert lines(out / "metrics.jsonl") == lines(straight / "metrics.jsonl")


# -- check_hook and pickling, for every hook here ------------------------------------------------------


@pytest.mark.parametrize(
    "hook",
    [
        log(writers.console()),
        fl.every(3, log(writers.jsonl("unused.jsonl"), name="other")),
        timer(),
        memory(),
        progress(),
        profile("unused", start=2, steps=1),
    ],
    ids=repr,
)
def test_is_a_good_hook(hook):
    state = TrainState(max_iter=6, iteration=2, metrics=fl.Metrics().record(1, {"loss": 1.0}))
    testing.check_hook(hook, state)
    assert pickle.loads(pickle.dumps(hook)) == hook
    assert not Path("unused.jsonl").exists() and not Path("unused").exists()


def test_log_refuses_no_writers_and_non_writers():
    with pytest.raises(ValueError, match=r"log\(\) needs at least one writer \(got none\)"):
        log()
    with pytest.raises(TypeError, match=r"start, write and close .* \(got 'x.jsonl' that is a str\)"):
        log("x.jsonl")


# -- progress ------------------------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_a_bar_with_the_loss_on_a_terminal(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    hooks = [progress(mininterval=0)]
    fl.run(TrainState(max_iter=10, iteration=4), stepping(Clock()), range(6), hooks)
    text = screen.getvalue()
    assert "10/10" in text and "4/10" in text
    assert "loss: 0.1" in text  # 1 / (9 + 1), the newest loss at the last redraw
    from fnloop.hooks._progress import _BARS

    assert not _BARS, "the bar is closed at AFTER_TRAIN"


def test_progress_between_redraws_only_counts_and_ends_at_the_last_step(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    fl.run(TrainState(max_iter=10), stepping(Clock()), range(10), [progress(mininterval=1000)])
    text = screen.getvalue()
    assert "10/10" in text and "loss" not in text  # never redrawn mid-run: the loss was never read


def test_progress_does_nothing_without_a_terminal(monkeypatch):
    screen = io.StringIO()
    monkeypatch.setattr(sys, "stderr", screen)
    final = fl.run(TrainState(max_iter=5), stepping(Clock()), range(5), [progress(mininterval=0)])
    assert screen.getvalue() == ""
    assert final.hooks == {}


def test_progress_without_tqdm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(
        ImportError, match=r'pip install tqdm \(from a checkout of fnloop: pip install -e "\.\[progress\]"\)'
    ):
        progress()


# -- memory --------------------------------------------------------------------------------------------


def test_memory_records_peak_rss_in_mib_on_cpu():
    import resource

    state = TrainState(max_iter=4, params={"w": torch.zeros(3)})
    final = fl.run(state, lambda s, b: s, range(4), [fl.every(2, memory())])
    history = final.metrics.history("max_mem")
    assert [i for i, _ in history] == [1, 3]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if os.path.exists("/proc/self/status"):  # read as the hook reads it (ru_maxrss lags it a little)
        with open("/proc/self/status") as status:
            peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024
    assert all(type(v) is float and 10 < v <= peak for _, v in history)


_CHILD_PEAK = """
import fnloop as fl, torch
state = fl.TrainState(max_iter=1, params={"w": torch.zeros(3)})
print(fl.run(state, lambda s, b: s, [None], [fl.hooks.memory()]).metrics.latest("max_mem")[1])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss survives exec on Linux")
def test_memory_of_a_script_started_by_a_large_process_is_its_own():
    # ru_maxrss keeps the parent's peak across exec: a run started from a notebook or a test
    # process holding gigabytes reported that memory as its own max_mem.
    ballast = torch.ones(2**28)  # 1 GiB in this process, touched
    out = subprocess.run([sys.executable, "-c", _CHILD_PEAK], capture_output=True, text=True, check=True)
    del ballast
    assert float(out.stdout) < 900, out.stdout


# -- profile -------------------------------------------------------------------------------------------


def test_profile_writes_a_chrome_trace_of_its_window(tmp_path):
    def step(state, batch):
        return attrs.evolve(state, params={"w": state.params["w"] @ state.params["w"]})

    state = TrainState(max_iter=6, params={"w": torch.eye(8)})
    fl.run(state, step, range(6), [profile(tmp_path / "prof", start=2, steps=2)])
    trace = json.loads(trace_path(tmp_path / "prof", 2).read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names
    assert os.listdir(tmp_path / "prof") == ["trace-2.json"]


def test_profile_stops_at_the_end_of_a_run_shorter_than_its_window(tmp_path):
    fl.run(TrainState(max_iter=3), lambda s, b: s, range(3), [profile(tmp_path, start=1, steps=10)])
    assert "traceEvents" in json.loads(trace_path(tmp_path, 1).read_text())


def test_profile_refuses_bad_windows():
    with pytest.raises(ValueError, match=r"'steps' must be a positive int \(got 0 that is an int\)"):
        profile("p", start=0, steps=0)
    with pytest.raises(ValueError, match=r"'start' must be a non-negative int \(got -1 that is an int\)"):
        profile("p", start=-1, steps=1)


@pytest.mark.parametrize(
    ("time", "step_time", "draws"),
    [(10.3, 0.4, True), (10.7, 0.4, False), (10.7, 2.0, True), (0.05, 0.05, False)],
)
def test_progress_asks_for_a_draw_only_when_the_step_crossed_a_multiple_of_mininterval(
    time, step_time, draws
):
    state = attrs.evolve(TrainState(max_iter=10, iteration=3), clock=fl.Clock(time=time, step_time=step_time))
    out = progress(mininterval=1.0)(state, Phase.AFTER_STEP)
    assert (len(out.effects) == 1) is draws
    assert progress(mininterval=0)(state, Phase.AFTER_STEP).effects  # 0: every step
