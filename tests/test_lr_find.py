"""``fl.find_lr``: a range of learning rates as one population run, a suggestion, the caller's state untouched.

The digits MLP and a tiny GPT-2, as ``benchmarks/bench_lr_find.py`` runs them against Lightning's
``lr_find`` (its figures in docs/benchmarks.md). The steps run fnloop's traced graph (the suite's
graph backend): what is claimed here is the finder's, not inductor's.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import fnloop as fl
from fnloop import _lr_find


def cross_entropy(forward, batch):
    inputs, labels = batch
    return torch.nn.functional.cross_entropy(forward(inputs), labels)


@functools.cache
def digits() -> tuple[list, fl.LRFinding, dict, torch.nn.Module, fl.TrainState, list]:
    """The benchmark's digits case, a range test and 13 rates, 100 steps; what ``run`` was called with; the inputs after."""
    from fnloop.examples import digits as ex

    (x, y), _, _ = ex.digits()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    batches = [(x[order[i : i + 64]], y[order[i : i + 64]]) for i in range(0, len(x) - 64, 64)]
    torch.manual_seed(0)
    model = ex.mlp()
    state = fl.init(model, fl.optim.adamw(1e-3), seed=0, max_iter=5)
    before = (
        {k: v.clone() for k, v in model.state_dict().items()},
        {k: v.clone() for k, v in state.params.items()},
    )
    calls: list = []
    real = _lr_find.run

    def counted(members, step, stream):
        calls.append((members, step))
        return real(members, step, stream)

    _lr_find.run = counted
    try:
        found = fl.find_lr(model, cross_entropy, fl.optim.adamw, batches, num=13, steps=100, state=state)
    finally:
        _lr_find.run = real
    return calls, found, {"module": before[0], "state": before[1]}, model, state, batches


def test_the_rates_are_one_population_run_of_one_step():
    calls, found, *_ = digits()
    assert len(calls) == 1, "one run trains every rate"
    members, _ = calls[0]
    assert members.population is not None and members.population.size == len(found.lrs) + 1 == 14
    rates = [dict(kv.split("=") for kv in label.split(", ")) for label in members.population.labels]
    assert [float(r["lr"]) for r in rates[:-1]] == pytest.approx(list(found.lrs), rel=1e-2)
    assert {float(r["growth"]) for r in rates[:-1]} == {1.0}, "the constant rates"
    assert float(rates[-1]["growth"]) == pytest.approx(1e6 ** (1 / 100), rel=1e-3), "the range test"


def test_the_rates_are_log_spaced_over_the_range_and_each_has_its_curve():
    _, found, *_ = digits()
    assert found.lrs[0] == pytest.approx(1e-6) and found.lrs[-1] == pytest.approx(1.0)
    ratios = [b / a for a, b in zip(found.lrs, found.lrs[1:])]
    assert ratios == pytest.approx([ratios[0]] * len(ratios))
    assert all(len(curve) == 100 for curve in found.losses)


def test_the_callers_model_and_state_are_given_back_unchanged():
    _, _, before, model, state, _ = digits()
    assert state.iteration == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before["module"][k]), k
    for k, v in state.params.items():
        assert torch.equal(v, before["state"][k]), k


def test_the_range_test_grows_as_lightnings_and_its_suggestion_is_lightnings_rule():
    _, found, *_ = digits()
    assert found.rule == "range" and found.suggestion == dict(found.suggestions)["range"]
    ramp_lrs = [lr for lr, _ in found.ramp]
    growth = 1e6 ** (1 / 100)
    assert ramp_lrs == pytest.approx([1e-6 * growth ** (t + 1) for t in range(len(ramp_lrs))])
    smoothed = [loss for _, loss in found.ramp]
    assert len(smoothed) == 100 or smoothed[-1] > 4 * min(smoothed[:-1]), "stopped only where it diverged"
    # Lightning's suggestion(skip_begin=10, skip_end=1): the steepest fall against the rate itself.
    window = found.ramp[10:-1]
    slopes = [(window[1][1] - window[0][1]) / (window[1][0] - window[0][0])]
    slopes += [
        (window[i + 1][1] - window[i - 1][1]) / (window[i + 1][0] - window[i - 1][0])
        for i in range(1, len(window) - 1)
    ]
    slopes += [(window[-1][1] - window[-2][1]) / (window[-1][0] - window[-2][0])]
    assert found.suggestion == window[slopes.index(min(slopes))][0]


def test_the_digits_mlps_suggestion_is_inside_the_range_lightnings_lr_find_suggests():
    """Lightning's ``lr_find`` (100 steps, AdamW, seeds 0-4) suggested 5.2e-3 to 1.2e-2 here."""
    _, found, *_ = digits()
    assert 5.2e-3 <= found.suggestion <= 1.21e-2, str(found)


def test_the_steepest_rule_on_the_constant_rates_is_the_final_losses_fastest_fall():
    _, found, *_ = digits()
    steepest = dict(found.suggestions)["steepest"]
    usable = []
    for lr, end in zip(found.lrs, found.final):
        if math.isnan(end):
            break
        usable.append((math.log10(lr), end))
    # Central differences (one-sided at the ends), as torch.gradient and Lightning's np.gradient take them.
    xs, ys = zip(*usable)
    slopes = [(ys[1] - ys[0]) / (xs[1] - xs[0])]
    slopes += [(ys[i + 1] - ys[i - 1]) / (xs[i + 1] - xs[i - 1]) for i in range(1, len(xs) - 1)]
    slopes += [(ys[-1] - ys[-2]) / (xs[-1] - xs[-2])]
    assert steepest == pytest.approx(10 ** xs[slopes.index(min(slopes))])
    # The digits MLP learns: the suggestion's loss is below the slowest rate's.
    assert found.final[found.lrs.index(steepest)] < found.final[0]


def test_the_rates_that_blow_up_are_diverged_and_the_low_rates_that_barely_move_are_not():
    _, found, *_ = digits()
    assert math.isnan(found.final[-1]), "lr=1 on AdamW blows the MLP's loss up"
    assert not any(math.isnan(end) for end in found.final[:4]), "a loss that has not moved has not diverged"
    assert "diverged" in str(found) and "(range): " in str(found) and "<- the suggestion" in str(found)


def test_the_lowest_rule_takes_the_lowest_final_loss():
    _, found, *_ = digits()
    finite = [(end, lr) for lr, end in zip(found.lrs, found.final) if not math.isnan(end)]
    assert dict(found.suggestions)["lowest"] == min(finite)[1]


GPT2_LOW, GPT2_HIGH = 8.3e-5, 5.8e-4
"""Lightning's lr_find on the GPT-2 below, seeds 0-4: 5.0e-4, 5.8e-4, 1.9e-4, 1.3e-4, 8.3e-5."""


def test_a_tiny_gpt2s_suggestion_is_inside_the_range_lightnings_lr_find_suggests():
    """Lightning's ``lr_find`` (100 steps, AdamW, seeds 0-4) suggested 8.3e-5 to 5.8e-4 here."""
    transformers = pytest.importorskip("transformers")
    from pathlib import Path

    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(config)
    text = Path(torch.__file__).with_name("nn").joinpath("modules", "module.py").read_bytes()
    ids = torch.tensor(list(text[: 64 * 8 * 200]), dtype=torch.long).reshape(-1, 64)
    batches = [ids[i : i + 8] for i in range(0, len(ids) - 8, 8)]

    def loss(forward, batch):
        return forward(input_ids=batch, labels=batch).loss

    found = fl.find_lr(model, loss, fl.optim.adamw, batches, num=13, steps=100)
    assert GPT2_LOW <= found.suggestion <= GPT2_HIGH, str(found)


def test_a_list_shorter_than_the_steps_is_gone_through_again_as_epochs_are():
    *_, batches = digits()
    assert len(batches) < 100  # the digits case above ran 100 steps on 21 batches


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"min_lr": 0.0}, "min_lr"),
        ({"max_lr": math.inf}, "max_lr"),
        ({"min_lr": 1e-2, "max_lr": 1e-3}, "must be below"),
        ({"num": 2}, "num"),
        ({"num": 10**9}, "num"),
        ({"steps": 3}, "steps"),
        ({"rule": "valley"}, "rule"),
        ({"optimizer": fl.optim.adamw(1e-3)}, "function of the learning rate"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(kwargs, says):
    args = {"optimizer": fl.optim.sgd}
    args.update(kwargs)
    optimizer = args.pop("optimizer")
    with pytest.raises((ValueError, TypeError), match=says):
        fl.find_lr(torch.nn.Linear(2, 1), cross_entropy, optimizer, iter(()), **args)


def test_a_stream_that_runs_out_says_how_many_steps_it_needed():
    data = iter([(torch.randn(4, 2), torch.randint(0, 1, (4,)))] * 3)
    with pytest.raises(ValueError, match="ran out before 4 steps"):
        fl.find_lr(torch.nn.Linear(2, 1), cross_entropy, fl.optim.sgd, data, num=3, steps=4, compile=False)


def test_the_range_test_is_smoothed_and_stopped_as_lightnings_callback_does():
    """Lightning's ``_LRCallback``: an exponential average corrected by the optimizer steps taken (one more
    than the index), stopped after the step whose smoothed loss is 4 times the lowest so far."""
    losses = [2.0, 1.0, 1.5, 0.5, 0.4, 9.0, 50.0, 80.0, 99.0]
    ramp = _lr_find._smoothed([float(i) for i in range(len(losses))], losses)
    average, want, best = 0.0, [], 0.0
    for t, loss in enumerate(losses):
        average = 0.98 * average + 0.02 * loss
        want.append(average / (1 - 0.98 ** (t + 2)))
        if t > 0 and want[-1] > 4 * best:
            break
        best = want[-1] if t == 0 or want[-1] < best else best
    assert [loss for _, loss in ramp] == pytest.approx(want)
    assert len(ramp) < len(losses), "the test stopped"
    assert _lr_find._smoothed([1.0, 2.0, 3.0], [1.0, math.nan, 1.0]) == _lr_find._smoothed([1.0], [1.0])


def test_the_plot_draws_the_constant_rates_and_the_range_test(tmp_path):
    _, found, *_ = digits()
    figure = found.plot(tmp_path / "lr.png")
    assert (tmp_path / "lr.png").stat().st_size > 0
    labels = [line.get_label() for line in figure.axes[1].get_lines()]
    assert labels[:2] == ["after 100 steps at each rate", "the range test, smoothed"]
