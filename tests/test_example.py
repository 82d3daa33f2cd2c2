"""The main job, ``python -m fnloop.examples.digits``: it learns, and a killed run resumes bit for bit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import fnloop as fl
from fnloop import testing
from fnloop.examples import digits
from tests.test_distributed import ONE_CORE_EACH

# Eager: the run takes seconds, not a compile, and a kill lands mid-run (a millisecond or so per
# step, a checkpoint every 50 steps). The example pins torch to one thread, on which a run's bits depend.
MAX_ITER = 3000
LONG = ("--eager", "--quiet", "--max-iter", str(MAX_ITER), "--checkpoint-every", "50")
TIMEOUT = 120


def command(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "fnloop.examples.digits", "--out", str(out), *args]


def start(out: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command(out, *args),
        cwd=out.parent,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(process: subprocess.Popen[str], code: int = 0) -> str:
    stdout, stderr = process.communicate(timeout=TIMEOUT)
    assert process.returncode == code, f"exit code {process.returncode}, expected {code}\n{stdout}\n{stderr}"
    return stdout + stderr


def accuracy(output: str) -> float:
    found = re.findall(r"^test accuracy: (\d\.\d{4})$", output, re.MULTILINE)
    assert len(found) == 1, output
    return float(found[0])


def resumed_from(output: str) -> int:
    found = re.search(r"^resumed from iteration (\d+) ", output, re.MULTILINE)
    assert found, output
    return int(found[1])


def final_state(out: Path, max_iter: int = MAX_ITER) -> fl.TrainState:
    template = digits.job(str(out), max_iter=max_iter, compile=False)[0]
    return fl.load(fl.checkpoint.path_for(out / "ckpt", max_iter), like=template)


def assert_same_run(a: fl.TrainState, b: fl.TrainState) -> None:
    testing.assert_identical(a.params, b.params)
    # The clock (state.time, the timer's readings) is the one thing two runs never share.
    testing.assert_identical(testing.without_clock(a), testing.without_clock(b))


def json_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def json_iterations(out: Path) -> list[int]:
    return [line["iteration"] for line in json_lines(out)]


def assert_same_log(a: Path, b: Path) -> None:
    # A resumed run's log reads as the uninterrupted run's: the same lines, the clock's values aside.
    def unclocked(out: Path) -> list[dict]:
        return [{k: v for k, v in line.items() if k not in ("time", "data_time")} for line in json_lines(out)]

    assert unclocked(a) == unclocked(b)


def kill_after_first_checkpoint(out: Path, signum: int) -> subprocess.Popen[str]:
    process = start(out, *LONG)
    deadline = time.monotonic() + TIMEOUT
    while not fl.checkpoint.checkpoints(out / "ckpt"):
        assert process.poll() is None, finish(process)
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    assert process.poll() is None, "the run ended before it could be stopped; give it more steps"
    process.send_signal(signum)
    return process


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], fl.TrainState]]:
    """The reference run, started at once so it runs beside the interrupted ones; call to wait for it."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    process = start(out, *LONG)
    done: list[fl.TrainState] = []

    def wait() -> fl.TrainState:
        if not done:
            assert accuracy(finish(process)) >= 0.95
            done.append(final_state(out))
        return done[0]

    wait.out = out  # type: ignore[attr-defined]
    yield wait
    if process.poll() is None:
        process.kill()
        process.communicate()


def test_sigkill_then_rerun_equals_the_uninterrupted_run(tmp_path, uninterrupted):
    out = tmp_path / "run"
    finish(kill_after_first_checkpoint(out, signal.SIGKILL), code=-signal.SIGKILL)

    output = finish(start(out, *LONG))

    assert 0 < resumed_from(output) < MAX_ITER
    assert accuracy(output) >= 0.95
    assert_same_run(final_state(out), uninterrupted())
    assert json_iterations(out) == list(range(digits.LOG_EVERY, MAX_ITER + 1, digits.LOG_EVERY))
    assert_same_log(out, uninterrupted.out)


def test_sigterm_saves_exits_143_and_rerun_equals_the_uninterrupted_run(tmp_path, uninterrupted):
    out = tmp_path / "run"
    stopped = finish(kill_after_first_checkpoint(out, signal.SIGTERM), code=128 + signal.SIGTERM)
    at = int(re.search(r"stopped at iteration (\d+)", stopped)[1])
    # The run saved the very state it stopped with, whatever the checkpoint period.
    assert fl.checkpoint.checkpoints(out / "ckpt")[0] == fl.checkpoint.path_for(out / "ckpt", at)

    output = finish(start(out, *LONG))

    assert resumed_from(output) == at
    assert_same_run(final_state(out), uninterrupted())
    assert_same_log(out, uninterrupted.out)


def test_the_default_run_reaches_95_percent_and_a_rerun_resumes_at_the_end(tmp_path):
    out = tmp_path / "run"
    output = finish(start(out))  # the defaults: compiled, digits.MAX_ITER steps

    assert output.startswith(f"started fresh: checkpoints go to {out / 'ckpt'}\n")
    assert re.search(rf"fnloop\] eta: 0:00:00  iter: {digits.MAX_ITER}  loss: ", output), output
    assert accuracy(output) >= 0.95
    every = digits.LOG_EVERY
    assert json_iterations(out) == list(range(every, digits.MAX_ITER + 1, every))
    assert (out / "best" / "best.safetensors").exists() and list((out / "tb").iterdir())

    again = finish(start(out))
    assert resumed_from(again) == digits.MAX_ITER
    assert accuracy(again) == accuracy(output)

    # The same command under torchrun, two ranks on the CPU: the same accuracy, printed once.
    two = tmp_path / "two"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [*launch, "-m", "fnloop.examples.digits", "--out", str(two), "--quiet"],
        capture_output=True,
        text=True,
        timeout=4 * TIMEOUT,
        env={**os.environ, **ONE_CORE_EACH},
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.count("started fresh") == 1, done.stdout
    assert abs(accuracy(done.stdout) - accuracy(output)) <= 0.01


def test_main_in_process_resumes_extends_and_refuses_another_seed(tmp_path, capsys):
    args = ["--out", str(tmp_path), "--eager", "--max-iter", "60", "--checkpoint-every", "20", "--quiet"]
    digits.main(args)
    first = capsys.readouterr().out
    assert first.startswith("started fresh")
    assert [p.name for p in fl.checkpoint.checkpoints(tmp_path / "ckpt")] == [
        "ckpt-00000060.safetensors",
        "ckpt-00000040.safetensors",
        "ckpt-00000020.safetensors",
    ]

    digits.main(args)
    assert resumed_from(capsys.readouterr().out) == 60

    with pytest.raises(SystemExit, match=r"seeded 0, but the template is seeded 1"):
        digits.main(["--out", str(tmp_path), "--eager", "--max-iter", "60", "--seed", "1"])

    # A longer run extends this one, and says so (fl.checkpoint.resume: the template's max_iter wins).
    with pytest.warns(fl.checkpoint.RunChanged, match=r"max_iter"):
        digits.main(
            ["--out", str(tmp_path), "--eager", "--max-iter", "80", "--checkpoint-every", "20", "--quiet"]
        )
    assert resumed_from(capsys.readouterr().out) == 60
    assert fl.checkpoint.checkpoints(tmp_path / "ckpt")[0].name == "ckpt-00000080.safetensors"


def test_job_is_one_definition_of_the_run():
    rng = torch.random.get_rng_state()
    state, _, batches, hooks = digits.job("somewhere", seed=3, max_iter=10, compile=False)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert (state.rng, state.max_iter, state.iteration) == (3, 10, 0)
    assert batches == digits.job("elsewhere", seed=3, max_iter=10, compile=False)[2]
    # The initial weights are a function of the seed alone.
    testing.assert_identical(state.params, digits.job(seed=3, max_iter=10, compile=False)[0].params)
    (x, _), (x_val, _), (x_test, _) = digits.digits()
    assert (len(x), len(x_val), len(x_test)) == (1300, 200, 297)
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert len(hooks) == 7
