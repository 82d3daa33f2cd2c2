"""The checkpoint hooks, in process: what they save, when, where, and what survives a resume."""

from __future__ import annotations

import contextlib
import itertools
import math

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import Phase, TrainState, checkpoint, testing
from fnloop.hooks import Best, best_checkpoint


def names(directory) -> list[int]:
    return [int(p.stem.removeprefix("ckpt-")) for p in checkpoint.checkpoints(directory)]


def moving(state, batch):
    """A step that changes params, records a metric and keeps the batch in ``extra``."""
    w = state.params["w"] + batch.sum()
    return fl.record(attrs.evolve(state, params={"w": w}), x=float(state.iteration))


def start(max_iter: int) -> TrainState:
    return TrainState(max_iter=max_iter, params={"w": torch.zeros(3)})


DATA = torch.arange(12.0).reshape(4, 3)


def stream():
    return fl.data.batches(DATA, batch_size=1, seed=0)


def zero() -> float:
    return 0.0


# -- when and what -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("keep", "left"), [(1, [6]), (2, [6, 5]), (None, [6, 5, 4, 3, 2, 1])])
def test_keep_prunes_all_but_the_newest(tmp_path, keep, left):
    fl.run(start(6), moving, stream(), [fl.hooks.checkpoint(tmp_path, keep=keep)])
    assert names(tmp_path) == left


def test_pruning_leaves_other_files_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    fl.run(
        start(4),
        moving,
        stream(),
        [fl.hooks.checkpoint(tmp_path, keep=1), best_checkpoint(tmp_path, "x", "max")],
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".fnloop.lock",
        "best.safetensors",
        "ckpt-00000004.safetensors",
        "notes.txt",
    ]


def test_the_checkpoint_of_step_i_holds_iteration_i_plus_1_and_resumes_there(tmp_path):
    hooks = [fl.every(3, fl.hooks.checkpoint(tmp_path, keep=None))]
    yielded = list(fl.scan(start(7), moving, stream(), hooks, clock=zero))
    assert names(tmp_path) == [7, 6, 3]  # steps 2 and 5, then the end of the run
    three = checkpoint.load(checkpoint.path_for(tmp_path, 3), like=start(7))
    assert (three.iteration, three.data, three.metrics.latest("x")) == (3, 3, (2, 2.0))
    testing.assert_identical(three, yielded[2])  # the state after step 2, which step 3 starts from
    resumed = fl.run(three, moving, stream(), clock=zero)
    testing.assert_identical(resumed, yielded[-1])


@pytest.mark.parametrize("position", ["first", "last"])
def test_what_is_saved_is_the_state_after_every_hook_of_the_phase(tmp_path, position):
    def mark(state, phase):
        if phase is Phase.AFTER_STEP:
            return attrs.evolve(state, extra=(state.extra or 0) + 10)
        return state

    others = [testing.counter("steps"), mark]
    ckpt = fl.hooks.checkpoint(tmp_path, keep=None)
    hooks = [ckpt, *others] if position == "first" else [*others, ckpt]
    fl.run(start(4), moving, stream(), hooks, clock=zero)
    like = attrs.evolve(start(4), hooks={"steps": 0}, extra=0)
    for i in (1, 2, 3, 4):
        saved = checkpoint.load(checkpoint.path_for(tmp_path, i), like=like)
        assert (saved.iteration, saved.hooks["steps"], saved.extra) == (i, i, 10 * i)


def test_a_completed_run_is_not_saved_twice(tmp_path):
    ticks = itertools.count()
    final = fl.run(
        start(3), moving, stream(), [fl.hooks.checkpoint(tmp_path)], clock=lambda: float(next(ticks))
    )
    saved = checkpoint.load(checkpoint.path_for(tmp_path, 3), like=start(3))
    assert saved.time < final.time  # written at AFTER_STEP of step 2; AFTER_TRAIN kept it


@pytest.mark.parametrize(
    "failure",
    [
        lambda: ([], testing.Fail(Phase.BEFORE_STEP, 5)),
        lambda: ([], testing.Fail(Phase.AFTER_STEP, 5)),
        lambda: ("step", None),
    ],
    ids=["before-step", "after-step", "in-the-step"],
)
def test_after_train_saves_the_last_consistent_state_after_a_failure(tmp_path, failure):
    where, hook = failure()

    def step(state, batch):
        if where == "step" and state.iteration == 5:
            raise testing.InjectedFailure("step 5")
        return moving(state, batch)

    hooks = [fl.every(100, fl.hooks.checkpoint(tmp_path)), hook]
    with pytest.raises(testing.InjectedFailure) as info:
        fl.run(start(10), step, stream(), hooks, clock=zero)
    assert info.value.state.iteration == 5
    assert names(tmp_path) == [5]  # the period (100) never came
    testing.assert_identical(checkpoint.latest(tmp_path, like=start(10)), info.value.state)


def test_after_train_does_not_overwrite_the_periodic_checkpoint_of_the_same_iteration(tmp_path):
    path = checkpoint.path_for(tmp_path, 4)
    written = []

    def note(state):  # performed after the checkpoint's own effect: the file as AFTER_STEP of step 3 wrote it
        written.append((path.stat().st_ino, path.stat().st_mtime_ns))

    seen = fl.on(Phase.AFTER_STEP, fl.once(3, lambda s, p: fl.request(s, note)))
    hooks = [fl.every(2, fl.hooks.checkpoint(tmp_path)), seen, testing.Fail(Phase.BEFORE_STEP, 4)]
    with pytest.raises(testing.InjectedFailure):
        fl.run(start(10), moving, stream(), hooks)
    assert names(tmp_path) == [4, 2]
    # Written at AFTER_STEP of step 3, and not again at AFTER_TRAIN (an atomic rewrite is a new file).
    assert written == [(path.stat().st_ino, path.stat().st_mtime_ns)]


def test_the_after_train_save_does_not_depend_on_where_the_hook_sits(tmp_path):
    """It saves the state the fold entered AFTER_TRAIN with: no hook's end-of-run changes."""

    def ends(state, phase, n):
        return state, n + (phase is Phase.AFTER_TRAIN)

    saved = []
    for i, position in enumerate(["first", "last"]):
        directory = tmp_path / str(i)
        ckpt, other = fl.every(100, fl.hooks.checkpoint(directory)), fl.stateful("ends", 0, ends)
        hooks = [ckpt, other] if position == "first" else [other, ckpt]
        fl.run(start(3), moving, stream(), hooks, clock=zero)
        saved.append(checkpoint.read_raw(checkpoint.path_for(directory, 3))[1]["hooks"])
    assert saved[0] == saved[1] == {"ends": 0}


# -- best_checkpoint ---------------------------------------------------------------------------------


def scripted(values):
    """A step recording ``val = values[iteration]`` (``None``: nothing recorded that step)."""

    def step(state, batch):
        state = moving(state, batch)
        value = values[state.iteration]
        return state if value is None else fl.record(state, val=value)

    return step


@pytest.mark.parametrize(
    ("mode", "values", "best"),
    [
        ("min", [3.0, 1.0, 2.0, None, 0.5, 0.7], Best(0.5, 4)),
        ("max", [3.0, 1.0, None, 4.0, 4.0, 0.7], Best(4.0, 3)),
        ("min", [math.nan, 2.0, 1.0, 1.5, 2.0, 3.0], Best(1.0, 2)),
    ],
)
def test_best_checkpoint_keeps_the_state_where_the_metric_was_best(tmp_path, mode, values, best):
    hook = best_checkpoint(tmp_path, "val", mode)
    finite = all(v is None or math.isfinite(v) for v in values)
    with contextlib.nullcontext() if finite else pytest.warns(fl.hooks.NonFiniteMetric, match="is nan"):
        final = fl.run(start(6), scripted(values), stream(), [hook], clock=zero)
    assert final.hooks["best:val"] == best
    saved = checkpoint.load(
        tmp_path / "best.safetensors", like=attrs.evolve(start(6), hooks={"best:val": Best(0.0)})
    )
    assert saved.iteration == best.iteration + 1
    assert saved.metrics.latest("val") == (best.iteration, best.value)
    assert saved.hooks["best:val"] == best  # its own update is in the file
    assert names(tmp_path) == []


def test_best_checkpoint_without_the_metric_saves_nothing_and_says_so(tmp_path):
    with pytest.warns(fl.hooks.MetricNeverRecorded, match=r"'val' was never recorded.*\['x'\]"):
        final = fl.run(start(3), moving, stream(), [best_checkpoint(tmp_path, "val", name="b")])
    assert final.hooks == {"b": Best(math.inf)}
    assert not (tmp_path / "best.safetensors").exists()


def test_the_best_so_far_survives_a_resume(tmp_path):
    ckpt, best_dir = tmp_path / "ckpt", tmp_path / "best"
    hooks = [fl.hooks.checkpoint(ckpt, keep=2), best_checkpoint(best_dir, "val")]
    values = [5.0, 2.0, 3.0, 4.0, 2.5, 3.0, 9.0, 2.1]

    def crashing(state, batch):
        if state.iteration == 4:
            raise testing.InjectedFailure("preempted")
        return scripted(values)(state, batch)

    with pytest.raises(testing.InjectedFailure):
        fl.run(start(8), crashing, stream(), hooks, clock=zero)
    best_file = best_dir / "best.safetensors"
    before = best_file.read_bytes()

    resumed = checkpoint.latest(ckpt, like=start(8))  # a fresh template that knows no hook
    assert resumed.iteration == 4
    assert type(resumed.hooks["best:val"]) is fl.Unclaimed
    final = fl.run(resumed, scripted(values), stream(), hooks, clock=zero)  # 2.5, 3, 9, 2.1: all worse
    assert final.hooks["best:val"] == Best(2.0, 1)
    assert best_file.read_bytes() == before

    # A better value after another resume still replaces it.
    better = attrs.evolve(checkpoint.latest(ckpt, like=start(8)), max_iter=9)
    fl.run(better, scripted([*values, 1.0]), stream(), hooks, clock=zero)
    assert checkpoint.read_raw(best_file)[1]["hooks"]["best:val"] == {"value": 1.0, "iteration": 8}


# -- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keep", "message"),
    [
        (0, r"'keep' must be a positive int or None to keep every checkpoint \(got 0 that is an? int\)\."),
        (-2, r"\(got -2 that is an? int\)"),
        (2.0, r"\(got 2\.0 that is a float\)"),
        (True, r"\(got True that is a bool\)"),
        ("3", r"\(got '3' that is a str\)"),
    ],
)
def test_a_bad_keep_is_refused(tmp_path, keep, message):
    with pytest.raises(ValueError, match=message):
        fl.hooks.checkpoint(tmp_path, keep=keep)


@pytest.mark.parametrize("mode", ["mean", "MIN", None])
def test_a_bad_mode_is_refused(tmp_path, mode):
    with pytest.raises(
        ValueError, match=rf"best_checkpoint\(\) mode must be 'min' or 'max' \(got {mode!r}\)\."
    ):
        best_checkpoint(tmp_path, "val", mode)


def test_reprs_name_the_configuration(tmp_path):
    assert repr(fl.hooks.checkpoint("run/ckpt", keep=3)) == "checkpoint('run/ckpt', keep=3)"
    assert repr(fl.every(10, fl.hooks.checkpoint("run/ckpt"))) == "every(10, checkpoint('run/ckpt', keep=5))"
    assert "best_checkpoint('run', 'val', 'max')" in repr(best_checkpoint("run", "val", "max"))


def test_a_restart_from_an_older_state_sets_the_abandoned_future_aside(tmp_path):
    """Run to 6 (keeps 6, 4), restart from 2 into the same directory: latest must resume the new run."""
    ckpt = fl.every(2, fl.hooks.checkpoint(tmp_path, keep=2))
    fl.run(start(6), moving, stream(), [ckpt], clock=zero)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == [
        "ckpt-00000006.safetensors",
        "ckpt-00000004.safetensors",
    ]
    two = fl.run(start(2), moving, stream(), [], clock=zero)
    with pytest.warns(
        checkpoint.CheckpointWarning,
        match=r"ckpt-00000006.safetensors is newer than the state just saved \(iteration 4\)",
    ):
        fl.run(attrs.evolve(two, max_iter=4), moving, stream(), [ckpt], clock=zero)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["ckpt-00000004.safetensors"]
    assert sorted(p.name for p in tmp_path.glob("*.abandoned")) == ["ckpt-00000006.safetensors.abandoned"]
    assert fl.checkpoint.latest(tmp_path, like=start(4)).iteration == 4


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path):
    ckpt = fl.hooks.checkpoint(tmp_path, keep=1)
    fl.run(start(3), moving, stream(), [ckpt], clock=zero)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["ckpt-00000003.safetensors"]


@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_best_checkpoint_never_saves_a_non_finite_value_and_says_so(tmp_path, bad):
    values = [1.0, bad, 2.0]

    def step(state, batch):
        return fl.record(state, val=values[state.iteration])

    with pytest.warns(fl.hooks.NonFiniteMetric, match=rf"'val' is {bad} at iteration 1"):
        fl.run(fl.TrainState(max_iter=3), step, [None] * 3, [fl.hooks.best_checkpoint(tmp_path, "val")])
    assert checkpoint.load(tmp_path / "best.safetensors", like=fl.TrainState(max_iter=3)).iteration == 1
