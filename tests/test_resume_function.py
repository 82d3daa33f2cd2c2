"""checkpoint.resume: the newest checkpoint or the template, and never a silent change of the run's settings."""

from __future__ import annotations

import warnings

import attrs
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fnloop as fl
from fnloop import testing
from fnloop.checkpoint import CheckpointMismatch, RunChanged
from fnloop.examples import digits


def loss_fn(forward, batch):
    x, y = batch
    return F.mse_loss(forward(x), y)


def job(max_iter: int, seed: int = 0):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = fl.optim.sgd(fl.optim.cosine(0.1, max_iter))
    state = fl.init(model, optimizer, seed=seed, max_iter=max_iter)
    step = fl.train_step(model, loss_fn, optimizer, compile=False)
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(32, 3, generator=g), torch.randn(32, 1, generator=g))
    return state, step, fl.data.batches(data, batch_size=8, seed=seed)


def test_a_longer_template_extends_the_run_and_says_so(tmp_path):
    state, step, batches = job(200)
    fl.run(state, step, batches, [fl.every(100, fl.hooks.checkpoint(tmp_path))])
    template, step, batches = job(500)

    # The defect: latest keeps the saved max_iter, and `latest(...) or template` never notices.
    assert fl.checkpoint.latest(tmp_path, like=template).max_iter == 200

    with pytest.warns(
        RunChanged, match=r"iteration 200 with max_iter=200; it continues to the template's max_iter=500"
    ):
        resumed = fl.checkpoint.resume(tmp_path, like=template)
    assert (resumed.iteration, resumed.max_iter) == (200, 500)
    final = fl.run(resumed, step, batches, [fl.every(100, fl.hooks.checkpoint(tmp_path))])
    assert final.iteration == 500
    assert fl.checkpoint.checkpoints(tmp_path)[0].name == "ckpt-00000500.safetensors"
    # Once extended, the run is the longer one: resuming it again says nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fl.checkpoint.resume(tmp_path, like=template).max_iter == 500


def test_the_warning_says_a_schedule_spans_the_templates_length(tmp_path):
    template = fl.TrainState(max_iter=50)
    fl.save(attrs.evolve(template, max_iter=20, iteration=20), fl.checkpoint.path_for(tmp_path, 20))
    with pytest.warns(
        RunChanged,
        match=r"schedule spanning max_iter is built from the code, so it spans the template's 50 steps",
    ):
        fl.checkpoint.resume(tmp_path, like=template)
    with pytest.warns(RunChanged, match=r"To keep the run as it was, build the template with max_iter=20\."):
        fl.checkpoint.resume(tmp_path, like=template)


def test_no_checkpoint_gives_the_template_itself(tmp_path):
    template = fl.TrainState(max_iter=5, params={"w": torch.zeros(2)})
    assert fl.checkpoint.resume(tmp_path / "missing", like=template) is template
    assert fl.checkpoint.resume(tmp_path, like=template) is template


def test_the_same_settings_resume_the_saved_state_unchanged(tmp_path):
    state, step, batches = job(20)
    fl.run(state, step, batches, [fl.every(10, fl.hooks.checkpoint(tmp_path))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = fl.checkpoint.resume(tmp_path, like=job(20)[0])
    testing.assert_identical(resumed, fl.checkpoint.latest(tmp_path, like=state))


def test_another_seed_is_another_run(tmp_path):
    fl.save(fl.TrainState(max_iter=10, iteration=4, rng=1), fl.checkpoint.path_for(tmp_path, 4))
    with pytest.raises(
        CheckpointMismatch,
        match=r"iteration 4 seeded 1, but the template is seeded 2: .* seed=1 to resume it, or give the new run another directory",
    ):
        fl.checkpoint.resume(tmp_path, like=fl.TrainState(max_iter=10, rng=2))
    # Both settings changed: the seed decides, no warning first.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointMismatch, match="seeded 1"):
            fl.checkpoint.resume(tmp_path, like=fl.TrainState(max_iter=30, rng=2))


def test_a_template_shorter_than_the_steps_taken_is_an_error(tmp_path):
    fl.save(fl.TrainState(max_iter=10, iteration=8), fl.checkpoint.path_for(tmp_path, 8))
    with pytest.raises(
        CheckpointMismatch, match=r"past the template's max_iter=5: .* max_iter >= 8 to resume it"
    ):
        fl.checkpoint.resume(tmp_path, like=fl.TrainState(max_iter=5))
    with pytest.warns(RunChanged, match="max_iter=8"):
        assert fl.checkpoint.resume(tmp_path, like=fl.TrainState(max_iter=8)).max_iter == 8


def test_a_template_that_does_not_fit_is_named_as_latest_names_it(tmp_path):
    fl.save(fl.TrainState(max_iter=10, params={"w": torch.zeros(2)}), fl.checkpoint.path_for(tmp_path, 0))
    with pytest.raises(CheckpointMismatch, match=r"ckpt-00000000.safetensors"):
        fl.checkpoint.resume(tmp_path, like=fl.TrainState(max_iter=10, params={"w": torch.zeros(3)}))
    with pytest.raises(TypeError, match=r"resume\(\) expected like= a fnloop.TrainState"):
        fl.checkpoint.resume(tmp_path, like=None)  # type: ignore[arg-type]


def test_the_digits_example_extends_with_a_warning_and_refuses_another_seed(tmp_path, capsys):
    args = ["--out", str(tmp_path), "--eager", "--checkpoint-every", "10", "--quiet"]
    digits.main([*args, "--max-iter", "20"])
    assert capsys.readouterr().out.startswith(f"started fresh: checkpoints go to {tmp_path / 'ckpt'}\n")

    with pytest.warns(RunChanged, match="max_iter=20; it continues to the template's max_iter=30"):
        digits.main([*args, "--max-iter", "30"])
    assert f"resumed from iteration 20 ({tmp_path / 'ckpt'})" in capsys.readouterr().out
    assert fl.checkpoint.checkpoints(tmp_path / "ckpt")[0].name == "ckpt-00000030.safetensors"

    with pytest.raises(
        SystemExit,
        match=r"(?s)seeded 0, but the template is seeded 1: .*resume it with the --seed it was run with",
    ):
        digits.main([*args, "--max-iter", "30", "--seed", "1"])


def member(seed: int, lr: float = 0.1, max_iter: int = 6) -> fl.TrainState:
    torch.manual_seed(seed)
    return fl.init(nn.Linear(3, 1), fl.optim.inject(fl.optim.sgd, lr=lr), seed=seed, max_iter=max_iter)


def saved_population(tmp_path, seeds=(0, 1), lrs=(0.1, 0.2)) -> fl.TrainState:
    population = fl.population(member, seeds=list(seeds), lr=list(lrs))
    fl.checkpoint.save(attrs.evolve(population, iteration=3), fl.checkpoint.path_for(tmp_path, 3))
    return population


def test_a_population_template_with_another_seed_for_any_member_is_another_run(tmp_path):
    # Only member 0's seed (state.rng) was compared: the others' were kept silently.
    saved_population(tmp_path)
    template = fl.population(member, seeds=[0, 2], lr=[0.1, 0.2])
    with pytest.raises(
        CheckpointMismatch,
        match=r"a population whose members are seeded \[0, 1\], but the template's are seeded \[0, 2\] "
        r"\(member 1: 1 saved, 2 in the template\).*Build the template with seeds=\[0, 1\]",
    ):
        fl.checkpoint.resume(tmp_path, like=template)


def test_a_population_template_with_other_hyperparameters_warns_and_keeps_the_saved_ones(tmp_path):
    # The saved hyperparameters were kept without a word.
    saved_population(tmp_path)
    template = fl.population(member, seeds=[0, 1], lr=[0.1, 0.3])
    with pytest.warns(
        RunChanged,
        match=r"other hyperparameters than the template's \(member 1: 'lr=0\.2' saved, 'lr=0\.3' in the "
        r"template\).*continues with the checkpoint's.*another directory",
    ):
        resumed = fl.checkpoint.resume(tmp_path, like=template)
    assert resumed.population.labels == ("lr=0.1", "lr=0.2")
    assert resumed.opt_state.hyperparams["lr"].tolist() == [0.1, 0.2]


def test_a_population_resumes_silently_under_the_same_seeds_and_hyperparameters(tmp_path):
    saved = saved_population(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = fl.checkpoint.resume(tmp_path, like=fl.population(member, seeds=[0, 1], lr=[0.1, 0.2]))
    assert resumed.iteration == 3 and resumed.population == saved.population
