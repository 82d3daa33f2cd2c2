"""evaluate and mean_over: when it evaluates, what it records, what survives a resume."""

from __future__ import annotations

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import Phase, TrainState, testing
from fnloop.hooks import Evaluated, evaluate, mean_over


def seen(state: TrainState) -> dict[str, float]:
    """An evaluation that reports which state it saw."""
    return {"seen": float(state.iteration), "w": state.params["w"].sum() if state.params else 0.0}


def nothing(state, batch):
    return state


def moving(state, batch):
    return fl.record(attrs.evolve(state, params={"w": state.params["w"] + 1.0}), loss=0.5)


def start(max_iter: int) -> TrainState:
    return TrainState(max_iter=max_iter, params={"w": torch.zeros(2)})


def evaluations(state: TrainState, name: str = "seen") -> list[int]:
    return [i for i, _ in state.metrics.history(name)] if name in state.metrics.series else []


# -- when --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("max_iter", "calls"), [(30, [14, 29]), (31, [14, 29, 31]), (14, [14]), (15, [14])])
def test_detectron2_call_counts_with_a_period(max_iter, calls):
    final = fl.run(start(max_iter), nothing, [None] * max_iter, [fl.every(15, evaluate(seen))])
    assert evaluations(final) == calls


def test_on_after_train_evaluates_once_at_the_end():
    final = fl.run(start(7), nothing, [None] * 7, [fl.on(Phase.AFTER_TRAIN, evaluate(seen))])
    assert evaluations(final) == [7]
    assert final.hooks["eval"] == Evaluated(7)


def test_a_failed_run_is_not_evaluated_at_the_end():
    hooks = [fl.every(5, evaluate(seen)), testing.Fail(Phase.AFTER_STEP, 7)]
    with pytest.raises(testing.InjectedFailure) as info:
        fl.run(start(20), nothing, [None] * 20, hooks)
    assert evaluations(info.value.state) == [4]


def test_an_early_stopped_run_is_evaluated_at_its_end():
    def stop_at_6(state, phase):
        if phase is Phase.AFTER_STEP and state.iteration == 6:
            return attrs.evolve(state, max_iter=7)
        return state

    final = fl.run(start(20), nothing, [None] * 20, [stop_at_6, fl.every(5, evaluate(seen))])
    assert (final.iteration, evaluations(final)) == (7, [4, 7])


def test_the_evaluation_sees_the_parameters_after_the_step():
    final = fl.run(start(4), moving, [None] * 4, [fl.every(2, evaluate(seen))])
    values = [float(v) for _, v in final.metrics.history("w")]
    assert values == [4.0, 8.0]  # w == 2 after steps 0-1, 4 after steps 0-3, two entries each


# -- what --------------------------------------------------------------------------------------------


def test_results_are_recorded_unprefixed_and_seen_by_the_next_hook_in_the_phase():
    def look(state, phase):
        if phase is Phase.AFTER_STEP:
            return attrs.evolve(state, extra=state.metrics.latest("seen"))
        return state

    final = fl.run(start(3), nothing, [None] * 3, [evaluate(seen), look])
    assert final.extra == (2, 2.0)
    assert set(final.metrics.names) == {"seen", "w"}


def test_tensors_are_recorded_as_they_are():
    value = torch.tensor(0.25)
    state = evaluate(lambda s: {"acc": value})(start(1), Phase.AFTER_STEP)
    iteration, recorded = state.metrics.latest("acc")
    assert iteration == 0
    assert isinstance(recorded, torch.Tensor) and recorded.dim() == 0 and recorded.item() == 0.25


def test_a_hook_state_says_what_was_evaluated_and_a_finished_run_is_not_evaluated_again(tmp_path):
    hooks = [fl.every(15, evaluate(seen)), fl.every(15, fl.hooks.checkpoint(tmp_path))]
    final = fl.run(start(31), nothing, [None] * 31, hooks)
    assert final.hooks["eval"] == Evaluated(31)
    loaded = fl.checkpoint.latest(tmp_path, like=start(31))
    assert loaded is not None and loaded.iteration == 31
    again = fl.run(loaded, nothing, [], hooks)
    assert evaluations(again) == [14, 29, 31]


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    def hooks(folder):
        return [fl.every(3, evaluate(seen)), fl.every(4, fl.hooks.checkpoint(folder, keep=None))]

    data = torch.zeros(10, 1)

    def stream():
        return fl.data.batches(data, batch_size=1, seed=0)

    whole = fl.run(start(10), moving, stream(), hooks(tmp_path), clock=lambda: 0.0)
    middle = fl.checkpoint.load(fl.checkpoint.path_for(tmp_path, 4), like=start(10))
    assert fl.hook_state(middle, "eval", Evaluated()) == Evaluated(3)
    resumed = fl.run(middle, moving, stream(), hooks(tmp_path / "resumed"), clock=lambda: 0.0)
    testing.assert_identical(resumed, whole)


@pytest.mark.parametrize("phase", list(Phase))
def test_evaluate_is_a_good_hook(phase):
    state = fl.record(start(5), loss=torch.tensor(1.0))
    for hook in [evaluate(seen), fl.every(2, evaluate(seen, name="other")), evaluate(seen, ema="ema")]:
        with_ema = fl.hooks.ema(0.9)(state, Phase.BEFORE_TRAIN)
        testing.check_hook(hook, with_ema, (phase,))


def test_reprs_name_the_function():
    assert repr(evaluate(seen)) == "stateful('eval', evaluate(seen))"
    assert repr(evaluate(seen, ema="ema")) == "stateful('eval', evaluate(seen, ema='ema'))"


# -- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ([1.0], r"evaluate 'eval' \(.*\): fn must return a mapping .* \(got \[1.0\] that is a list\)"),
        ({1: 1.0}, r"evaluate 'eval' .*: metric names must be str \(the key got 1 that is an int\)"),
        (
            {"acc": torch.ones(3)},
            r"metric 'acc' must be a number or a 0-d tensor \(got a tensor of shape \(3,\)\)",
        ),
        ({"acc": "high"}, r"metric 'acc' must be a number or a 0-d tensor \(got 'high' that is a str\)"),
        ({"acc": None}, r"metric 'acc' .*got None that is a NoneType"),
    ],
)
def test_a_bad_result_is_a_type_error_naming_the_hook_and_the_key(result, message):
    with pytest.raises(TypeError, match=message):
        evaluate(lambda s: result)(start(1), Phase.AFTER_STEP)


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match=r"evaluate\(\) expected fn, a callable"):
        evaluate("seen")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'ema' must be the name of an ema hook"):
        evaluate(seen, ema=True)  # type: ignore[arg-type]


def test_evaluating_the_ema_without_an_ema_hook_says_how_to_add_one():
    with pytest.raises(KeyError, match=r"no EMA named 'ema'.*fnloop.hooks.ema\(decay, name='ema'\)"):
        evaluate(seen, ema="ema")(start(1), Phase.AFTER_STEP)


# -- evaluating the EMA --------------------------------------------------------------------------------


def test_ema_evaluates_the_averaged_parameters_and_records_on_the_real_state():
    hooks = [fl.hooks.ema(0.5), evaluate(seen, ema="ema", name="on_ema"), evaluate(seen)]
    final = fl.run(start(2), moving, [None] * 2, hooks)
    # w: 0 -> 1 -> 2 per entry; ema: 0 -> 0.5 -> 1.25; the sums are over two entries
    assert [float(v) for _, v in final.metrics.history("w")] == [1.0, 2.0, 2.5, 4.0]
    ema_run = fl.run(start(2), moving, [None] * 2, hooks[:2])
    assert [float(v) for _, v in ema_run.metrics.history("w")] == [1.0, 2.5]
    testing.assert_identical(ema_run.params, final.params)


# -- mean_over ---------------------------------------------------------------------------------------

X = torch.linspace(-1.0, 1.0, 10).reshape(10, 1)
Y = 3.0 * X + 0.5


def squared(state, batch):
    x, y = batch
    err = (x * state.params["w"] + state.params["b"] - y).pow(2)
    return {"loss": err.mean(), "worst": err.max(), "ok": (err < 1.0).float().mean()}


def linear() -> TrainState:
    return TrainState(max_iter=1, params={"w": torch.ones(1), "b": torch.zeros(1)})


def full_data_means() -> dict[str, float]:
    err = (X * 1.0 - Y).pow(2)
    return {"loss": err.mean().item(), "ok": (err < 1.0).float().mean().item()}


def test_mean_over_weights_each_batch_by_its_examples():
    uneven = [(X[:4], Y[:4]), (X[4:8], Y[4:8]), (X[8:], Y[8:])]
    means = mean_over(squared, uneven, prefix="val_")(linear())
    assert sorted(means) == ["val_loss", "val_ok", "val_worst"]
    want = full_data_means()
    assert means["val_loss"].item() == pytest.approx(want["loss"], rel=1e-6)
    assert means["val_ok"].item() == pytest.approx(want["ok"], rel=1e-6)


def test_mean_over_returns_0d_tensors_on_the_device_with_no_host_sync():
    means = mean_over(squared, [(X, Y)])(linear())
    for value in means.values():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and value.device == X.device


def test_mean_over_reads_one_epoch_of_a_stream_from_its_start_each_time():
    stream = fl.data.batches((X, Y), batch_size=4, seed=0, shuffle=False, drop_last=False)
    fn = mean_over(squared, stream)
    first, second = fn(linear()), fn(linear())
    assert first["loss"].item() == pytest.approx(full_data_means()["loss"], rel=1e-6)
    testing.assert_identical(first, second)


def test_mean_over_averages_python_numbers_too():
    def plain(state, batch):
        return {"n": float(len(batch))}

    assert mean_over(plain, [torch.zeros(2), torch.zeros(4)])(linear()) == {"n": (2 * 2 + 4 * 4) / 6}


def test_mean_over_with_an_eager_eval_step():
    model = torch.nn.Linear(1, 1)
    step = fl.eval_step(model, lambda f, b: {"loss": (f(b[0]) - b[1]).pow(2).mean()}, compile=False)
    state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
    means = mean_over(step, [(X[:7], Y[:7]), (X[7:], Y[7:])])(state)
    with torch.no_grad():
        want = (model(X) - Y).pow(2).mean()
    assert means["loss"].item() == pytest.approx(want.item(), rel=1e-6)


def test_mean_over_with_a_compiled_eval_step_matches_the_eager_one():
    model = torch.nn.Linear(1, 1)
    fn = lambda f, b: {"loss": (f(b[0]) - b[1]).pow(2).mean()}  # noqa: E731
    state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
    val = [(X[:5], Y[:5]), (X[5:], Y[5:])]
    compiled = mean_over(fl.eval_step(model, fn), val)(state)
    eager = mean_over(fl.eval_step(model, fn, compile=False), val)(state)
    assert compiled["loss"].item() == pytest.approx(eager["loss"].item(), rel=1e-6)


def test_best_checkpoint_driven_by_evaluate_keeps_the_best_state(tmp_path):
    # The parameter walks past the optimum w == 3 and back: the best is at w == 3.
    walk = [1.0, 2.0, 3.0, 4.0, 5.0]

    def walking(state, batch):
        w = torch.full((1,), walk[state.iteration])
        return attrs.evolve(state, params={"w": w, "b": torch.full((1,), 0.5)})

    hooks = [
        evaluate(mean_over(squared, [(X, Y)], prefix="val_")),
        fl.hooks.best_checkpoint(tmp_path, "val_loss"),
    ]
    final = fl.run(attrs.evolve(linear(), max_iter=5), walking, [None] * 5, hooks)
    best = fl.load(tmp_path / "best.safetensors", like=attrs.evolve(linear(), max_iter=5))
    assert best.params["w"].item() == 3.0
    assert best.iteration == 3  # the state after step 2, which recorded the best
    assert final.hooks["best:val_loss"].iteration == 2
    assert final.hooks["best:val_loss"].value == pytest.approx(0.0, abs=1e-12)


def test_mean_over_refuses_a_one_shot_iterator():
    with pytest.raises(
        TypeError, match=r"mean_over\(\) needs batches it can read again.*iterator is used up"
    ):
        mean_over(squared, iter([(X, Y)]))


def test_mean_over_errors_say_what_went_wrong():
    with pytest.raises(ValueError, match=r"mean_over\(squared\): the validation batches held no example"):
        mean_over(squared, [])(linear())

    def changing(state, batch):
        return {"a": 1.0} if batch.shape[0] == 2 else {"b": 1.0}

    with pytest.raises(ValueError, match=r"a batch gave the metrics \['b'\], an earlier one \['a'\]"):
        mean_over(changing, [torch.zeros(2), torch.zeros(3)])(linear())
    with pytest.raises(TypeError, match=r"cannot tell how many examples.*Pass size="):
        mean_over(lambda s, b: {"a": 1.0}, [{"x": 1.0}])(linear())
    assert mean_over(lambda s, b: {"a": 1.0}, [{"x": 1.0}], size=lambda b: 1)(linear()) == {"a": 1.0}
    with pytest.raises(TypeError, match=r"'prefix' must be a str"):
        mean_over(squared, [], prefix=1)  # type: ignore[arg-type]


def test_evaluate_with_mean_over_is_a_good_hook():
    hook = fl.every(2, evaluate(mean_over(squared, [(X, Y)], prefix="val_")))
    for phase in Phase:
        testing.check_hook(hook, attrs.evolve(linear(), max_iter=4, iteration=1), (phase,))
