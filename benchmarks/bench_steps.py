"""Several steps per compiled call (``train_step(..., steps_per_call=k)``) against one step per call.

    python benchmarks/bench_steps.py                  # throughput and compile time, tiny MLP
    python benchmarks/bench_steps.py --skip-compile   # throughput only (one process, a minute)

Throughput: the tiny MLP (32->64->10, batch 32, SGD), whole ``fnloop.run``s of
``--iters`` iterations (the fold, its hooks' plan, the batches, the step),
each ``steps_per_call`` taking turns in one process, one thread; median of the
repeats, in microseconds per iteration. The hand-written compiled step
(``torch.compile`` of forward, backward and an in-place SGD update, one call per
step) is run beside them as the reference a user would write.

Compile time: seconds of the first call that compiles (tracing, inductor,
the C++ build), in fresh processes with empty inductor and fnloop caches,
alternated; and again with the caches those processes left (warm).
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

import torch
from bench_step import cross_entropy
from bench_step import tiny_problem as problem

import fnloop as fl

torch.set_num_threads(1)

HERE = os.path.dirname(os.path.abspath(__file__))


def fnloop_run(k: int):
    model, data = problem()
    opt = fl.optim.sgd(0.01)
    step = fl.train_step(model, cross_entropy, opt, steps_per_call=k)
    state = fl.init(model, opt, seed=0, max_iter=0)

    def run(n: int) -> None:
        final = fl.run(
            fl.TrainState(**{**state.__dict__, "max_iter": n}), step, (data[i % 16] for i in range(n))
        )
        assert final.iteration == n

    return run, step


def handwritten():
    from bench_step import tiny_handwritten

    return tiny_handwritten(0, {"cpp_wrapper": True})


def throughput(ks: list[int], iters: int, repeats: int) -> dict[str, float]:
    runs = {}
    steps = {}
    for k in ks:
        runs[f"steps_per_call={k}"], steps[k] = fnloop_run(k)
    runs["hand-written compiled"] = handwritten()
    for run in runs.values():
        run(max(ks) * 4)  # compile and warm up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run(iters)
            times[name].append((time.perf_counter() - start) / iters * 1e6)
    for k, step in steps.items():
        assert step.compiles == 1, (k, step.compiles)  # iters is a multiple of k: no single-step tail
    return {name: statistics.median(v) for name, v in times.items()}


CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[2])
import fnloop as fl
from bench_steps import problem, cross_entropy
k = int(sys.argv[1])
model, data = problem()
opt = fl.optim.sgd(0.01)
step = fl.train_step(model, cross_entropy, opt, steps_per_call=k)
state = fl.init(model, opt, seed=0, max_iter=k)
start = time.perf_counter()
final = fl.run(state, step, [data[i % 16] for i in range(k)])
final.metrics.latest_float("loss")
print(json.dumps({"first_call": time.perf_counter() - start}))
"""


def first_call(k: int, inductor: str, cache: str) -> float:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor, "FNLOOP_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", CHILD, str(k), HERE], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"steps_per_call={k}: the child failed:\n{out.stderr[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["first_call"])


def compile_times(ks: list[int], rounds: int) -> dict[int, dict[str, float]]:
    cold: dict[int, list[float]] = {k: [] for k in ks}
    warm: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(rounds):
        for k in ks:
            with tempfile.TemporaryDirectory() as tmp:
                inductor, cache = os.path.join(tmp, "inductor"), os.path.join(tmp, "fnloop")
                cold[k].append(first_call(k, inductor, cache))
                warm[k].append(first_call(k, inductor, cache))
    return {k: {"cold": statistics.median(cold[k]), "warm": statistics.median(warm[k])} for k in ks}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 8, 32, 128])
    parser.add_argument("--iters", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-compile", action="store_true")
    args = parser.parse_args(argv)
    ks = sorted({1, *args.ks})
    if args.iters % max(ks):
        parser.error(f"--iters must be a multiple of every k (largest {max(ks)})")
    med = throughput(ks, args.iters, args.repeats)
    single = med["steps_per_call=1"]
    print(
        f"tiny MLP 32->64->10, batch 32, SGD; fnloop.run of {args.iters} iterations x {args.repeats}, one thread"
    )
    for name, us in med.items():
        print(f"  {name:24s} {us:7.1f} us/it   {single / us:5.2f}x one step per call")
    if args.skip_compile:
        return
    times = compile_times(ks, args.rounds)
    print(f"first call, compiling (fresh processes, median of {args.rounds}):")
    base = times[1]
    for k, t in times.items():
        print(
            f"  steps_per_call={k:<3d} cold {t['cold']:5.1f} s ({t['cold'] / base['cold']:.2f}x)   "
            f"warm caches {t['warm']:5.1f} s"
        )
    best = max((k for k in ks if k > 1), key=lambda k: single / med[f"steps_per_call={k}"])
    speedup = single / med[f"steps_per_call={best}"]
    ratio = times[best]["cold"] / base["cold"]
    print(
        f"target: >= 2x throughput with a cold compile <= 2x: steps_per_call={best} gives {speedup:.2f}x "
        f"for {ratio:.2f}x the compile ({'met' if speedup >= 2 and ratio <= 2 else 'missed'})"
    )


if __name__ == "__main__":
    main()
