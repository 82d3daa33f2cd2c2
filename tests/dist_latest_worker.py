"""Two ranks call ``latest`` while checkpoints keep landing in the directory: they must agree.

    torchrun --standalone --nproc_per_node=2 tests/dist_latest_worker.py DIRECTORY ROUNDS OUT

A thread of rank 0 saves ``ckpt-{k}`` for k = 1, 2, ... into DIRECTORY (each a few MB, so a save
is in flight for a while) while both ranks call ``fl.checkpoint.latest`` ROUNDS times. Each rank
writes the iterations it loaded to OUT/rank-{rank}.json (a file each: two ranks printing to one
pipe can interleave their lines); the test compares the two lists.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import torch

import fnloop as fl


def template() -> fl.TrainState:
    return fl.TrainState(max_iter=10**6, params={"w": torch.zeros(512, 1024)})


def main() -> None:
    directory, rounds, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    rank = fl.distributed.rank()
    fl.save(template(), fl.checkpoint.path_for(directory, 0)) if rank == 0 else None
    torch.distributed.barrier()
    stop = threading.Event()

    def keep_saving() -> None:
        k = 1
        while not stop.is_set():
            state = fl.TrainState(
                max_iter=10**6, iteration=k, params={"w": torch.full((512, 1024), float(k))}
            )
            fl.save(state, fl.checkpoint.path_for(directory, k))
            k += 1

    saver = threading.Thread(target=keep_saving) if rank == 0 else None
    if saver is not None:
        saver.start()
    seen = []
    for _ in range(rounds):
        found = fl.checkpoint.latest(directory, like=template())
        assert found is not None
        assert torch.equal(found.params["w"], torch.full_like(found.params["w"], float(found.iteration)))
        seen.append(found.iteration)
    stop.set()
    if saver is not None:
        saver.join()
    (out / f"rank-{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
