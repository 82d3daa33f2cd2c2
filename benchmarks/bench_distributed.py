"""Data parallel on this CPU: 2 ranks (torchrun, gloo) against 1 process, same global batches.

Run: python benchmarks/bench_distributed.py [--repeats R] [--steps N]

Workloads: the tiny MLP (32->64->10, global batch 32, SGD) and the 2048-wide MLP
(2048->2048->2048->10, global batch 64, AdamW). Variants, in alternating fresh
processes (a torchrun job cannot share a process with the others):

* 1 process, 1 thread;
* 1 process, 2 threads (the same two cores, used by intra-op threads instead);
* 2 ranks x 1 thread (torchrun --standalone --nproc_per_node=2, gloo).

Each process compiles its step, warms up, then times ``fl.run`` over N steps;
reported: milliseconds per global step (median of the repeats) and the speed-up
of each variant over 1 process, 1 thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

import fnloop as fl

WORKLOADS = {"tiny": (32, 64, 10, 32, "sgd"), "wide": (2048, 2048, 10, 64, "adamw")}


def worker(workload: str, steps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    inputs, width, classes, batch, kind = WORKLOADS[workload]
    torch.manual_seed(0)
    layers = [torch.nn.Linear(inputs, width), torch.nn.ReLU()]
    if workload == "wide":
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, classes))
    opt = fl.optim.sgd(0.01) if kind == "sgd" else fl.optim.adamw(1e-4)

    def loss_fn(forward, b):
        x, y = b
        return torch.nn.functional.cross_entropy(forward(x), y)

    g = torch.Generator().manual_seed(1)
    rows = batch * 8
    data = (torch.randn(rows, inputs, generator=g), torch.randint(0, classes, (rows,), generator=g))
    step = fl.train_step(model, loss_fn, opt)
    stream = fl.data.batches(data, batch_size=batch, seed=0)
    warm = 20
    state = fl.run(fl.init(model, opt, seed=0, max_iter=warm), step, stream)
    state = fl.TrainState(**{**state.__dict__, "max_iter": warm + steps})
    start = time.perf_counter()
    fl.run(state, step, stream)
    took = time.perf_counter() - start
    if fl.distributed.is_main():
        print(f"ms/step {took / steps * 1e3:.4f}")


def launch(workload: str, variant: str, steps: int) -> float:
    me = [os.path.abspath(__file__), "--worker", workload, "--steps", str(steps)]
    if variant == "2 ranks x 1 thread":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *me]
    else:
        threads = "2" if variant.startswith("1 process, 2") else "1"
        command = [sys.executable, *me, "--threads", threads]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return float(done.stdout.split("ms/step")[-1])


VARIANTS = ("1 process, 1 thread", "1 process, 2 threads", "2 ranks x 1 thread")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.threads)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; ms per global step, median of {args.repeats}")
    print(f"| workload | {' | '.join(VARIANTS)} |")
    print(f"|---|{'---|' * len(VARIANTS)}")
    for workload, steps in (("tiny", args.steps or 2000), ("wide", args.steps or 30)):
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                times[variant].append(launch(workload, variant, steps))
        base = statistics.median(times[VARIANTS[0]])
        cells = []
        for variant in VARIANTS:
            ms = statistics.median(times[variant])
            cells.append(f"{ms:.3f} ({base / ms:.2f}x)")
        print(f"| {workload} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
