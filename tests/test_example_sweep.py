"""The sweep example: eight learning rates of the digits MLP in one population run, plotted."""

from __future__ import annotations

from pathlib import Path

import pytest

import fnloop as fl
from fnloop.examples import sweep

pytestmark = pytest.mark.slow


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
