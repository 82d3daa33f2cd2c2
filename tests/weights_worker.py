"""The weights of each layout written to a file and to rank 0 alone, and a failed write on every rank.

    torchrun --standalone --nproc_per_node=4 tests/weights_worker.py RESULTS

For each layout (data parallel, ``shard="optimizer"``, ``shard="full"``, and a 2-D mesh of two copies),
every rank writes ``RESULTS/<layout>/rank{r}.pt``: the whole parameters and buffers every rank
gathers (``fl.state_dict``), what ``fl.state_dict(rank0_only=True)`` gave it, and the same of
``fl.unshard`` (parameters and optimizer state). Rank 0 writes each layout's file; then
``failed``: rank 0's path lies under a regular file, and every rank says what it raised.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import fnloop as fl

LAYOUTS = {"dp": (None, 1), "optimizer": ("optimizer", 1), "full": ("full", 1), "mesh": ("full", 2)}


def main() -> None:
    torch.set_num_threads(1)
    fl.distributed.setup()
    out, rank = Path(sys.argv[1]), fl.distributed.rank()
    torch.manual_seed(0)
    # Rows that do not divide by 4 (the chunks are padded), floating buffers and an int64 one.
    net = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    net.append(torch.nn.Linear(5, 11))
    for name, (shard, copies) in LAYOUTS.items():
        state = fl.init(net, fl.optim.adamw(1e-3), seed=0, max_iter=1, shard=shard, replicate=copies)
        fl.save_weights(state, out / name / "model.safetensors", dtype=torch.bfloat16, metadata={"run": name})
        alone = fl.state_dict(state, rank0_only=True)
        whole = fl.state_dict(state)
        gathered, to_rank0 = fl.unshard(state), fl.unshard(state, rank0_only=True)
        torch.save(
            {
                "whole": dict(whole),
                "alone": dict(alone),
                "unshard": _tensors(gathered),
                "unshard_alone": None if to_rank0 is None else _tensors(to_rank0),
            },
            out / name / f"rank{rank}.pt",
        )
    blocked = out / "failed" / "file"
    if rank == 0:
        blocked.parent.mkdir(parents=True)
        blocked.write_text("a file, not a folder")
    try:
        fl.save_weights(state, blocked / "model.safetensors")
        said = "nothing"
    except OSError as error:
        said = f"{type(error).__name__}: {error}"
    torch.save({"said": said}, out / "failed" / f"rank{rank}.pt")


def _tensors(state: fl.TrainState) -> dict:
    """The parameters and the optimizer state's leaves, by path, and whether the state is whole."""
    from torch.utils import _pytree as pytree

    leaves = pytree.tree_flatten_with_path(state.opt_state)[0]
    return {
        "params": dict(state.params),
        "opt_state": {pytree.keystr(path): leaf for path, leaf in leaves},
        "shards": state.shards,
    }


if __name__ == "__main__":
    main()
