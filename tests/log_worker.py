"""A training run that logs to a JSON lines file and checkpoints, for the log-after-a-kill test.

    python tests/log_worker.py OUT MAX_ITER --every K --log J
    python tests/log_worker.py --serve

It trains the model of ``tests/crash_worker.py`` (same state, same data),
resumes from ``latest(OUT, like=template) or template``, and runs with
``every(K, checkpoint(OUT, keep=2))`` followed by ``every(J, log(jsonl(OUT /
"metrics.jsonl")))``: the checkpoint comes first, so a kill can land between
a save and the write of the same phase. ``--serve`` is crash_worker's server
(one import of torch, one forked child per command line) running this
``main``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

import fnloop as fl

_spec = importlib.util.spec_from_file_location("crash_worker", Path(__file__).with_name("crash_worker.py"))
assert _spec is not None and _spec.loader is not None
crash_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_worker)

JSONL = "metrics.jsonl"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("max_iter", type=int)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--log", type=int, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    step = fl.train_step(crash_worker.model(), crash_worker.loss_fn, crash_worker.optimizer(), compile=False)
    like = crash_worker.template(args.max_iter)
    state = fl.checkpoint.latest(args.out, like=like) or like
    print(f"resuming at {state.iteration}", flush=True)
    hooks = [
        fl.every(args.every, fl.hooks.checkpoint(args.out, keep=2)),
        fl.every(args.log, fl.hooks.log(fl.writers.jsonl(Path(args.out) / JSONL))),
    ]
    batches = fl.data.batches(crash_worker.dataset(), batch_size=crash_worker.BATCH, seed=3)
    fl.run(state, step, batches, hooks)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        crash_worker.main = main  # the server runs whatever `main` its module holds
        crash_worker.serve()
    else:
        main()
