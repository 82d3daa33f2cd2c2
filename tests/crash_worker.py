"""A tiny deterministic training run that checkpoints and resumes, for the crash tests.

    python tests/crash_worker.py OUT MAX_ITER [--every N] [--pause-at I] [--record FILE]
    python tests/crash_worker.py --serve

It resumes from the newest checkpoint in ``OUT`` (``latest(OUT, like=template)
or template``) and trains to ``MAX_ITER``, saving with ``checkpoint(OUT,
keep=2)`` every ``N`` steps (default 1). The model is small but its
checkpoints are a few MB, so a save takes long enough for a kill to land in
the middle of one. ``--pause-at I`` blocks at ``AFTER_STEP`` of step ``I``
until a line arrives on stdin (so a test can signal it at a known moment);
``--record FILE`` writes the fingerprint of the state after every step to
``FILE`` (JSON, iteration -> digest) when the run ends.

``--serve`` pays for importing torch once: it reads such command lines
(``OUT MAX_ITER ...``) from stdin and runs each in a forked child, printing
``pid N`` when the child starts and ``exit CODE`` (``-9``: SIGKILL) when it
ends. ``tests/test_crash.py`` starts and kills some twenty runs that way, and
imports ``template`` and ``fingerprint`` from here, so the test and the worker
build the very same state.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import sys
import traceback
from typing import Any

import torch

import fnloop as fl
from fnloop import Phase, TrainState
from fnloop._core.tree import leaves

# 64 -> 384 -> 384 -> 10: ~0.18 M parameters, ~2 MB per checkpoint with AdamW's moments.
WIDTH = 384
BATCH = 16
ROWS = 256


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 10),
    )


def optimizer() -> fl.optim.Optimizer:
    return fl.optim.adamw(lr=fl.optim.warmup(fl.optim.cosine(1e-3, 1000), 20), weight_decay=0.01)


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 64, generator=generator)
    return x, torch.randint(0, 10, (ROWS,), generator=generator)


def loss_fn(forward: Any, batch: Any) -> Any:
    x, y = batch
    logits = forward(x)
    loss = torch.nn.functional.cross_entropy(logits, y)
    return loss, {"accuracy": (logits.argmax(-1) == y).float().mean()}


def template(max_iter: int) -> TrainState:
    """The state a fresh run starts from (and the ``like`` a resumed one loads into)."""
    return fl.init(model(), optimizer(), seed=7, max_iter=max_iter)


def fingerprint(state: TrainState) -> str:
    """A digest of every bit of ``state`` but its ``clock`` (the driver's) and ``effects``."""
    digest = hashlib.blake2b(digest_size=16)
    for path, leaf in leaves(state):
        if path.startswith(("state.clock.", "state.effects")):
            continue
        digest.update(path.encode())
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().cpu().contiguous()
            digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(f"{type(leaf).__name__}:{leaf!r}".encode())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("max_iter", type=int)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--pause-at", type=int, default=None)
    parser.add_argument("--record", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    net = model()
    step = fl.train_step(net, loss_fn, optimizer(), compile=False)
    like = template(args.max_iter)
    state = fl.checkpoint.latest(args.out, like=like) or like
    print(f"resuming at {state.iteration}", flush=True)

    prints: dict[int, str] = {}
    hooks: list[Any] = [fl.every(args.every, fl.hooks.checkpoint(args.out, keep=2))]
    if args.record:

        def record(state: TrainState, phase: Phase) -> TrainState:
            if phase is not Phase.AFTER_STEP:
                return state
            return fl.request(state, lambda s: prints.__setitem__(s.iteration, fingerprint(s)), "record")

        hooks.append(record)
    if args.pause_at is not None:
        pause_at = args.pause_at

        def pause(state: TrainState, phase: Phase) -> TrainState:
            if phase is not Phase.AFTER_STEP or state.iteration != pause_at:
                return state
            return fl.request(state, lambda s: (print("paused", flush=True), sys.stdin.readline()), "pause")

        hooks.append(pause)

    fl.run(state, step, fl.data.batches(dataset(), batch_size=BATCH, seed=3), hooks)
    if args.record:
        with open(args.record, "w") as file:
            json.dump(prints, file)


def serve() -> None:
    """Run each command line read from stdin in a forked child; report its pid and exit status."""
    print("ready", flush=True)
    while line := sys.stdin.readline():
        pid = os.fork()
        if pid == 0:  # the child: one training run, then out without running the server's code
            code = 1
            try:
                main(shlex.split(line))
                code = 0
            except SystemExit as exc:  # fnloop.Preempted included: 143
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # noqa: BLE001 - reported, then the child exits with 1
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main()
