"""Data parallel under torchrun (2 ranks, gloo, CPU) against one process: tests/dist_worker.py runs both."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

WORKER = str(Path(__file__).with_name("dist_worker.py"))
LIMIT = 240
"""Seconds any one launch may take (a cold compile on a busy 2-core machine included)."""


# Each rank computes and compiles on one thread, without inductor's pool of compile workers: the
# ranks share two cores. In CI a cold compile in both ranks at once ended one of them, once, with
# "terminate called without an active exception" (SIGABRT); the worker pool is the likeliest cause.
ONE_CORE_EACH = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}


def launch(
    tmp: Path, ranks: int, *options: str, limit: int = LIMIT, restarts: int = 0
) -> subprocess.CompletedProcess[str]:
    """The worker on ``ranks`` processes (torchrun for 2, plain python for 1), writing into ``tmp``."""
    runner = (
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"),
            f"--max-restarts={restarts}",
        ]
        if ranks > 1
        else [sys.executable]
    )
    env = {**os.environ, **ONE_CORE_EACH}
    return subprocess.run(
        [*runner, WORKER, str(tmp / "out"), str(tmp / "results"), *options],
        capture_output=True,
        text=True,
        timeout=limit,
        env=env,
    )


def jobs(tmp: Path, ranks: int, *runs: tuple[Path, list[str]]) -> subprocess.CompletedProcess[str]:
    """Several jobs in one launch, one after the other: ``(folder, options)`` each, into ``folder/out`` and
    ``folder/results``."""
    runner = [*(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}")]
    if ranks == 1:
        runner = [sys.executable]
    argv: list[str] = []
    for folder, options in runs:
        argv += [*(["--then"] if argv else []), str(folder / "out"), str(folder / "results"), *options]
    env = {**os.environ, **ONE_CORE_EACH}
    return subprocess.run([*runner, WORKER, *argv], capture_output=True, text=True, timeout=LIMIT, env=env)


def on_two_ranks(*argv: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node=2 *argv``: a script of a test's own on two ranks."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return subprocess.run(
        [*launch, *argv], capture_output=True, text=True, timeout=LIMIT, env={**os.environ, **ONE_CORE_EACH}
    )


def results(tmp: Path, rank: int = 0) -> dict:
    return torch.load(tmp / "results" / f"rank{rank}.pt")


def ok(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A 2-rank job that died after step 12 (every rank): its folder, as the launch left it, and the launch."""
    tmp = tmp_path_factory.mktemp("killed")
    return tmp, launch(tmp, 2, "--die-at", "12")


def _copy(folder: Path, into: Path) -> Path:
    shutil.copytree(folder / "out", into / "out")
    return into


@pytest.fixture(scope="module")
def two_ranks(
    tmp_path_factory: pytest.TempPathFactory, killed: tuple[Path, subprocess.CompletedProcess[str]]
) -> Path:
    """The 2-rank jobs, in one launch: the straight run (here), the same run four steps per call
    (``several``), and the killed job resumed (``resumed``)."""
    tmp = tmp_path_factory.mktemp("two")
    resumed = _copy(killed[0], tmp / "resumed")
    ok(jobs(tmp, 2, (tmp, []), (tmp / "several", ["--steps-per-call", "4"]), (resumed, [])))
    return tmp


@pytest.fixture(scope="module")
def one_process(
    tmp_path_factory: pytest.TempPathFactory, killed: tuple[Path, subprocess.CompletedProcess[str]]
) -> Path:
    """The jobs of one process, in one launch: the straight run (here), and the killed 2-rank job
    resumed (``resumed``)."""
    tmp = tmp_path_factory.mktemp("one")
    resumed = _copy(killed[0], tmp / "resumed")
    ok(jobs(tmp, 1, (tmp, []), (resumed, [])))
    return tmp


def test_two_ranks_match_one_process_on_the_same_global_batches(two_ranks: Path, one_process: Path) -> None:
    zero, one, single = results(two_ranks, 0), results(two_ranks, 1), results(one_process)
    assert (zero["world_size"], single["world_size"]) == (2, 1)
    assert zero["iteration"] == single["iteration"] == 20
    for name, value in single["params"].items():
        # Replicas are identical by construction; the mean over two halves matches the global mean.
        assert torch.equal(zero["params"][name], one["params"][name]), name
        torch.testing.assert_close(zero["params"][name], value, rtol=0, atol=1e-5)
    # The recorded loss is the global batch's (averaged over the ranks), as one process records it.
    torch.testing.assert_close(torch.tensor(zero["loss"]), torch.tensor(single["loss"]), rtol=0, atol=1e-5)


def test_the_step_with_its_collective_is_one_graph_over_a_scheduled_run(two_ranks: Path) -> None:
    assert results(two_ranks, 0)["compiles"] == results(two_ranks, 1)["compiles"] == 1


def test_several_steps_per_call_on_two_ranks_equal_single_steps(two_ranks: Path) -> None:
    several = two_ranks / "several"  # 20 iterations: five calls of 4, no single step
    for rank in (0, 1):
        many, single = results(several, rank), results(two_ranks, rank)
        assert many["compiles"] == many["loop_graphs"] == 1 and many["iteration"] == 20
        for name, value in single["params"].items():
            assert torch.equal(many["params"][name], value), (rank, name)
        assert many["loss"] == single["loss"]
    lines = (several / "out" / "metrics.jsonl").read_text().splitlines()
    assert [line.split(",")[0] for line in lines] == [f'{{"iteration": {i}' for i in (8, 16, 20)]


def test_only_rank_zero_writes(two_ranks: Path, one_process: Path) -> None:
    def listing(tmp: Path) -> list[str]:
        return sorted(str(p.relative_to(tmp / "out")) for p in (tmp / "out").rglob("*"))

    # Two ranks wrote exactly what one process writes: one set of checkpoints, one log, no duplicate.
    assert listing(two_ranks) == listing(one_process)
    assert "ckpt/ckpt-00000020.safetensors" in listing(two_ranks)
    lines = (two_ranks / "out" / "metrics.jsonl").read_text().splitlines()
    assert [line.split(",")[0] for line in lines] == [f'{{"iteration": {i}' for i in (5, 10, 15, 20)]


def test_resume_under_two_ranks_is_bit_exact(
    killed: tuple[Path, subprocess.CompletedProcess[str]], two_ranks: Path
) -> None:
    assert killed[1].returncode != 0
    saved = sorted(p.name for p in (killed[0] / "out" / "ckpt").glob("*.safetensors"))
    assert saved == ["ckpt-00000005.safetensors", "ckpt-00000010.safetensors"]
    for rank in (0, 1):
        resumed, straight = results(two_ranks / "resumed", rank), results(two_ranks, rank)
        for name, value in straight["params"].items():
            assert torch.equal(resumed["params"][name], value), (rank, name)


def test_a_two_rank_checkpoint_resumes_on_one_process(
    killed: tuple[Path, subprocess.CompletedProcess[str]], one_process: Path
) -> None:
    assert killed[1].returncode != 0
    resumed, straight = results(one_process / "resumed"), results(one_process)
    # The same global batches from the cursor on; only float rounding differs from one process.
    for name, value in straight["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=1e-5)


def test_a_rank_that_raises_ends_the_job_in_bounded_time(tmp_path: Path) -> None:
    start = time.monotonic()
    done = launch(tmp_path, 2, "--max-iter", "100000", "--raise-at", "6", limit=120)
    took = time.monotonic() - start
    assert done.returncode != 0
    assert "injected failure at iteration 6" in done.stderr
    assert "raised on rank 1 of 2" in done.stderr
    assert took < 120
    # Rank 0 saved the last consistent state on its way out; nothing of rank 1's reached the directory.
    assert not (tmp_path / "results").exists()
    assert any((tmp_path / "out" / "ckpt").glob("ckpt-*.safetensors"))


def test_sigterm_checkpoints_once_and_every_rank_exits_non_zero(tmp_path: Path) -> None:
    done = launch(tmp_path, 2, "--max-iter", "100000", "--sigterm-at", "7", limit=120)
    assert done.returncode != 0
    assert not (tmp_path / "results").exists()  # no rank finished normally
    saved = sorted(p.name for p in (tmp_path / "out" / "ckpt").glob("*.safetensors"))
    # The periodic checkpoint at 5, then one written on the way out, at the step the signal ended.
    assert saved[0] == "ckpt-00000005.safetensors" and len(saved) == 2, saved
    assert 8 <= int(saved[1][5:13]) <= 12


def test_rank_zero_alone_decides_where_a_signalled_run_stops(tmp_path: Path) -> None:
    # Rank 1 is signalled first, at step 7, rank 0 only at step 9 (as when a forwarded SIGTERM
    # reaches the ranks a step apart). Had rank 1 stopped at once, rank 0 would wait in step 8's
    # all-reduce for it, fail there with its state torn, and save nothing on the way out.
    done = launch(
        tmp_path, 2, "--max-iter", "100000", "--sigterm-self", "1:7", "--sigterm-self", "0:9", limit=120
    )
    assert done.returncode != 0
    saved = sorted(p.name for p in (tmp_path / "out" / "ckpt").glob("*.safetensors"))
    # Rank 0 stopped between steps 9 and 10, as signalled, and saved that state on the way out.
    assert saved == ["ckpt-00000005.safetensors", "ckpt-00000010.safetensors"], (saved, done.stderr[-3000:])


def test_check_replicas_names_the_tensor_that_drifted(tmp_path: Path) -> None:
    done = launch(tmp_path, 2, "--drift-at", "3", limit=120)
    assert done.returncode != 0
    assert "ReplicasDiverged" in done.stderr
    assert "after step 3, rank 1 and rank 0 hold different params['0.weight']" in done.stderr


@pytest.fixture(autouse=True)
def _no_leftovers(tmp_path: Path):
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_every_rank_loads_the_checkpoint_rank_zero_chose_while_saves_land(tmp_path: Path) -> None:
    worker = str(Path(__file__).with_name("dist_latest_worker.py"))
    done = on_two_ranks(worker, str(tmp_path / "ckpt"), "20", str(tmp_path))
    ok(done)
    loaded = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert loaded[0] == loaded[1], loaded
    assert len(set(loaded[0])) > 1  # saves did land while the ranks were reading


APART = """
import os, sys
from pathlib import Path
import torch
import fnloop as fl

out = Path(sys.argv[1])
rank = fl.distributed.rank()
here = out / f"machine-{rank}"  # each rank on a machine of its own: a directory nobody else sees
here.mkdir()
os.chdir(here)
like = fl.TrainState(max_iter=10, params={"w": torch.zeros(2)})
if rank == 0:
    fl.save(fl.TrainState(max_iter=10, iteration=4, params={"w": torch.ones(2)}), fl.checkpoint.path_for("ckpt", 4))
try:
    fl.checkpoint.latest("ckpt", like=like)
except fl.checkpoint.CheckpointError as exc:
    (out / f"rank-{rank}.txt").write_text(str(exc))
"""


def test_a_checkpoint_directory_the_ranks_do_not_share_stops_the_resume_on_every_rank_with_the_fix(
    tmp_path: Path,
) -> None:
    # Not a fresh start on rank 1 beside a resume on rank 0, nor a damaged checkpoint skipped.
    script = tmp_path / "apart.py"
    script.write_text(APART)
    done = on_two_ranks(str(script), str(tmp_path))
    ok(done)
    said = [(tmp_path / f"rank-{r}.txt").read_text() for r in (0, 1)]
    for text in said:
        assert "rank 1 finds no such file" in text and "filesystem they share" in text, text


LEAVING = """
import atexit, sys
from pathlib import Path
import torch.distributed as dist
import fnloop as fl

out, fail = Path(sys.argv[1]), sys.argv[2] == "raise"

def after() -> None:  # registered before fnloop's own, so it runs after it (last in, first out)
    (out / f"rank-{fl.distributed.rank() if dist.is_initialized() else 'left'}-{rank}.txt").write_text("")

atexit.register(after)
rank = fl.distributed.rank()  # joins the group torchrun describes
if fail:
    raise RuntimeError("injected")
"""


@pytest.mark.parametrize("how", ["clean", "raise"])
def test_the_group_fnloop_joined_is_left_at_a_clean_exit_and_kept_after_an_error(
    tmp_path: Path, how: str
) -> None:
    # A gloo group left to the interpreter's teardown could abort a finished job (SIGABRT); after an
    # unhandled exception it is kept, since another rank may still wait in a collective.
    script = tmp_path / "leaving.py"
    script.write_text(LEAVING)
    done = on_two_ranks(str(script), str(tmp_path), how)
    written = sorted(p.name for p in tmp_path.glob("rank-*.txt"))
    if how == "clean":
        ok(done)
        assert written == ["rank-left-0.txt", "rank-left-1.txt"], written
    else:
        assert done.returncode != 0
        assert written == ["rank-0-0.txt", "rank-1-1.txt"], written


TRAINED = """
import atexit, os, sys
from pathlib import Path
import torch
import fnloop as fl

out = Path(sys.argv[1])

def after() -> None:  # registered before fnloop's own, so it runs after it (last in, first out)
    names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    (out / f"threads-{os.environ['RANK']}.txt").write_text("\\n".join(sorted(names)))

def main() -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    opt = fl.optim.sgd(0.1)
    state = fl.init(net, opt, seed=0, max_iter=3)
    step = fl.train_step(net, lambda forward, batch: forward(batch).square().mean(), opt, compile=False)
    data = torch.randn(16, 4)
    fl.run(state, step, fl.data.batches(data, batch_size=4, seed=0))

atexit.register(after)
main()
"""


def test_a_clean_exit_frees_the_group_and_joins_its_threads_before_the_interpreter_ends(
    tmp_path: Path,
) -> None:
    # An eager step's functional collectives import torch.distributed.nn.functional, whose defaults
    # then hold the group: destroy_process_group alone left its gloo threads running into the
    # interpreter's teardown, where one freeing a collective's tensors late aborted a finished rank
    # (SIGABRT, "terminate called without an active exception"; CI saw it in a two-machine job).
    script = tmp_path / "trained.py"
    script.write_text(TRAINED)
    done = on_two_ranks(str(script), str(tmp_path))
    ok(done)
    for rank in (0, 1):
        threads = (tmp_path / f"threads-{rank}.txt").read_text().split()
        assert threads and not [name for name in threads if "gloo" in name], (rank, threads)


@pytest.mark.parametrize("kill", ["1:3", "0:7", "1:12", "0:14"])
def test_torchrun_restarts_after_a_sigkill_and_ends_bit_exact(
    tmp_path: Path, two_ranks: Path, kill: str
) -> None:
    # `torchrun --max-restarts` after a SIGKILL of a rank: rank R kills itself after step I in the
    # first attempt (before the first checkpoint at 1:3, right after one at 0:14). Before, 2 of 9
    # such restarts hung for gloo's whole timeout in connectFullMesh (see the next test).
    done = launch(tmp_path, 2, "--sigkill-self", kill, restarts=2, limit=150)
    ok(done)
    assert "exitcode: -9" in done.stderr  # the kill happened, and torchrun restarted the job
    resumed, straight = results(tmp_path), results(two_ranks)
    assert resumed["iteration"] == straight["iteration"] == 20
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    assert resumed["loss"] == straight["loss"]


RESTARTED = """
import os, signal, sys
import torch.distributed as dist
import fnloop as fl

attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
fl.distributed.setup()
store = dist.distributed_c10d._get_default_store()
seen = store.check([f"left by attempt 0, rank {fl.distributed.rank()}"])
with open(os.path.join(sys.argv[1], f"attempt-{attempt}-rank-{fl.distributed.rank()}.txt"), "w") as f:
    f.write(str(seen))
if attempt == "0":
    store.set(f"left by attempt 0, rank {fl.distributed.rank()}", "stale")
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_restarted_attempt_sees_none_of_the_keys_the_killed_one_left(tmp_path: Path) -> None:
    # torchrun's store outlives a restart with its keys: a restarted rank read its peers' addresses
    # of the attempt before, and gloo's connect was refused, or hung until the timeout, on a port
    # nobody listened on. The group fnloop joins keeps its keys under the attempt's own prefix.
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    done = on_two_ranks("--max-restarts=1", str(script), str(tmp_path))
    ok(done)
    seen = {p.name: p.read_text() for p in tmp_path.glob("attempt-*.txt")}
    assert seen == {f"attempt-{a}-rank-{r}.txt": "False" for a in (0, 1) for r in (0, 1)}, seen
