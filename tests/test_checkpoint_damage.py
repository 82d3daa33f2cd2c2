"""Any bytes named like a checkpoint give the state or a CheckpointError: damage is found, never loaded.

Each test reproduces a defect an adversarial probe found; each failed before its fix.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import zlib

import attrs
import pytest
import torch

from fnloop import TrainState, checkpoint, cli, testing
from fnloop.checkpoint import CheckpointError, CheckpointMismatch, CheckpointWarning, DamagedCheckpoint
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


def test_a_header_of_many_empty_entries_is_refused_quickly(tmp_path):
    path = tmp_path / "many.safetensors"
    entries = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(200_000)}
    raw_file(path, {"__metadata__": metadata("null"), **entries})
    began = time.perf_counter()
    with pytest.raises(DamagedCheckpoint):
        checkpoint.load(path, like=LIKE)
    assert time.perf_counter() - began < 2.5


def test_digest_is_deterministic():
    assert checkpoint._transfer._digest("null", [], 1) == f"crc32:{zlib.crc32(b'null'):08x}"


def test_a_file_whose_name_says_another_iteration_is_skipped_as_damage(tmp_path):
    # latest orders by name and trusted the content: ckpt-00000099 holding iteration 3 resumed iteration 3.
    like = TrainState(max_iter=100)
    checkpoint.save(attrs.evolve(like, iteration=40), checkpoint.path_for(tmp_path, 40))
    checkpoint.save(attrs.evolve(like, iteration=3), checkpoint.path_for(tmp_path, 99))
    with pytest.warns(
        CheckpointWarning, match=r"ckpt-00000099.safetensors: its name says iteration 99, it holds 3"
    ):
        found = checkpoint.latest(tmp_path, like=like)
    assert found.iteration == 40


def test_a_symlinked_checkpoint_is_skipped_as_not_this_runs(tmp_path):
    # A link named like a checkpoint resumed whatever run it pointed into.
    like = TrainState(max_iter=100)
    other = checkpoint.save(
        attrs.evolve(like, iteration=50), tmp_path / "other" / "ckpt-00000050.safetensors"
    )
    run = tmp_path / "run"
    checkpoint.save(attrs.evolve(like, iteration=10), checkpoint.path_for(run, 10))
    checkpoint.path_for(run, 50).symlink_to(other)
    with pytest.warns(CheckpointWarning, match=r"ckpt-00000050.safetensors: a symbolic link"):
        found = checkpoint.latest(run, like=like)
    assert found.iteration == 10


# -- the header before the bytes (defect 6) ----------------------------------------------------------

_WIDE = TrainState(max_iter=1, extra={"w": torch.zeros(4)})


def test_a_file_the_template_cannot_fit_is_refused_from_its_header_without_reading_its_tensors(
    tmp_path, monkeypatch
):
    # A 2.5 GB file whose tensor shape did not fit `like` was read in full (2.5 GB RSS, 11 s) before
    # the CheckpointMismatch that its header alone shows.
    import fnloop.checkpoint._reading as reading

    path = checkpoint.save(
        attrs.evolve(_WIDE, extra={"w": torch.zeros(2, 2)}), checkpoint.path_for(tmp_path, 0)
    )

    def never(*args):
        raise AssertionError("the tensors were read into memory")

    monkeypatch.setattr(reading, "_tensors", never)
    with pytest.raises(CheckpointMismatch, match=r"state\.extra\['w'\]: expected shape \(4,\), got \(2, 2\)"):
        checkpoint.load(path, like=_WIDE)
    with pytest.raises(CheckpointMismatch):  # and `latest` does not pass it off as damage
        checkpoint.latest(tmp_path, like=_WIDE)


def test_a_misfit_in_damaged_bytes_is_damage_not_a_mismatch(tmp_path):
    # Told from the header before the checksum, a mismatch must not hide damage: `latest` skips
    # damage and would stop at a mismatch.
    path = checkpoint.save(
        attrs.evolve(_WIDE, extra={"w": torch.zeros(2, 2)}), checkpoint.path_for(tmp_path, 0)
    )
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # a byte of the tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpoint, match="checksum mismatch"):
        checkpoint.load(path, like=_WIDE)
    with pytest.warns(CheckpointWarning, match="checksum mismatch"):
        assert checkpoint.latest(tmp_path, like=_WIDE) is None


def test_a_shape_changed_in_the_header_alone_is_damage(tmp_path):
    # The header and skeleton rewritten consistently, [4] as [2, 2] (same bytes): only the checksum
    # tells that the header was changed; the shape check must not speak first.
    path = checkpoint.save(_WIDE, checkpoint.path_for(tmp_path, 0))
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    head = json.loads(data[8 : 8 + length])
    key = next(k for k in head if k != "__metadata__")
    head[key]["shape"] = [2, 2]
    head["__metadata__"]["fnloop.skeleton"] = head["__metadata__"]["fnloop.skeleton"].replace(
        '"shape":[4]', '"shape":[2,2]'
    )
    assert '"shape":[2,2]' in head["__metadata__"]["fnloop.skeleton"]
    raw_file(path, head, data[8 + length :])
    with pytest.raises(DamagedCheckpoint, match="checksum mismatch"):
        checkpoint.load(path, like=_WIDE)


_MISFIT_MEMORY = """
import sys, torch, fnloop as fl
from fnloop import checkpoint

def peak():  # this process's own high-water mark (ru_maxrss would count the parent's, before exec)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))

like = fl.TrainState(max_iter=1, extra={"w": torch.zeros(4)})
before = peak()
try:
    checkpoint.load(sys.argv[1], like=like)
except checkpoint.CheckpointMismatch as exc:
    print("mismatch", str(exc).split(":")[2])
print("grew", (peak() - before) // 1024)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak memory from /proc")
def test_refusing_a_large_file_that_cannot_fit_takes_the_memory_of_a_buffer(tmp_path):
    path = checkpoint.save(
        attrs.evolve(_WIDE, extra={"w": torch.ones(64 * 2**20)}), checkpoint.path_for(tmp_path, 0)
    )  # 256 MiB of tensor
    out = subprocess.run(
        [sys.executable, "-c", _MISFIT_MEMORY, str(path)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[:2] == ["mismatch", "expected"], out
    assert int(out[-1]) < 64, f"refusing the file grew the process by {out[-1]} MiB"
