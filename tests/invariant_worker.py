"""The world-size-invariant run for ``tests/test_invariant.py``; the same script on one process or under torchrun.

    [torchrun --standalone --nproc_per_node=W] tests/invariant_worker.py RESULTS [options] [--then RESULTS ...]

A small network (Linear, BatchNorm1d, GELU, dropout 0.2, Linear) with AdamW behind a global-norm
clip, or a ``transformers`` GPT-2 of two layers at its defaults (dropout 0.1), trained with
``train_step(..., invariant=4)`` on a global batch of 16 rows from ``fl.data.batches``. Each job
saves into ``RESULTS/rank{r}.pt`` every tensor of the final state (params, buffers, optimizer
state's leaves), the loss history (tensors, compared bit for bit), where the run began, the
warnings the run gave, and how many times a block's backward added a slice's gradients over the
ranks (traced once, compiled).

Options:
    --model KIND       net (default) or gpt2
    --max-iter N       steps in all (default 50)
    --compile          compile the step (default: eager)
    --steps-per-call K train_step(..., steps_per_call=K)
    --checkpoint DIR   checkpoint into DIR every 10 steps
    --from DIR:I       start from DIR's checkpoint of iteration I (written at another world size)
    --slices G         train_step(..., invariant=G) (default 4); a refusal's message is saved instead
    --shard MODE       init(..., shard=MODE): full or optimizer (the saved state is gathered whole)
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree
from worker_exit import jobs, leave

import fnloop as fl

SLICES = 4
BATCH = 16


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 3))


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=16, n_embd=16, n_layer=2, n_head=2))


def net_loss(forward, batch):
    x, y = batch
    return nn.functional.cross_entropy(forward(x), y)


def lm_loss(forward, batch):
    (ids,) = batch
    return forward(input_ids=ids, labels=ids).loss


def data(model: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    if model == "gpt2":
        return (torch.randint(0, 61, (96, 12), generator=g),)
    return torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)


TREES = [0]
"""How many times a block's gather's backward added a slice's gradients over the ranks (``ranks_tree``)."""


def _count_trees() -> None:
    import fnloop._step.placement as placement

    real = placement.ranks_tree

    def counted(grad: torch.Tensor, group: object) -> torch.Tensor:
        TREES[0] += 1
        return real(grad, group)

    placement.ranks_tree = counted


def run(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("--model", choices=("net", "gpt2"), default="net")
    parser.add_argument("--max-iter", type=int, default=50)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps-per-call", type=int, default=1)
    parser.add_argument("--checkpoint")
    parser.add_argument("--from", dest="start")
    parser.add_argument("--slices", type=int, default=SLICES)
    parser.add_argument("--shard", choices=("full", "optimizer"))
    args = parser.parse_args(argv)
    model = net() if args.model == "net" else gpt2()
    opt = fl.optim.chain(fl.optim.clip_by_global_norm(1.0), fl.optim.adamw(1e-2))
    state = fl.init(model, opt, seed=0, max_iter=args.max_iter, shard=args.shard)
    if args.start:
        where, at = args.start.rsplit(":", 1)
        state = fl.load(fl.checkpoint.path_for(where, int(at)), like=state)
    began = state.iteration
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    step = fl.train_step(
        model,
        net_loss if args.model == "net" else lm_loss,
        opt,
        compile=args.compile,
        steps_per_call=args.steps_per_call,
        invariant=args.slices,
    )
    hooks = []
    if args.checkpoint:
        hooks.append(fl.every(10, fl.hooks.checkpoint(args.checkpoint, keep=None)))
    batches = fl.data.batches(data(args.model), batch_size=BATCH, seed=0)
    TREES[0] = 0
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:  # the world size is checked at the first step, where the layout is known
            final = fl.unshard(fl.run(state, step, batches, hooks))
        except ValueError as exc:
            torch.save({"refused": str(exc)}, out / f"rank{fl.distributed.rank()}.pt")
            return
    torch.save(
        {
            "params": dict(final.params),
            "buffers": dict(final.buffers),
            "opt_state": pytree.tree_leaves(final.opt_state),
            "losses": [(i, torch.as_tensor(v)) for i, v in final.metrics.series["loss"]],
            "began": began,
            "iteration": final.iteration,
            "trees": TREES[0],
            "warned": "\n".join(str(w.message) for w in warned),
        },
        out / f"rank{fl.distributed.rank()}.pt",
    )


def main() -> None:
    import sys

    torch.set_num_threads(1)
    _count_trees()
    for job in jobs(sys.argv[1:]):
        run(job)
    leave(fl.distributed.rank())


if __name__ == "__main__":
    main()
