"""Check a job's resume: a ``transformers`` GPT-2 that resumes exactly, and the same job with a leak.

Run it with ``python -m fnloop.examples.resume_check [DIR]`` (``pip install -e
".[examples]"`` from a checkout: it needs ``transformers``). It runs
``fnloop.replay.check_resume`` on two jobs and prints both reports:

* ``job``: GPT-2 from a tiny config at the library's defaults (dropout 0.1),
  AdamW behind global-norm clipping, a warmup and cosine schedule, the data
  stream, JSON lines and checkpoints every 4 steps: it resumes exactly;
* ``leaky``: the same job with a hook that keeps an exponential average of the
  loss in a closure, outside the state: a resumed run starts it over, and the
  check says where.

Each is what ``check_resume`` takes: ``job(directory) -> (state, step,
batches, hooks)``, built as a training script builds its run, the resume from
``directory / "ckpt"`` included. Walkthrough: ``docs/replay.md``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import fnloop as fl

MAX_ITER = 12
EVERY = 4


def gpt2() -> Any:
    """A GPT-2 of 2 layers, 64 wide, over 256 tokens: ``transformers``' defaults except its size."""
    from transformers import GPT2Config, GPT2LMHeadModel  # pip install -e ".[examples]"

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4))


def loss_fn(forward: Any, batch: tuple[torch.Tensor]) -> torch.Tensor:
    (ids,) = batch
    return forward(input_ids=ids, labels=ids).loss


def job(directory: Path, extra: tuple[fl.Hook, ...] = ()) -> tuple[fl.TrainState, fl.Step, Any, list[Any]]:
    """The run, resumed from ``directory / "ckpt"`` if it has a checkpoint; every file under ``directory``."""
    torch.set_num_threads(1)  # the bits of a run depend on the thread count: it is part of the run
    model = gpt2()
    schedule = fl.optim.warmup(fl.optim.cosine(1e-3, MAX_ITER), 3)
    optimizer = fl.optim.chain(fl.optim.clip_by_global_norm(1.0), fl.optim.adamw(schedule))
    state = fl.init(model, optimizer, seed=0, max_iter=MAX_ITER)
    state = fl.checkpoint.resume(directory / "ckpt", like=state)
    step = fl.train_step(model, loss_fn, optimizer, compile=False)
    tokens = torch.randint(0, 256, (64, 32), generator=torch.Generator().manual_seed(1))
    batches = fl.data.batches((tokens,), batch_size=8, seed=0)
    hooks = [
        *extra,
        fl.every(2, fl.hooks.log(fl.writers.jsonl(directory / "metrics.jsonl"))),
        fl.every(EVERY, fl.hooks.checkpoint(directory / "ckpt", keep=2)),
    ]
    return state, step, batches, hooks


def leaky(directory: Path) -> tuple[fl.TrainState, fl.Step, Any, list[Any]]:
    """``job`` with a hook whose memory is a closure's: the defect the check is for."""
    average = [0.0]

    def smoothed_loss(state: fl.TrainState, phase: fl.Phase) -> fl.TrainState:
        if phase is not fl.Phase.AFTER_STEP:
            return state
        average[0] = 0.9 * average[0] + 0.1 * float(state.metrics.latest("loss")[1])
        return fl.record(state, smoothed_loss=average[0])

    return job(directory, extra=(smoothed_loss,))


def main(argv: list[str] | None = None) -> int:
    """Check both jobs, under ``DIR`` (default: a temporary directory); print the reports."""
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="resume-check-"))
    exact = fl.replay.check_resume(job, root / "job")
    print(exact, end="\n\n")
    leaking = fl.replay.check_resume(leaky, root / "leaky", how=["kill"])
    print(leaking)
    return 0 if exact.identical and not leaking.identical else 1


if __name__ == "__main__":
    sys.exit(main())
