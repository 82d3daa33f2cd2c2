"""Sweep eight learning rates in one run: a population of the digits MLP, plotted.

Run it with ``python -m fnloop.examples.sweep``. Eight members, each the digits
MLP of ``fnloop.examples.digits`` with its own seed and its own peak learning
rate (1e-4, 3e-4, ... 3e-1, injected into the optimizer's state), train
together in one compiled step; every member is evaluated on the validation split
in one call, each keeps its own best checkpoint, and the eight training curves
and validation accuracies are drawn into ``runs/sweep/sweep.png`` (matplotlib,
``pip install "fnloop[plot]"``). Walkthrough: ``docs/population.md``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

import fnloop as fl
from fnloop.examples.digits import BATCH_SIZE, accuracy, digits, loss_fn, mlp

MAX_ITER = 600
EVAL_EVERY = 50
LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)  # log-spaced


def optimizer(lr: float, max_iter: int) -> fl.optim.Optimizer:
    """AdamW on a cosine schedule whose peak, ``lr``, the state holds (so it differs by member)."""
    return fl.optim.inject(lambda lr: fl.optim.adamw(fl.optim.cosine(lr, max_iter)), lr=lr)


def member(seed: int, lr: float, max_iter: int = MAX_ITER) -> fl.TrainState:
    """One member's state: its own initial weights (from ``seed``) and learning rate."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = mlp()
    state = fl.init(model, optimizer(lr, max_iter), seed=seed, max_iter=max_iter)
    return attrs.evolve(state, metrics=fl.Metrics(window=max_iter))  # every value kept, for the plot


def job(
    out: str = "runs/sweep", max_iter: int = MAX_ITER, lrs: Sequence[float] = LRS, *, compile: bool = True
) -> tuple[fl.TrainState, fl.Step, fl.data.Batches, list[fl.Hook]]:
    """The sweep as data: the population's first state, the step, the batches and the hooks."""
    torch.set_num_threads(1)
    (x, y), val, _ = digits()
    population = fl.population(
        functools.partial(member, max_iter=max_iter), seeds=list(range(len(lrs))), lr=list(lrs)
    )
    step = fl.train_step(mlp(), loss_fn, optimizer(lrs[0], max_iter), compile=compile)
    batches = fl.data.batches((x, y), batch_size=BATCH_SIZE, seed=0)
    evaluation = fl.eval_step(mlp(), accuracy, compile=compile)
    validate = fl.hooks.mean_over(evaluation, [val], prefix="val_")
    hooks = [
        fl.every(EVAL_EVERY, fl.hooks.evaluate(validate)),
        fl.hooks.best_checkpoint(Path(out) / "best", "val_accuracy", mode="max"),
        fl.every(100, fl.hooks.log(fl.writers.jsonl(Path(out) / "metrics.jsonl"))),
    ]
    return population, step, batches, hooks


def plot(final: fl.TrainState, path: Path) -> None:
    """Each member's training loss (smoothed) and validation accuracy, one curve per member."""
    import matplotlib

    population = final.population
    assert population is not None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.get_cmap("viridis")(torch.linspace(0, 1, population.size).tolist())
    for m, label in enumerate(population.labels):
        metrics = fl.member(final, m).metrics
        losses = metrics.floats("loss")
        smooth = [statistics.fmean(losses[max(0, i - 19) : i + 1]) for i in range(len(losses))]
        left.plot([i for i, _ in metrics.history("loss")], smooth, color=colors[m], label=label)
        at = [i + 1 for i, _ in metrics.history("val_accuracy")]
        right.plot(at, metrics.floats("val_accuracy"), color=colors[m], marker="o", markersize=3, label=label)
    left.set(xlabel="step", ylabel="training loss (mean of 20 steps)", yscale="log", title="Training loss")
    right.set(xlabel="step", ylabel="validation accuracy", title="Validation accuracy", ylim=(0, 1))
    right.legend(fontsize=7, loc="lower right")
    figure.suptitle(f"Eight learning rates, one run: a population of {population.size} MLPs")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> fl.TrainState:
    parser = argparse.ArgumentParser(description="Sweep eight learning rates of the digits MLP in one run.")
    parser.add_argument("--out", default="runs/sweep")
    parser.add_argument("--max-iter", type=int, default=MAX_ITER)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    state, step, batches, hooks = job(args.out, args.max_iter, compile=not args.no_compile)
    final = fl.run(state, step, batches, hooks)
    best = final.hooks["best:val_accuracy"]
    print(f"{'member':<8} {'peak lr':>9} {'best val accuracy':>18} {'at step':>8}")
    for m, (lr, kept) in enumerate(zip(LRS, best)):
        print(f"{m:<8} {lr:>9.2e} {kept.value:>18.4f} {kept.iteration + 1:>8}")
    winner = max(range(len(best)), key=lambda m: (best[m].value, -m))
    print(
        f"best: member {winner}, lr={LRS[winner]:.2e}, saved in {Path(args.out) / 'best' / f'member-{winner}'}"
    )
    try:
        plot(final, Path(args.out) / "sweep.png")
        print(f"curves: {Path(args.out) / 'sweep.png'}")
    except ImportError:
        print('no plot: matplotlib is not installed (pip install "fnloop[plot]")', file=sys.stderr)
    return final


if __name__ == "__main__":
    main()
