"""The ``fnloop`` command: inspect, diff and replay, in process; one run through ``python -m fnloop``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import TrainState, checkpoint
from fnloop.cli import main
from fnloop.hooks import Best


def trained_state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    state = fl.init(model, fl.optim.adamw(1e-2), seed=5, max_iter=40, extra={"note": "hi", "scale": 2.5})
    state = attrs.evolve(
        state,
        iteration=12,
        data=12,
        hooks={"best:loss": Best(0.25, 9), "steps": 12},
        metrics=state.metrics.record(10, {"loss": torch.tensor(0.5), "lr": 0.01}).record(
            11, {"loss": torch.tensor(0.375)}
        ),
    )
    return state


@pytest.fixture
def saved(tmp_path):
    state = trained_state()
    return state, checkpoint.save(state, checkpoint.path_for(tmp_path, state.iteration))


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def squeezed(out: str) -> list[str]:
    """The lines of ``out`` with every run of spaces made one: what they say, not how they align."""
    return [" ".join(line.split()) for line in out.splitlines()]


# -- inspect ---------------------------------------------------------------------------------------


def test_inspect_shows_every_field_aligned(saved, capsys):
    state, path = saved
    code, out, err = run_cli(capsys, "inspect", path)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith(f"file       {path}  (") and lines[0].endswith(" kB)")
    assert lines[1].startswith("format     2, written by fnloop 0.1.0, crc32:")
    assert "iteration  12 / 40" in lines
    assert "rng        5" in lines and "data       12" in lines
    assert "params: 6 tensors, 29 elements, 116 B" in lines
    weight = state.params["0.weight"]
    norm = f"norm {torch.linalg.vector_norm(weight.double()).item():.4g}"
    assert any(line.startswith("  0.weight  float32  (4, 3)  " + norm) for line in lines)
    assert f"  2.bias    float32  (1,)    {state.params['2.bias'].item():.4g}" in lines
    assert any(line.startswith("  1.num_batches_tracked  int64    ()    0") for line in lines)
    assert any(line.startswith("  [0].mu['0.weight']  float32  (4, 3)  norm 0") for line in lines)
    assert "  [1]                 EmptyState()" in lines
    assert "metrics: 2 names, the last 20 entries of each kept" in lines
    assert "  loss  0.375  at iteration 11  (2 kept)" in lines
    assert "  lr    0.01   at iteration 10  (1 kept)" in lines
    assert "hooks: 2 states" in lines
    assert "  best:loss  Best(value=0.25, iteration=9)" in lines
    assert "  steps      12" in lines
    assert lines[-3:] == ["extra:", "  ['note']   'hi'", "  ['scale']  2.5"]


def test_inspect_json_is_machine_readable(saved, capsys):
    state, path = saved
    code, out, _ = run_cli(capsys, "inspect", path, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["file"] == {
        "path": str(path),
        "size": path.stat().st_size,
        "format": "2",
        "fnloop_version": fl.__version__,
        "checksum": checkpoint.read_raw(path)[0]["fnloop.checksum"],
    }
    assert (report["iteration"], report["max_iter"], report["rng"], report["data"]) == (12, 40, 5, 12)
    weight = report["params"]["0.weight"]
    assert (weight["dtype"], weight["shape"], weight["numel"]) == ("float32", [4, 3], 12)
    assert weight["norm"] == pytest.approx(torch.linalg.vector_norm(state.params["0.weight"]).item())
    assert weight["mean"] == pytest.approx(state.params["0.weight"].mean().item())
    assert report["opt_state"][0]["__type__"].endswith("ScaleByAdamState")
    assert report["opt_state"][0]["step"]["value"] == 0
    assert report["metrics"]["latest"]["loss"] == {"iteration": 11, "value": 0.375, "kept": 2}
    assert report["hooks"]["best:loss"] == {
        "__type__": "fnloop.hooks._checkpoint.Best",
        "value": 0.25,
        "iteration": 9,
    }
    assert report["extra"] == {"note": "hi", "scale": 2.5}
    assert set(report) == {"file"} | {f.name for f in attrs.fields(TrainState)} - {
        "effects",
        "clock",
        "shards",
        "tensor",  # a tensor-parallel state is saved whole
    }


def test_inspect_a_directory_shows_its_newest_checkpoint(tmp_path, capsys):
    for i in (3, 7, 5):
        checkpoint.save(TrainState(max_iter=9, iteration=i), checkpoint.path_for(tmp_path, i))
    code, out, _ = run_cli(capsys, "inspect", tmp_path)
    assert code == 0
    assert "ckpt-00000007.safetensors" in out.splitlines()[0]
    assert "iteration  7 / 9" in out


def test_inspect_a_state_without_tensors(tmp_path, capsys):
    path = checkpoint.save(TrainState(max_iter=3), tmp_path / "c")
    code, out, _ = run_cli(capsys, "inspect", path)
    assert code == 0
    for line in (
        "iteration  0 / 3",
        "params: {}",
        "opt_state: None",
        "metrics: none recorded (window 20)",
        "hooks: {}",
        "extra: None",
    ):
        assert line in out.splitlines()


def test_inspect_summarizes_every_kind_of_tensor_and_writes_strict_json(tmp_path, capsys):
    extra = {
        "odd": torch.tensor([1.0, math.nan, math.inf, -2.0]),
        "bad": torch.tensor([math.nan, -math.inf]),
        "flags": torch.tensor([True, False, True]),
        "ids": torch.arange(5).to(torch.uint16),
        "z": torch.tensor([3 + 4j], dtype=torch.complex64),
        "empty": torch.zeros(0, 2),
        "half": torch.ones(2, dtype=torch.bfloat16),
        "nan": torch.tensor(math.nan),
    }
    path = checkpoint.save(TrainState(max_iter=1, extra=extra), tmp_path / "c")
    code, out, _ = run_cli(capsys, "inspect", path)
    assert code == 0
    lines = squeezed(out)
    assert (
        "['odd'] float32 (4,) norm 2.236 mean -0.5 min -2 max 1 (of the finite values; 1 nan, 1 inf)" in lines
    )
    assert "['bad'] float32 (2,) no finite values (1 nan, 1 inf)" in lines
    assert "['flags'] bool (3,) 2 true" in lines
    assert "['ids'] uint16 (5,) norm 5.477 mean 2 min 0 max 4" in lines
    assert "['z'] complex64 (1,) (3+4j)" in lines
    assert "['empty'] float32 (0, 2) empty" in lines
    code, out, _ = run_cli(capsys, "inspect", path, "--json")

    def strict(constant):
        raise ValueError(f"not JSON: {constant}")

    extra_json = json.loads(out, parse_constant=strict)["extra"]
    assert (extra_json["odd"]["nan"], extra_json["odd"]["inf"], extra_json["odd"]["max"]) == (1, 1, 1.0)
    assert extra_json["bad"] == {"dtype": "float32", "shape": [2], "numel": 2, "nan": 1, "inf": 1}
    assert extra_json["nan"]["value"] == "nan"
    assert extra_json["flags"]["true"] == 2
    assert extra_json["z"]["value"] == "(3+4j)"
    assert extra_json["empty"] == {"dtype": "float32", "shape": [0, 2], "numel": 0}
    assert extra_json["half"]["mean"] == 1.0


_LARGE = {
    "f32": torch.randn(5 * 2**20),  # 20 MiB: two pieces of the checksum, five chunks of a summary
    "bf16": torch.randn(3 * 2**20).to(torch.bfloat16),
    "i8": torch.randint(-128, 127, (2**20 + 7,), dtype=torch.int8),
    "u64": torch.randint(0, 2**62, (2**20 + 3,)).to(torch.uint64),
    "flags": torch.rand(2**20 + 5) > 0.3,
    "z": torch.randn(2**20 + 1, dtype=torch.complex64),
    "holes": torch.where(torch.rand(3 * 2**20) > 0.99, math.nan, torch.randn(3 * 2**20)),
}


def test_inspect_summarizes_a_tensor_read_piece_by_piece_as_it_does_one_in_memory(tmp_path, capsys):
    # `fnloop inspect` no longer holds the file's tensors (a 2.5 GB file passed 3 GiB and was
    # killed): each is summarized from the bytes as they are read, and says what the tensor would.
    from fnloop.checkpoint._raw import tensor_stats

    path = checkpoint.save(TrainState(max_iter=1, extra=_LARGE), tmp_path / "c")
    code, out, _ = run_cli(capsys, "inspect", path, "--json")
    assert code == 0
    shown = json.loads(out)["extra"]
    assert shown == {name: tensor_stats(t) for name, t in _LARGE.items()}
    assert shown["holes"]["nan"] > 0 and shown["flags"]["true"] > 0


_INSPECT_MEMORY = """
import sys
from fnloop import cli

def peak():  # this process's own high-water mark, in KiB
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))

before = peak()
code = cli.main(["inspect", sys.argv[1]])
print("grew", (peak() - before) // 1024, "code", code)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak memory from /proc")
def test_inspect_of_a_large_file_takes_the_memory_of_a_piece(tmp_path):
    path = checkpoint.save(TrainState(max_iter=1, extra={"w": torch.ones(64 * 2**20)}), tmp_path / "c")
    out = subprocess.run(
        [sys.executable, "-c", _INSPECT_MEMORY, str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert "norm 8192  mean 1  min 1  max 1" in out
    grew = int(out.split()[-3])
    assert grew < 96, f"inspecting a 256 MiB file grew the process by {grew} MiB"


def test_inspect_shows_the_start_of_a_long_list_and_counts_the_rest(tmp_path, capsys):
    # A hook state of 2M ints printed 2M rows (20.7 s, 828 MB); the text shows 20, the JSON all.
    path = checkpoint.save(TrainState(max_iter=1, hooks={"seen": list(range(100_000))}), tmp_path / "c")
    code, out, _ = run_cli(capsys, "inspect", path)
    assert code == 0
    assert len(out.splitlines()) < 60
    lines = squeezed(out)
    assert "seen[19] 19" in lines and "seen[20:] ... 99,980 more entries" in lines
    assert "seen[20] 20" not in lines
    code, out, _ = run_cli(capsys, "inspect", path, "--json")
    assert json.loads(out)["hooks"]["seen"] == list(range(100_000))


def test_a_long_value_in_one_line_is_cut_without_rendering_the_rest():
    from fnloop.checkpoint._raw import short

    class Unrenderable(int):
        def __str__(self):
            raise AssertionError("rendered past the cut")

    text = short([*range(50), Unrenderable(0)])
    assert text.startswith("[0, 1, 2") and text.endswith("...") and len(text) == 100


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-7]), r"truncated"),
        (lambda p: p.write_bytes(b"not a checkpoint"), r"not a checkpoint"),
        (lambda p: p.unlink(), r"cannot read the file"),
    ],
    ids=["truncated", "garbage", "missing"],
)
def test_a_damaged_file_is_a_clear_error_with_status_2(saved, capsys, damage, message):
    _, path = saved
    damage(path)
    for argv in (["inspect", path], ["diff", path, path]):
        code, out, err = run_cli(capsys, *argv)
        assert (code, out) == (2, "")
        assert err.startswith(f"fnloop {argv[0]}: error: {path}: ")
        assert message in err


def test_a_directory_without_checkpoints_is_an_error(tmp_path, capsys):
    code, _, err = run_cli(capsys, "inspect", tmp_path)
    assert code == 2
    assert err == f"fnloop inspect: error: {tmp_path}: a directory without checkpoints (ckpt-*.safetensors)\n"


# -- diff ------------------------------------------------------------------------------------------


def test_diff_of_identical_files_exits_0(saved, tmp_path, capsys):
    state, path = saved
    copy = checkpoint.save(state, tmp_path / "copy")
    code, out, _ = run_cli(capsys, "diff", path, copy)
    assert code == 0
    lines = out.splitlines()
    assert lines[:2] == [f"A: {path} (iteration 12)", f"B: {copy} (iteration 12)"]
    assert len(lines) == 3
    assert lines[-1].startswith("identical: ") and lines[-1].endswith(" leaves, bit for bit")


def test_diff_names_each_difference_and_exits_1(saved, tmp_path, capsys):
    state, path = saved
    params = dict(state.params)
    params["0.weight"] = params["0.weight"].clone()
    params["0.weight"][2, 1] += 0.5
    changed = attrs.evolve(
        state,
        iteration=13,
        params=params,
        hooks={"best:loss": Best(0.25, 10), "new": 1},
        extra={"note": "hi", "scale": 2.5, "more": (1, 2)},
    )
    other = checkpoint.save(changed, tmp_path / "other")
    code, out, _ = run_cli(capsys, "diff", path, other)
    assert code == 1
    lines = squeezed(out)
    assert "state.iteration 12 != 13" in lines
    assert (
        "state.params['0.weight'] float32 (4, 3): 1 of 12 elements differ, max abs diff 0.5 (largest at (2, 1))"
    ) in lines
    assert "state.hooks['best:loss'].iteration 9 != 10" in lines
    assert "state.hooks['steps'] only in A: 12" in lines
    assert "state.hooks['new'] only in B: 1" in lines
    assert "state.extra['more'] only in B: (1, 2)" in lines
    assert len(lines) == 2 + 6 + 1
    assert lines[-1] == "different: 3 of 41 leaves differ, max abs diff 0.5; 1 entry only in A, 2 only in B"


def test_diff_tolerance_and_ignored_entries(tmp_path, capsys):
    a = TrainState(max_iter=3, params={"w": torch.zeros(4)}, metrics=fl.Metrics().record(0, {"time": 1.0}))
    b = attrs.evolve(
        a, params={"w": torch.tensor([0.0, 1e-7, 0.0, 0.0])}, metrics=fl.Metrics().record(0, {"time": 2.0})
    )
    pa, pb = checkpoint.save(a, tmp_path / "a"), checkpoint.save(b, tmp_path / "b")
    assert run_cli(capsys, "diff", pa, pb)[0] == 1
    code, out, _ = run_cli(capsys, "diff", pa, pb, "--atol", "1e-6", "--clock")
    assert code == 1  # the timer's metric differs by 1
    assert "state.metrics.series['time'][0][1] 1.0 != 2.0" in squeezed(out)
    code, out, _ = run_cli(capsys, "diff", pa, pb, "--atol", "1e-6", "--clock", "--ignore", "metrics")
    assert code == 0
    assert out.splitlines()[-1] == "identical: 11 leaves, within atol 1e-06 (1 within atol 1e-06)"
    code, out, _ = run_cli(capsys, "diff", pa, pb, "--atol", "1e-8", "--clock", "--ignore", "state.metrics")
    assert code == 1
    assert "max abs diff 1e-07" in out


def test_diff_is_bit_for_bit(tmp_path, capsys):
    nan = torch.tensor([math.nan, 1.0])
    a = TrainState(max_iter=1, params={"w": torch.tensor([0.0, 1.0]), "n": nan}, extra=0.0)
    b = attrs.evolve(a, params={"w": torch.tensor([-0.0, 1.0]), "n": nan.clone()}, extra=-0.0)
    pa, pb = checkpoint.save(a, tmp_path / "a"), checkpoint.save(b, tmp_path / "b")
    code, out, _ = run_cli(capsys, "diff", pa, pb)
    assert code == 1  # -0.0 is not 0.0, bit for bit; the same NaN is the same
    lines = squeezed(out)
    assert "state.params['w'] float32 (2,): 1 of 2 elements differ, max abs diff 0 (largest at (0,))" in lines
    assert "state.extra 0.0 != -0.0" in lines
    assert len(lines) == 2 + 2 + 1
    assert run_cli(capsys, "diff", pa, pb, "--atol", "0")[0] == 0


def test_diff_of_different_kinds(tmp_path, capsys):
    a = TrainState(max_iter=1, params={"w": torch.zeros(2)}, extra={"x": 1})
    b = attrs.evolve(a, params={"w": torch.zeros(3, dtype=torch.float64)}, extra={"x": "1"}, opt_state=(1,))
    pa, pb = checkpoint.save(a, tmp_path / "a"), checkpoint.save(b, tmp_path / "b")
    code, out, _ = run_cli(capsys, "diff", pa, pb)
    assert code == 1
    lines = squeezed(out)
    assert "state.params['w'] float32 (2,) != float64 (3,)" in lines
    assert "state.opt_state NoneType != tuple of 1" in lines
    assert "state.extra['x'] 1 != '1'" in lines


def test_diff_reports_a_long_series_in_one_line_and_keeps_integer_tensors_exact(tmp_path, capsys):
    metrics = fl.Metrics(window=5)
    a = TrainState(max_iter=9, opt_state={"count": torch.tensor(3)}, metrics=metrics)
    b = attrs.evolve(a, opt_state={"count": torch.tensor(4)})
    for i in range(8):
        a = fl.record(attrs.evolve(a, iteration=i), loss=1.0 / (i + 1))
        b = fl.record(attrs.evolve(b, iteration=i), loss=1.0 / (i + 2))
    pa, pb = checkpoint.save(a, tmp_path / "a"), checkpoint.save(b, tmp_path / "b")
    code, out, _ = run_cli(capsys, "diff", pa, pb, "--atol", "10")
    assert code == 1
    lines = squeezed(out)
    assert "state.opt_state['count'] int64 (): 3 != 4" in lines  # counters are exact, whatever the atol
    assert "state.metrics.series['loss'] 5 of 10 leaves differ" not in lines  # the floats are within atol
    code, out, _ = run_cli(capsys, "diff", pa, pb)
    lines = squeezed(out)
    assert "state.metrics.series['loss'] 5 of 10 leaves differ, max abs diff 0.05" in lines
    assert (
        lines[-1] == "different: 6 of 22 leaves differ, max abs diff 0.05; 0 entries only in A, 0 only in B"
    )


@pytest.mark.parametrize("atol", ["-1", "nan", "big"])
def test_diff_refuses_a_bad_tolerance(saved, capsys, atol):
    _, path = saved
    with pytest.raises(SystemExit) as info:
        main(["diff", str(path), str(path), "--atol", atol])
    assert info.value.code == 2
    assert f"argument --atol: must be a non-negative number (got '{atol}')" in capsys.readouterr().err


# -- replay, help, usage ---------------------------------------------------------------------------


def test_replay_forwards_every_argument(monkeypatch):
    seen = []
    fake = types.ModuleType("fnloop.replay")
    fake.main = lambda argv: seen.append(argv) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fnloop.replay", fake)
    assert main(["replay", "--help"]) == 3
    assert main(["replay", "job:make", "--from", "ckpt", "-x"]) == 3
    assert main(["replay"]) == 3
    assert seen == [["--help"], ["job:make", "--from", "ckpt", "-x"], []]


def test_replay_without_the_module_is_an_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fnloop.replay", None)  # makes the import fail
    assert main(["replay", "x"]) == 2
    assert "fnloop replay: error: this fnloop has no fnloop.replay module" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--help"], ["inspect", "diff", "replay", "newest checkpoint"]),
        (["inspect", "--help"], ["CKPT", "--json", "Needs no training code"]),
        (["diff", "--help"], ["--atol X", "--ignore PATH", "0 identical", "1 different", "2 error"]),
    ],
)
def test_help_texts(capsys, argv, words):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for word in words:
        assert word in out


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["inspect"], ["diff", "a"]])
def test_usage_errors_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage: fnloop" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == f"fnloop {fl.__version__}\n"


def test_python_dash_m_fnloop_runs_the_command(saved):
    _, path = saved
    done = subprocess.run(
        [sys.executable, "-m", "fnloop", "inspect", str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "iteration  12 / 40" in done.stdout
