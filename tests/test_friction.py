"""A new user's smaller mistakes: each is explained or just works (issue 9, defect 5)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import checkpoint, testing
from fnloop.cli import main

ROOT = Path(__file__).resolve().parent.parent


# -- a torch scheduler or optimizer where a learning rate is expected ------------------------------


def _torch_optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: torch.optim.lr_scheduler.CosineAnnealingLR(_torch_optimizer(), T_max=100), "cosine"),
        (lambda: torch.optim.lr_scheduler.StepLR(_torch_optimizer(), step_size=10), "multistep"),
        (lambda: torch.optim.lr_scheduler.LinearLR(_torch_optimizer()), "linear_warmup"),
        (lambda: torch.optim.lr_scheduler.LambdaLR(_torch_optimizer(), lambda i: 1.0), "cosine"),
    ],
)
def test_a_torch_scheduler_as_lr_names_fnloop_schedules(make, named):
    scheduler = make()
    with pytest.raises(TypeError, match=r"fnloop\.optim\.cosine") as info:
        fl.optim.adamw(lr=scheduler)
    message = str(info.value)
    assert f"torch.optim.lr_scheduler.{type(scheduler).__name__}" in message
    assert f"fnloop.optim.{named}(" in message
    assert "warmup(" in message
    with pytest.raises(TypeError, match=r"not a torch\.optim\.lr_scheduler"):
        fl.optim.sgd(scheduler)


def test_a_torch_optimizer_as_lr_is_refused_with_the_fix():
    with pytest.raises(
        TypeError, match=r"'lr' must be a float or a fnloop schedule, not a torch\.optim\.SGD"
    ):
        fl.optim.adamw(lr=_torch_optimizer())


def test_fnloop_schedules_and_plain_functions_still_pass_as_lr():
    fl.optim.adamw(lr=fl.optim.cosine(1e-3, 100))
    fl.optim.sgd(lambda i: 0.1 * torch.ones(()))


# -- a module already wrapped by torch.compile -----------------------------------------------------


def _loss(forward, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(forward(x), y)


def _train(model: torch.nn.Module, compiled_wrapper: torch.nn.Module) -> fl.TrainState:
    optimizer = fl.optim.adamw(1e-2)
    state = fl.init(compiled_wrapper, optimizer, seed=0, max_iter=5)
    step = fl.train_step(compiled_wrapper, _loss, optimizer, compile=False)
    torch.manual_seed(1)
    batches = [(torch.randn(8, 3), torch.randn(8, 1)) for _ in range(5)]
    return fl.run(state, step, batches)


def test_a_torch_compiled_module_is_unwrapped_and_trains_like_the_plain_one():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    wrapped = torch.compile(model)
    assert isinstance(wrapped, torch._dynamo.eval_frame.OptimizedModule)
    plain_state = _train(model, model)
    wrapped_state = _train(model, wrapped)
    assert sorted(wrapped_state.params) == sorted(dict(model.named_parameters()))  # no "_orig_mod." prefix
    testing.assert_identical(testing.without_clock(plain_state), testing.without_clock(wrapped_state))
    evaluate = fl.eval_step(wrapped, lambda f, b: {"out": f(b).sum()}, compile=False)
    plain = fl.eval_step(model, lambda f, b: {"out": f(b).sum()}, compile=False)
    x = torch.randn(4, 3)
    assert torch.equal(evaluate(wrapped_state, x)["out"], plain(plain_state, x)["out"])


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: fl.init("model", fl.optim.sgd(0.1), seed=0, max_iter=1), "init"),
        (lambda: fl.train_step("model", _loss, fl.optim.sgd(0.1)), "train_step"),
        (lambda: fl.eval_step("model", _loss), "eval_step"),
    ],
)
def test_a_model_that_is_no_module_is_refused(call, name):
    with pytest.raises(TypeError, match=rf"{name}\(\) expected a torch\.nn\.Module, got 'model' \(a str\)"):
        call()


# -- catching in-place writes; the metrics window ---------------------------------------------------


def test_a_metrics_window_of_1000_keeps_1000():
    state = attrs.evolve(fl.TrainState(max_iter=2000), metrics=fl.Metrics(window=1000))
    metrics = state.metrics
    for i in range(1500):
        metrics = metrics.record(i, {"loss": float(i)})
    assert len(metrics.series["loss"]) == 1000
    assert metrics.series["loss"][0] == (500, 500.0)


def _page_blocks(page: str, heading: str) -> list[str]:
    text = (ROOT / "docs" / page).read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


@pytest.mark.parametrize("heading", ["## Catching in-place writes", "## The metrics window"])
def test_the_concepts_page_sections_run(heading, tmp_path):
    blocks = _page_blocks("concepts.md", heading)
    assert blocks
    for block in blocks:  # as a script, so that its functions pickle as a user's would
        done = subprocess.run(
            [sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr


# -- fnloop diff and inspect -----------------------------------------------------------------------


def _job(out: Path, lr: float = 1e-2) -> fl.TrainState:
    torch.manual_seed(0)
    x, y = torch.randn(64, 3), torch.randn(64, 2)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = fl.optim.adamw(lr)
    state = fl.init(model, optimizer, seed=0, max_iter=8)
    step = fl.train_step(model, _loss, optimizer, compile=False)
    hooks = [fl.hooks.timer(), fl.every(4, fl.hooks.checkpoint(out / "ckpt"))]
    return fl.run(state, step, fl.data.batches((x, y), batch_size=16, seed=0), hooks)


def _cli(capsys, *argv) -> tuple[int, list[str], str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, [" ".join(line.split()) for line in out.splitlines()], err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for name, lr in (("a", 1e-2), ("b", 1e-2), ("c", 2e-2)):
        _job(root / name, lr)
    return root


def test_diff_of_two_identical_runs_compares_runs_not_clocks(runs, capsys):
    code, lines, _ = _cli(capsys, "diff", runs / "a" / "ckpt", runs / "b" / "ckpt")
    assert code == 0, lines
    assert lines[-2] == (
        "not compared: the clock (state.metrics.series['time'], "
        "state.metrics.series['data_time'] differ); --clock compares it"
    )
    assert lines[-1].startswith("identical: ") and lines[-1].endswith(" leaves, bit for bit")
    code, lines, _ = _cli(capsys, "diff", runs / "a" / "ckpt", runs / "b" / "ckpt", "--clock")
    assert code == 1
    assert not any(line.startswith("state.time ") for line in lines)  # no part of a checkpoint
    assert any(line.startswith("state.metrics.series['time'] ") for line in lines)


def test_diff_ignores_a_timer_state_unless_asked(tmp_path, capsys):
    state = fl.TrainState(max_iter=3, hooks={"timer": fl.hooks.TimerState(0)})
    resumed = attrs.evolve(state, hooks={"timer": fl.hooks.TimerState(2)})
    a, b = checkpoint.save(state, tmp_path / "a"), checkpoint.save(resumed, tmp_path / "b")
    assert _cli(capsys, "diff", a, b)[0] == 0
    code, lines, _ = _cli(capsys, "diff", a, b, "--clock")
    assert code == 1
    assert "state.hooks['timer'].start 0 != 2" in lines


def test_diff_groups_optimizer_state_in_one_line(runs, capsys):
    code, lines, _ = _cli(capsys, "diff", runs / "a" / "ckpt", runs / "c" / "ckpt")
    assert code == 1
    opt = [line for line in lines if line.startswith("state.opt_state")]
    assert len(opt) == 1, lines
    assert re.fullmatch(
        r"state\.opt_state 8 of 11 leaves differ, max abs diff \S+ \(largest at \[0\]\.mu\['\S+'\]\): "
        r"\[0\]\.mu 4 tensors, \[0\]\.nu 4 tensors",
        opt[0],
    ), opt[0]
    assert len(lines) == 2 + 4 + 1 + 2 + 1 + 1  # A, B; 4 params; opt_state; loss, lr; the clock; summary


def test_diff_groups_many_differing_params(tmp_path, capsys):
    params = {f"layer{i}.weight": torch.zeros(2) for i in range(6)}
    a = fl.TrainState(max_iter=1, params=params)
    b = attrs.evolve(a, params={k: v + i for i, (k, v) in enumerate(params.items())})
    pa, pb = checkpoint.save(a, tmp_path / "a"), checkpoint.save(b, tmp_path / "b")
    code, lines, _ = _cli(capsys, "diff", pa, pb)
    assert code == 1
    assert lines[2] == "state.params 5 of 6 tensors differ, max abs diff 5 (largest at ['layer5.weight'])"
    assert len(lines) == 4


def test_inspect_of_a_run_directory_points_at_its_checkpoints(runs, capsys, tmp_path):
    (runs / "a" / "best").mkdir(exist_ok=True)
    checkpoint.save(fl.TrainState(max_iter=1), checkpoint.path_for(runs / "a" / "best", 0))
    for argv in (("inspect", runs / "a"), ("diff", runs / "a", runs / "b" / "ckpt")):
        code, out, err = _cli(capsys, *argv)
        assert (code, out) == (2, [])
        assert err == (
            f"fnloop {argv[0]}: error: {runs / 'a'}: a run directory; its checkpoints are in "
            f"{runs / 'a' / 'best'}, {runs / 'a' / 'ckpt'} (pass one of these)\n"
        )
    code, out, err = _cli(capsys, "inspect", tmp_path)
    assert code == 2
    assert err == f"fnloop inspect: error: {tmp_path}: a directory without checkpoints (ckpt-*.safetensors)\n"


# -- what the extras install -----------------------------------------------------------------------


def test_the_examples_extra_installs_what_the_docs_say():
    # Python 3.10 has no tomllib: the extra is one line, read as such.
    found = re.search(r"^examples = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert found is not None
    installed = {re.split(r"[<>=\[]", spec.strip().strip('"'))[0] for spec in found[1].split(",")}
    line = next(
        line for line in (ROOT / "docs" / "example.md").read_text().splitlines() if '".[examples]"' in line
    )
    said = {name.strip() for name in line.split("#", 1)[1].split(",")}
    assert said - {"torch", "attrs", "toolz"} == installed


def test_train_step_names_a_torch_optimizer_whole():
    with pytest.raises(
        TypeError, match=r"train_step\(\) expected a fnloop\.optim\.Optimizer, got a torch\.optim\.SGD; build"
    ):
        fl.train_step(torch.nn.Linear(2, 1), _loss, _torch_optimizer())
