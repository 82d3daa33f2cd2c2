"""Non-finite losses and gradients never poison the state; the learning rate is recorded."""

from __future__ import annotations

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import testing


def problem():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))

    def mse(forward, batch):
        x, y = batch
        return ((forward(x) - y) ** 2).mean()

    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(6)]
    return model, mse, data


def nan_at(data, at, where="x"):
    x, y = data[at]
    bad = (x.clone().fill_(float("nan")), y) if where == "x" else (x, torch.full_like(y, float("inf")))
    return [bad if i == at else b for i, b in enumerate(data)]


@pytest.mark.parametrize("where", ["x", "y"])
def test_the_bad_step_leaves_every_tensor_as_it_was(where):
    model, mse, data = problem()
    opt = fl.optim.adam(0.1)
    step = fl.train_step(model, mse, opt, compile=False, skip_nonfinite=True)
    state = fl.init(model, opt, seed=0, max_iter=6)
    states = list(fl.scan(state, step, nan_at(data, 2, where)))
    testing.assert_identical(states[2].params, states[1].params)  # step 2 changed nothing
    testing.assert_identical(states[2].buffers, states[1].buffers)
    testing.assert_identical(states[2].opt_state, states[1].opt_state)
    assert all(torch.isfinite(p).all() for p in states[-1].params.values())
    assert [float(v) for _, v in states[-1].metrics.history("skipped")] == [0, 0, 1, 1, 1, 1]


def test_skipping_equals_leaving_the_bad_batch_out():
    model, mse, data = problem()
    opt = fl.optim.sgd(0.1, momentum=0.9)
    skipping = fl.train_step(model, mse, opt, compile=False, skip_nonfinite=True)
    state = fl.init(model, opt, seed=0, max_iter=6)
    skipped = fl.run(state, skipping, nan_at(data, 2))
    # A step that is skipped still counts as an iteration (schedules see its index): compare against
    # running the good batches with the same iteration indices.
    manual = state
    for i, batch in enumerate(data):
        if i != 2:
            manual = attrs.evolve(skipping(attrs.evolve(manual, iteration=i), batch), iteration=i + 1)
    testing.assert_identical(skipped.params, manual.params)


def test_the_skipped_count_survives_a_resume(tmp_path):
    model, mse, data = problem()
    opt = fl.optim.sgd(0.1)
    step = fl.train_step(model, mse, opt, compile=False, skip_nonfinite=True)
    state = fl.init(model, opt, seed=0, max_iter=6)
    stream = nan_at(data, 1)
    whole = fl.run(state, step, stream)
    half = fl.run(attrs.evolve(state, max_iter=3), step, stream[:3])
    fl.save(half, tmp_path / "half.safetensors")
    resumed = attrs.evolve(fl.load(tmp_path / "half.safetensors", like=state), max_iter=6)
    final = fl.run(resumed, step, stream[3:])
    assert final.metrics.latest_float("skipped") == whole.metrics.latest_float("skipped") == (5, 1.0)
    testing.assert_identical(final.params, whole.params)


def test_by_default_the_run_stops_with_a_clean_state_and_no_poisoned_checkpoint(tmp_path):
    model, mse, data = problem()
    opt = fl.optim.sgd(0.1)
    step = fl.train_step(model, mse, opt, compile=False)
    state = fl.init(model, opt, seed=0, max_iter=6)
    hooks = [fl.hooks.checkpoint(tmp_path, keep=None)]  # saves after every step
    with pytest.raises(fl.NonFiniteLoss, match=r"step 4: a gradient was not finite|step 4: the loss was"):
        fl.run(state, step, nan_at(data, 4, "y"), hooks)
    saved = fl.checkpoint.checkpoints(tmp_path)
    assert saved[0].name == "ckpt-00000004.safetensors"
    for path in saved:
        loaded = fl.load(path, like=state)
        assert all(torch.isfinite(t).all() for t in (*loaded.params.values(), *loaded.buffers.values()))


def test_the_message_names_a_gradient_when_the_loss_is_finite():
    model = torch.nn.Linear(1, 1)

    def loss_fn(forward, batch):
        # sqrt at 0: a finite loss whose gradient is infinite.
        return torch.sqrt(forward(batch).abs() * 0).sum()

    opt = fl.optim.sgd(0.1)
    step = fl.train_step(model, loss_fn, opt, compile=False)
    with pytest.raises(fl.NonFiniteLoss, match=r"step 0: a gradient was not finite \(loss 0\)"):
        fl.run(fl.init(model, opt, seed=0, max_iter=1), step, [torch.ones(2, 1)])


def test_skip_nonfinite_must_be_a_bool():
    model, mse, _ = problem()
    with pytest.raises(TypeError, match="'skip_nonfinite' must be a bool"):
        fl.train_step(model, mse, fl.optim.sgd(0.1), skip_nonfinite=1)


def test_one_lr_per_group_of_a_partition():
    model, mse, data = problem()
    opt = fl.optim.partition(
        lambda name, p: "decay" if p.ndim >= 2 else "no_decay",
        {
            "decay": fl.optim.adamw(fl.optim.cosine(0.1, 6)),
            "no_decay": fl.optim.adamw(0.01, weight_decay=0.0),
        },
    )
    step = fl.train_step(model, mse, opt, compile=False)
    final = fl.run(fl.init(model, opt, seed=0, max_iter=6), step, data)
    assert "lr" not in final.metrics.names
    assert final.metrics.floats("lr/decay") == pytest.approx(
        [float(fl.optim.cosine(0.1, 6)(i)) for i in range(6)]
    )
    assert final.metrics.floats("lr/no_decay") == [0.01] * 6


def test_a_transformation_without_a_learning_rate_records_none():
    model, mse, data = problem()
    opt = fl.optim.Optimizer(fl.optim.clip_by_global_norm(1.0))
    step = fl.train_step(model, mse, opt, compile=False)
    final = fl.run(fl.init(model, opt, seed=0, max_iter=2), step, data[:2])
    assert final.metrics.names == ("loss",)


def test_the_learning_rate_after_a_resume_equals_the_uninterrupted_runs(tmp_path):
    # detectron2's test_checkpoint_resume for its LRScheduler hook, here a schedule read in the graph.
    model, mse, data = problem()
    opt = fl.optim.sgd(fl.optim.warmup_multistep(0.1, (3, 5), warmup_iters=2), momentum=0.9)
    step = fl.train_step(model, mse, opt, compile=False)
    state = fl.init(model, opt, seed=0, max_iter=6)
    whole = fl.run(state, step, data)
    half = fl.run(attrs.evolve(state, max_iter=4), step, data[:4], [fl.hooks.checkpoint(tmp_path)])
    assert half.iteration == 4
    resumed = attrs.evolve(fl.checkpoint.latest(tmp_path, like=state), max_iter=6)
    final = fl.run(resumed, step, data[4:])
    assert final.metrics.floats("lr") == whole.metrics.floats("lr")
    assert len(set(whole.metrics.floats("lr"))) >= 3  # warm-up and two milestones: it did change
    testing.assert_identical(final.params, whole.params)


@pytest.mark.parametrize("compile", [False, True])
def test_a_non_finite_gradient_under_a_finite_loss_is_caught_compiled_too(compile):
    # The clamp cuts the loss to 1, and its gradient w.r.t. the weight is 0 * inf = nan. (A guard
    # written as `(g * 0).sum()` passes this eagerly and fails it compiled: inductor folds `* 0`.)
    model = torch.nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(0.5)

    def clamped(forward, batch):
        return forward(batch).clamp(max=1.0).sum()

    opt = fl.optim.sgd(0.1)
    step = fl.train_step(model, clamped, opt, compile=compile)
    state = fl.init(model, opt, seed=0, max_iter=1)
    with pytest.raises(fl.NonFiniteLoss, match=r"step 0: a gradient was not finite \(loss 2\)") as info:
        fl.run(state, step, [torch.full((2, 1), float("inf"))])
    testing.assert_identical(info.value.state.params, state.params)


def test_a_nan_column_of_a_large_gradient_skips_the_adamw_step_compiled():
    # The guard reads each gradient's largest magnitude: a few NaN entries among 4096
    # under a finite loss must leave the params, AdamW's moments and its count as they were.
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        model.weight[:, 3].abs_()  # every output sees +inf from input 3, clamped to 1

    def clamped(forward, x):
        return forward(x).clamp(max=1.0).sum()

    opt = fl.optim.adamw(1e-2)
    step = fl.train_step(model, clamped, opt, skip_nonfinite=True)
    state = fl.init(model, opt, seed=0, max_iter=2)
    after_good = step(state, torch.full((1, 64), -1e-3))
    x = torch.zeros(1, 64)
    x[0, 3] = float("inf")
    after_bad = step(after_good, x)
    assert after_bad.metrics.latest("loss")[1].item() == 64.0  # finite: only the gradient is bad
    assert int(after_bad.metrics.latest("skipped")[1]) == 1
    testing.assert_identical(after_bad.params, after_good.params)
    testing.assert_identical(after_bad.opt_state, after_good.opt_state)


@pytest.mark.parametrize("compile", [False, True])
def test_a_huge_finite_float64_gradient_is_not_taken_for_an_overflow(compile):
    # 1e200 is finite in float64 and inf in float32: the check must not narrow the gradient.
    model = torch.nn.Linear(2, 1).double()

    def bounded(forward, batch):
        return torch.sin(forward(batch)).sum()  # a loss in [-3, 3], a weight gradient of about 1e200

    opt = fl.optim.sgd(1e-201)  # an update of about 0.2
    step = fl.train_step(model, bounded, opt, compile=compile, skip_nonfinite=True)
    state = fl.init(model, opt, seed=0, max_iter=1)
    after = step(state, torch.full((3, 2), 1e200, dtype=torch.float64))
    assert float(after.metrics.latest("skipped")[1]) == 0
    assert not torch.equal(after.params["weight"], state.params["weight"])
