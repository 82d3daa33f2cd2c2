"""best_checkpoint(..., k=K): the K best states on disk, the same after a kill and a resume as straight."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest
import torch

import fnloop as fl
from fnloop.checkpoint import load, resume
from fnloop.hooks import Best, TopK

VALUES = [5.0, 3.0, 4.0, 1.0, 6.0, 2.0, 2.0, 0.5, 7.0, 1.5, 3.5, 0.25]
"""The metric recorded at each iteration; the top 3 (min) end as 0.25 @11, 0.5 @7, 1.0 @3."""


def step(state: fl.TrainState, batch: object) -> fl.TrainState:
    params = {"w": state.params["w"] + 1}
    return fl.record(attrs.evolve(state, params=params), val=VALUES[state.iteration])


def start() -> fl.TrainState:
    return fl.TrainState(max_iter=len(VALUES), params={"w": torch.zeros(2)})


def hooks(run: Path, k: int = 3, mode: str = "min") -> list:
    return [
        fl.hooks.best_checkpoint(run / "best", "val", mode, k=k),
        fl.every(4, fl.hooks.checkpoint(run / "ckpt", keep=None)),
    ]


def files(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "best").iterdir() if not p.name.startswith("."))


def test_the_k_best_states_are_kept_best_first_and_the_others_removed(tmp_path):
    final = fl.run(start(), step, [None] * len(VALUES), hooks(tmp_path))
    top = final.hooks["best:val"]
    assert top == TopK((0.25, 0.5, 1.0), (11, 7, 3))
    assert top.kept == (Best(0.25, 11), Best(0.5, 7), Best(1.0, 3))
    assert files(tmp_path) == [
        "best.safetensors",
        "top-00000004.safetensors",
        "top-00000008.safetensors",
        "top-00000012.safetensors",
    ]
    like = start()
    for iteration in (3, 7, 11):  # each file is the state after the step that recorded its value
        saved = load(tmp_path / "best" / f"top-{iteration + 1:08d}.safetensors", like=like)
        assert saved.iteration == iteration + 1 and saved.params["w"].tolist() == [iteration + 1.0] * 2
    assert load(tmp_path / "best" / "best.safetensors", like=like).iteration == 12


def test_max_mode_and_a_tie_with_the_kth_keeps_the_earlier(tmp_path):
    final = fl.run(start(), step, [None] * len(VALUES), hooks(tmp_path, k=4, mode="max"))
    assert final.hooks["best:val"] == TopK((7.0, 6.0, 5.0, 4.0), (8, 4, 0, 2))
    # 2.0 at 5 and at 6 (min): with k=4 both are kept, the earlier first; with k=2 the later ties the 2nd and is not
    seven = attrs.evolve(start(), max_iter=7)
    final = fl.run(seven, step, [None] * 7, hooks(tmp_path / "tie", k=4))
    assert final.hooks["best:val"] == TopK((1.0, 2.0, 2.0, 3.0), (3, 5, 6, 1))
    final = fl.run(seven, step, [None] * 7, hooks(tmp_path / "tie2", k=2))
    assert final.hooks["best:val"] == TopK((1.0, 2.0), (3, 5))


@pytest.mark.parametrize("stop", [5, 6, 9, 10])
def test_a_killed_run_resumed_keeps_the_same_k_best_as_the_straight_run(tmp_path, stop):
    straight = fl.run(start(), step, [None] * len(VALUES), hooks(tmp_path / "straight"))
    # A kill after `stop` steps: the run had written its top- files up to there, and its last
    # checkpoint is the one of iteration 4 or 8; what came after it is lost but the files.
    run = tmp_path / "killed"
    fl.run(attrs.evolve(start(), max_iter=stop), step, [None] * stop, hooks(run))
    os.remove(run / "ckpt" / f"ckpt-{stop:08d}.safetensors")  # the final save a kill never made
    resumed = attrs.evolve(
        resume(run / "ckpt", like=attrs.evolve(start(), max_iter=stop)), max_iter=len(VALUES)
    )
    assert resumed.iteration == stop // 4 * 4
    final = fl.run(resumed, step, [None] * (len(VALUES) - resumed.iteration), hooks(run))
    assert final.hooks["best:val"] == straight.hooks["best:val"]
    assert files(run) == files(tmp_path / "straight")
    for name in files(run):
        a = load(run / "best" / name, like=start())
        b = load(tmp_path / "straight" / "best" / name, like=start())
        assert a.iteration == b.iteration and torch.equal(a.params["w"], b.params["w"]), name


@pytest.mark.parametrize("k", [0, -1, 1.5, True, 10**6])
def test_k_is_checked_and_shown(k):
    # 10**6 was accepted, and its memory of the best put 42 MB into every checkpoint of a tiny model.
    with pytest.raises(ValueError, match=r"k must be an int from 1 to 1,000"):
        fl.hooks.best_checkpoint("somewhere", "val", k=k)
    hook = fl.hooks.best_checkpoint("somewhere", "val", k=2)
    assert "k=2" in repr(hook)


@pytest.mark.parametrize(("metric", "name"), [(5, None), ("", None), (None, None), ("loss", ""), ("loss", 5)])
def test_a_metric_that_is_no_name_or_an_empty_hook_name_is_refused_when_built(tmp_path, metric, name):
    with pytest.raises((TypeError, ValueError), match="best_checkpoint"):
        fl.hooks.best_checkpoint(tmp_path, metric, name=name)
