"""Compile latency: from process start to the first finished step, cold and warm, in fresh processes.

    python benchmarks/bench_latency.py            # tiny MLP and the digits example, 2 rounds
    python benchmarks/bench_latency.py --rounds 3

Each measurement is a fresh Python process, one thread. Three settings, alternated
round by round so that a busy machine hurts each alike:

- cold: empty inductor and fnloop caches (``TORCHINDUCTOR_CACHE_DIR`` and
  ``FNLOOP_CACHE_DIR`` point at new empty folders);
- warm, fnloop cache off: inductor's caches warm, ``FNLOOP_CACHE_DIR=off`` (the step
  before fnloop had its own cache);
- warm: both caches warm.

Reported: seconds from process start to the first finished step (``total``), and of
that, the first call of the step (``first call``: tracing and compiling or loading,
with inductor's lazy imports).
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

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
import fnloop as fl
which = sys.argv[1]
if which == "tiny":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    batch = (torch.randn(32, 32), torch.randint(0, 10, (32,)))
    def loss_fn(forward, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(forward(x), y)
    optimizer = fl.optim.sgd(0.01)
    state = fl.init(model, optimizer, seed=0, max_iter=1)
    step = fl.train_step(model, loss_fn, optimizer)
else:
    from fnloop.examples import digits
    state, step, batches, _ = digits.job(max_iter=1, quiet=True)
    batch = next(iter(batches))
start = time.perf_counter()
after = step(state, batch)
after.metrics.latest_float("loss")
first_call = time.perf_counter() - start
print(json.dumps({"done": time.time(), "first_call": first_call}))
"""


def measure(which: str, inductor: str, fnloop: str) -> tuple[float, float]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor, "FNLOOP_CACHE_DIR": fnloop}
    begin = time.time()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, which], env=env, capture_output=True, text=True, check=True
    ).stdout
    line = json.loads(out.strip().splitlines()[-1])
    return line["done"] - begin, line["first_call"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=["tiny", "digits"])
    args = parser.parse_args()
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as root:
        warm_inductor, warm_fnloop = os.path.join(root, "inductor"), os.path.join(root, "fnloop")
        for which in args.workloads:  # fill the warm caches once
            measure(which, warm_inductor, warm_fnloop)
        for round_ in range(args.rounds):
            for which in args.workloads:
                cold = os.path.join(root, f"cold-{which}-{round_}")
                settings = {
                    "cold": (cold + "-inductor", cold + "-fnloop"),
                    "warm, fnloop cache off": (warm_inductor, "off"),
                    "warm": (warm_inductor, warm_fnloop),
                }
                for name, (inductor, fnloop) in settings.items():
                    results.setdefault((which, name), []).append(measure(which, inductor, fnloop))
    print(f"{'workload':8s} {'setting':24s} {'total s':>8s} {'first call s':>13s}")
    for (which, name), runs in results.items():
        total = statistics.median(r[0] for r in runs)
        first = statistics.median(r[1] for r in runs)
        print(f"{which:8s} {name:24s} {total:8.2f} {first:13.2f}")


if __name__ == "__main__":
    main()
