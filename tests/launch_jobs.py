"""What the ranks of ``tests/test_launch.py`` run: importable functions, as ``fl.distributed.launch``'s spawn needs.

The run is ``tests/dist_worker.py``'s (an MLP of 6 -> 16 -> 3 with a warmed-up cosine AdamW, 64 fixed
rows, global batch 8), eager, with the data-parallel step or a ``shard="full"`` state; ``train`` runs it
in any process, so the test runs the one-process reference with the same code.
"""

from __future__ import annotations

import multiprocessing.util
import os
import signal
import time
from typing import Any

import torch

import fnloop as fl
from fnloop import Phase, TrainState

BATCH = 8
ROWS = 64
VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
)
"""The variables torchrun sets for each worker that the tests compare."""


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g)


def loss_fn(forward, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(forward(x), y)


class Fail:
    """A hook raising ``ValueError`` at ``BEFORE_STEP`` of step ``iteration`` on rank ``rank``."""

    def __init__(self, rank: int, iteration: int) -> None:
        self.rank, self.iteration = rank, iteration

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if (
            phase is Phase.BEFORE_STEP
            and state.iteration == self.iteration
            and fl.distributed.rank() == self.rank
        ):
            raise ValueError(f"injected failure at iteration {state.iteration}")
        return state


def train(
    *, shard: str | None = None, invariant: int | None = None, max_iter: int = 20, fail: Fail | None = None
) -> dict[str, Any]:
    """The run on this process (one, or a rank of several): its whole final parameters, losses and layout."""
    net = model()
    optimizer = fl.optim.adamw(lr=fl.optim.warmup(fl.optim.cosine(1e-2, 40), 4))
    state = fl.init(net, optimizer, seed=0, max_iter=max_iter, shard=shard)
    step = fl.train_step(net, loss_fn, optimizer, compile=False, invariant=invariant)
    final = fl.run(state, step, fl.data.batches(data(), batch_size=BATCH, seed=3), [fail])
    return {
        "params": {k: v.clone() for k, v in fl.state_dict(final).items()},
        "loss": [float(v) for _, v in final.metrics.history("loss")],
        "iteration": final.iteration,
        "shards": None if final.shards is None else (final.shards.world, final.shards.rank),
    }


def environment() -> dict[str, str | None]:
    """This process's launch variables, its rank and world size as fnloop sees them, and its threads."""
    seen: dict[str, Any] = {name: os.environ.get(name) for name in VARIABLES}
    seen["rank"], seen["world_size"] = fl.distributed.rank(), fl.distributed.world_size()
    seen["threads"] = torch.get_num_threads()
    return seen


def everything() -> dict[str, list[Any]]:
    """Every job of the shared launch, each rank's result gathered in rank order (``launch`` returns rank 0's)."""
    jobs = {
        "environment": environment(),
        "dp": train(),
        "dp-invariant": train(invariant=2),
        "full": train(shard="full"),
        "full-invariant": train(shard="full", invariant=2),
    }
    return {name: fl.distributed.gather_object(value) for name, value in jobs.items()}


def fail_in_run(rank: int, iteration: int) -> dict[str, Any]:
    """The data-parallel run for ever, rank ``rank`` raising before step ``iteration``."""
    return train(max_iter=100_000, fail=Fail(rank, iteration))


def killed(rank: int) -> None:
    """Rank ``rank`` is SIGKILLed once the group is joined; the others wait in a collective for it."""
    fl.distributed.setup()
    if fl.distributed.rank() == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    fl.distributed.gather_object(fl.distributed.rank())


def stubborn(seconds: float) -> None:
    """Rank 1 raises at once; rank 0 ignores SIGTERM and sleeps ``seconds``: it must be killed."""
    if int(os.environ["RANK"]) == 1:
        raise KeyError("rank 1 gives up")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(seconds)


def returns(value: Any, *, plus: int = 0) -> Any:
    """``value`` (with ``plus`` added on each rank), and which rank returned it."""
    return {"value": value + plus, "rank": int(os.environ["RANK"])}


def unpicklable() -> Any:
    """A value no pickle takes: a lambda."""
    return lambda: None


def fails_at_exit(rank: int) -> None:
    """Returns on every rank; rank ``rank``'s process then ends with code 3 as it exits."""
    if int(os.environ["RANK"]) == rank:
        multiprocessing.util.Finalize(None, os._exit, args=(3,), exitpriority=0)
