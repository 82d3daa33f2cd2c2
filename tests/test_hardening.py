"""Issue 10: any bytes give the state or a CheckpointError, one live run per directory, no silent inputs.

Each test reproduces a defect an adversarial probe found; each failed before its fix.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import zlib

import attrs
import pytest
import torch

import fnloop as fl
import fnloop.checkpoint._transfer
from fnloop import TrainState, checkpoint, cli, testing
from fnloop.checkpoint import CheckpointError, CheckpointWarning, DamagedCheckpoint
from fnloop.checkpoint._state_codec import encode_state

LIKE = TrainState(max_iter=1)


def raw_file(path, head: dict, data: bytes = b"") -> None:
    """A safetensors-shaped file with exactly this header: what a hostile or broken writer produces."""
    text = json.dumps(head).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def metadata(skeleton: str, entries=(), version: str = str(checkpoint.FORMAT_VERSION)) -> dict:
    """fnloop metadata whose checksum is right for ``skeleton`` and ``entries`` (key, spec, crcs)."""
    digest = checkpoint._transfer._digest(skeleton, entries, int(version)) if version.isdigit() else "crc32:0"
    return {"fnloop.format": version, "fnloop.skeleton": skeleton, "fnloop.checksum": digest}


def state_skeleton(**fields) -> str:
    """The skeleton of TrainState(max_iter=1), with some fields' nodes replaced."""
    skeleton, _ = encode_state(LIKE)
    skeleton["fields"] = [[k, fields.get(k, v)] for k, v in skeleton["fields"]]
    return json.dumps(skeleton)


# -- defect 2: every bad file is a CheckpointError ---------------------------------------------------


def test_a_zero_element_entry_with_a_huge_dimension_is_damaged(tmp_path):
    path = checkpoint.path_for(tmp_path, 1)
    entry = {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}
    node = {"kind": "tensor", "key": "t", "dtype": "float32", "shape": [0, 2**63]}
    raw_file(path, {"__metadata__": metadata(state_skeleton(extra=node)), "t": entry})
    with pytest.raises(DamagedCheckpoint, match=r"tensor 't' has a malformed header entry"):
        checkpoint.load(path, like=LIKE)
    with pytest.raises(DamagedCheckpoint):
        checkpoint.read_raw(path)
    with pytest.warns(CheckpointWarning, match="malformed header entry"):
        assert checkpoint.latest(tmp_path, like=LIKE) is None
    assert cli.main(["inspect", str(path)]) == 2


def test_a_huge_tensor_in_a_sparse_file_is_a_checkpoint_error_at_once(tmp_path):
    path = tmp_path / "sparse.safetensors"
    size = 10**12
    node = {"kind": "tensor", "key": "t", "dtype": "uint8", "shape": [size]}
    entry = {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}
    head = {"__metadata__": metadata(state_skeleton(extra=node)), "t": entry}
    raw_file(path, head)
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size + size)
    began = time.perf_counter()
    with pytest.raises(
        CheckpointError, match=r"sparse\.safetensors: its tensors take 1,000,000,000,000 bytes, more memory"
    ):
        checkpoint.load(path, like=LIKE)
    assert time.perf_counter() - began < 5


def test_a_phase_whose_name_is_a_list_is_damaged(tmp_path):
    path = tmp_path / "c"
    skeleton = state_skeleton(extra={"kind": "phase", "name": ["AFTER_STEP"]})
    raw_file(path, {"__metadata__": metadata(skeleton)})
    with pytest.raises(DamagedCheckpoint, match=r"unknown phase \['AFTER_STEP'\]"):
        checkpoint.read_raw(path)


def test_a_path_with_a_nul_byte_is_a_checkpoint_error(tmp_path):
    with pytest.raises(DamagedCheckpoint, match="cannot read the file"):
        checkpoint.load(f"{tmp_path}/a\0b", like=LIKE)
    with pytest.raises(CheckpointError, match="not a usable directory name"):
        checkpoint.latest(f"{tmp_path}/a\0b", like=LIKE)


# -- defect 3: a flipped format digit is damage, not a newer format ----------------------------------


def test_every_single_bit_flip_of_the_format_digit_is_skipped_as_damage(tmp_path):
    older = checkpoint.save(TrainState(max_iter=9, iteration=1), checkpoint.path_for(tmp_path, 1))
    newest = checkpoint.save(TrainState(max_iter=9, iteration=2), checkpoint.path_for(tmp_path, 2))
    data = newest.read_bytes()
    at = data.index(b'"fnloop.format":"') + len(b'"fnloop.format":"')
    for bit in range(8):
        flipped = bytearray(data)
        flipped[at] ^= 1 << bit
        newest.write_bytes(flipped)
        with pytest.raises(DamagedCheckpoint):
            checkpoint.load(newest, like=LIKE)
        with pytest.warns(CheckpointWarning, match="skipping a damaged checkpoint"):
            assert checkpoint.latest(tmp_path, like=LIKE).iteration == 1
    assert older.exists()


def test_only_an_intact_file_of_a_newer_format_asks_for_an_upgrade(tmp_path):
    path = checkpoint.path_for(tmp_path, 3)
    skeleton = state_skeleton()
    version = str(checkpoint.FORMAT_VERSION + 1)
    raw_file(path, {"__metadata__": metadata(skeleton, version=version)})
    with pytest.raises(CheckpointError, match=rf"written in checkpoint format {version}.*Upgrade fnloop"):
        checkpoint.latest(tmp_path, like=LIKE)


# -- defect 4: only regular files are read ------------------------------------------------------------


def test_a_fifo_named_like_a_checkpoint_is_skipped_not_waited_for(tmp_path):
    fifo = checkpoint.path_for(tmp_path, 5)
    os.mkfifo(fifo)
    checkpoint.save(TrainState(max_iter=9, iteration=2), checkpoint.path_for(tmp_path, 2))

    def unblock() -> None:  # a reader stuck on the FIFO then fails this test instead of hanging it
        while not done.wait(1):
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    done = threading.Event()
    threading.Thread(target=unblock, daemon=True).start()
    began = time.perf_counter()
    try:
        with pytest.raises(DamagedCheckpoint, match="not a regular file"):
            checkpoint.load(fifo, like=LIKE)
        with pytest.warns(CheckpointWarning, match="not a regular file"):
            assert checkpoint.latest(tmp_path, like=LIKE).iteration == 2
        assert cli.main(["inspect", str(fifo)]) == 2
    finally:
        done.set()
    assert time.perf_counter() - began < 0.9


# -- defect 5: inspect prints deep hook states --------------------------------------------------------


def test_inspect_prints_a_hook_state_nested_400_deep(tmp_path, capsys):
    deep: object = 1
    for _ in range(400):
        deep = [deep]
    state = TrainState(max_iter=1, hooks={"deep": deep})
    path = checkpoint.save(state, tmp_path / "c")
    testing.assert_identical(checkpoint.load(path, like=state), state)
    assert cli.main(["inspect", str(path)]) == 0
    assert "deep" in capsys.readouterr().out
    assert cli.main(["inspect", "--json", str(path)]) == 0
    assert cli.main(["diff", str(path), str(path)]) == 0


# -- defect 6: the work is bounded by the file ---------------------------------------------------------


def test_a_header_of_many_empty_entries_is_refused_quickly(tmp_path):
    path = tmp_path / "many.safetensors"
    entries = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(200_000)}
    raw_file(path, {"__metadata__": metadata("null"), **entries})
    began = time.perf_counter()
    with pytest.raises(DamagedCheckpoint):
        checkpoint.load(path, like=LIKE)
    assert time.perf_counter() - began < 2.5


# -- defect 1: one live run per directory ----------------------------------------------------------------


def counting(state, batch):
    return attrs.evolve(state, extra=(state.extra or 0) + 1)


def hold(directory):
    """Hold ``directory``'s lock as another process would (another open file description)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".fnloop.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.write(fd, b"424242\n")
    return fd


def test_a_run_on_a_held_directory_is_refused_before_its_first_step_and_writes_nothing(tmp_path):
    fd = hold(tmp_path)
    steps = []

    def step(state, batch):
        steps.append(state.iteration)
        return state

    try:
        with pytest.raises(fl.hooks.DirectoryInUse, match=rf"{tmp_path}.*process 424242"):
            fl.run(TrainState(max_iter=3), step, [None] * 3, [fl.hooks.checkpoint(tmp_path)])
        with pytest.raises(fl.hooks.DirectoryInUse):
            fl.run(TrainState(max_iter=3), step, [None] * 3, [fl.hooks.best_checkpoint(tmp_path, "x")])
    finally:
        os.close(fd)
    assert steps == []
    assert sorted(os.listdir(tmp_path)) == [".fnloop.lock"]


def test_the_lock_is_released_when_the_run_ends_and_shared_by_the_hooks_of_one_run(tmp_path):
    hooks = [fl.hooks.checkpoint(tmp_path), fl.hooks.best_checkpoint(tmp_path, "x")]
    step = lambda s, b: fl.record(s, x=float(-s.iteration))  # noqa: E731
    fl.run(TrainState(max_iter=2), step, [None] * 2, hooks)
    os.close(hold(tmp_path))  # free again
    assert {p.name for p in checkpoint.checkpoints(tmp_path)} == {
        "ckpt-00000001.safetensors",
        "ckpt-00000002.safetensors",
    }
    assert (tmp_path / "best.safetensors").exists()


WORKER = textwrap.dedent(
    """
    import sys, attrs, fnloop as fl
    directory, tag, pause = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "pause"
    def step(state, batch):
        if pause and state.iteration == 2:
            print("paused", flush=True)
            sys.stdin.readline()
        return attrs.evolve(state, extra=tag)
    try:
        fl.run(fl.TrainState(max_iter=4), step, [None] * 4, [fl.hooks.checkpoint(directory)])
    except fl.hooks.DirectoryInUse as exc:
        print("refused:", exc, flush=True)
        sys.exit(3)
    print("done", flush=True)
    """
)


@pytest.mark.slow
def test_a_second_process_is_refused_at_once_and_the_first_keeps_its_directory(tmp_path):
    run = [sys.executable, "-c", WORKER, str(tmp_path)]
    with subprocess.Popen(
        [*run, "1", "pause"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as first:
        try:
            assert first.stdout.readline().strip() == "paused"
            before = sorted(os.listdir(tmp_path))
            began = time.perf_counter()
            second = subprocess.run([*run, "2", "go"], capture_output=True, text=True, timeout=60)
            assert second.returncode == 3, second.stderr
            assert str(tmp_path) in second.stdout and f"process {first.pid}" in second.stdout
            assert time.perf_counter() - began < 30  # importing torch; no waiting for the first run
            assert sorted(os.listdir(tmp_path)) == before
            first.stdin.write("\n")
            first.stdin.flush()
            assert first.wait(timeout=60) == 0
        finally:
            first.kill()
    newest = checkpoint.latest(tmp_path, like=TrainState(max_iter=4, extra=0))
    assert (newest.iteration, newest.extra) == (4, 1)


def test_abandoned_files_obey_keep(tmp_path):
    ckpt = fl.hooks.checkpoint(tmp_path, keep=2)
    for restart in range(4):
        fl.run(TrainState(max_iter=6 + restart), counting, [None] * 9, [ckpt])
        with pytest.warns(CheckpointWarning, match="abandoned"):
            fl.run(TrainState(max_iter=1), counting, [None], [ckpt])
    assert len(list(tmp_path.glob("*.abandoned"))) <= 2


def test_renames_and_pruning_tolerate_files_vanishing(tmp_path, monkeypatch):
    from fnloop.hooks import _checkpoint as module

    for i in (1, 2, 5, 6):
        checkpoint.save(TrainState(max_iter=9, iteration=i), checkpoint.path_for(tmp_path, i))
    listed = module.checkpoints

    def listing_then_vanishing(directory):
        found = listed(directory)
        for path in found:
            if path.name != "ckpt-00000003.safetensors":
                path.unlink()  # another process (or a user) removes them right after the listing
        return found

    monkeypatch.setattr(module, "checkpoints", listing_then_vanishing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        fl.run(TrainState(max_iter=3, iteration=2), counting, [None], [fl.hooks.checkpoint(tmp_path, keep=1)])
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["ckpt-00000003.safetensors"]


def test_a_checkpoint_directory_that_is_a_file_is_refused_at_once(tmp_path):
    existing = tmp_path / "run.txt"
    existing.write_text("not a directory")
    with pytest.raises(ValueError, match=r"run\.txt.*is an existing file"):
        fl.hooks.checkpoint(existing)
    with pytest.raises(ValueError, match=r"run\.txt.*is an existing file"):
        fl.hooks.best_checkpoint(existing, "loss")


# -- defect 7: inputs accepted in silence or refused obscurely ------------------------------------------


def test_a_metric_never_recorded_is_named_at_the_end_of_the_run(tmp_path):
    step = lambda s, b: fl.record(s, loss=1.0)  # noqa: E731
    with pytest.warns(fl.hooks.MetricNeverRecorded, match=r"'losss' was never recorded.*\['loss'\]"):
        fl.run(TrainState(max_iter=2), step, [None] * 2, [fl.hooks.best_checkpoint(tmp_path, "losss")])
    assert issubclass(fl.hooks.MetricNeverRecorded, UserWarning)


def test_init_explains_a_torch_optimizer():
    model = torch.nn.Linear(2, 1)
    with pytest.raises(
        TypeError, match=r"init\(\) expected a fnloop\.optim\.Optimizer.*torch\.optim\.SGD"
    ) as exc:
        fl.init(model, torch.optim.SGD(model.parameters(), lr=0.1), seed=0, max_iter=1)
    assert "fnloop.optim.sgd" in str(exc.value)


def test_init_names_a_bad_seed():
    with pytest.raises(ValueError, match=r"'seed' must be a non-negative int \(got -1 that is an int\)"):
        fl.init(torch.nn.Linear(2, 1), fl.optim.sgd(0.1), seed=-1, max_iter=1)


@pytest.mark.parametrize("make", [lambda: fl.optim.cosine(-1e-3, 100), lambda: fl.optim.constant(-0.1)])
def test_a_negative_schedule_is_refused_as_sgd_refuses_a_negative_lr(make):
    with pytest.raises(ValueError, match=r"must be at least 0"):
        make()


def test_a_schedule_of_the_wrong_shape_is_named():
    model = torch.nn.Linear(2, 1)
    opt = fl.optim.sgd(lambda t: torch.ones(3))
    # train_step reads the optimizer's learning rates once when it is built: the error comes at once.
    with pytest.raises(TypeError, match=r"schedule .* must return a 0-d tensor.*shape \(3,\)"):
        fl.train_step(model, lambda f, b: f(b).pow(2).mean(), opt, compile=False)
    with pytest.raises(TypeError, match=r"schedule .* must return a 0-d tensor.*shape \(3,\)"):
        opt.update(
            {"w": torch.ones(1)}, opt.init({"w": torch.ones(1)}), {"w": torch.ones(1)}, torch.tensor(0)
        )


def test_run_explains_a_missing_step():
    with pytest.raises(TypeError, match=r"step must be a callable \(state, batch\) -> state.*None"):
        fl.run(TrainState(max_iter=1), None, [None])


def test_train_state_names_a_param_that_is_not_a_tensor():
    with pytest.raises(TypeError, match=r"'params'\['w'\] must be a tensor \(got 3 that is an int\)"):
        TrainState(max_iter=1, params={"w": 3})


def test_train_state_explains_bad_metrics():
    with pytest.raises(TypeError, match=r"'metrics' must be a fnloop\.Metrics \(got \{\} that is a dict\)"):
        TrainState(max_iter=1, metrics={})


def test_non_scalar_metrics_from_the_loss_are_named():
    model = torch.nn.Linear(2, 1)
    opt = fl.optim.sgd(0.1)

    def loss_fn(forward, batch):
        out = forward(batch)
        return out.pow(2).mean(), {"acc": out.squeeze(1)}

    step = fl.train_step(model, loss_fn, opt, compile=False)
    with pytest.raises(TypeError, match=r"metric 'acc'.*shape \(4,\)"):
        fl.run(fl.init(model, opt, seed=0, max_iter=1), step, [torch.ones(4, 2)])


def test_digest_is_deterministic():
    assert checkpoint._transfer._digest("null", [], 1) == f"crc32:{zlib.crc32(b'null'):08x}"


@pytest.mark.parametrize("make", [fl.hooks.checkpoint, lambda d: fl.hooks.best_checkpoint(d, "x")])
def test_the_locking_hooks_are_good_hooks(tmp_path, make):
    state = fl.record(TrainState(max_iter=3, iteration=1, params={"w": torch.ones(2)}), x=1.0)
    testing.check_hook(make(tmp_path), state)
    assert os.listdir(tmp_path) == []  # a hook only asks; the fold holds and writes
