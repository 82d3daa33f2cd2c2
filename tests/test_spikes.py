"""Skipping loss spikes: the rule of a running window, a skip that changes nothing, resume, and the stop."""

from __future__ import annotations

import statistics

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import testing

pytestmark = pytest.mark.xdist_group("spikes")

STEPS = 40
SPIKES = (24, 31, 32)
SETTINGS = {"window": 16, "threshold": 6.0, "warmup": 8}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def loss_fn(forward, batch):
    x, y = batch
    return ((forward(x) - y) ** 2).mean()


def data(spikes=SPIKES, steps=STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        out.append((x, y * 100.0 if i in spikes else y))  # a batch of wild targets
    return out


def optimizer() -> fl.optim.SkipsSpikes:
    return fl.optim.skip_spikes(fl.optim.adam(1e-2), **SETTINGS)


@pytest.fixture(scope="module")
def steps() -> dict[str, fl.Step]:
    return {
        "eager": fl.train_step(model(), loss_fn, optimizer(), compile=False),
        "compiled": fl.train_step(model(), loss_fn, optimizer()),
    }


def series(states: list[fl.TrainState], name: str) -> list[float]:
    found: dict[int, float] = {}
    for state in states:
        for i, value in state.metrics.history(name):
            found[i] = float(value)
    return [found[i] for i in sorted(found)]


def skipped_at(states: list[fl.TrainState], name: str = "spikes") -> list[int]:
    """Per step, 1 where it was skipped: the steps of the running count ``spikes``."""
    counts = series(states, name)
    return [int(b - a) for a, b in zip([0.0, *counts], counts)]


def judged(losses: list[float], norms: list[float]) -> list[int]:
    """The rule by hand: skip where the loss or norm is above mean + threshold * (population) deviation."""
    window, threshold, warmup = SETTINGS["window"], SETTINGS["threshold"], SETTINGS["warmup"]
    kept: list[tuple[float, float]] = []
    out = []
    for loss, norm in zip(losses, norms):
        recent = kept[-window:]
        spike = 0
        if len(recent) >= warmup:
            for values, value in (([a for a, _ in recent], loss), ([b for _, b in recent], norm)):
                if value > statistics.fmean(values) + threshold * statistics.pstdev(values):
                    spike = 1
        out.append(spike)
        if not spike:
            kept.append((loss, norm))
    return out


@pytest.mark.parametrize("how", ["eager", "compiled"])
def test_the_spikes_are_skipped_by_the_windows_rule_and_change_nothing(how, steps):
    states = list(fl.scan(fl.init(model(), optimizer(), seed=0, max_iter=STEPS), steps[how], data()))
    spikes = skipped_at(states)
    assert [i for i, s in enumerate(spikes) if s] == list(SPIKES)
    # The same decisions by hand, from each step's loss and gradient norm (taken from a run with stats).
    watched = fl.train_step(model(), loss_fn, optimizer(), compile=False, stats="model")
    seen = list(fl.scan(fl.init(model(), optimizer(), seed=0, max_iter=STEPS), watched, data()))
    assert judged(series(seen, "loss"), series(seen, "grad_norm")) == spikes
    assert series(states, "spikes_in_a_row")[30:34] == [0, 1, 2, 0]
    for i in SPIKES:  # a skipped step leaves the parameters and Adam's state as they were
        testing.assert_identical(states[i].params, states[i - 1].params)
        testing.assert_identical(states[i].opt_state.inner, states[i - 1].opt_state.inner)
    assert int(states[-1].opt_state.skipped) == len(SPIKES)
    assert int(states[-1].opt_state.inner[0].step) == STEPS - len(SPIKES)


@pytest.mark.parametrize("how", ["eager", "compiled"])
def test_a_resume_across_a_skip_is_bit_exact(how, steps, tmp_path):
    step = steps[how]
    whole = fl.run(fl.init(model(), optimizer(), seed=0, max_iter=STEPS), step, data())
    for at in (24, 25, 32, 33):
        start = fl.init(model(), optimizer(), seed=0, max_iter=at)
        half = fl.run(start, step, data()[:at])
        fl.save(half, tmp_path / "half.safetensors")
        loaded = fl.load(tmp_path / "half.safetensors", like=start)
        final = fl.run(attrs.evolve(loaded, max_iter=STEPS), step, data()[at:])
        testing.assert_identical(final.params, whole.params)
        testing.assert_identical(final.opt_state, whole.opt_state)


def test_the_run_stops_after_n_spikes_in_a_row_with_the_last_good_checkpoint(steps, tmp_path):
    hooks = [fl.hooks.checkpoint(tmp_path, keep=None), fl.hooks.stop_on_spikes(3)]
    state = fl.init(model(), optimizer(), seed=0, max_iter=STEPS)
    with pytest.raises(fl.hooks.SpikesInARow, match=r"step 22: 3 steps in a row were skipped as spikes"):
        fl.run(state, steps["eager"], data(spikes=range(20, STEPS)), hooks)
    last = fl.load(fl.checkpoint.checkpoints(tmp_path)[0], like=state)
    assert int(last.opt_state.inner[0].step) == 20  # no spike ever reached the parameters


def test_with_loss_scaling_the_two_wrap_each_other():
    opt = fl.optim.dynamic_loss_scale(optimizer(), init_scale=2.0**8)
    step = fl.train_step(model(), loss_fn, opt, compile=False)
    states = list(fl.scan(fl.init(model(), opt, seed=0, max_iter=STEPS), step, data()))
    assert [i for i, s in enumerate(skipped_at(states)) if s] == list(SPIKES)
    assert set(series(states, "overflow")) == {0.0}
    with pytest.raises(TypeError, match=r"dynamic_loss_scale\(skip_spikes\(adamw"):
        fl.optim.skip_spikes(fl.optim.dynamic_loss_scale(fl.optim.adam(1e-2)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 1}, "window"),
        ({"window": 10**9}, r"window=...\) must be an int from 2 to 100,000 \(got 1000000000"),
        ({"threshold": 0}, "threshold"),
        ({"warmup": 1}, "warmup"),
    ],
)
def test_settings_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fl.optim.skip_spikes(fl.optim.sgd(0.1), **kwargs)


@pytest.mark.parametrize("how", ["eager", "compiled"])
def test_each_member_of_a_population_judges_its_own_spikes_as_its_solo_run(how, steps):
    def member(seed):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        return fl.init(net, optimizer(), seed=seed, max_iter=STEPS)

    together = list(fl.scan(fl.population(member, seeds=[0, 1]), steps[how], data()))
    for m in (0, 1):
        alone = list(fl.scan(member(m), steps[how], data()))
        assert skipped_at(together, f"spikes/{m}") == skipped_at(alone)
        mine = fl.member(together[-1], m)
        assert int(mine.opt_state.skipped) == int(alone[-1].opt_state.skipped) >= 1
        if how == "eager":
            testing.assert_identical(mine.opt_state, alone[-1].opt_state)


def test_stop_on_spikes_in_a_run_whose_optimizer_skips_none_is_refused_as_it_starts():
    opt = fl.optim.adam(1e-2)  # no skip_spikes: spikes_in_a_row is never recorded
    step = fl.train_step(model(), loss_fn, opt, compile=False)
    with pytest.raises(ValueError, match=r"stop_on_spikes\(2\) in a run whose optimizer skips no spikes"):
        fl.run(fl.init(model(), opt, seed=0, max_iter=2), step, data(steps=2), [fl.hooks.stop_on_spikes(2)])
    scaled = fl.optim.dynamic_loss_scale(optimizer())  # wrapped in loss scaling: found inside
    state = fl.init(model(), scaled, seed=0, max_iter=2)
    assert fl.hooks.stop_on_spikes(2)(state, fl.Phase.BEFORE_TRAIN) is state
