"""The command line on whole runs: diff compares runs, not clocks; inspect finds a run's checkpoints."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import checkpoint
from fnloop.cli import main


def _loss(forward, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(forward(x), y)


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
        "not compared: what the machine measured (state.metrics.series['time'], "
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


def test_diff_leaves_the_memory_the_machine_measured_out_unless_asked(tmp_path, capsys):
    # Two bit-exact runs differ in their processes' peak memory (memory()'s max_mem), as in their clocks.
    state = fl.TrainState(max_iter=3, metrics=fl.Metrics().record(2, {"loss": 0.5, "max_mem": 100.0}))
    other = attrs.evolve(state, metrics=fl.Metrics().record(2, {"loss": 0.5, "max_mem": 120.0}))
    a, b = checkpoint.save(state, tmp_path / "a"), checkpoint.save(other, tmp_path / "b")
    code, lines, _ = _cli(capsys, "diff", a, b)
    assert code == 0, lines
    assert (
        lines[-2]
        == "not compared: what the machine measured (state.metrics.series['max_mem'] differ); --clock compares it"
    )
    code, lines, _ = _cli(capsys, "diff", a, b, "--clock")
    assert code == 1
    assert any(line.startswith("state.metrics.series['max_mem']") for line in lines)


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
