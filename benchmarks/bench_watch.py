"""What watching a run costs: statistics inside the step, loss scaling, and the throughput hook.

    python benchmarks/bench_watch.py              # GPT-2 of bench_models (2 layers, 128 wide), ~5 min
    python benchmarks/bench_watch.py --quick      # tiny sizes: a smoke run

The workload is ``bench_models.py``'s GPT-2 (``transformers``, 2 layers, 128 wide, 4 heads, 128
positions, batch 16, dropout 0.1, AdamW 1e-3), one thread, each step compiled whole. The variants:

- ``off``: ``train_step(...)``, as every run without statistics;
- ``model`` / ``blocks`` / ``parameters``: ``train_step(..., stats=...)``;
- ``fp16``: ``autocast=torch.float16`` with ``dynamic_loss_scale(adamw)``, against ``fp16-plain``
  (the same autocast, no scaling): what the scaling adds; and ``bf16`` for reference (a CPU
  without float16 arithmetic runs float16 products far slower than bfloat16 ones);
- ``hook``: ``off`` run by ``fl.run`` with ``throughput(...)`` after every step, against ``off``
  run by ``fl.run`` bare; and the hook's own call, timed alone over 10,000 calls.

All are built and warmed (compiled) first, then take turns in one process, ``--rounds`` times
``--steps`` steps each, each round starting from the next variant; the figure is the median over rounds of ms per step, and each
variant's ratio to its baseline.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import attrs
import torch
from bench_models import workloads

import fnloop as fl


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 3
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "train_step\\(autocast=torch.float16\\) without loss scaling")
    warnings.simplefilter("ignore", fl.data.DataRestarts)  # each round restarts the same batches
    work = workloads(args.quick)["gpt2"]
    data = work.batches(torch.device("cpu"))
    adamw = fl.optim.adamw(1e-3)
    scaled = fl.optim.dynamic_loss_scale(adamw)

    def variant(opt: Any, **kw: Any) -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = work.build()
        return fl.init(model, opt, seed=0, max_iter=10**9), fl.train_step(model, work.loss, opt, **kw)

    variants = {
        "off": variant(adamw),
        "model": variant(adamw, stats="model"),
        "blocks": variant(adamw, stats="blocks"),
        "parameters": variant(adamw, stats="parameters"),
        "bf16": variant(adamw, autocast=torch.bfloat16),
        "fp16-plain": variant(adamw, autocast=torch.float16),
        "fp16": variant(scaled, autocast=torch.float16),
    }
    tokens = data[0].numel()
    hook = fl.hooks.throughput(samples=data[0].shape[0], tokens=tokens)
    states = {name: s for name, (s, _) in variants.items()}

    def steps(name: str, n: int) -> float:
        state, step = states[name], variants[name][1]
        start = time.perf_counter()
        for i in range(n):
            state = step.donating(state, data[i % len(data)])
        states[name] = state
        return (time.perf_counter() - start) / n

    def folded(name: str, hooks: list, n: int) -> float:
        state, step = states[name], variants[name][1]
        start = time.perf_counter()
        states[name] = fl.run(
            attrs.evolve(state, max_iter=state.iteration + n), step, data * (n // len(data) + 1), hooks
        )
        return (time.perf_counter() - start) / n

    for name in variants:  # compile and warm each
        steps(name, 2)
    folded("off", [hook], 2)
    times: dict[str, list[float]] = {name: [] for name in [*variants, "run", "run+hook"]}
    order = [*variants, "run", "run+hook"]
    for r in range(args.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:  # each round starts elsewhere
            if name == "run":
                times[name].append(folded("off", [], args.steps))
            elif name == "run+hook":
                times[name].append(folded("off", [hook], args.steps))
            else:
                times[name].append(steps(name, args.steps))
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    print(
        f"{work.label}, AdamW, one thread; median of {args.rounds} rounds of {args.steps} steps, interleaved"
    )
    print(f"{'variant':<28}{'ms/step':>10}{'ratio':>9}")
    for name, base in [
        ("off", "off"),
        ("model", "off"),
        ("blocks", "off"),
        ("parameters", "off"),
        ("bf16", "bf16"),
        ("fp16-plain", "fp16-plain"),
        ("fp16", "fp16-plain"),
        ("run", "run"),
        ("run+hook", "run"),
    ]:
        label = {"model": "stats='model'", "blocks": "stats='blocks'", "parameters": "stats='parameters'",
                 "fp16": "fp16 + dynamic_loss_scale", "bf16": "bf16", "fp16-plain": "fp16, no scaling",
                 "run": "fl.run, no hook", "run+hook": "fl.run + throughput()"}.get(name, name)  # fmt: skip
        print(f"{label:<28}{ms[name]:>10.2f}{ms[name] / ms[base]:>9.3f}")
    print(f"throughput() in fl.run, the difference per step: {1e3 * (ms['run+hook'] - ms['run']):.0f} us")
    timed = attrs.evolve(states["off"], clock=fl.Clock(time=1.0, step_time=0.1))
    timed = hook(timed, fl.Phase.AFTER_STEP)
    calls = 10_000
    start = time.perf_counter()
    for _ in range(calls):
        hook(timed, fl.Phase.AFTER_STEP)
    print(f"throughput() alone, one call: {1e6 * (time.perf_counter() - start) / calls:.1f} us")


if __name__ == "__main__":
    main()
