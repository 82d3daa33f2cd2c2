"""Block by block under a memory limit: each rank in a memory cgroup of its own (tests/cap_worker.py).

The model (8 blocks of ``Linear(2048, 2048)``, AdamW: 403 MB of parameters and optimizer state)
is built on the meta device and made by ``fl.init`` one module at a time. Each rank is limited to
``LIMIT`` MiB charged after it joins: the kernel kills a rank that goes over. Sharded block by block
on 4 ranks the job trains under the limit; the same job unsharded does not. Both steps are compiled
by an unlimited launch first (the limit is on training, not on inductor, whose compile alone charges
about 300 MB here), and each limited launch loads its step from that launch's graph cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = str(Path(__file__).with_name("cap_worker.py"))
LIMIT = 800
"""MiB a rank may charge: measured here, block by block about 510, unsharded about 1,200."""

pytestmark = pytest.mark.slow


def launch(results: Path, cache: Path, *jobs: list[str]) -> subprocess.CompletedProcess[str]:
    argv: list[str] = []
    for job in jobs:
        argv += (["--then"] if argv else []) + [str(results / job[0]), *job[1:]]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "FNLOOP_CACHE_DIR": str(cache),
    }
    runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", WORKER]
    return subprocess.run([*runner, *argv], capture_output=True, text=True, timeout=900, env=env)


def test_a_model_whose_state_a_rank_cannot_hold_whole_trains_under_the_limit_only_sharded(
    tmp_path: Path,
) -> None:
    assert os.access("/sys/fs/cgroup/memory", os.W_OK), "this test needs the cgroup v1 memory controller"
    cache = tmp_path / "cache"
    unlimited = launch(tmp_path, cache, ["full", "--shard", "full"], ["none", "--shard", "none"])
    assert unlimited.returncode == 0, unlimited.stderr[-4000:]
    limited = launch(tmp_path, cache, ["full-limited", "--shard", "full", "--limit", str(LIMIT)])
    assert limited.returncode == 0, limited.stderr[-4000:]
    refused = launch(tmp_path, cache, ["none-limited", "--shard", "none", "--limit", str(LIMIT)])
    assert refused.returncode != 0 and not (tmp_path / "none-limited" / "rank0.json").exists()
    assert "Signals.SIGKILL" in refused.stderr or "-9" in refused.stderr  # killed by the kernel
    reference = json.loads((tmp_path / "none" / "rank0.json").read_text())
    for rank in range(4):
        mine = json.loads((tmp_path / "full-limited" / f"rank{rank}.json").read_text())
        assert mine["peak"] <= LIMIT * 2**20
        assert mine["held"] * 4 <= reference["held"] * 1.01  # a quarter of the state each
        assert max(abs(a - b) for a, b in zip(mine["losses"], reference["losses"], strict=True)) < 1e-6
    assert reference["held"] > 400e6  # without sharding a rank holds the whole state
