"""Tensor parallelism at T=2 against data parallel at 2 ranks, on this CPU (gloo over the loopback).

Run: python benchmarks/bench_tensor_parallel.py [--steps N] [--repeats R] [--eager]

One launch of 2 ranks (``fl.distributed.launch``), one thread each. Both variants live in each
rank's process and take turns, round by round: ``dp``, data parallel (each rank half of the global
batch, the gradients averaged), and ``tp``, ``init(..., tensor=2)`` (both ranks the whole global
batch, every layer of the built-in plan split). The workload: ``transformers``' Llama, 4 layers, 256
wide, 8 heads (4 key-value heads), MLP 1024, vocabulary 2048, context 128, global batch 8, AdamW,
compiled. Reported: ms per global step (median over the rounds) and ``tp / dp`` per round (median,
lowest, highest), and the bytes of parameters and optimizer state each rank holds.

gloo on one machine's two cores is not where tensor parallelism pays: it runs two all-reduces of
the activations per layer and step, where data parallel runs one of the gradients per step. The
number is a baseline to compare a GPU's with.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fnloop as fl

VOCAB, CONTEXT, BATCH = 2048, 128, 8


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=CONTEXT,
    )
    return LlamaForCausalLM(config)


def _loss(forward, ids):
    return forward(input_ids=ids, labels=ids).loss


def _held(state: fl.TrainState) -> int:
    leaves = torch.utils._pytree.tree_leaves(state.opt_state)
    return sum(t.nbytes for t in [*state.params.values(), *leaves] if isinstance(t, torch.Tensor))


def rank_body(steps: int, repeats: int, compile: bool) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model()
    optimizer = fl.optim.adamw(1e-4)
    rank = fl.distributed.rank()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=g) for _ in range(steps)]
    variants = {}
    for name, degree in (("dp", 1), ("tp", 2)):
        state = fl.init(model, optimizer, seed=0, max_iter=10**6, tensor=degree)
        step = fl.train_step(model, _loss, optimizer, compile=compile)
        mine = [b.chunk(2)[rank] for b in batches] if degree == 1 else batches
        state = step(state, mine[0])  # compiled and warmed
        variants[name] = [state, step, mine, _held(state)]
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, entry in variants.items():
            state, step, mine, _ = entry
            torch.distributed.barrier()
            start = time.perf_counter()
            for batch in mine:
                state = step(state, batch)
            float(state.metrics.latest("loss")[1])
            times[name].append((time.perf_counter() - start) / len(mine) * 1e3)
            entry[0] = state
    return {"times": times, "held": {name: entry[3] for name, entry in variants.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--eager", action="store_true", help="compile=False")
    args = parser.parse_args()
    found = fl.distributed.launch(rank_body, args.steps, args.repeats, not args.eager, nprocs=2)
    dp, tp = found["times"]["dp"], found["times"]["tp"]
    ratios = [t / d for t, d in zip(tp, dp)]
    mode = "eager" if args.eager else "compiled"
    print(f"Llama 4x256 on 2 ranks, {mode}, {args.repeats} rounds of {args.steps} steps (rank 0):")
    print("| variant | ms per global step | held per rank (MB) |")
    print("|---|---|---|")
    for name, values in (("data parallel", dp), ("tensor=2", tp)):
        key = "dp" if name == "data parallel" else "tp"
        print(f"| {name} | {statistics.median(values):.1f} | {found['held'][key] / 2**20:.1f} |")
    low, high = min(ratios), max(ratios)
    print(f"tensor=2 / data parallel: {statistics.median(ratios):.2f}x ({low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
