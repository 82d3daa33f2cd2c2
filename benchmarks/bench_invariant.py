"""The price of the world-size-invariant mode: ``train_step(..., invariant=G)`` against ordinary data parallel.

Run: python benchmarks/bench_invariant.py [--worlds 1 2 4] [--models wide gpt2] [--slices 8] [--shard full]
         [--rounds R] [--steps N]

For each world size W (1: one process; more: torchrun --standalone, gloo, one thread per rank)
and each model, one launch whose processes build both steps, compiled, on the same global
batches, and time them interleaved: R rounds of N steps of each, in turn, in the same processes
(fresh processes differ more than the effect). Reported: milliseconds per global step (the median
over rounds, rank 0's clock) and the ratio invariant / data parallel.

Models: ``wide``, the 2048-wide MLP (2048 -> 2048 -> 2048 -> 10, ReLU, AdamW, global batch 64);
``gpt2``, ``transformers``' GPT-2 from a config (2 layers, 128 wide, 4 heads, 64 tokens, its
defaults otherwise: dropout 0.1; AdamW behind a global-norm clip, global batch 16).
``--slices G`` (default 8, twice the largest world size here): every global batch in G slices.
``--shard MODE``: both states sharded, ``init(..., shard=MODE)`` (the GPT-2's ``"full"`` step
without invariant gathers block by block; with it, every parameter at once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import attrs
import torch

import fnloop as fl


def model_of(kind: str) -> tuple[torch.nn.Module, object, tuple[torch.Tensor, ...], int]:
    """``(model, loss_fn, data, global batch)``."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "wide":
        model = torch.nn.Sequential(
            torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
            torch.nn.Linear(2048, 10),
        )  # fmt: skip

        def loss(forward, b):
            x, y = b
            return torch.nn.functional.cross_entropy(forward(x), y)

        return (
            model,
            loss,
            (torch.randn(512, 2048, generator=g), torch.randint(0, 10, (512,), generator=g)),
            64,
        )
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=128, n_layer=2, n_head=4))

    def lm_loss(forward, b):
        (ids,) = b
        return forward(input_ids=ids, labels=ids).loss

    return model, lm_loss, (torch.randint(0, 256, (128, 64), generator=g),), 16


def worker(kind: str, slices: int, rounds: int, steps: int, shard: str | None) -> None:
    torch.set_num_threads(1)
    model, loss, data, batch = model_of(kind)
    opt = fl.optim.chain(fl.optim.clip_by_global_norm(1.0), fl.optim.adamw(1e-4))
    variants = {
        "data parallel": fl.train_step(model, loss, opt),
        f"invariant={slices}": fl.train_step(model, loss, opt, invariant=slices, blocks=()),
    }
    states = {name: fl.init(model, opt, seed=0, max_iter=0, shard=shard) for name in variants}
    batches = {name: fl.data.batches(data, batch_size=batch, seed=0) for name in variants}

    def advance(name: str, n: int) -> float:
        state = attrs.evolve(states[name], max_iter=states[name].iteration + n)
        start = time.perf_counter()
        state = fl.run(state, variants[name], batches[name])
        float(state.metrics.latest("loss")[1])  # wait for the device
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        states[name] = state
        return (time.perf_counter() - start) / n * 1000

    for name in variants:  # compile and warm up
        advance(name, 3)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name in variants:
            times[name].append(advance(name, steps))
    if fl.distributed.rank() == 0:
        print(json.dumps({name: statistics.median(t) for name, t in times.items()}), flush=True)


def launch(world: int, kind: str, args: argparse.Namespace) -> dict[str, float]:
    runner = [sys.executable]
    if world > 1:
        runner += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    argv = [__file__, "--worker", kind, "--slices", str(args.slices), "--rounds", str(args.rounds)]
    argv += ["--steps", str(args.steps), *(["--shard", args.shard] if args.shard else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*runner, *argv], capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(done.stderr[-4000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--models", nargs="+", default=["wide", "gpt2"])
    parser.add_argument("--slices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--shard", choices=("full", "optimizer"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.slices, args.rounds, args.steps, args.shard)
        return
    sharded = f", shard={args.shard!r}" if args.shard else ""
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, one thread per rank{sharded}; ms per global step"
    )
    print("| model | ranks | data parallel | invariant | ratio |")
    print("|---|---:|---:|---:|---:|")
    for kind in args.models:
        for world in args.worlds:
            found = launch(world, kind, args)
            plain, inv = found["data parallel"], found[f"invariant={args.slices}"]
            print(f"| {kind} | {world} | {plain:.1f} | {inv:.1f} | {inv / plain:.2f} |", flush=True)


if __name__ == "__main__":
    main()
