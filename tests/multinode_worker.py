"""A tiny data-parallel run for the two-node tests: one torchrun agent per simulated node.

    torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT \
        --rdzv_id=ID tests/multinode_worker.py OUT RESULTS SEEN [options]

The model, data, loss and optimizer are those of ``tests/dist_worker.py``,
trained eagerly (``compile=False``: six processes share the test machine's
cores) for 20 steps of a global batch of 8. The run resumes from
``OUT/ckpt`` and checkpoints there every 10 steps.

Each rank writes, before it joins the group, what its launcher told it
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK``, the restart count,
its agent's PID) into ``SEEN/<ns>-<pid>.json``, one file per process started,
so that the test knows every worker it has to end. When the run ends it saves
what the test compares into ``RESULTS/rank{r}.pt`` (and the same into
``RESULTS/rank{r}-from{i}.pt``, ``i`` the iteration it resumed at, which a
later round of the job does not overwrite), with every path under
``OUT`` that this process created, wrote, renamed or removed (recorded by an
audit hook): outside ``OUT``, so that the test can check that only rank 0
wrote there.

Options:
    --die-at I        every rank ends its process at once (os._exit) after step I: a job killed
    --lose-node-at I  in a run that started from scratch, the ranks of node (GROUP_RANK) 1 end their
                      node after step I: local rank 0 SIGKILLs the node's agent, and both exit
    --crash-at I      global rank 3 SIGKILLs itself after step I, in its agent's first attempt
                      (TORCHELASTIC_RESTART_COUNT 0): a crash that torchrun restarts
    --own-group       the script joins the process group itself (init_process_group), before fnloop
    --timeout S       fl.distributed.setup(timeout=S seconds): how long a rank waits for the
                      others (default 60)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from worker_exit import leave

import fnloop as fl
from fnloop import Phase, TrainState
from tests.dist_worker import BATCH, At, data, die, kill_self, loss_fn, model, optimizer

ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
)
WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
CHANGES = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.truncate", "os.chmod", "shutil.rmtree"}


def watch_writes(root: Path) -> list[str]:
    """Every path under ``root`` this process will create, write, rename or remove (a live list)."""
    root = os.path.abspath(root)
    seen: list[str] = []

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags & WRITES)
            paths = [path] if writing else []
        elif event in CHANGES:
            paths = list(args[:2]) if event == "os.rename" else [args[0]]
        else:
            return
        for path in paths:
            if isinstance(path, (str, os.PathLike)):
                where = os.path.abspath(path)
                if os.path.commonpath([root, where]) == root:
                    seen.append(os.path.relpath(where, root))

    sys.addaudithook(hook)
    return seen


def lose_node(state: TrainState) -> TrainState:
    if os.environ["LOCAL_RANK"] == "0":
        os.kill(os.getppid(), signal.SIGKILL)  # the agent: a machine going away takes it too
    return die(state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("results")
    parser.add_argument("seen")
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--lose-node-at", type=int)
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--own-group", action="store_true")
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    told = {key: os.environ.get(key) for key in ENV}
    record = {**told, "pid": os.getpid(), "agent": os.getppid()}
    Path(args.seen).mkdir(parents=True, exist_ok=True)
    (Path(args.seen) / f"{time.time_ns()}-{os.getpid()}.json").write_text(json.dumps(record))
    out = Path(args.out)
    wrote = watch_writes(out)

    timeout = datetime.timedelta(seconds=args.timeout)
    if args.own_group:
        torch.distributed.init_process_group("gloo", timeout=timeout)
    fl.distributed.setup(timeout=timeout)
    net = model()
    opt = optimizer()
    template = fl.init(net, opt, seed=0, max_iter=20)
    state = fl.checkpoint.resume(out / "ckpt", like=template)
    step = fl.train_step(net, loss_fn, opt, compile=False)
    stream = fl.data.batches(data(), batch_size=BATCH, seed=3)
    hooks = [
        fl.every(10, fl.hooks.checkpoint(out / "ckpt", keep=None)),
        fl.every(2, fl.hooks.check_replicas()),
    ]
    everyone = set(range(fl.distributed.world_size()))
    if args.die_at is not None:
        hooks.append(At(Phase.AFTER_STEP, args.die_at, everyone, die))
    if args.lose_node_at is not None and state.iteration == 0 and os.environ["GROUP_RANK"] == "1":
        hooks.append(At(Phase.AFTER_STEP, args.lose_node_at, everyone, lose_node))
    if args.crash_at is not None:
        hooks.append(At(Phase.AFTER_STEP, args.crash_at, {3}, kill_self))
    started = state.iteration
    final = fl.run(state, step, stream, hooks)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    result = {
        "params": final.params,
        "iteration": final.iteration,
        "started": started,
        "loss": [float(v) for _, v in final.metrics.history("loss")],
        "told": told,
        "agent": os.getppid(),
        "rank": fl.distributed.rank(),
        "world_size": fl.distributed.world_size(),
        "wrote": sorted(set(wrote)),
    }
    torch.save(result, results / f"rank{fl.distributed.rank()}.pt")
    torch.save(result, results / f"rank{fl.distributed.rank()}-from{started}.pt")
    leave(fl.distributed.rank())


if __name__ == "__main__":
    main()
