"""The cold first step of a job at 4 ranks against 1 rank's: how much the ranks' compiles cost together.

    python benchmarks/bench_first_step.py              # a GPT-2 (2 layers, 64 wide), 3 rounds
    python benchmarks/bench_first_step.py --rounds 5 --ranks 4

Each round starts every job from empty caches (inductor's and fnloop's, fresh folders), one job at
a time, the variants taking turns: a plain process (1 rank), then ``torchrun --nproc_per_node=N``
on this machine. Each rank times its process from start to the end of its first step (imports,
the trace, the compile or the load, the step) and the job's figure is its slowest rank's. fnloop's
compile cache lets one rank of the machine build each graph while the others wait and load it
(``fnloop/_compile/cache.py``), so the N ranks should pay about one compile, not N; what is left is
N processes importing and tracing on the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = """
import json, os, sys, time
start = float(sys.argv[2])
import torch
import fnloop as fl
from transformers import GPT2Config, GPT2LMHeadModel
torch.set_num_threads(1)
fl.distributed.setup()
torch.manual_seed(0)
model = GPT2LMHeadModel._from_config(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2))
opt = fl.optim.adamw(1e-3)
step = fl.train_step(model, lambda f, b: f(input_ids=b, labels=b).loss, opt)
state = fl.init(model, opt, seed=0, max_iter=1)
ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
fl.run(state, step, [ids])
took = time.time() - start
rank = fl.distributed.rank()
cache = step.jit.cache
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"took": took, "hits": cache.hits if cache else 0, "compiles": step.compiles}, f)
"""


def job(ranks: int) -> tuple[float, list[dict]]:
    """One cold job at ``ranks`` ranks: its slowest rank's seconds to the end of the first step, and each rank's report."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "out"
        out.mkdir()
        script = Path(scratch) / "job.py"
        script.write_text(WORKER)
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": str(Path(scratch) / "inductor"),
            "FNLOOP_CACHE_DIR": str(Path(scratch) / "fnloop"),
            "OMP_NUM_THREADS": "1",
        }
        env.pop("FNLOOP_BACKEND", None)
        runner = [sys.executable]
        if ranks > 1:
            runner += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        start = time.time()
        subprocess.run([*runner, str(script), str(out), str(start)], check=True, env=env, timeout=1800)
        reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    return max(r["took"] for r in reports), reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    one, many, ratios = [], [], []
    for r in range(args.rounds):
        a, _ = job(1)
        b, reports = job(args.ranks)
        one.append(a)
        many.append(b)
        ratios.append(b / a)
        hits = [x["hits"] for x in reports]
        print(
            f"round {r}: 1 rank {a:.1f} s, {args.ranks} ranks {b:.1f} s ({b / a:.2f}x); loads from the cache by rank: {hits}",
            flush=True,
        )
    print(
        f"\n| job | cold first step, s (median, lowest-highest) |\n|---|---:|\n"
        f"| 1 rank | {statistics.median(one):.1f} ({min(one):.1f}-{max(one):.1f}) |\n"
        f"| {args.ranks} ranks | {statistics.median(many):.1f} ({min(many):.1f}-{max(many):.1f}) |\n"
        f"| ratio, per round | {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
    )


if __name__ == "__main__":
    main()
