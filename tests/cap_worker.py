"""A model whose state is over twice what each rank may hold, trained under a memory limit per rank.

    torchrun --standalone --nproc_per_node=N tests/cap_worker.py RESULTS --shard full|none|tensor [--limit MIB]
        [--then RESULTS ...]

The model (``DEPTH`` equal blocks of ``Linear(WIDTH, WIDTH)``, AdamW) is built on the meta device and
made by ``fl.init`` module by module, so no rank ever holds it whole unless its layout says so
(``--shard tensor``: every layer split over every rank, ``init(..., tensor=N)``). With
``--limit``, each rank moves itself into a memory cgroup of its own (cgroup v1, the machine's
memory controller) right after importing torch and joining the process group, with that limit on
what it charges from then on: the kernel kills a rank that goes over it. Each rank writes
``RESULTS/rank{r}.json``: the bytes its state holds, the peak it charged (the cgroup's
``max_usage_in_bytes``) and the losses. The run is given its state (``fl.run(..., donate_input=True)``):
its first step writes into the state ``fl.init`` made, not beside it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from exported import exported_model
from worker_exit import jobs, leave

import fnloop as fl

WIDTH, DEPTH, BATCH = 2560, 32, 16
CGROUPS = Path("/sys/fs/cgroup/memory")


class Blocks(torch.nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _limited(name: str, limit: int) -> Path:
    """This process in a memory cgroup of its own, limited to ``limit`` bytes charged from now on."""
    group = CGROUPS / name
    group.mkdir(exist_ok=True)
    (group / "memory.limit_in_bytes").write_text(str(limit))
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return group


def main() -> None:
    import sys

    torch.set_num_threads(1)
    fl.distributed.setup()
    if "--export" not in sys.argv:
        _warm()
    for job in jobs(sys.argv[1:]):
        (export if "--export" in job else run)(job)
    leave(fl.distributed.rank())


def export(argv: list[str]) -> None:
    """The Llama made sharded under the limit, then its weights written to ``RESULTS/model.safetensors``:
    ``--export weights`` by ``fl.save_weights`` (one tensor at a time on rank 0), ``--export gathered``
    by ``safetensors.torch.save_file`` of ``fl.state_dict`` (the whole model on every rank)."""
    import safetensors.torch

    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("--export", choices=("weights", "gathered"), required=True)
    parser.add_argument("--limit", type=int, required=True, help="MiB each rank may charge after joining")
    args = parser.parse_args(argv)
    rank = fl.distributed.rank()
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    model = exported_model()
    if rank == 0:
        model.config.save_pretrained(out)
    group = _limited(f"{out.name}-{os.getpid()}", args.limit * 2**20)
    state = fl.init(
        model, fl.optim.sgd(0.1), seed=0, max_iter=1, shard="full", init_weights=model._init_weights
    )
    held = sum(t.numel() * t.element_size() for t in state.params.values())
    made = int((group / "memory.max_usage_in_bytes").read_text())
    (group / "memory.max_usage_in_bytes").write_text("0")  # the export's own peak from here
    if args.export == "weights":
        fl.save_weights(state, out / "model.safetensors", model)
    else:
        whole = fl.state_dict(state, model)
        if rank == 0:
            safetensors.torch.save_file(whole, out / "model.safetensors")
    peak = int((group / "memory.max_usage_in_bytes").read_text())
    (group / "cgroup.procs").parent.parent.joinpath("cgroup.procs").write_text(str(os.getpid()))  # out again
    (out / f"rank{rank}.json").write_text(json.dumps({"held": held, "made": made, "peak": peak}))


def _warm() -> None:
    """A tiny sharded step compiled and run once, before any limit: the libraries a step loads on first
    use (inductor, the compiled graph's loader) are loaded outside what a job is charged."""
    model, optimizer = Blocks(width=4), fl.optim.adamw(1e-3)
    state = fl.init(model, optimizer, seed=0, max_iter=1, shard="full")
    step = fl.train_step(model, lambda forward, x: forward(x).square().mean(), optimizer)
    fl.run(state, step, [torch.ones(4, 4)])


def run(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("--shard", choices=("full", "none", "tensor"), required=True)
    parser.add_argument("--limit", type=int, help="MiB each rank may charge after joining")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--save", action="store_true", help="then fl.save the state to RESULTS/ckpt.safetensors"
    )
    args = parser.parse_args(argv)
    rank, world = fl.distributed.rank(), fl.distributed.world_size()
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    group = _limited(f"{out.name}-{os.getpid()}", (args.limit or 2**20) * 2**20)
    with torch.device("meta"):
        model = Blocks()
    optimizer = fl.optim.adamw(1e-3)
    if args.shard == "tensor":  # every layer split over every rank: column-wise, then row-wise, in turn
        plan = {f"layers.{i}": "colwise" if i % 2 == 0 else "rowwise" for i in range(DEPTH)}
        state = fl.init(model, optimizer, seed=0, max_iter=args.steps, tensor=world, tensor_plan=plan)
    else:
        shard = None if args.shard == "none" else "full"
        state = fl.init(model, optimizer, seed=0, max_iter=args.steps, shard=shard)
    step = fl.train_step(model, lambda forward, x: forward(x).square().mean(), optimizer)
    data = torch.randn(BATCH * 4, WIDTH, generator=torch.Generator().manual_seed(1))
    final = fl.run(state, step, fl.data.batches(data, batch_size=BATCH, seed=0), donate_input=True)
    held = sum(t.numel() * t.element_size() for t in (*final.params.values(), *_leaves(final.opt_state)))
    if args.save:  # under the limit too: a checkpoint of a state no rank holds whole
        fl.save(final, out / "ckpt.safetensors")
    peak = int((group / "memory.max_usage_in_bytes").read_text())
    (group / "cgroup.procs").parent.parent.joinpath("cgroup.procs").write_text(str(os.getpid()))  # out again
    losses = [float(v) for _, v in final.metrics.series["loss"]]
    (out / f"rank{rank}.json").write_text(
        json.dumps({"held": held, "peak": peak, "world": world, "losses": losses})
    )


def _leaves(tree: object) -> list[torch.Tensor]:
    from torch.utils import _pytree as pytree

    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


if __name__ == "__main__":
    main()
