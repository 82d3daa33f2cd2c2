"""``fl.distributed.launch`` at 2 ranks (gloo, CPU): the jobs of tests/launch_jobs.py, from a script and a notebook.

Launches are what this file costs (each spawned rank imports torch), so one spawned launch runs
every training job and reports every rank's environment (``shared``); the failures are forks of
this process, which start at once; one ``python -`` process plays the notebook (its functions live
in a ``__main__`` without a file, which only a fork can run).
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import fnloop as fl
from fnloop._launch import RankFailed, RankTraceback
from tests import launch_jobs as jobs

ROOT = Path(__file__).parent.parent
FORKS = pytest.mark.filterwarnings(
    # Python 3.12 and later warn at any fork of a process with several threads; torch starts some.
    "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"
)
PROMPT = 60
"""Seconds a failed launch may take to return (a hang waits out the group's 5-minute timeout)."""


@pytest.fixture(scope="module")
def shared() -> dict[str, list[Any]]:
    """Every job of ``jobs.everything`` on 2 spawned ranks, each job's results in rank order.

    Launched once more if a rank aborted at its exit after ``fn`` returned (SIGABRT, "terminate
    called without an active exception"; seen in 2 of 3 whole suites run on a 2-core machine on
    2026-12-06, once here and once in a torchrun launch of test_multinode, never where the jobs ran
    alone). As ``tests/launches.again_after_native_crash`` does for torchrun's launches, the crash is
    counted in the suite's summary, and a second one fails the fixture.
    """
    try:
        return fl.distributed.launch(jobs.everything, nprocs=2)
    except RankFailed as exc:
        if "SIGABRT after fn returned" not in str(exc):
            raise
        from conftest import NATIVE_CRASHES

        with NATIVE_CRASHES.open("a") as log:
            log.write(
                f"\n--- {time.strftime('%H:%M:%S')} test_launch.shared: a rank aborted at exit\n{exc}\n"
            )
        return fl.distributed.launch(jobs.everything, nprocs=2)


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict[str, Any]]:
    """The same runs in this process: data parallel's reference, and the run any world size gives bit for bit."""
    return {"dp": jobs.train(), "invariant": jobs.train(invariant=2)}


def furthest(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in b["params"])


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a["params"][k], b["params"][k]) for k in b["params"]) and a["loss"] == b["loss"]


@pytest.mark.parametrize("job", ["dp", "full"])
def test_a_launched_run_equals_one_process_on_the_same_global_batches(
    shared: dict[str, list[Any]], one_process: dict[str, dict[str, Any]], job: str
) -> None:
    zero, one = shared[job]
    assert zero["iteration"] == one["iteration"] == 20
    assert (zero["shards"], one["shards"]) == ((None, None) if job == "dp" else ((2, 0), (2, 1)))
    # The ranks hold one state (gathered whole when sharded), that of one process up to the order
    # in which the two half-batches' gradients are added, as under torchrun (tests/test_distributed.py).
    assert same(zero, one)
    assert furthest(zero, one_process["dp"]) < 1e-5
    assert max(abs(a - b) for a, b in zip(zero["loss"], one_process["dp"]["loss"], strict=True)) < 1e-5
    # The world-size-invariant run is the same bits at 2 ranks as in one process.
    assert same(shared[f"{job}-invariant"][0], one_process["invariant"])


def test_each_rank_sees_the_environment_torchrun_gives_its_workers(shared: dict[str, list[Any]]) -> None:
    seen = shared["environment"]
    port, run_id = seen[0]["MASTER_PORT"], seen[0]["TORCHELASTIC_RUN_ID"]
    assert port is not None and 0 < int(port) < 2**16 and run_id
    for rank, mine in enumerate(seen):
        assert mine == {
            **dict.fromkeys(("RANK", "LOCAL_RANK", "ROLE_RANK"), str(rank)),
            **dict.fromkeys(("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE"), "2"),
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMP_NUM_THREADS": "1",  # unset here: torchrun's default for several processes
            "rank": rank,
            "world_size": 2,
            "threads": 1,
        }


@FORKS
def test_rank_zeros_value_comes_back_and_the_arguments_reach_every_rank() -> None:
    assert fl.distributed.launch(jobs.returns, 1, nprocs=2, plus=2, start_method="fork") == {
        "value": 3,
        "rank": 0,
    }
    back = fl.distributed.launch(jobs.returns, torch.ones(3), nprocs=2, plus=1, start_method="fork")
    assert torch.equal(back["value"], torch.full((3,), 2.0)) and back["rank"] == 0
    # A value that does not pickle is rank 0's error.
    with pytest.raises(TypeError, match="the value fn returned on rank 0 cannot be pickled") as caught:
        fl.distributed.launch(jobs.unpicklable, nprocs=2, start_method="fork")
    assert "raised on rank 0 of 2" in "\n".join(caught.value.__notes__)
    assert multiprocessing.active_children() == []


@FORKS
@pytest.mark.parametrize("rank", [1, 0])
def test_a_failing_rank_raises_its_exception_in_the_caller_naming_the_rank(rank: int) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match="injected failure at iteration 4") as caught:
        fl.distributed.launch(jobs.fail_in_run, rank, 4, nprocs=2, start_method="fork")
    took = time.monotonic() - start
    error = caught.value
    assert (
        f"fnloop.distributed.launch: raised on rank {rank} of 2, the first rank to fail"
        in error.__notes__[-1]
    )
    # The rank's own traceback is the cause, down to the hook that raised.
    assert isinstance(error.__cause__, RankTraceback)
    assert 'launch_jobs.py", line' in error.__cause__.text and "in __call__" in error.__cause__.text
    assert error.__cause__.text.rstrip().endswith(f"fnloop: raised on rank {rank} of 2.")
    # It carries what fnloop's exceptions carry: the last consistent state, before step 4.
    assert error.state.iteration == 4  # type: ignore[attr-defined]
    assert took < PROMPT and multiprocessing.active_children() == []


@FORKS
def test_a_rank_killed_by_a_signal_is_named_with_the_signal() -> None:
    start = time.monotonic()
    # Killed inside fn: said so, with the likely causes (it said "failed before or outside fn").
    with pytest.raises(
        RankFailed,
        match=r"^rank 1 of 2 was killed by SIGKILL while fn ran, without raising an exception. A signal",
    ):
        fl.distributed.launch(jobs.killed, 1, nprocs=2, start_method="fork")
    assert time.monotonic() - start < PROMPT and multiprocessing.active_children() == []


@FORKS
def test_a_rank_that_fails_after_fn_returned_is_told_apart() -> None:
    with pytest.raises(
        RankFailed, match=r"^rank 1 of 2 exited with code 3 after fn returned, as its process ended"
    ):
        fl.distributed.launch(jobs.fails_at_exit, 1, nprocs=2, start_method="fork")


@FORKS
def test_a_rank_that_ignores_the_end_is_killed_after_the_grace_period() -> None:
    start = time.monotonic()
    with pytest.raises(KeyError, match="rank 1 gives up"):
        fl.distributed.launch(jobs.stubborn, 300, nprocs=2, grace_period=1, start_method="fork")
    # Rank 0 ignored SIGTERM and would have slept 300 s.
    assert time.monotonic() - start < 30 and multiprocessing.active_children() == []


NOTEBOOK = """
import json, multiprocessing, os, signal, sys, threading, time
from pathlib import Path
import fnloop as fl

out = Path(sys.argv[1])
# A kernel handles Ctrl-C, even when started by something that ignores it (a shell's background job).
signal.signal(signal.SIGINT, signal.default_int_handler)

class Boom(Exception):
    pass

def where(offset):
    return fl.distributed.gather_object((fl.distributed.rank() + offset, os.environ["RANK"], os.getpid()))

def boom():
    if fl.distributed.rank() == 1:
        raise Boom("raised in a cell")
    fl.distributed.gather_object(0)

def sleeps(pids=None):
    if pids is not None:
        (pids / f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(300)

seen = {"file": getattr(__import__("__main__"), "__file__", None), "me": os.getpid()}
seen["where"] = fl.distributed.launch(where, 10, nprocs=2)
try:
    fl.distributed.launch(where, 0, nprocs=2, start_method="spawn")
except ValueError as exc:
    seen["refused"] = str(exc)
try:
    fl.distributed.launch(boom, nprocs=2)
except Boom as exc:
    seen["raised"] = [str(exc), exc.__notes__[-1], str(exc.__cause__)]
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()  # the notebook's interrupt
start = time.monotonic()
try:
    fl.distributed.launch(sleeps, nprocs=2, grace_period=5)
except KeyboardInterrupt:
    seen["interrupted"] = [time.monotonic() - start, len(multiprocessing.active_children())]
(out / "seen.json").write_text(json.dumps(seen))
(out / "pids").mkdir()
fl.distributed.launch(sleeps, out / "pids", nprocs=2)  # until the test kills this process
"""
"""A notebook's cells: functions and an exception class in a ``__main__`` without a file (``python -``);
its last launch lasts until the test kills the notebook's process."""


def ended(pid: int) -> bool:
    """Whether process ``pid`` is gone, or a zombie nobody has reaped yet (its parent killed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_functions_of_a_notebook_run_forked_and_their_errors_come_back(tmp_path: Path) -> None:
    with (tmp_path / "stderr").open("w") as log:
        notebook = subprocess.Popen(
            [sys.executable, "-", str(tmp_path)], stdin=subprocess.PIPE, stderr=log, cwd=ROOT, text=True
        )
    assert notebook.stdin is not None
    notebook.stdin.write(NOTEBOOK)
    notebook.stdin.close()
    pids = [tmp_path / "pids" / f"pid{rank}" for rank in range(2)]
    deadline = time.monotonic() + 120
    while not all(p.exists() for p in pids) and notebook.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert all(p.exists() for p in pids), (tmp_path / "stderr").read_text()[-3000:]
    finally:
        notebook.kill()  # as a kernel restarted: its ranks are sent SIGTERM, and end
        notebook.wait()
    ranks = [int(p.read_text()) for p in pids]
    deadline = time.monotonic() + 20
    while not all(ended(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(ended(pid) for pid in ranks)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["file"] in (None, "<stdin>")  # as a notebook's: no file a fresh interpreter could import
    # Both ranks ran the cell's function in processes of their own.
    (r0, env0, pid0), (r1, env1, pid1) = seen["where"]
    assert (r0, env0, r1, env1) == (10, "0", 11, "1") and len({pid0, pid1, seen["me"]}) == 3
    assert "is defined in the __main__ of an interactive session" in seen["refused"]
    message, note, cause = seen["raised"]
    assert message == "raised in a cell" and "raised on rank 1 of 2" in note
    assert 'File "<stdin>"' in cause and "in boom" in cause
    # The interrupt stopped the sleeping ranks (SIGINT) long before their 300 s, and left none.
    took, left = seen["interrupted"]
    assert took < 30 and left == 0


def _cell() -> None:
    """A function as a notebook's cell defines it (its module set to ``__main__`` below)."""


@pytest.mark.parametrize(
    ("fn", "options", "error", "match"),
    [
        (
            jobs.returns,
            {"nprocs": 0},
            ValueError,
            r"^'nprocs' must be a positive int \(got 0 that is a int\)\.$",
        ),
        (jobs.returns, {"nprocs": True}, ValueError, "'nprocs' must be a positive int"),
        (
            jobs.returns,
            {"nprocs": 2, "start_method": "thread"},
            ValueError,
            "'start_method' must be None or one of",
        ),
        (
            jobs.returns,
            {"nprocs": 2, "grace_period": -1},
            ValueError,
            "'grace_period' must be a number of seconds",
        ),
        (
            jobs.returns,
            {"nprocs": 2, "grace_period": float("nan")},
            ValueError,
            "'grace_period' must be a number of seconds, 0 or more and finite",
        ),
        (
            jobs.returns,
            {"nprocs": 10**6},
            ValueError,
            "'nprocs' is 1,000,000, more ranks than one machine runs",
        ),
        (3, {"nprocs": 2}, TypeError, "'fn' must be callable"),
    ],
    ids=["nprocs-0", "nprocs-bool", "start-method", "grace-period", "grace-period-nan", "nprocs-huge", "fn"],
)
def test_arguments_out_of_range_are_refused(
    fn: Any, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        fl.distributed.launch(fn, 1, **options)


def test_what_cannot_work_is_refused_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(error: type[Exception], match: str, fn: Any = jobs.returns, **options: Any) -> None:
        with pytest.raises(error, match=match):
            fl.distributed.launch(fn, 1, nprocs=2, **options)
        assert multiprocessing.active_children() == []

    with monkeypatch.context() as patched:
        patched.setattr(torch.cuda, "is_initialized", lambda: True)
        refused(RuntimeError, "cannot fork this process: CUDA is already initialized", start_method="fork")
    with monkeypatch.context() as patched:
        patched.setattr(torch.distributed, "is_initialized", lambda: True)
        refused(RuntimeError, "cannot fork this process: it has joined a process group", start_method="fork")
    with monkeypatch.context() as patched:
        patched.setenv("RANK", "1")
        patched.setenv("WORLD_SIZE", "2")
        refused(RuntimeError, r"called in a rank of a launch already \(RANK=1, WORLD_SIZE=2\)")
    with pytest.raises(Exception, match="lambda") as caught:
        fl.distributed.launch(jobs.returns, lambda: 0, nprocs=2, start_method="spawn")
    assert "start_method='spawn' pickles fn and its arguments" in caught.value.__notes__[-1]
    assert multiprocessing.active_children() == []
    with monkeypatch.context() as patched:
        patched.setattr(_cell, "__module__", "__main__")
        patched.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
        refused(
            ValueError, "is defined in the __main__ of an interactive session", _cell, start_method="spawn"
        )
