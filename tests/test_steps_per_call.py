"""Several steps per compiled call: bit for bit what single steps give, with hooks at call boundaries.

The compiled steps are shared by module fixtures: each graph costs seconds to build.
"""

from __future__ import annotations

import functools
import json

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import Phase, testing

MAX_ITER = 10


def _model(dropout: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, *([torch.nn.Dropout(0.5)] if dropout else []), torch.nn.Linear(16, 3))


def classify(forward, batch):
    x, y = batch
    out = forward(x)
    return torch.nn.functional.cross_entropy(out, y), {"acc": (out.argmax(1) == y).float().mean()}


# A schedule (the learning rate is a graph output every step), BatchNorm buffers, a metric.
OPT = fl.optim.adamw(fl.optim.warmup(fl.optim.cosine(1e-2, 40), 3))


def _data(n: int = 24) -> list:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)) for _ in range(n)]


DATA = _data()


def _nan_at(at: int) -> list:
    data = list(DATA)
    x, y = data[at]
    data[at] = (torch.full_like(x, float("nan")), y)
    return data


def _start(max_iter: int = MAX_ITER) -> fl.TrainState:
    return fl.init(_model(), OPT, seed=0, max_iter=max_iter)


def _run(step, state, data=DATA, hooks=(), **kwargs) -> fl.TrainState:
    return fl.run(state, step, fl.data.resumable(data), hooks, clock=lambda: 0.0, **kwargs)


@pytest.fixture(scope="module")
def single():
    return fl.train_step(_model(), classify, OPT)


@functools.cache
def _several(k: int):
    return fl.train_step(_model(), classify, OPT, steps_per_call=k)


@pytest.fixture(params=[2, 4], ids=["2 steps", "4 steps"])
def multi(request):
    return _several(request.param)


@pytest.fixture
def four():
    return _several(4)


def test_several_steps_per_call_equal_single_steps(single, multi):
    k = multi.steps_per_call
    expected = _run(single, _start())
    got = _run(multi, _start())
    testing.assert_identical(got, expected)  # params, buffers, optimizer state, metrics, data cursor
    assert [i for i, _ in got.metrics.history("loss")] == list(range(MAX_ITER))  # every step recorded
    assert got.metrics.names == expected.metrics.names == ("loss", "lr", "acc")
    # Whole calls where they fit; the last MAX_ITER % k iterations run as single steps.
    assert multi.multi.compiles == 1
    assert multi.jit.compiles == (1 if MAX_ITER % k else 0)


def test_a_run_resumed_off_a_boundary_goes_on_as_single_steps_would(single, four):
    at_six = _run(single, _start(6))
    expected = _run(single, attrs.evolve(at_six, max_iter=14))
    # Iterations 6 and 7 one by one, then 8..11 in one call, then 12 and 13.
    got = _run(four, attrs.evolve(at_six, max_iter=14))
    testing.assert_identical(got, expected)


def test_calling_the_steps_leaves_the_given_state_as_it_was(four):
    state = _start()
    before = testing.without_clock(
        attrs.evolve(state, params={k: v.clone() for k, v in state.params.items()})
    )
    after = four.steps(state, DATA[:4])
    assert after.iteration == 3  # the last step's index: the fold advances it
    testing.assert_identical(testing.without_clock(state), before)
    assert not torch.equal(after.params["0.weight"], state.params["0.weight"])


def test_hooks_act_at_call_boundaries_and_see_per_iteration_times(tmp_path, four):
    seen = []

    def note(state, phase):
        seen.append((phase.name, state.iteration))
        return state

    ticks = iter(float(t) for t in range(1000))
    hooks = [
        fl.every(4, fl.hooks.timer(warmup=0)),
        fl.on(Phase.AFTER_STEP, fl.every(4, note)),
        fl.on(Phase.BEFORE_STEP, fl.once(4, note)),
        fl.every(8, fl.hooks.log(fl.writers.jsonl(tmp_path / "m.jsonl"))),
    ]
    final = fl.run(_start(16), four, DATA, hooks, clock=lambda: next(ticks))
    assert seen == [
        ("AFTER_STEP", 3),
        ("BEFORE_STEP", 4),
        ("AFTER_STEP", 7),
        ("AFTER_STEP", 11),
        ("AFTER_STEP", 15),
    ]
    times = final.metrics.history("time")
    assert [i for i, _ in times] == [3, 7, 11, 15]
    assert all(0 < t < 4 for _, t in times)  # a call's time shared out over its 4 steps
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [line["iteration"] for line in lines] == [8, 16]
    assert [i for i, _ in final.metrics.history("loss")] == list(range(16))


def test_the_steering_hooks_run_every_multiple_of_the_call(tmp_path, four):
    def validate(state):
        return {"val": torch.tensor(float(state.iteration))}  # rises: early stop after 2 evaluations

    hooks = [
        fl.every(4, fl.hooks.evaluate(validate)),
        fl.every(4, fl.hooks.early_stop("val", patience=2)),
        fl.every(4, fl.hooks.best_checkpoint(tmp_path / "best", "val")),
    ]
    final = fl.run(_start(24), four, DATA, hooks)
    assert [i for i, _ in final.metrics.history("val")] == [3, 7, 11]
    assert final.iteration == 12  # stopped after the third evaluation, at a call boundary
    assert final.hooks["best:val"].iteration == 3


@pytest.mark.parametrize(
    ("hook", "where"),
    [
        (fl.hooks.timer(), "AFTER_STEP of iteration 0"),
        (fl.every(6, fl.hooks.timer()), "AFTER_STEP of iteration 5"),
        (fl.every(8, lambda s, p: s), "BEFORE_STEP of iteration 7"),
        (fl.on(Phase.BEFORE_STEP, fl.once(5, lambda s, p: s)), "BEFORE_STEP of iteration 5"),
    ],
)
def test_a_hook_inside_a_call_is_refused_before_anything_runs(tmp_path, four, hook, where):
    saves = fl.every(4, fl.hooks.checkpoint(tmp_path))
    with pytest.raises(
        ValueError, match=rf"steps_per_call=4: the hook .* may act in {where}, inside a call"
    ) as err:
        fl.run(_start(), four, DATA, [saves, hook])
    assert "fl.every(4, hook)" in str(err.value)
    assert not any(tmp_path.iterdir())  # refused before BEFORE_TRAIN: nothing written


def test_a_non_finite_step_inside_a_call_stops_where_single_steps_stop(single, four):
    with pytest.raises(fl.NonFiniteLoss) as one:
        _run(single, _start(), _nan_at(5))
    with pytest.raises(fl.NonFiniteLoss) as many:
        _run(four, _start(), _nan_at(5))
    assert many.value.iteration == one.value.iteration == 5
    assert str(many.value) == str(one.value)
    assert many.value.state.iteration == 5
    testing.assert_identical(many.value.state, one.value.state)  # tensors, metrics of 0..4, cursor


def test_skipping_non_finite_steps_inside_a_call_counts_as_single_steps_do():
    single = fl.train_step(_model(), classify, OPT, skip_nonfinite=True)
    many = fl.train_step(_model(), classify, OPT, skip_nonfinite=True, steps_per_call=4)
    data = _nan_at(5)
    data[9] = (torch.full_like(DATA[9][0], float("inf")), DATA[9][1])
    expected = _run(single, _start(12), data)
    got = _run(many, _start(12), data)
    testing.assert_identical(got, expected)
    assert [int(v) for _, v in got.metrics.history("skipped")] == [0] * 5 + [1] * 4 + [2] * 3


def test_dropout_inside_a_call_draws_what_single_steps_draw():
    # Each step of a call draws from its own (seed, iteration), inside the loop's graph.
    model = _model(dropout=True)
    single = fl.train_step(model, classify, OPT)
    many = fl.train_step(model, classify, OPT, steps_per_call=4)
    state = fl.init(model, OPT, seed=0, max_iter=8)
    expected = _run(single, state)
    testing.assert_identical(_run(many, state), expected)
    other = _run(many, attrs.evolve(state, rng=5))
    assert fl._core.tree.first_difference(other.params, expected.params) is not None, (
        "dropout follows the seed"
    )


def test_an_op_that_draws_from_the_generator_is_refused_inside_a_call():
    def shuffled(forward, batch):  # randperm draws from torch's generator, not from the step's seed
        x, y = batch
        order = torch.randperm(x.shape[0])
        return classify(forward, (x[order], y[order]))

    step = fl.train_step(_model(), shuffled, OPT, steps_per_call=2)
    with pytest.raises(
        ValueError, match=r"steps_per_call=2\) runs 2 steps in one compiled call, but"
    ) as info:
        fl.run(_start(4), step, DATA)
    assert "aten.randperm" in str(info.value)


def test_python_in_the_loss_runs_once_when_the_call_is_traced(four):
    seen = []

    def noting(forward, batch):
        seen.append(1)  # runs while the step is traced, as for a single step (library logging, say)
        return classify(forward, batch)

    step = fl.train_step(_model(), noting, OPT, steps_per_call=4)
    got = _run(step, _start(8))
    assert len(seen) == 1
    testing.assert_identical(got, _run(four, _start(8)))


def test_eager_steps_per_call_equal_single_eager_steps_with_dropout():
    model = _model(dropout=True)
    single = fl.train_step(model, classify, OPT, compile=False)
    many = fl.train_step(model, classify, OPT, compile=False, steps_per_call=4)
    state = fl.init(model, OPT, seed=0, max_iter=MAX_ITER)
    testing.assert_identical(_run(many, state), _run(single, state))


def test_batches_running_out_inside_a_call_keep_the_last_whole_call(four):
    with pytest.raises(fl.BatchesExhausted, match="ran out at iteration 6") as err:
        fl.run(_start(8), four, DATA[:6])
    assert err.value.state.iteration == 4


def test_batches_of_another_structure_in_one_call_are_named(four):
    data = [DATA[0], DATA[1], [DATA[2][0], DATA[2][1]], DATA[3]]
    with pytest.raises(ValueError, match=r"the batch for iteration 2 .* differs from iteration 0"):
        fl.run(_start(4), four, data)


def test_steps_per_call_must_be_a_positive_int():
    with pytest.raises(ValueError, match="'steps_per_call' must be a positive int"):
        fl.train_step(_model(), classify, OPT, steps_per_call=0)


def test_accumulation_autocast_and_parameter_groups_inside_a_call():
    # The options that change the traced body: micro-batches, bf16 autocast, two optimizer groups
    # (one with a schedule: lr/<group> metrics from the graph, one fixed: numbers).
    opt = fl.optim.partition(
        lambda name, p: "decay" if p.ndim >= 2 else "no_decay",
        {"decay": OPT, "no_decay": fl.optim.sgd(0.05, momentum=0.9)},
    )
    options = {"accumulate": 2, "autocast": torch.bfloat16}
    single = fl.train_step(_model(), classify, opt, **options)
    many = fl.train_step(_model(), classify, opt, steps_per_call=4, **options)
    state = fl.init(_model(), opt, seed=0, max_iter=8)
    expected = _run(single, state)
    got = _run(many, state)
    testing.assert_identical(got, expected)
    assert {"lr/decay", "lr/no_decay", "acc"} <= set(got.metrics.names)
    assert [i for i, _ in got.metrics.history("lr/no_decay")] == list(range(8))


def test_a_users_own_compiled_function_survives_a_run() -> None:
    # fnloop traces and compiles its steps without touching dynamo's state: a function the user
    # compiled before the run is not compiled again after it (torch._dynamo.reset() would make it so).
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter)
    def mine(x: torch.Tensor) -> torch.Tensor:
        return x.sin() + 1

    x = torch.randn(4)
    mine(x)
    assert counter.frame_count == 1
    _run(fl.train_step(_model(), classify, OPT, steps_per_call=4), _start())  # traced afresh
    mine(x)
    assert counter.frame_count == 1


def test_an_injected_learning_rate_recorded_as_a_metric_runs_in_a_call_as_in_single_steps():
    # The learning rate `inject` keeps in the state is recorded as a metric: it left the loop's
    # body as one of its inputs, which torch's loop refuses ("scan might be aliasing the input").
    opt = fl.optim.inject(fl.optim.adam, lr=1e-2)
    start = fl.init(_model(), opt, seed=0, max_iter=4)
    single = _run(fl.train_step(_model(), classify, opt), start)
    several = _run(fl.train_step(_model(), classify, opt, steps_per_call=2), start)
    assert [(i, float(v)) for i, v in several.metrics.series["lr"]] == [(i, 1e-2) for i in range(4)]
    for name in single.params:
        assert torch.equal(several.params[name], single.params[name]), name
