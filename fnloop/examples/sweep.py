"""Sweep eight learning rates in one run: a population of the digits MLP, plotted.

Run it with ``python -m fnloop.examples.sweep``. Eight members, each the digits
MLP of ``fnloop.examples.digits`` with its own seed and its own peak learning
rate (1e-4, 3e-4, ... 3e-1, injected into the optimizer's state), train
together in one compiled step; every member is evaluated on the validation split
in one call, each keeps its own best checkpoint, and the eight training curves
and validation accuracies are drawn into ``runs/sweep/sweep.png``, coloured
along viridis in the order of the learning rates, the best member marked
(matplotlib, ``pip install -e ".[plot]"`` from a checkout). Walkthrough: ``docs/population.md``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

import fnloop as fl
from fnloop.examples.digits import BATCH_SIZE, accuracy, digits, loss_fn, mlp

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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
        # On the console, a table of the members (fnloop.writers.format_line); every value in the file.
        fl.every(100, fl.hooks.log(fl.writers.console(), fl.writers.jsonl(Path(out) / "metrics.jsonl"))),
    ]
    return population, step, batches, hooks


def best_member(final: fl.TrainState) -> int:
    """The member with the highest validation accuracy it reached (the lower index on a tie)."""
    population = final.population
    assert population is not None
    peaks = [max(final.metrics.floats(f"val_accuracy/{m}")) for m in range(population.size)]
    return max(range(population.size), key=lambda m: (peaks[m], -m))


def figure(final: fl.TrainState) -> Figure:
    """Each member's training loss (smoothed) and validation accuracy, coloured by its learning rate.

    The colours run along viridis in the order of the members' peak learning
    rates (read from the state, on a log scale), with a colour bar; the best
    member (``best_member``) is drawn thicker, its best validation accuracy
    marked with a star.
    """
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    population = final.population
    assert population is not None
    lrs = final.opt_state.hyperparams["lr"].tolist()  # each member's peak, as the step used it
    best = best_member(final)
    colours = ScalarMappable(LogNorm(min(lrs), max(lrs)), "viridis")

    drawing = Figure(figsize=(11.5, 4.2), layout="constrained")
    left, right = drawing.subplots(1, 2)
    for m in sorted(range(population.size), key=lambda m: lrs[m]):
        metrics = fl.member(final, m).metrics
        colour = colours.to_rgba(lrs[m])
        width, z = (2.6, 3) if m == best else (1.2, 2)
        losses = metrics.floats("loss")
        smooth = [statistics.fmean(losses[max(0, i - 19) : i + 1]) for i in range(len(losses))]
        steps = [i for i, _ in metrics.history("loss")]
        left.plot(steps, smooth, color=colour, linewidth=width, zorder=z, label=population.labels[m])
        at = [i + 1 for i, _ in metrics.history("val_accuracy")]
        accuracies = metrics.floats("val_accuracy")
        right.plot(at, accuracies, color=colour, linewidth=width, zorder=z, marker="o", markersize=3)
        if m == best:
            peak = max(range(len(accuracies)), key=lambda i: (accuracies[i], -i))
            right.plot(
                at[peak],
                accuracies[peak],
                marker="*",
                markersize=16,
                color=colour,
                markeredgecolor="black",
                linestyle="none",
                zorder=4,
                clip_on=False,  # an accuracy of 1 sits on the frame
                label=f"best: member {m}, {population.labels[m]} ({accuracies[peak]:.3f})",
            )
    left.set(xlabel="step", ylabel="training loss (mean of 20 steps)", yscale="log", title="Training loss")
    right.set(xlabel="step", ylabel="validation accuracy", title="Validation accuracy", ylim=(0, 1))
    right.legend(fontsize=8, loc="lower right")
    drawing.colorbar(colours, ax=[left, right], label="peak learning rate")
    drawing.suptitle(f"{population.size} learning rates, one run: a population of {population.size} MLPs")
    return drawing


def plot(final: fl.TrainState, path: Path) -> None:
    """Save ``figure(final)`` to ``path`` (a PNG)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure(final).savefig(path, dpi=110)


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
    winner = best_member(final)
    print(
        f"best: member {winner}, lr={LRS[winner]:.2e}, saved in {Path(args.out) / 'best' / f'member-{winner}'}"
    )
    try:
        plot(final, Path(args.out) / "sweep.png")
        print(f"curves: {Path(args.out) / 'sweep.png'}")
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return final


if __name__ == "__main__":
    main()
