"""ema and ema_params: the numbers, purity, no aliasing, resume."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fnloop as fl
from fnloop import Phase, TrainState, testing
from fnloop.hooks import EmaState, ema, ema_params

DECAY = 0.9


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def loss_fn(forward, batch):
    x, y = batch
    return (forward(x) - y).pow(2).mean()


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 3, generator=g)
    return x, x.sum(1, keepdim=True)


def stream():
    return fl.data.batches(data(), batch_size=8, seed=0)


def train(max_iter: int, hooks, *, donate: bool = True, state: TrainState | None = None) -> TrainState:
    model = tiny()
    step = fl.train_step(model, loss_fn, fl.optim.sgd(0.1), compile=False, donate=donate)
    start = state or fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=max_iter)
    return fl.run(start, step, stream(), hooks, clock=lambda: 0.0)


def params_after_each_step(max_iter: int) -> list[dict[str, torch.Tensor]]:
    model = tiny()
    step = fl.train_step(model, loss_fn, fl.optim.sgd(0.1), compile=False, donate=False)
    start = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=max_iter)
    states = list(fl.scan(start, step, stream()))
    return [{k: v.clone() for k, v in s.params.items()} for s in [start, *states[:-1]]]


def test_it_matches_a_hand_written_average():
    history = params_after_each_step(6)
    average = history[0]
    for params in history[1:]:
        average = {k: DECAY * average[k] + (1 - DECAY) * params[k] for k in average}
    final = train(6, [ema(DECAY)])
    got = ema_params(final)
    assert list(got) == list(final.params)
    for k in average:
        torch.testing.assert_close(got[k], average[k], rtol=1e-6, atol=1e-7)
    assert final.hooks["ema"].updates == 6


def test_it_matches_torch_averaged_model_bit_for_bit():
    history = params_after_each_step(6)
    model = tiny()
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    for params in history:  # the first call copies, as the hook does at BEFORE_TRAIN
        model.load_state_dict(params)
        averaged.update_parameters(model)
    final = train(6, [ema(DECAY)])
    want = {k.removeprefix("module."): v for k, v in averaged.named_parameters()}
    testing.assert_identical(ema_params(final), {k: want[k].detach() for k in final.params})


def test_donating_and_not_donating_give_the_same_average():
    testing.assert_identical(train(5, [ema(DECAY)]), train(5, [ema(DECAY)], donate=False))


def test_the_average_never_shares_storage_with_the_params():
    final = train(3, [ema(DECAY)])
    ptrs = {p.untyped_storage().data_ptr() for p in final.params.values()}
    assert not ptrs & {p.untyped_storage().data_ptr() for p in ema_params(final).values()}
    started = ema(DECAY)(TrainState(max_iter=1, params={"w": torch.ones(2)}), Phase.BEFORE_TRAIN)
    assert started.hooks["ema"].params["w"].data_ptr() != started.params["w"].data_ptr()


def test_an_update_builds_new_tensors_and_leaves_the_old_average_as_it_was():
    state = ema(0.5)(TrainState(max_iter=2, params={"w": torch.zeros(3)}), Phase.BEFORE_TRAIN)
    old = state.hooks["ema"].params["w"]
    stepped = attrs.evolve(state, params={"w": torch.ones(3)})
    new = ema(0.5)(stepped, Phase.AFTER_STEP)
    assert new.hooks["ema"].params["w"].tolist() == [0.5, 0.5, 0.5]
    assert old.tolist() == [0.0, 0.0, 0.0] and old._version == 0


def test_before_train_keeps_an_average_the_state_already_holds():
    state = TrainState(max_iter=2, params={"w": torch.zeros(2)})
    held = EmaState({"w": torch.full((2,), 7.0)}, 3)
    kept = ema(DECAY)(attrs.evolve(state, hooks={"ema": held}), Phase.BEFORE_TRAIN)
    assert kept.hooks["ema"] is held


def test_an_average_of_another_model_is_refused():
    state = TrainState(
        max_iter=2, params={"w": torch.zeros(2)}, hooks={"ema": EmaState({"v": torch.zeros(2)})}
    )
    with pytest.raises(
        ValueError, match=r"ema 'ema': the average holds \['v'\] but the state's params are \['w'\]"
    ):
        ema(DECAY)(state, Phase.BEFORE_TRAIN)


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    def hooks(folder):
        return [ema(DECAY), fl.every(3, fl.hooks.checkpoint(folder, keep=None))]

    whole = train(7, hooks(tmp_path))
    model = tiny()
    like = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=7)
    middle = fl.checkpoint.load(fl.checkpoint.path_for(tmp_path, 3), like=like)
    assert ema_params(middle).keys() == middle.params.keys()  # claimed from the file, no hook run yet
    resumed = train(7, hooks(tmp_path / "b"), state=middle)
    testing.assert_identical(resumed, whole)


def test_ema_params_without_an_ema_says_how_to_add_one():
    state = TrainState(max_iter=1, hooks={"eval": 1})
    with pytest.raises(
        KeyError, match=r"no EMA named 'ema' in this state \(hook states present: \['eval'\]\)"
    ):
        ema_params(state)
    with pytest.raises(TypeError, match=r"state.hooks\['eval'\] holds int, not an EMA"):
        ema_params(state, "eval")


@pytest.mark.parametrize("decay", [-0.1, 1.0, 1.5, "0.9", True])
def test_a_bad_decay_is_refused(decay):
    # 1.0 too: the average would never move from the first parameters.
    with pytest.raises(ValueError, match=r"'decay' must be a float in \[0, 1\)"):
        ema(decay)


def test_it_names_its_configuration():
    assert repr(ema(0.999)) == "ema(0.999, name='ema')"
    assert fl.state_names(ema(0.9, name="slow")) == ("slow",)
    with pytest.raises(ValueError, match="two hooks keep their state under the name 'ema'"):
        fl.chain(ema(0.9), ema(0.99))


@pytest.mark.parametrize("phase", list(Phase))
def test_ema_is_a_good_hook(phase):
    state = TrainState(max_iter=4, iteration=1, params={"w": torch.randn(2, 2), "b": torch.randn(2)})
    started = ema(DECAY)(state, Phase.BEFORE_TRAIN)
    for s in [state, started]:
        testing.check_hook(ema(DECAY), s, (phase,))
        testing.check_hook(fl.every(2, ema(DECAY)), s, (phase,))
