"""A population of P members in one compiled step against P runs one after another.

    python benchmarks/bench_population.py                 # both workloads, P=8
    python benchmarks/bench_population.py --only tiny     # one workload
    python benchmarks/bench_population.py --quick         # small sizes, few steps: a smoke run
    python benchmarks/bench_population.py --device cuda   # on a GPU (memory: the allocator's peak)

Speed, in one process, one thread, the loops taking turns (interleaved): each
round trains ``--steps`` iterations of

* ``population``: ``fnloop.run`` of the population's state (``fnloop.population``,
  P members with their own seeds and learning rates, injected), one compiled
  step for all of them;
* ``one after another``: ``fnloop.run`` of each member's own state, the P runs
  one after the other, with the same compiled solo step;
* ``torch, one after another``: the plain PyTorch loop (the model's own
  forward, ``loss.backward()``, ``torch.optim``), the P runs one after the
  other, eager: the loop a user writes for a sweep; measured with
  ``foreach=True`` and with ``fused=True``, the faster is the reference.

The table gives the median over ``--repeats`` rounds of the milliseconds per
iteration of the whole population (a population's iteration is P members'
steps). Memory, each loop in a fresh process: the bytes of the state (params
and optimizer state) and the peak RSS of a few steps above the RSS before the
first (the step's working memory; the compiled graph is read from the cache the
speed run filled; glibc's mmap threshold pinned, so that freed blocks leave the
RSS), for the population and for one member.

Workloads: ``tiny``, the tiny MLP of ``bench_steps.py`` (32->64->10, batch 32,
SGD); ``gpt2``, the GPT-2 of ``bench_models.py`` (2 layers, 128 wide, 128
positions, batch 16, dropout 0.1, AdamW).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

import fnloop as fl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


@dataclass(frozen=True)
class Job:
    name: str
    label: str
    build: Callable[[], torch.nn.Module]
    batches: list[Any]
    loss: Callable[[Any, Any], torch.Tensor]
    optimizer: Callable[..., fl.optim.Optimizer]  # optimizer(lr)
    torch_optimizer: Callable[[Any, float, str], torch.optim.Optimizer]  # (params, lr, "foreach"|"fused")
    lrs: tuple[float, ...]


DEVICE = torch.device("cpu")


def _on_device(build: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    return lambda: build().to(DEVICE)


def jobs(members: int, quick: bool) -> dict[str, Job]:
    from workloads import TINY, loss

    spread = tuple(TINY.lr * 2 ** (m - members // 2) for m in range(members))
    tiny = Job(
        "tiny",
        "tiny MLP 32→64→10, batch 32, SGD",
        _on_device(TINY.build),
        pytree.tree_map(lambda t: t.to(DEVICE), TINY.batches()),
        loss,
        lambda lr: fl.optim.inject(fl.optim.sgd, lr=lr),
        lambda params, lr, kind: torch.optim.SGD(params, lr=lr, **{kind: True}),
        spread,
    )
    from bench_models import workloads

    gpt = workloads(quick)["gpt2"]
    gpt2 = Job(
        "gpt2",
        gpt.label + ", AdamW",
        _on_device(gpt.build),
        gpt.batches(DEVICE),
        gpt.loss,
        lambda lr: fl.optim.inject(fl.optim.adamw, lr=lr, weight_decay=0.01),
        lambda params, lr, kind: torch.optim.AdamW(params, lr=lr, weight_decay=0.01, **{kind: True}),
        tuple(1e-3 * 2 ** (m - members // 2) for m in range(members)),
    )
    return {"tiny": tiny, "gpt2": gpt2}


def member(job: Job, m: int) -> fl.TrainState:
    torch.manual_seed(m)
    return fl.init(job.build(), job.optimizer(job.lrs[m]), seed=m, max_iter=0)


def _init(job: Job) -> Callable[..., fl.TrainState]:
    def init(seed: int, lr: float) -> fl.TrainState:
        torch.manual_seed(seed)
        return fl.init(job.build(), job.optimizer(lr), seed=seed, max_iter=0)

    return init


Train = Callable[[int], None]


def fnloop_runs(job: Job, step: fl.Step, states: list[fl.TrainState]) -> Train:
    """``n`` iterations of each state in turn (one state: the population)."""
    held = list(states)

    def train(n: int) -> None:
        for k, state in enumerate(held):
            start = state.iteration
            batches = (job.batches[(start + i) % len(job.batches)] for i in range(n))
            given = fl.TrainState(**{**state.__dict__, "max_iter": start + n})
            held[k] = None  # the run gets the only reference: its first state is freed once stepped
            held[k] = fl.run(given, step, batches)

    return train


def torch_runs(job: Job, members: int, kind: str) -> Train:
    """``n`` steps of each member's plain PyTorch loop in turn (``torch.optim`` with ``kind=True``)."""
    runs = []
    for m in range(members):
        torch.manual_seed(m)
        model = job.build()
        runs.append((model, job.torch_optimizer(model.parameters(), job.lrs[m], kind), [0]))

    def train(n: int) -> None:
        for model, opt, done in runs:
            model.train()
            for _ in range(n):
                batch = job.batches[done[0] % len(job.batches)]
                done[0] += 1
                job.loss(model, batch).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

    return train


def loops(job: Job, members: int) -> dict[str, Train]:
    torch.manual_seed(0)
    step = fl.train_step(job.build(), job.loss, job.optimizer(job.lrs[0]))
    population = fl.population(_init(job), seeds=list(range(members)), lr=list(job.lrs))
    return {
        "population": fnloop_runs(job, step, [population]),
        "one after another": fnloop_runs(job, step, [member(job, m) for m in range(members)]),
        "torch, one after another (foreach)": torch_runs(job, members, "foreach"),
        "torch, one after another (fused)": torch_runs(job, members, "fused"),
    }


def speed(job: Job, members: int, steps: int, repeats: int) -> dict[str, float]:
    """Median ms per population iteration (every member's step) of each loop, interleaved."""
    built = loops(job, members)
    for train in built.values():
        train(2)  # compile and warm up
    times: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(repeats):
        for name, train in built.items():
            _sync()
            start = time.perf_counter()
            train(steps)
            _sync()
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def state_bytes(state: fl.TrainState) -> int:
    leaves = [*state.params.values(), *pytree.tree_leaves(state.opt_state)]
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def memory_probe(job: Job, members: int, which: str, steps: int) -> dict[str, float]:
    """In a fresh process: the state's bytes and the peak RSS of ``steps`` steps above the RSS before them."""
    from peers import peak_rss_mb, reset_peak_rss, rss_mb

    torch.manual_seed(0)
    step = fl.train_step(job.build(), job.loss, job.optimizer(job.lrs[0]))
    if which == "population":
        state = fl.population(_init(job), seeds=list(range(members)), lr=list(job.lrs))
    else:
        state = member(job, 0)
    held = state_bytes(state)
    train = fnloop_runs(job, step, [state])
    del state
    # From before the first step: once warm, glibc keeps the freed blocks of earlier steps in the
    # RSS, so a peak taken over later steps alone sees only what a step adds to them.
    if DEVICE.type == "cuda":  # the caching allocator's peak above what was allocated before
        _sync()
        allocated = torch.cuda.memory_allocated(DEVICE)
        torch.cuda.reset_peak_memory_stats(DEVICE)
        train(steps)
        _sync()
        return {
            "state_mb": held / 2**20,
            "working_mb": (torch.cuda.max_memory_allocated(DEVICE) - allocated) / 2**20,
        }
    before = rss_mb()
    reset_peak_rss()
    train(steps)
    return {"state_mb": held / 2**20, "working_mb": peak_rss_mb() - before}


def table(job: Job, members: int, ms: dict[str, float], mem: dict[str, dict[str, float]]) -> str:
    base = ms["population"]
    rows = [
        f"### {job.label}, P={members}",
        "",
        "| loop | ms per iteration (P members) | time against the population |",
        "|---|---:|---:|",
    ]
    rows += [f"| {name} | {value:.2f} | {value / base:.2f}x |" for name, value in ms.items()]
    one, pop = mem["member"], mem["population"]
    rows += [
        "",
        "| memory | one member | population | population / one member |",
        "|---|---:|---:|---:|",
        f"| state (params + optimizer) | {one['state_mb']:.2f} MB | {pop['state_mb']:.2f} MB | "
        f"{pop['state_mb'] / one['state_mb']:.2f} |",
        f"| working peak of the steps ({'allocated' if DEVICE.type == 'cuda' else 'RSS'}) | {one['working_mb']:.1f} MB | {pop['working_mb']:.1f} MB | "
        f"{pop['working_mb'] / max(one['working_mb'], 1e-9):.2f} |",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=["tiny", "gpt2"])
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--probe", nargs=2, metavar=("JOB", "WHICH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", fl.data.DataRestarts)  # each round's runs go on over fresh batches
    torch.set_num_threads(1)
    global DEVICE
    DEVICE = torch.device(args.device)
    built = jobs(args.members, args.quick)
    if args.probe:
        name, which = args.probe
        steps = args.steps or (50 if name == "tiny" else 4)
        print(json.dumps(memory_probe(built[name], args.members, which, steps)))
        return
    for name in args.only or ["tiny", "gpt2"]:
        job = built[name]
        steps = args.steps or ((20 if args.quick else 200) if name == "tiny" else (2 if args.quick else 6))
        ms = speed(job, args.members, steps, args.repeats)
        mem = {}
        for which in ("member", "population"):
            command = [sys.executable, __file__, "--probe", name, which, "--members", str(args.members)]
            command += ["--device", args.device]
            command += ["--quick"] if args.quick else []
            # glibc's mmap threshold pinned, so that blocks a step frees leave the RSS (as bench_remat.py).
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
            done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
            mem[which] = json.loads(done.stdout.strip().splitlines()[-1])
        print(table(job, args.members, ms, mem), flush=True)
        print()


if __name__ == "__main__":
    main()
