"""A tiny data-parallel run for the torchrun tests; the same script on one process or several.

    torchrun --standalone --nproc_per_node=2 tests/dist_worker.py OUT RESULTS [options] [--then OUT RESULTS [options] ...]
    python tests/dist_worker.py OUT RESULTS [options] [--then ...]

``--then`` runs another job in the same processes once the one before ended (one launch, several
runs).

It resumes from ``OUT/ckpt`` (``fl.checkpoint.resume``), trains a small MLP
with a schedule on fixed data (global batch 8), checkpoints and logs into
``OUT`` (rank 0 alone performs effects), and when the run ends each rank
saves what the test compares into ``RESULTS/rank{r}.pt`` (params, iteration,
number of compiled graphs): outside ``OUT``, so that the test can check that
only rank 0 wrote there.

Options:
    --max-iter N       steps in all (default 20)
    --die-at I         every rank ends its process at once (os._exit) after step I: a kill
    --raise-at I       rank --raise-rank raises at BEFORE_STEP of step I
    --raise-rank R     (default 1)
    --sigterm-at I     rank 0 sends SIGTERM to its launcher at AFTER_STEP of step I (a preemption), and
                       waits there until the forwarded signal reaches it
    --sigterm-self R:I rank R sends SIGTERM to itself at AFTER_STEP of step I (repeatable)
    --sigkill-self R:I rank R sends SIGKILL to itself at AFTER_STEP of step I, in the launcher's first
                       attempt only (TORCHELASTIC_RESTART_COUNT 0): a crash that torchrun restarts
    --drift-at I       rank 1 nudges one weight at BEFORE_STEP of step I (replicas then differ)
    --steps-per-call K train_step(..., steps_per_call=K); the hooks then run every 2K steps (every K
                       for check_replicas) instead of every 5 (2)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import torch
from worker_exit import jobs, leave

import fnloop as fl
from fnloop import Phase, TrainState

BATCH = 8
ROWS = 64


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g)


def loss_fn(forward, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(forward(x), y)


def optimizer() -> fl.optim.Optimizer:
    return fl.optim.adamw(lr=fl.optim.warmup(fl.optim.cosine(1e-2, 40), 4))


class At:
    """A hook doing ``action`` once, at ``phase`` of step ``iteration``, on ``ranks``."""

    def __init__(self, phase: Phase, iteration: int, ranks: set[int], action) -> None:
        self.phase, self.iteration, self.ranks, self.action = phase, iteration, ranks, action

    def __call__(self, state: TrainState, phase: Phase) -> TrainState:
        if phase is self.phase and state.iteration == self.iteration and fl.distributed.rank() in self.ranks:
            return self.action(state)
        return state


def die(state: TrainState) -> TrainState:
    sys.stdout.flush()
    os._exit(9)


def fail(state: TrainState) -> TrainState:
    raise RuntimeError(f"injected failure at iteration {state.iteration}")


def preempt(state: TrainState) -> TrainState:
    # Wait (up to 60 s) until the launcher's forwarded SIGTERM reaches this rank, so the run stops
    # within a step of here however slow the machine: otherwise, on a loaded day, the steps run on
    # while torchrun forwards it, and the periodic checkpoint of step 10 lands before the stop.
    arrived: list[int] = []
    handler = signal.getsignal(signal.SIGTERM)

    def noting(signum: int, frame: FrameType | None) -> None:
        arrived.append(signum)
        if callable(handler):
            handler(signum, frame)

    signal.signal(signal.SIGTERM, noting)
    os.kill(os.getppid(), signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not arrived and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


def terminate_self(state: TrainState) -> TrainState:
    os.kill(os.getpid(), signal.SIGTERM)
    return state


def kill_self(state: TrainState) -> TrainState:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return state


def drift(state: TrainState) -> TrainState:
    params = dict(state.params)
    params["0.weight"] = params["0.weight"] + 1e-3
    return fl.TrainState(**{**state.__dict__, "params": params})


def main() -> None:
    # ``--then OUT RESULTS [options]`` runs another job in the same processes once the one before ended.
    torch.set_num_threads(1)
    for job in jobs(sys.argv[1:]):
        run(job)
    leave(fl.distributed.rank())


def run(argv: list[str]) -> None:
    """One job: train as ``argv`` says, into its OUT, and write what the tests compare into its RESULTS."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("results")
    parser.add_argument("--max-iter", type=int, default=20)
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--raise-at", type=int)
    parser.add_argument("--raise-rank", type=int, default=1)
    parser.add_argument("--sigterm-at", type=int)
    parser.add_argument("--sigterm-self", action="append", default=[])
    parser.add_argument("--sigkill-self", action="append", default=[])
    parser.add_argument("--drift-at", type=int)
    parser.add_argument("--steps-per-call", type=int, default=1)
    args = parser.parse_args(argv)

    net = model()
    opt = optimizer()
    template = fl.init(net, opt, seed=0, max_iter=args.max_iter)
    state = fl.checkpoint.resume(f"{args.out}/ckpt", like=template)
    k = args.steps_per_call
    step = fl.train_step(net, loss_fn, opt, steps_per_call=k)
    stream = fl.data.batches(data(), batch_size=BATCH, seed=3)
    period, check = (5, 2) if k == 1 else (2 * k, k)
    hooks = [
        fl.every(period, fl.hooks.checkpoint(f"{args.out}/ckpt", keep=None)),
        fl.every(period, fl.hooks.log(fl.writers.jsonl(f"{args.out}/metrics.jsonl"))),
        fl.every(check, fl.hooks.check_replicas()),
    ]
    if args.die_at is not None:
        hooks.append(At(Phase.AFTER_STEP, args.die_at, {0, 1}, die))
    if args.raise_at is not None:
        hooks.append(At(Phase.BEFORE_STEP, args.raise_at, {args.raise_rank}, fail))
    if args.sigterm_at is not None:
        hooks.append(At(Phase.AFTER_STEP, args.sigterm_at, {0}, preempt))
    for spec in args.sigterm_self:
        who, at = map(int, spec.split(":"))
        hooks.append(At(Phase.AFTER_STEP, at, {who}, terminate_self))
    for spec in args.sigkill_self:
        who, at = map(int, spec.split(":"))
        hooks.append(At(Phase.AFTER_STEP, at, {who}, kill_self))
    if args.drift_at is not None:
        hooks.insert(0, At(Phase.BEFORE_STEP, args.drift_at, {1}, drift))
    final = fl.run(state, step, stream, hooks)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "params": final.params,
            "iteration": final.iteration,
            "compiles": step.compiles,
            "loop_graphs": 0 if step.multi is None else step.multi.compiles,  # several steps per call
            "world_size": fl.distributed.world_size(),
            "loss": [float(v) for _, v in final.metrics.history("loss")],
        },
        results / f"rank{fl.distributed.rank()}.pt",
    )


if __name__ == "__main__":
    main()
