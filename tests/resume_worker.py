"""Jobs for ``fnloop.replay.check_resume`` (``tests/test_resume_check.py``): one that resumes exactly,
the examples, and one per planted defect.

Each is ``job(directory) -> (state, step, batches, hooks)``, resuming from ``directory / "ckpt"`` as a
training script does, every file under ``directory``. The check imports them in fresh processes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fnloop as fl
from fnloop.examples import digits, lm

MAX_ITER = 12
EVERY = 4


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 3))


def _loss(forward: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(forward(x), y)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)


def _job(
    directory: Path,
    *,
    lr: Any = 1e-2,
    batches: Any = None,
    extra: tuple = (),
    resume: bool = True,
    per_call: int = 1,
) -> tuple:
    torch.set_num_threads(1)
    net = _net()
    opt = fl.optim.chain(fl.optim.clip_by_global_norm(1.0), fl.optim.adamw(lr))
    state = fl.init(net, opt, seed=0, max_iter=MAX_ITER)
    if resume:
        state = fl.checkpoint.resume(directory / "ckpt", like=state)
    step = fl.train_step(net, _loss, opt, compile=False, steps_per_call=per_call)
    if batches is None:
        batches = fl.data.batches(_data(), batch_size=8, seed=0)
    hooks = [
        *extra,
        fl.every(
            2,
            fl.hooks.log(
                fl.writers.jsonl(directory / "metrics.jsonl"), fl.writers.csv(directory / "metrics.csv")
            ),
        ),
        fl.every(EVERY, fl.hooks.checkpoint(directory / "ckpt", keep=None)),
    ]
    return state, step, batches, hooks


def good(directory: Path) -> tuple:
    """Dropout, clipping, AdamW, the data stream, JSON lines and CSV logs: resumes exactly."""
    return _job(directory)


def several(directory: Path) -> tuple:
    """``good``, two steps per call."""
    return _job(directory, per_call=2)


def no_resume(directory: Path) -> tuple:
    """The script forgot ``fl.checkpoint.resume``: run again, it starts over."""
    return _job(directory, resume=False)


# -- planted defects ---------------------------------------------------------------------------------


def closure(directory: Path) -> tuple:
    """A hook keeping a running mean of the loss in a closure: a resumed run starts it over."""
    kept = {"mean": 0.0, "n": 0}

    def running_mean(state: fl.TrainState, phase: fl.Phase) -> fl.TrainState:
        if phase is not fl.Phase.AFTER_STEP:
            return state
        kept["n"] += 1
        kept["mean"] += (float(state.metrics.latest("loss")[1]) - kept["mean"]) / kept["n"]
        return fl.record(state, loss_mean=kept["mean"])

    return _job(directory, extra=(running_mean,))


def restarts(directory: Path) -> tuple:
    """Batches as a plain list: a resumed run takes them from the first again."""
    x, y = _data()
    return _job(directory, batches=[(x[i : i + 8], y[i : i + 8]) for i in range(0, 96, 8)])


STARTED = time.time()


def _by_the_clock(iteration: torch.Tensor) -> torch.Tensor:
    """A warmup over the first seconds of the process, not the first steps."""
    return torch.tensor(1e-2 * min(1.0, (time.time() - STARTED) / 30.0), dtype=torch.float64)


def wall_clock(directory: Path) -> tuple:
    """A learning-rate schedule read from the wall clock."""
    return _job(directory, lr=_by_the_clock)


class Appends:
    """A writer appending each line to its file, never cutting back what a resumed run writes again."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def start(self, iteration: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, line: Any) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps({"iteration": line.iteration, **line.values()}) + "\n")

    def close(self) -> None:
        pass


def duplicates(directory: Path) -> tuple:
    """A writer that appends without cutting back: a resumed run's lines come twice."""
    state, step, batches, hooks = _job(directory)
    return (
        state,
        step,
        batches,
        [fl.every(2, fl.hooks.log(Appends(directory / "appended.jsonl"), name="appended")), *hooks],
    )


# -- the examples ------------------------------------------------------------------------------------


def digits_job(directory: Path) -> tuple:
    """The digits example, 60 steps, checkpoints every 20, as its ``main`` resumes it."""
    state, step, batches, hooks = digits.job(
        str(directory), max_iter=60, checkpoint_every=20, eval_every=20, compile=False, quiet=True
    )
    return fl.checkpoint.resume(directory / "ckpt", like=state), step, batches, hooks


def lm_job(directory: Path) -> tuple:
    """The GPT-2 example, 12 steps, checkpoints every 4, as its ``main`` resumes it."""
    state, step, batches, hooks, _ = lm.job(
        str(directory), max_iter=12, checkpoint_every=4, eval_every=6, compile=False, quiet=True
    )
    return fl.checkpoint.resume(directory / "ckpt", like=state), step, batches, hooks
