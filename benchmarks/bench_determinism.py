"""What ``train_step(..., deterministic=True)`` costs, and what it buys, on GPT-2 and the mixtures of experts.

    python benchmarks/bench_determinism.py                    # GPT-2, Qwen2-MoE, Mixtral; 2 threads
    python benchmarks/bench_determinism.py --only mixtral --threads 4
    python benchmarks/bench_determinism.py --quick            # fewer steps and rounds

The models are the models suite's tiny configs (``tests/models_worker.py``),
compiled, at ``--threads`` CPU threads (torch's default on this machine is 2).
In one process, for each model, the step built with ``deterministic=True``
and the one without take turns (interleaved), ``--rounds`` times, each round
timing ``--steps`` steps; the table gives the median milliseconds per step
and the ratio. What it buys: each variant also trains 6 steps four times from
the same start, and the table says how many of the last three runs differ,
in any bit of any parameter, from the first.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
import warnings
from pathlib import Path

import torch

import fnloop as fl

_SPEC = importlib.util.spec_from_file_location(
    "models_worker", Path(__file__).resolve().parent.parent / "tests" / "models_worker.py"
)
assert _SPEC is not None
assert _SPEC.loader is not None
cases = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cases)


def zero() -> float:
    return 0.0


def differing(name: str, step: fl.Step) -> int:
    """How many of three more 6-step runs differ in any bit from the first."""
    batches = cases.CASES[name][2]
    finals = [
        fl.run(fl.init(cases.built(name), cases.OPT, seed=0, max_iter=6), step, batches(), clock=zero)
        for _ in range(4)
    ]
    first = finals[0].params
    return sum(any(not torch.equal(first[k], other.params[k]) for k in first) for other in finals[1:])


def timed(name: str, step: fl.Step, n: int) -> float:
    """Milliseconds per step over ``n`` steps."""
    data = (cases.CASES[name][2]() * (n // cases.STEPS + 1))[:n]
    state = fl.init(cases.built(name), cases.OPT, seed=0, max_iter=n)
    start = time.perf_counter()
    fl.run(state, step, data, clock=zero)
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["gpt2", "qwen2-moe", "mixtral", "olmoe"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps, rounds = (30, 2) if args.quick else (args.steps, args.rounds)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # the warning of the step without the switch is what this measures
    names = [args.only] if args.only else ["gpt2", "qwen2-moe", "mixtral"]
    print(
        f"torch {torch.__version__}, {args.threads} threads, {steps} steps x {rounds} rounds, interleaved\n"
    )
    print(
        "| model | ms per step, deterministic | without | ratio | runs differing, deterministic | without |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        loss = cases.CASES[name][1]
        steps_of = {
            det: fl.train_step(cases.built(name), loss, cases.OPT, deterministic=det) for det in (True, False)
        }
        ms: dict[bool, list[float]] = {True: [], False: []}
        for step in steps_of.values():
            timed(name, step, 10)  # compile and warm up
        for _ in range(rounds):
            for det, step in steps_of.items():
                ms[det].append(timed(name, step, steps))
        on, off = statistics.median(ms[True]), statistics.median(ms[False])
        print(
            f"| {name} | {on:.2f} | {off:.2f} | {on / off:.2f} | "
            f"{differing(name, steps_of[True])}/3 | {differing(name, steps_of[False])}/3 |",
            flush=True,
        )


if __name__ == "__main__":
    main()
