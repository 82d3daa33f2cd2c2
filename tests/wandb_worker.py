"""A training run that logs to ``fnloop.writers.wandb`` and checkpoints, for the W&B tests' other processes.

    python tests/wandb_worker.py OUT --record CALLS [--kill N] [--hold N] [--name NAME]

Unless ``--real`` is given, ``wandb`` is a recorded double put into
``sys.modules`` before the run: each call the writer makes (``wandb.init``,
``Run.log``, ``Run.finish``) is appended to the JSON lines file ``CALLS`` with
this process's id, and flushed, so a SIGKILL loses none. The run resumes from
``OUT/ckpt`` (``fl.checkpoint.resume``), logs every 2 iterations into the W&B
directory ``OUT``, checkpoints every 4, and with ``--kill N`` kills itself
with SIGKILL after step ``N``; with ``--hold N`` it prints ``holding`` after
step ``N`` and waits for a line on stdin.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import types
from typing import Any

import fnloop as fl


def double(record: str) -> types.ModuleType:
    """A ``wandb`` module that records every call the writer makes into the file ``record``."""
    module = types.ModuleType("wandb")
    module.__version__ = "0.31.0"  # type: ignore[attr-defined]

    def note(**entry: Any) -> None:
        with open(record, "a", encoding="utf-8") as file:
            file.write(json.dumps({"pid": os.getpid(), **entry}) + "\n")

    class Run:
        def __init__(self, run_id: str) -> None:
            self.id = run_id

        def log(self, data: dict[str, float], step: int | None = None, commit: bool | None = None) -> None:
            note(call="log", id=self.id, data=data, step=step, commit=commit)

        def finish(self, exit_code: int | None = None) -> None:
            note(call="finish", id=self.id, exit_code=exit_code)

    def init(**options: Any) -> Run:
        note(call="init", **options)
        return Run(options.get("id") or f"random-{os.getpid()}")

    module.init = init  # type: ignore[attr-defined]
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--record", required=True)
    parser.add_argument("--real", action="store_true")
    parser.add_argument("--kill", type=int, default=-1)
    parser.add_argument("--hold", type=int, default=-1)
    parser.add_argument("--name", default="run")
    args = parser.parse_args()
    if not args.real:
        sys.modules["wandb"] = double(args.record)

    def step(state: fl.TrainState, batch: object) -> fl.TrainState:
        state = fl.record(state, loss=1.0 / (state.iteration + 1))
        return fl.record(state, val=float(state.iteration)) if state.iteration % 4 == 3 else state

    def stop(state: fl.TrainState, phase: fl.Phase) -> fl.TrainState:
        if phase is fl.Phase.AFTER_STEP and state.iteration == args.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        if phase is fl.Phase.AFTER_STEP and state.iteration == args.hold:
            print("holding", flush=True)
            sys.stdin.readline()
        return state

    writer = fl.writers.wandb("exp", name=args.name, dir=args.out, config={"lr": 0.1})
    ckpt = os.path.join(args.out, "ckpt")
    state = fl.checkpoint.resume(ckpt, like=fl.TrainState(max_iter=12))
    hooks = [fl.every(2, fl.hooks.log(writer)), fl.every(4, fl.hooks.checkpoint(ckpt)), stop]
    fl.run(state, step, fl.data.resumable([None] * 12), hooks)


if __name__ == "__main__":
    main()
