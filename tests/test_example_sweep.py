"""The sweep example: eight learning rates of the digits MLP in one population run, plotted."""

from __future__ import annotations

import functools
from pathlib import Path

import attrs
import pytest

import fnloop as fl
from fnloop.examples import sweep


def test_the_sweep_trains_eight_members_keeps_each_best_and_draws_the_curves(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    final = sweep.main(["--out", str(tmp_path), "--max-iter", "100"])
    assert final.population is not None and final.population.size == 8 and final.iteration == 100
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "best: member" in printed and printed.count("e-0") >= 8
    for m in range(8):
        best = fl.load(
            tmp_path / "best" / f"member-{m}" / "best.safetensors", like=sweep.member(m, sweep.LRS[m], 100)
        )
        assert best.population is None and best.opt_state.hyperparams["lr"].item() == sweep.LRS[m]
    # The members differ: their learning rates span three orders of magnitude.
    accuracies = [b.value for b in final.hooks["best:val_accuracy"]]
    assert max(accuracies) > 0.9 and min(accuracies) < max(accuracies)


# -- the plot, from a population whose curves are made up ----------------------------------------------

LRS = (1e-2, 1e-4, 1e-1, 1e-3)
"""Not in order: the colours must follow the values, not the members' indices."""

PEAKS = (0.9, 0.5, 0.7, 0.8)
"""Each member's best validation accuracy: member 0 (lr 1e-2) is the best."""


def finished() -> fl.TrainState:
    population = fl.population(functools.partial(sweep.member, max_iter=10), seeds=[0, 1, 2, 3], lr=list(LRS))
    metrics = population.metrics
    for i in range(10):
        metrics = metrics.record(i, {f"loss/{m}": 2.0 / (1 + i * (m + 1)) for m in range(4)})
    for i, share in ((4, 0.5), (9, 1.0)):
        metrics = metrics.record(i, {f"val_accuracy/{m}": PEAKS[m] * share for m in range(4)})
    return attrs.evolve(population, iteration=10, metrics=metrics)


def luminance(rgba: tuple[float, ...]) -> float:
    red, green, blue = rgba[:3]
    return 0.2126 * red + 0.7152 * green + 0.0722 * blue


def test_the_plot_colours_the_members_in_the_order_of_their_learning_rates_and_marks_the_best():
    matplotlib = pytest.importorskip("matplotlib")
    from matplotlib.colors import to_rgba

    final = finished()
    assert final.population is not None and sweep.best_member(final) == 0
    labels = final.population.labels
    drawing = sweep.figure(final)
    left, right, bar = drawing.axes
    curves = {str(line.get_label()): line for line in left.get_lines()}
    assert sorted(curves) == sorted(labels)
    # viridis grows lighter from its low end to its high end: lighter colour, higher learning rate.
    by_lr = sorted(range(4), key=lambda m: LRS[m])
    shades = [luminance(to_rgba(curves[labels[m]].get_color())) for m in by_lr]
    assert shades == sorted(shades) and len(set(shades)) == 4
    assert to_rgba(curves["lr=0.0001"].get_color()) == matplotlib.colormaps["viridis"](0.0)
    assert to_rgba(curves["lr=0.1"].get_color()) == matplotlib.colormaps["viridis"](1.0)
    # The best member: the thickest curve, and one star at its best validation accuracy.
    widths = {label: line.get_linewidth() for label, line in curves.items()}
    assert (
        max(widths, key=widths.__getitem__) == "lr=0.01" and sorted(widths.values())[-2] < widths["lr=0.01"]
    )
    (star,) = [line for line in right.get_lines() if line.get_marker() == "*"]
    assert star.get_xydata().tolist() == [[10, 0.9]]  # type: ignore[union-attr]
    assert star.get_label() == "best: member 0, lr=0.01 (0.900)"
    legend = right.get_legend()
    assert legend is not None and [t.get_text() for t in legend.get_texts()] == [star.get_label()]
    # The colour bar reads the learning rates, on a log scale from the lowest to the highest.
    assert bar.get_ylabel() == "peak learning rate" and bar.get_yscale() == "log"
    assert bar.get_ylim() == pytest.approx((1e-4, 1e-1))


def test_plot_writes_the_figure_as_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    sweep.plot(finished(), tmp_path / "deep" / "sweep.png")
    assert (tmp_path / "deep" / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
