"""Train a small MLP on scikit-learn's handwritten digits: fnloop's main job.

Run it with ``python -m fnloop.examples.digits`` (``--help`` lists its
settings, which ``--config FILE``, TOML or YAML, and ``--key=value`` flags
set). It shows a progress bar on a
terminal, logs to the console, to ``runs/digits/metrics.jsonl`` and to
TensorBoard (``runs/digits/tb``), evaluates on a validation split, keeps the
best state in ``runs/digits/best`` and checkpoints into ``runs/digits/ckpt``;
run the same command again after a crash, a SIGTERM or a Ctrl-C and it resumes
from the newest checkpoint, ending exactly where an uninterrupted run ends.
Walkthrough: ``docs/example.md``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn import functional as F

import fnloop as fl

MAX_ITER = 1_500
BATCH_SIZE = 64
LR = 3e-3
WARMUP = 50
LOG_EVERY = 250
EVAL_EVERY = 250
CHECKPOINT_EVERY = 100
# The split does not follow --seed, so test accuracies of different seeds compare.
SPLIT_SEED = 0
N_TRAIN = 1_300
N_VAL = 200

Split = tuple[torch.Tensor, torch.Tensor]


@attrs.frozen
class Settings:
    """Train a small MLP on scikit-learn's handwritten digits (fnloop's main job)."""

    out: str = "runs/digits"
    """The run's directory; the same one resumes."""
    max_iter: int = MAX_ITER
    """Training steps; the learning rate schedule spans them."""
    seed: int = 0
    """Seeds the weights, data order and dropout."""
    checkpoint_every: int = CHECKPOINT_EVERY
    """Save every this many steps (and when the run ends)."""
    eval_every: int = EVAL_EVERY
    """Evaluate on the validation split every this many steps (and when the run ends)."""
    eager: bool = False
    """Do not compile the step (debugging)."""
    quiet: bool = False
    """No console lines or progress bar (the files are still written)."""


@functools.cache
def digits() -> tuple[Split, Split, Split]:
    """The digits as ``(train, validation, test)`` pairs ``(x, y)``: 1,300, 200 and 297 images, pixels in [0, 1]."""
    # Imported here, so importing this module needs no scikit-learn (pip install -e ".[examples]").
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)  # bundled with scikit-learn: no download
    x = torch.tensor(images, dtype=torch.float32) / 16.0  # 8x8 pixels of 0..16
    y = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    train, val, test = order[:N_TRAIN], order[N_TRAIN : N_TRAIN + N_VAL], order[N_TRAIN + N_VAL :]
    return (x[train], y[train]), (x[val], y[val]), (x[test], y[test])


def mlp() -> nn.Module:
    """64 pixels -> 128 hidden units -> 10 classes, with dropout."""
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))


def loss_fn(forward: Any, batch: Split) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy, plus the batch accuracy as a metric (a tensor: the compiled step never syncs)."""
    x, y = batch
    logits = forward(x)
    return F.cross_entropy(logits, y), {"accuracy": (logits.argmax(1) == y).float().mean()}


def accuracy(forward: Any, batch: Split) -> dict[str, torch.Tensor]:
    """The share of ``batch`` classified right, and its mean cross-entropy."""
    x, y = batch
    logits = forward(x)
    return {"accuracy": (logits.argmax(1) == y).float().mean(), "loss": F.cross_entropy(logits, y)}


def job(
    out: str = "runs/digits",
    seed: int = 0,
    max_iter: int = MAX_ITER,
    *,
    checkpoint_every: int = CHECKPOINT_EVERY,
    eval_every: int = EVAL_EVERY,
    compile: bool = True,
    quiet: bool = False,
) -> tuple[fl.TrainState, fl.Step, fl.data.Batches, list[fl.Hook | None]]:
    """The run, as data: its first state, its step, its batches and its hooks.

    ``main`` runs it; tools (a replay, a test) rebuild the very same run from it.
    It sets torch to one thread (``torch.set_num_threads(1)``), as part of the run.

    Args:
        out: the run's directory: checkpoints go to ``out/ckpt``, the best
            state to ``out/best``, logs to ``out/metrics.jsonl`` and ``out/tb``.
        seed: seeds the initial weights, the data order and dropout.
        max_iter: how many steps; the learning rate schedule spans them.
        checkpoint_every: save every this many steps (and when the run ends).
        eval_every: evaluate on the validation split every this many steps
            (and when the run ends).
        compile: compile the step (``False`` runs it eagerly, for debugging).
        quiet: no console lines and no progress bar (the files are still written).

    Returns:
        ``(state, step, batches, hooks)``, ready for ``fl.run``; ``state`` is
        also the template to load checkpoints into.

    Examples:
        >>> state, step, batches, hooks = job(max_iter=3, compile=False)
        >>> fl.run(state, step, batches).iteration  # no hooks: nothing printed, evaluated or saved
        3
    """
    # Layers this small gain nothing from a second thread, which on a busy machine only spins
    # waiting; and the bits of a run depend on the thread count, so it is part of the run.
    torch.set_num_threads(1)
    (x, y), val, _ = digits()
    # The initial weights are a function of the seed; the caller's global RNG is left alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = mlp()
    optimizer = fl.optim.adamw(fl.optim.warmup(fl.optim.cosine(LR, max_iter), WARMUP))
    # The settings go into every checkpoint: fnloop inspect shows them, resume names what changed.
    # Where the run writes and whether it prints are no part of it: the same run in two directories
    # is the same state (a resume check compares such runs).
    settings = attrs.asdict(Settings(out, max_iter, seed, checkpoint_every, eval_every, not compile, quiet))
    settings = {k: v for k, v in settings.items() if k not in ("out", "quiet")}
    state = fl.init(model, optimizer, seed=seed, max_iter=max_iter, config=settings)
    step = fl.train_step(model, loss_fn, optimizer, compile=compile)
    # Endless and resumable: its position is state.data, saved with every checkpoint.
    batches = fl.data.batches((x, y), batch_size=BATCH_SIZE, seed=seed)
    # Evaluation is a forward over 200 images every few hundred steps: compiling it would cost more
    # than it saves. mean_over weighs each batch by its size; the names get a "val_" prefix.
    validate = fl.hooks.mean_over(fl.eval_step(model, accuracy, compile=False), [val], prefix="val_")
    run = Path(out)
    writers: list[fl.writers.Writer] = [
        fl.writers.jsonl(run / "metrics.jsonl"),
        fl.writers.tensorboard(run / "tb"),
    ]
    if not quiet:
        writers.append(fl.writers.console())
    hooks = [
        fl.hooks.timer(),
        None if quiet else fl.hooks.model_summary(model),  # parameters per block, logged at the start
        None if quiet else fl.hooks.progress(),  # drawn only when stderr is a terminal
        fl.every(eval_every, fl.hooks.evaluate(validate)),
        fl.hooks.best_checkpoint(run / "best", "val_accuracy", mode="max"),
        # Before the checkpoint: a kill between the two leaves a line the resumed run cuts back.
        fl.every(LOG_EVERY, fl.hooks.log(*writers)),
        fl.every(checkpoint_every, fl.hooks.checkpoint(run / "ckpt", keep=3)),
    ]
    return state, step, batches, hooks


def evaluate(state: fl.TrainState) -> float:
    """The accuracy of ``state``'s parameters on the test split."""
    _, _, test = digits()
    # One call per run: compiling it would cost more than it saves.
    return float(fl.eval_step(mlp(), accuracy, compile=False)(state, test)["accuracy"])


def main(argv: Sequence[str] | None = None) -> None:
    """Train (or resume), then print ``test accuracy: 0.xxxx``."""
    # --config FILE (TOML or YAML) and --key=value flags; --help lists the settings (docs/config.md).
    args = fl.config.parse(Settings, argv, prog="python -m fnloop.examples.digits")
    template, step, batches, hooks = job(
        args.out,
        args.seed,
        args.max_iter,
        checkpoint_every=args.checkpoint_every,
        eval_every=args.eval_every,
        compile=not args.eager,
        quiet=args.quiet,
    )
    ckpt = Path(args.out) / "ckpt"
    # The template is built by the same code as the saved run: loading checks every entry against it.
    # Another --max-iter extends (or shortens) the run, with a warning; another --seed is another run.
    try:
        state = fl.checkpoint.resume(ckpt, like=template)
    except fl.checkpoint.CheckpointMismatch as exc:
        sys.exit(
            f"cannot resume: {exc}\nOn this command line: resume it with the --seed it was run with (and a "
            "--max-iter of at least its iteration), or start a new run with another --out."
        )
    if state is template:
        say(f"started fresh: checkpoints go to {ckpt}")
    else:
        say(f"resumed from iteration {state.iteration} ({ckpt})")

    try:
        final = fl.run(state, step, batches, hooks)
    except (fl.Preempted, KeyboardInterrupt) as stop:
        # SIGTERM or Ctrl-C: run() finished the current step and let the checkpoint hook save it.
        # (A third Ctrl-C stops mid-step: then no state is left to save; the last checkpoint stands.)
        ended = getattr(stop, "state", None)
        where = (
            f"at iteration {ended.iteration}, saved"
            if ended is not None
            else "mid-step; resume from the last checkpoint"
        )
        say(f"stopped {where} in {ckpt}: run the same command to resume", file=sys.stderr)
        sys.exit(stop.code if isinstance(stop, fl.Preempted) else 130)  # 128 + signal, as a shell reports
    best = final.hooks["best:val_accuracy"]
    say(f"best validation accuracy: {best.value:.4f} at iteration {best.iteration + 1} ({args.out}/best)")
    say(f"test accuracy: {evaluate(final):.4f}")


def say(*args: object, **kwargs: Any) -> None:
    """``print``, on rank 0 alone under ``torchrun`` (every rank holds the same state)."""
    if fl.distributed.is_main():
        print(*args, **kwargs)


if __name__ == "__main__":
    main()
