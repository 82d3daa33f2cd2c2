"""precise_bn: the numbers of torch's update_bn, purity, when it runs, resume."""

from __future__ import annotations

import copy

import attrs
import pytest
import torch
from torch.optim.swa_utils import update_bn

import fnloop as fl
from fnloop import Phase, TrainState, testing
from fnloop.hooks import PreciseBNState, precise_bn


def net(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4),
        torch.nn.BatchNorm1d(4),
        torch.nn.Dropout(dropout),
        torch.nn.ReLU(),
        torch.nn.Linear(4, 2),
        torch.nn.BatchNorm1d(2, momentum=0.3),
    )


def batches(n: int = 5, size: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(size, 3, generator=g) * 2 + 1, torch.zeros(size)) for _ in range(n)]


def loss_fn(forward, batch):
    x, _ = batch
    return forward(x).pow(2).mean()


def trained(model: torch.nn.Module, steps: int = 3) -> TrainState:
    step = fl.train_step(model, loss_fn, fl.optim.sgd(0.1), compile=False)
    state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=steps)
    return fl.run(state, step, batches(steps))


def test_it_matches_torch_update_bn():
    model = net()
    state = trained(model)
    data = batches(5)
    new = precise_bn(model, data, num_iter=None)(state, Phase.AFTER_STEP)
    reference = copy.deepcopy(model)
    reference.load_state_dict({**state.params, **state.buffers})
    update_bn(data, reference)
    want = dict(reference.named_buffers())
    assert sorted(new.buffers) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(new.buffers[k], v, rtol=1e-6, atol=1e-7)
    assert new.buffers["1.num_batches_tracked"].item() == 5
    # The statistics are those of the current parameters, not of the model's own tensors.
    assert not torch.allclose(new.buffers["1.running_mean"], state.buffers["1.running_mean"])


def test_num_iter_takes_the_first_batches():
    model = net()
    state = trained(model)
    data = batches(5)
    three = precise_bn(model, data, num_iter=3)(state, Phase.AFTER_STEP)
    first_three = precise_bn(model, data[:3], num_iter=None)(state, Phase.AFTER_STEP)
    testing.assert_identical(three.buffers, first_three.buffers)


def test_the_model_the_state_and_the_old_buffers_are_left_as_they_were():
    model = net()
    state = trained(model)
    before = copy.deepcopy(model.state_dict())
    model.eval()
    momenta = [m.momentum for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d)]
    old = {k: v.clone() for k, v in state.buffers.items()}
    precise_bn(model, batches(), num_iter=None)(state, Phase.AFTER_STEP)
    testing.assert_identical(model.state_dict(), before)
    assert not model.training
    assert (
        [m.momentum for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d)] == momenta == [0.1, 0.3]
    )
    testing.assert_identical(state.buffers, old)


def test_with_dropout_it_is_deterministic_and_leaves_the_global_generator_alone():
    model = net(dropout=0.5)
    state = trained(model)
    hook = precise_bn(model, batches(), num_iter=None)
    rng = torch.get_rng_state()
    first = hook(state, Phase.AFTER_STEP)
    assert torch.equal(torch.get_rng_state(), rng)
    torch.manual_seed(123)
    testing.assert_identical(first.buffers, hook(state, Phase.AFTER_STEP).buffers)


def test_a_stream_is_read_from_its_start_and_wraps_around_epochs():
    model = net()
    state = trained(model)
    x = torch.cat([b[0] for b in batches(4)])
    stream = fl.data.batches((x, torch.zeros(len(x))), batch_size=6, seed=0)
    hook = precise_bn(model, stream, num_iter=10)  # 4 batches per epoch
    listed = [b for b, _ in zip(stream, range(10))]
    testing.assert_identical(
        hook(state, Phase.AFTER_STEP).buffers,
        precise_bn(model, listed, num_iter=None)(state, Phase.AFTER_STEP).buffers,
    )
    one_epoch = precise_bn(model, stream, num_iter=None)(state, Phase.AFTER_STEP)
    assert one_epoch.buffers["1.num_batches_tracked"].item() == 4


@pytest.mark.parametrize(("max_iter", "calls"), [(30, [14, 29]), (31, [14, 29, 31])])
def test_it_runs_when_evaluate_does(max_iter, calls):
    def spy(state, phase, memory):
        steps = state.hooks.get("precise_bn", PreciseBNState()).steps
        if steps == memory[0]:
            return state, memory
        return state, (steps, (*memory[1], state.iteration))

    model = net()
    state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=max_iter)
    hooks = [fl.every(15, precise_bn(model, batches(2), num_iter=2)), fl.stateful("spy", (-1, ()), spy)]
    final = fl.run(state, lambda s, b: s, [None] * max_iter, hooks)
    assert final.hooks["spy"][1] == tuple(calls)
    assert final.hooks["precise_bn"] == PreciseBNState(max_iter)
    assert final.buffers["1.num_batches_tracked"].item() == 2


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    model = net(dropout=0.2)
    step = fl.train_step(model, loss_fn, fl.optim.sgd(0.1), compile=False)
    data = batches(8)
    stream = fl.data.batches((torch.cat([b[0] for b in data]), torch.zeros(48)), batch_size=6, seed=0)

    def hooks(folder):
        return [
            fl.every(2, precise_bn(model, stream, num_iter=3)),
            fl.every(3, fl.hooks.checkpoint(folder, keep=None)),
        ]

    like = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=7)
    whole = fl.run(like, step, stream, hooks(tmp_path), clock=lambda: 0.0)
    middle = fl.checkpoint.load(fl.checkpoint.path_for(tmp_path, 3), like=like)
    resumed = fl.run(middle, step, stream, hooks(tmp_path / "b"), clock=lambda: 0.0)
    testing.assert_identical(resumed, whole)
    assert whole.hooks["precise_bn"] == PreciseBNState(7)


@pytest.mark.parametrize("phase", list(Phase))
def test_precise_bn_is_a_good_hook(phase):
    model = net()
    state = attrs.evolve(trained(model), iteration=1, max_iter=4)
    testing.check_hook(precise_bn(model, batches(2), num_iter=2), state, (phase,))
    testing.check_hook(fl.every(2, precise_bn(model, batches(2), num_iter=2)), state, (phase,))


def test_errors_say_what_to_do():
    model = net()
    state = trained(model)
    with pytest.raises(
        ValueError, match=r"the batches ran out after 2 of num_iter=5. Pass num_iter=2 \(None: one pass\)"
    ):
        precise_bn(model, batches(2), num_iter=5)(state, Phase.AFTER_STEP)
    with pytest.raises(ValueError, match=r"the batches are empty"):
        precise_bn(model, [], num_iter=None)(state, Phase.AFTER_STEP)
    with pytest.raises(ValueError, match=r"Linear has no BatchNorm layer that tracks running statistics"):
        precise_bn(torch.nn.Linear(2, 2), batches())
    with pytest.raises(TypeError, match=r"needs batches it can read again"):
        precise_bn(model, iter(batches()))
    with pytest.raises(
        ValueError, match=r"'num_iter' must be a positive int or None \(got 0 that is an int\)"
    ):
        precise_bn(model, batches(), num_iter=0)
    with pytest.raises(TypeError, match=r"expected the model, a torch.nn.Module"):
        precise_bn(state, batches())  # type: ignore[arg-type]
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Identity(), torch.nn.BatchNorm1d(4))
    with pytest.raises(
        ValueError, match=r"state.buffers has no '2.running_mean'.*the model the state was built from"
    ):
        precise_bn(other, batches())(state, Phase.AFTER_STEP)


def test_it_names_its_configuration():
    assert (
        repr(precise_bn(net(), batches(), num_iter=7))
        == "stateful('precise_bn', precise_bn(Sequential, num_iter=7))"
    )
