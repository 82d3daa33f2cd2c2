"""Throughput and MFU: the counts over the measured time, and MFU from a stated FLOP count."""

from __future__ import annotations

import itertools

import pytest
import torch

import fnloop as fl
from fnloop import Phase

STEPS = 12


def watching(seen: list) -> object:
    """A hook that keeps what the throughput hook before it saw: the clock and the newest values."""

    def hook(state, phase):
        if phase is Phase.AFTER_STEP:
            names = ("samples_per_s", "tokens_per_s", "mfu", "hook_time")
            newest = {n: state.metrics.latest(n) for n in names if n in state.metrics.series}
            seen.append((state.iteration, state.time, state.step_time, newest))
        return state

    return hook


def step(state, batch):
    return fl.record(state, tokens=float(batch))


def run(hook, every=3, batches=None) -> list:
    seen: list = []
    ticks = itertools.count(0.0, 0.25)  # the fold's clock, read where it reads it
    fl.run(
        fl.TrainState(max_iter=STEPS),
        step,
        batches or [100] * STEPS,
        [fl.every(every, hook), fl.every(every, watching(seen))],
        clock=lambda: next(ticks),
    )
    return seen


def test_the_rates_are_the_counts_over_the_wall_time_between_calls():
    hook = fl.hooks.throughput(samples=8, tokens=8 * 64, flops_per_token=1e6, peak=2e9)
    seen = run(hook)
    assert [s[0] for s in seen] == [2, 5, 8, 11]
    first = seen[0]  # a run's first call: that iteration up to its AFTER_STEP
    assert first[3]["samples_per_s"] == (first[0], pytest.approx(8 / first[2]))
    for (i0, t0, _, _), (i1, t1, step_time, values) in itertools.pairwise(seen):
        per_step = (t1 - t0) / (i1 - i0)
        assert values["samples_per_s"] == (i1, pytest.approx(8 / per_step))
        assert values["tokens_per_s"] == (i1, pytest.approx(8 * 64 / per_step))
        assert values["mfu"] == (i1, pytest.approx(1e6 * 8 * 64 / per_step / 2e9))
        assert values["hook_time"] == (i1, pytest.approx(max(per_step - step_time, 0.0)))


def test_a_count_a_metric_records_is_averaged_over_the_steps_since_the_last_call():
    batches = [100 + 10 * i for i in range(STEPS)]
    seen = run(fl.hooks.throughput(tokens="tokens"), batches=batches)
    for (i0, t0, _, _), (i1, t1, _, values) in itertools.pairwise(seen):
        mean = sum(batches[i0 + 1 : i1 + 1]) / (i1 - i0)
        assert values["tokens_per_s"] == (i1, pytest.approx(mean / ((t1 - t0) / (i1 - i0))))


def test_flops_per_token_is_6n_plus_the_attentions_12ldt():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    # Every parameter but the embeddings (the output head is tied to the token embedding).
    n = sum(
        p.numel()
        for name, p in model.named_parameters()
        if not name.startswith(("transformer.wte", "transformer.wpe"))
    )
    assert fl.hooks.flops_per_token(model) == 6 * n
    assert fl.hooks.flops_per_token(model, seq_len=16) == 6 * n + 12 * 2 * 32 * 16
    with pytest.raises(ValueError, match="needs the model's layers and width"):
        fl.hooks.flops_per_token(torch.nn.Linear(2, 2), seq_len=16)


def test_peaks_come_from_the_table_or_are_measured():
    assert fl.hooks.peak_flops("H100", "bf16") == 989e12
    assert fl.hooks.peak_flops("A100", "fp32") == 19.5e12
    measured = fl.hooks.peak_flops("cpu")
    assert 1e8 < measured < 1e14  # a matrix product's FLOP/s on this machine, measured
    with pytest.raises(ValueError, match="no peak known for 'V100'"):
        fl.hooks.peak_flops("V100")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"samples": 0}, "samples=...\\) must be a positive int"),
        ({"flops_per_token": 1e6}, "needs tokens"),
        ({"tokens": 5, "flops_per_sample": 1e6}, "give flops_per_token instead"),
        (
            {"samples": 4, "flops_per_sample": 1e6, "peak": -1.0},
            r"peak=...\) must be .* positive finite .* \(got -1.0",
        ),
        ({"samples": 4, "flops_per_sample": 1e6, "peak": 0}, r"peak=...\) must be .* \(got 0 "),
        ({"samples": 4, "flops_per_sample": 1e6, "peak": float("nan")}, r"peak=...\) must be .* \(got nan"),
        ({"samples": 4, "flops_per_sample": 1e6, "peak": True}, r"peak=...\) must be .* \(got True"),
        ({"samples": 4, "peak": -5.0}, r"peak=...\) must be .* \(got -5.0"),
        ({"samples": 4, "flops_per_sample": 1e6, "peak": "V100"}, "no peak known for 'V100'"),
        ({"samples": 4, "flops_per_sample": float("nan")}, r"positive finite number \(got nan"),
        ({"samples": 4, "flops_per_sample": float("inf")}, r"positive finite number \(got inf"),
        ({"samples": 4, "dtype": "int8"}, r"dtype=...\) must be 'bf16', 'fp16' or 'fp32'"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fl.hooks.throughput(**kwargs)


@pytest.mark.parametrize("seq_len", [0, -8, 1.5, float("nan"), True, "8"])
def test_flops_per_token_refuses_a_sequence_length_that_is_not_a_positive_int(seq_len):
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20)
    )
    with pytest.raises(ValueError, match=r"seq_len must be the sequence length, a positive int"):
        fl.hooks.flops_per_token(model, seq_len)


def test_flops_per_token_refuses_what_is_not_a_model():
    with pytest.raises(TypeError, match=r"expected the model, a torch.nn.Module \(got 'gpt2'"):
        fl.hooks.flops_per_token("gpt2", 8)


def test_a_runs_first_call_counts_a_metric_of_that_iteration_alone():
    # The first call measures its iteration alone (its step_time): its count must be that iteration's,
    # not the mean of every step before it.
    batches = [100 + 10 * i for i in range(STEPS)]
    seen = run(fl.hooks.throughput(tokens="tokens"), batches=batches)
    i, _, step_time, values = seen[0]
    assert values["tokens_per_s"] == (i, pytest.approx(batches[i] / step_time))


def test_a_count_named_by_a_metric_never_recorded_warns_at_the_end():
    with pytest.warns(fl.hooks.MetricNeverRecorded, match=r"the metric 'samples' was never recorded"):
        seen = run(fl.hooks.throughput(samples="samples"))
    assert all("samples_per_s" not in values for *_, values in seen)


def test_two_runs_on_two_clocks_compare_equal_without_the_rates(tmp_path):
    # The rates are the machine's, as the timer's times are: fnloop.testing.without_clock and
    # `fnloop diff` leave them out, and the hook's memory with them.
    from fnloop import testing
    from fnloop.cli import main

    hooks = [fl.every(3, fl.hooks.throughput(samples=8, tokens=64, flops_per_token=1e3, peak=1e9))]
    finals = []
    for stride in (0.25, 0.5):
        ticks = itertools.count(0.0, stride)
        state = fl.run(
            fl.TrainState(max_iter=STEPS), step, [100] * STEPS, hooks, clock=lambda t=ticks: next(t)
        )
        finals.append(state)
    assert finals[0].metrics.latest("mfu") != finals[1].metrics.latest("mfu")
    testing.assert_identical(testing.without_clock(finals[0]), testing.without_clock(finals[1]))
    paths = [fl.save(s, tmp_path / f"run{i}.safetensors") for i, s in enumerate(finals)]
    assert main(["diff", str(paths[0]), str(paths[1])]) == 0


def test_an_mfu_above_1_warns_that_the_peak_or_the_flops_are_wrong():
    """1e6 FLOPs x 512 tokens in 0.75 s of the fake clock is 6.8e8 FLOP/s: above a peak of 1e8."""
    with pytest.warns(
        fl.hooks.ImpossibleMFU, match=r"mfu above 1 .* peak is too low .* flops_per_token too high"
    ):
        seen = run(fl.hooks.throughput(tokens=8 * 64, flops_per_token=1e6, peak=1e8))
    assert all(values["mfu"][1] > 1 for *_, values in seen[1:])
