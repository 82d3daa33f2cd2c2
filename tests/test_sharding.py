"""Sharded training under torchrun (gloo, CPU): tests/shard_worker.py against the data-parallel run.

Each launch is a few seconds (eager steps; one compiled launch per mode);
the reference runs are shared by module fixtures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fnloop as fl

WORKER = str(Path(__file__).with_name("shard_worker.py"))
LIMIT = 300
ONE_CORE_EACH = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}

pytestmark = pytest.mark.slow


def launch(results: Path, ranks: int, *options: str) -> subprocess.CompletedProcess[str]:
    runner = [sys.executable]
    if ranks > 1:
        runner += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    env = {**os.environ, **ONE_CORE_EACH}
    return subprocess.run(
        [*runner, WORKER, str(results), *options], capture_output=True, text=True, timeout=LIMIT, env=env
    )


def ok(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def result(results: Path, rank: int = 0) -> dict:
    return torch.load(results / f"rank{rank}.pt")


def furthest(a: dict, b: dict) -> float:
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The unsharded 2-rank run, 50 steps, compiled."""
    out = tmp_path_factory.mktemp("dp")
    ok(launch(out, 2, "--compile"))
    return result(out)


@pytest.mark.parametrize(
    ("mode", "ranks", "compiled"),
    [("full", 2, True), ("optimizer", 2, True), ("full", 2, False), ("optimizer", 4, False)],
)
def test_sharded_training_equals_data_parallel_within_1e_5_over_50_steps(
    data_parallel: dict, tmp_path: Path, mode: str, ranks: int, compiled: bool
) -> None:
    ok(launch(tmp_path, ranks, "--shard", mode, *(["--compile"] if compiled else [])))
    for rank in range(ranks):
        mine = result(tmp_path, rank)
        assert mine["shards"] == (ranks, rank)
        assert furthest(mine, data_parallel) < 1e-5
        assert max(abs(a - b) for a, b in zip(mine["losses"], data_parallel["losses"], strict=True)) < 1e-5
        # The clip's global norm is the whole model's, not the local chunks'.
        assert abs(mine["norms"][0] - data_parallel["norms"][0]) < 1e-6 * max(1.0, data_parallel["norms"][0])
        assert mine["compiles"] == (1 if compiled else 0)
    # Each rank holds its share of what data parallel holds whole: the optimizer state's, and the
    # parameters' too when they are sharded ("full"); the rows are padded to a multiple of the ranks.
    held = [result(tmp_path, r)["held"] for r in range(ranks)]
    assert len(set(held)) == 1
    whole = data_parallel["held"]
    params = sum(t.numel() * t.element_size() for t in data_parallel["params"].values())
    share = (whole / ranks) if mode == "full" else params + (whole - params) / ranks
    assert held[0] <= share * 1.15


def test_several_steps_per_call_of_a_sharded_step_equal_single_steps_bit_for_bit(tmp_path: Path) -> None:
    ok(launch(tmp_path / "single", 2, "--shard", "full", "--compile", "--max-iter", "8"))
    ok(
        launch(
            tmp_path / "several",
            2,
            "--shard",
            "full",
            "--compile",
            "--max-iter",
            "8",
            "--steps-per-call",
            "2",
        )
    )
    for r in range(2):
        single, several = result(tmp_path / "single", r), result(tmp_path / "several", r)
        assert all(torch.equal(single["params"][k], several["params"][k]) for k in single["params"])
        assert single["losses"] == several["losses"] and several["compiles"] == 1


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A 2-rank fully sharded run of 30 steps that checkpoints every 10, eager."""
    tmp = tmp_path_factory.mktemp("ref")
    ok(launch(tmp / "results", 2, "--shard", "full", "--max-iter", "30", "--checkpoint", str(tmp / "ckpt")))
    return tmp / "ckpt", result(tmp / "results")


@pytest.mark.parametrize("kill", ["1:20:before", "1:20:after", "0:20:before", "0:20:after"])
def test_a_kill_at_any_moment_of_a_sharded_save_keeps_latest_whole_and_the_resume_is_bit_exact(
    uninterrupted: tuple[Path, dict], tmp_path: Path, kill: str
) -> None:
    ckpt, reference = tmp_path / "ckpt", uninterrupted[1]
    args = ["--shard", "full", "--max-iter", "30", "--checkpoint", str(ckpt)]
    done = launch(tmp_path / "killed", 2, *args, "--kill-in-save", kill)
    assert done.returncode != 0
    rank, _, when = kill.split(":")
    names = {p.name for p in fl.checkpoint.checkpoints(ckpt)}
    # The checkpoint of iteration 20 is complete only once rank 0 has written the index.
    complete = rank == "0" and when == "after"
    assert ("ckpt-00000020.safetensors" in names) is complete
    like = fl.init(_model(), _optimizer(), seed=0, max_iter=30)
    newest = fl.checkpoint.latest(ckpt, like=like)  # read at one rank: resharded whole
    assert newest is not None and newest.iteration == (20 if complete else 10)
    ok(launch(tmp_path / "resumed", 2, *args))
    for r in range(2):
        mine, theirs = result(tmp_path / "resumed", r), result(uninterrupted[0].parent / "results", r)
        assert all(torch.equal(mine["params"][k], theirs["params"][k]) for k in theirs["params"])
        assert mine["losses"] == theirs["losses"] == reference["losses"]


def _flipped(ckpt: Path, name: str) -> None:
    """One bit of ``name``'s tensor bytes flipped near its end, the file changed in place."""
    path = ckpt / name
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))


def _copy_of_all(uninterrupted: tuple[Path, dict], into: Path) -> Path:
    into.mkdir()
    for part in uninterrupted[0].iterdir():
        (into / part.name).write_bytes(part.read_bytes())
    return into


@pytest.mark.parametrize(
    "damaged", ["ckpt-00000030.safetensors", "ckpt-00000030.part-00001-of-00002.safetensors"]
)
def test_a_part_changed_in_place_is_skipped_for_the_one_before_on_every_rank(
    uninterrupted: tuple[Path, dict], tmp_path: Path, damaged: str
) -> None:
    # Each rank checks the bytes of its own part, and the ranks agree: the checkpoint of 30 is
    # skipped for 20 on both, with a warning naming the part, and the run goes on from there.
    ckpt = _copy_of_all(uninterrupted, tmp_path / "ckpt")
    _flipped(ckpt, damaged)
    done = launch(tmp_path / "resumed", 2, "--shard", "full", "--max-iter", "30", "--checkpoint", str(ckpt))
    ok(done)
    assert "skipping a damaged checkpoint" in done.stderr and damaged in done.stderr
    for r in range(2):
        mine, theirs = result(tmp_path / "resumed", r), result(uninterrupted[0].parent / "results", r)
        assert all(torch.equal(mine["params"][k], theirs["params"][k]) for k in theirs["params"])
        assert mine["losses"] == theirs["losses"]


def test_a_part_changed_in_place_is_skipped_at_another_world_size_and_in_one_process(
    uninterrupted: tuple[Path, dict], tmp_path: Path
) -> None:
    ckpt = _copy_of_all(uninterrupted, tmp_path / "ckpt")
    damaged = "ckpt-00000030.part-00001-of-00002.safetensors"
    _flipped(ckpt, damaged)
    like = fl.init(_model(), _optimizer(), seed=0, max_iter=30)
    with pytest.warns(fl.checkpoint.CheckpointWarning, match=damaged):
        assert fl.checkpoint.latest(ckpt, like=like).iteration == 20
    done = launch(tmp_path / "resharded", 4, "--shard", "full", "--max-iter", "30", "--checkpoint", str(ckpt))
    ok(done)
    assert "skipping a damaged checkpoint" in done.stderr and damaged in done.stderr
    for r in range(4):
        mine = result(tmp_path / "resharded", r)
        assert mine["iteration"] == 30 and furthest(mine, uninterrupted[1]) < 1e-5


def _copy_of_30(uninterrupted: tuple[Path, dict], into: Path) -> Path:
    into.mkdir()
    for part in uninterrupted[0].glob("ckpt-00000030*"):
        (into / part.name).write_bytes(part.read_bytes())
    return into


@pytest.fixture(scope="module")
def went_on(uninterrupted: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The 2-rank run of ``uninterrupted`` going on from its checkpoint of iteration 30 to 40."""
    tmp = tmp_path_factory.mktemp("on")
    ckpt = _copy_of_30(uninterrupted, tmp / "ckpt")
    ok(launch(tmp / "results", 2, "--shard", "full", "--max-iter", "40", "--checkpoint", str(ckpt)))
    return result(tmp / "results")


@pytest.mark.parametrize(("ranks", "shard"), [(4, "full"), (1, "full"), (1, "None"), (4, "optimizer")])
def test_a_sharded_checkpoint_loads_at_another_world_size_and_goes_on_to_the_same_run(
    uninterrupted: tuple[Path, dict], went_on: dict, tmp_path: Path, ranks: int, shard: str
) -> None:
    # 2 ranks wrote it; 4, 1, or an unsharded single process resume it from iteration 30 to 40.
    ckpt = _copy_of_30(uninterrupted, tmp_path / "ckpt")
    ok(launch(tmp_path / "resharded", ranks, "--shard", shard, "--max-iter", "40", "--checkpoint", str(ckpt)))
    for r in range(ranks):
        mine = result(tmp_path / "resharded", r)
        assert mine["iteration"] == 40 and mine["data"] == went_on["data"] == 40
        assert furthest(mine, went_on) < 1e-5


def test_a_preempted_sharded_run_stops_every_rank_at_one_step_and_saves_it_whole(
    uninterrupted: tuple[Path, dict], tmp_path: Path
) -> None:
    # SIGTERM to torchrun, which forwards it to both ranks: rank 0 announces the boundary where
    # every rank stops, so the final checkpoint has every part (without that agreement rank 0 would
    # wait for rank 1's part while rank 1 waits in the next step for rank 0).
    # The saves are in the background (every rank's writer thread), and the stop waits for them.
    ckpt = tmp_path / "ckpt"
    args = ["--shard", "full", "--max-iter", "30", "--checkpoint", str(ckpt), "--background"]
    done = launch(tmp_path / "stopped", 2, *args, "--sigterm-at", "13")
    assert done.returncode != 0
    newest = fl.checkpoint.checkpoints(ckpt)[0]
    stopped_at = int(newest.name.removeprefix("ckpt-").split(".")[0])
    assert 14 <= stopped_at < 30 and stopped_at != 20
    assert [p.name for p in fl.checkpoint._sharded.parts_of(newest)] == [
        f"ckpt-{stopped_at:08d}.part-00001-of-00002.safetensors"
    ]
    ok(launch(tmp_path / "resumed", 2, *args))
    for r in range(2):
        mine, theirs = result(tmp_path / "resumed", r), result(uninterrupted[0].parent / "results", r)
        assert all(torch.equal(mine["params"][k], theirs["params"][k]) for k in theirs["params"])
        assert mine["losses"] == theirs["losses"]


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_when_one_rank_is_lost_the_others_give_up_the_sharded_save_at_once_and_leave(
    uninterrupted: tuple[Path, dict], tmp_path: Path, how: str
) -> None:
    # Rank 1 is lost after step 12; rank 0 fails in the next step's collective, and its final save
    # waits for rank 1's part, which will never come: it gives the save up within seconds (rank 1's
    # signs of life stopped, or its run ended elsewhere), not after torchrun's SIGKILL (30 s) or the
    # group's timeout (5 minutes), and the checkpoint of 10 stays the newest, whole.
    ckpt, results = tmp_path / "ckpt", tmp_path / "results"
    args = ["--shard", "full", "--max-iter", "30", "--checkpoint", str(ckpt), "--lose-rank", f"1:12:{how}"]
    done = launch(results, 2, *args)
    assert done.returncode != 0
    lost = json.loads((results / "lost.json").read_text())["at"]
    left = json.loads((results / "left0.json").read_text())  # rank 0 left by itself, with its error
    said = " ".join([left["error"], *left["notes"]])
    assert "the sharded save was given up" in said, said
    assert left["at"] - lost < 20, left["at"] - lost  # 3 to 5 s here; torchrun's SIGKILL comes at 30
    like = fl.init(_model(), _optimizer(), seed=0, max_iter=30)
    assert fl.checkpoint.latest(ckpt, like=like).iteration == 10


def _model() -> torch.nn.Module:
    sys.path.insert(0, str(Path(__file__).parent))
    import shard_worker

    return shard_worker.model()


def _optimizer() -> fl.optim.Optimizer:
    import shard_worker

    return shard_worker.optimizer()
