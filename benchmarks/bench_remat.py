"""Activation checkpointing: peak memory and step time with and without it, fnloop against eager.

    python benchmarks/bench_remat.py            # GPT-2, 4 layers, 256 wide, 512 positions (~6 min)
    python benchmarks/bench_remat.py --quick    # tiny sizes: a smoke run

The workload is ``transformers``' GPT-2 at its defaults (dropout 0.1), 4 layers, 256 wide, 4 heads,
512 positions, a vocabulary of 256, batch 4, AdamW (lr 1e-3), one thread: a model whose
activations outweigh its state. Checkpointing is ``model.activation_checkpointing_enable()`` (each
block recomputed in the backward; non-reentrant). Four loops:

- ``fnloop``: ``fl.run`` over ``train_step(...)`` (the whole step compiled, donated);
- ``eager``: ``zero_grad(set_to_none=True)`` / ``backward`` / ``step`` with ``torch.optim.AdamW``,
  both ``foreach=True`` and ``fused=True`` measured: each row gives the faster (for speed) and the
  smaller (for memory), and names it;

each with checkpointing off and on. Memory runs each loop in a fresh process: after two warm-up
steps (the compile included) the RSS high-water mark is reset, and the row gives how far the peak
over the next steps rose above the RSS at that moment (the step's working memory: activations,
gradients, temporaries; the state itself is there before and after), with glibc's mmap threshold
pinned so that freed blocks leave the RSS. Speed runs the four loops in one process, taking turns;
the median over rounds of ms per step.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import fnloop as fl

LOOPS = ("fnloop", "fnloop+ckpt", "eager", "eager+ckpt")
KINDS = ("foreach", "fused")  # torch.optim.AdamW's two fast implementations
RUNS = ("fnloop", "fnloop+ckpt", *(f"eager-{k}{c}" for c in ("", "+ckpt") for k in KINDS))
"""Every loop measured: the eager rows of LOOPS are the better of their two optimizers."""


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"layers": 1, "width": 32, "context": 64, "batch": 2}
    return {"layers": 4, "width": 256, "context": 512, "batch": 4}


def _model(quick: bool, checkpointed: bool) -> torch.nn.Module:
    import transformers as T

    z = _sizes(quick)
    torch.manual_seed(0)
    config = T.GPT2Config(
        vocab_size=256,
        n_positions=z["context"],
        n_embd=z["width"],
        n_layer=z["layers"],
        n_head=4,
        bos_token_id=10,
        eos_token_id=10,
        use_cache=False,
    )
    model = T.GPT2LMHeadModel(config)
    model.train()
    if checkpointed:
        model.activation_checkpointing_enable()
    return model


def _batches(quick: bool, n: int = 4) -> list[torch.Tensor]:
    z = _sizes(quick)
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (z["batch"], z["context"]), generator=g) for _ in range(n)]


def _lm_loss(forward: Any, ids: torch.Tensor) -> torch.Tensor:
    return forward(input_ids=ids, labels=ids).loss


Train = Callable[[int], None]


def build(loop: str, quick: bool, options: dict[str, Any] | None = None) -> Train:
    """A loop that trains ``n`` more steps each time it is called, from where it left off."""
    model = _model(quick, loop.endswith("+ckpt"))
    data = _batches(quick)
    if loop.startswith("fnloop"):
        optimizer = fl.optim.adamw(1e-3)
        step = fl.train_step(model, _lm_loss, optimizer, options=options)
        box = [fl.init(model, optimizer, seed=0, max_iter=0)]

        def train(n: int) -> None:
            state = box[0]
            box[0] = fl.run(
                fl.TrainState(**{**state.__dict__, "max_iter": state.iteration + n}),
                step,
                [data[(state.iteration + i) % len(data)] for i in range(n)],
            )

        return train
    kind = loop.removeprefix("eager-").removesuffix("+ckpt")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, **{kind: True})
    seen = [0]

    def eager(n: int) -> None:
        for _ in range(n):
            optim.zero_grad(set_to_none=True)
            _lm_loss(model, data[seen[0] % len(data)]).backward()
            optim.step()
            seen[0] += 1

    return eager


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def _peak_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def probe(loop: str, quick: bool, steps: int, options: dict[str, Any] | None = None) -> dict[str, float]:
    """In this process: the working memory of ``steps`` steps of ``loop`` after a warm-up."""
    torch.set_num_threads(1)
    train = build(loop, quick, options)
    train(2)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark is reset to the RSS now
    base = _rss_mb()
    train(steps)
    return {"base_mb": base, "peak_mb": _peak_mb(), "working_mb": _peak_mb() - base}


def memory(quick: bool, steps: int) -> dict[str, dict[str, float]]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = {}
    for loop in RUNS:
        args = [sys.executable, __file__, "--probe", loop, "--steps", str(steps)] + (
            ["--quick"] if quick else []
        )
        done = subprocess.run(args, capture_output=True, text=True, env=env, check=True)
        out[loop] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def speed(quick: bool, steps: int, repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    loops = {loop: build(loop, quick) for loop in RUNS}
    for train in loops.values():
        train(2)  # compile, warm
    times: dict[str, list[float]] = {loop: [] for loop in RUNS}
    for _ in range(repeats):
        for loop, train in loops.items():
            start = time.perf_counter()
            train(steps)
            times[loop].append((time.perf_counter() - start) / steps * 1000)
    return {loop: statistics.median(t) for loop, t in times.items()}


def _best(values: dict[str, float], loop: str) -> str:
    """The run of ``loop`` with the smallest value: itself, or the better of an eager loop's optimizers."""
    if not loop.startswith("eager"):
        return loop
    return min((f"eager-{k}{loop.removeprefix('eager')}" for k in KINDS), key=values.__getitem__)


def _kind(run: str) -> str:
    return f" ({run.removeprefix('eager-').removesuffix('+ckpt')})" if run.startswith("eager") else ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--options", type=json.loads, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = args.steps or (2 if args.quick else 3)
    if args.probe:
        print(json.dumps(probe(args.probe, args.quick, steps, args.options)))
        return
    z = _sizes(args.quick)
    print(
        f"GPT-2, {z['layers']} layers, {z['width']} wide, {z['context']} positions, batch {z['batch']}, "
        f"dropout 0.1, AdamW, torch {torch.__version__}, one thread"
    )
    mem = memory(args.quick, steps)
    ms = speed(args.quick, steps, args.repeats or (2 if args.quick else 5))
    working = {loop: m["working_mb"] for loop, m in mem.items()}
    print("| loop | working memory (MiB) | vs. without checkpointing | ms/step | vs. without checkpointing |")
    print("|---|---:|---:|---:|---:|")
    for loop in LOOPS:
        plain = loop.removesuffix("+ckpt")
        least, fastest = _best(working, loop), _best(ms, loop)
        print(
            f"| {loop} | {working[least]:.0f}{_kind(least)} | {working[least] / working[_best(working, plain)]:.2f}x "
            f"| {ms[fastest]:.0f}{_kind(fastest)} | {ms[fastest] / ms[_best(ms, plain)]:.2f}x |"
        )
    print(json.dumps({"memory": mem, "ms": ms}))


if __name__ == "__main__":
    main()
