"""Checkpoints: round trips, strict templates, lenient hooks, damage, safety, atomicity, versions."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from typing import NamedTuple

import attrs
import pytest
import safetensors
import safetensors.torch
import torch

import fnloop as fl
import fnloop.checkpoint._transfer
from fnloop import TrainState, checkpoint, testing
from fnloop.checkpoint import CheckpointError, CheckpointMismatch, CheckpointWarning, DamagedCheckpoint


class Moments(NamedTuple):
    mu: torch.Tensor
    count: int


@attrs.frozen
class Best:
    score: float
    at: int
    _note: str = "x"
    seen: tuple = attrs.field(init=False, default=())


@attrs.frozen
class BestRenamed:
    """Same fields as Best, another class: loading rebuilds with the template's class."""

    score: float
    at: int
    _note: str = "x"
    seen: tuple = attrs.field(init=False, default=())


ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` with random bits (NaN payloads, subnormals and all)."""
    n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    if dtype is torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def full_state() -> TrainState:
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    return TrainState(
        max_iter=20,
        iteration=12,
        params={"fc.weight": w, "fc.bias": torch.zeros(4)},
        buffers={"steps": torch.tensor(12)},
        opt_state=(Moments(mu=torch.ones(4, 3), count=3), {"lr": 0.1}),
        rng=7,
        data=12,
        metrics=fl.Metrics().record(10, {"loss": torch.tensor(0.5)}).record(11, {"loss": 0.25, "lr": 0.1}),
        hooks={"best": Best(0.5, 3), "count": 12},
        extra={"tag": "run-1", 3: [None, True, -0.0]},
    )


def test_round_trip_is_identical(tmp_path):
    state = full_state()
    path = checkpoint.save(state, checkpoint.path_for(tmp_path, state.iteration))
    assert path == tmp_path / "ckpt-00000012.safetensors"
    testing.assert_identical(checkpoint.load(path, like=state), state)


def test_the_clock_is_no_part_of_a_checkpoint(tmp_path):
    # What the wall clock read is not the run: a state loads with a stopped clock, as one built by hand.
    state = attrs.evolve(full_state(), clock=fl.Clock(time=1.5, data_time=0.5, step_time=0.25))
    loaded = checkpoint.load(checkpoint.save(state, tmp_path / "c"), like=state)
    assert loaded.clock == fl.Clock()
    testing.assert_identical(loaded, attrs.evolve(state, clock=fl.Clock()))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly_including_0d_and_empty(tmp_path, dtype):
    tensors = {
        "a": random_bits(dtype, (3, 5), 1),
        "s": random_bits(dtype, (), 2),
        "e": random_bits(dtype, (0, 2)),
    }
    state = TrainState(max_iter=1, params=tensors)
    loaded = checkpoint.load(checkpoint.save(state, tmp_path / "c.safetensors"), like=state)
    for name, t in tensors.items():
        got = loaded.params[name]
        assert (got.dtype, got.shape) == (t.dtype, t.shape)
        assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_python_values_round_trip_exactly(tmp_path):
    extra = {
        "floats": (float("nan"), float("inf"), float("-inf"), -0.0, 0.1, 5e-324, 1.7976931348623157e308),
        "ints": [0, -1, 2**100, True, False],
        "text": "ünïcode \n \"quoted\" ['x']",
        7: None,
    }
    state = TrainState(max_iter=1, extra=extra)
    testing.assert_identical(checkpoint.load(checkpoint.save(state, tmp_path / "c"), like=state), state)


def test_records_are_rebuilt_with_the_templates_class(tmp_path):
    state = TrainState(max_iter=1, extra=Best(2.0, 1, "kept"))
    object.__setattr__(state.extra, "seen", (1, 2))  # an init=False field round trips too
    path = checkpoint.save(state, tmp_path / "c")
    like = attrs.evolve(state, extra=BestRenamed(0.0, 0))
    object.__setattr__(like.extra, "seen", (0, 0))
    loaded = checkpoint.load(path, like=like)
    assert type(loaded.extra) is BestRenamed
    assert (loaded.extra.score, loaded.extra.at, loaded.extra._note, loaded.extra.seen) == (
        2.0,
        1,
        "kept",
        (1, 2),
    )


def test_a_tensor_reached_twice_is_stored_once_and_views_are_fine(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    state = TrainState(max_iter=1, params={"w": w}, buffers={"same": w, "row": w[1], "t": w.t()})
    path = checkpoint.save(state, tmp_path / "c")
    with safetensors.safe_open(path, "pt") as f:
        assert sorted(f.keys()) == ["state.buffers['row']", "state.buffers['t']", "state.params['w']"]
    loaded = checkpoint.load(path, like=state)
    testing.assert_identical(loaded, state)
    assert loaded.buffers["same"] is loaded.params["w"]


def test_the_file_is_plain_safetensors(tmp_path):
    state = full_state()
    path = checkpoint.save(state, tmp_path / "c.safetensors")
    tensors = safetensors.torch.load_file(path)
    assert torch.equal(tensors["state.params['fc.weight']"], state.params["fc.weight"])
    with safetensors.safe_open(path, "pt") as f:
        metadata = f.metadata()
    assert metadata["fnloop.format"] == "2"
    assert re.fullmatch(r"crc32:[0-9a-f]{8}", metadata["fnloop.checksum"])
    json.loads(metadata["fnloop.skeleton"])
    # Re-laid out by safetensors' own writer, the file still checks and loads.
    safetensors.torch.save_file(tensors, tmp_path / "again.safetensors", metadata=metadata)
    testing.assert_identical(checkpoint.load(tmp_path / "again.safetensors", like=state), state)


def test_read_raw_needs_no_template(tmp_path):
    path = checkpoint.save(full_state(), tmp_path / "c")
    metadata, tree = checkpoint.read_raw(path)
    assert metadata["fnloop.format"] == str(checkpoint.FORMAT_VERSION)
    assert "fnloop.skeleton" not in metadata
    assert tree["iteration"] == 12
    assert tree["hooks"]["best"] == {"score": 0.5, "at": 3, "_note": "x", "seen": ()}
    assert tree["hooks"]["best"].type.endswith("Best")
    assert tree["opt_state"][0]["count"] == 3
    assert tree["metrics"]["series"]["loss"][1] == (11, 0.25)
    assert isinstance(tree["params"]["fc.weight"], torch.Tensor)


# -- saving what cannot be saved -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "where", "what"),
    [
        ({"f": print}, r"state\.extra\['f'\]", "a function"),
        ([1, object()], r"state\.extra\[1\]", "an object"),
        ({(1, 2): 3}, r"state\.extra", r"a dict key \(1, 2\) \(a tuple\)"),
        (Best(1, 2, torch.nn.Linear(1, 1)), r"state\.extra\._note", "a Linear"),
    ],
)
def test_save_names_what_cannot_be_saved(tmp_path, extra, where, what):
    with pytest.raises(TypeError, match=rf"{where}: cannot save {what}.*a checkpoint holds data only"):
        checkpoint.save(TrainState(max_iter=1, extra=extra), tmp_path / "c")
    assert not list(tmp_path.iterdir())


def test_save_refuses_pending_effects(tmp_path):
    state = fl.request(TrainState(max_iter=1), print, "print")
    with pytest.raises(ValueError, match=r"1 pending effect.*'print'.*attrs\.evolve\(state, effects=\(\)\)"):
        checkpoint.save(state, tmp_path / "c")


def test_save_creates_missing_directories(tmp_path):
    path = checkpoint.save(TrainState(max_iter=1), tmp_path / "a" / "b" / "ckpt-00000000.safetensors")
    assert path.exists()
    assert checkpoint.checkpoints(tmp_path / "a" / "b") == [path]


# -- strict templates ------------------------------------------------------------------------------


def saved_at_12(tmp_path, state: TrainState):
    return checkpoint.save(state, checkpoint.path_for(tmp_path, 12))


def test_shape_mismatch_names_file_and_path(tmp_path):
    state = TrainState(max_iter=20, params={"fc.weight": torch.zeros(32, 64)})
    path = saved_at_12(tmp_path, state)
    like = TrainState(max_iter=20, params={"fc.weight": torch.zeros(64, 32)})
    expected = r"ckpt-00000012\.safetensors: state\.params\['fc\.weight'\]: expected shape \(64, 32\), got \(32, 64\)"
    with pytest.raises(CheckpointMismatch, match=expected):
        checkpoint.load(path, like=like)


@pytest.mark.parametrize(
    ("saved", "like", "message"),
    [
        (
            {"params": {"w": torch.zeros(2)}},
            {"params": {"w": torch.zeros(2, dtype=torch.float16)}},
            r"state\.params\['w'\]: expected dtype float16, got float32",
        ),
        (
            {"params": {"w": torch.zeros(2)}},
            {"params": {"w": torch.zeros(2), "b": torch.zeros(1)}},
            r"state\.params\['b'\]: entry in the template but missing from the file",
        ),
        (
            {"params": {"w": torch.zeros(2), "b": torch.zeros(1)}},
            {"params": {"w": torch.zeros(2)}},
            r"state\.params\['b'\]: entry in the file but not in the template",
        ),
        (
            {"extra": (1, 2)},
            {"extra": (1, 2, 3)},
            r"state\.extra: expected a tuple of length 3, got length 2",
        ),
        ({"extra": [1, 2]}, {"extra": [1]}, r"state\.extra: expected a list of length 1, got length 2"),
        ({"extra": {"a": 1}}, {"extra": {"a": 1.5j}}, r"state\.extra\['a'\]: the template holds a complex"),
        (
            {"extra": {"a": 1.5}},
            {"extra": {"a": 1}},
            r"state\.extra\['a'\]: expected an int \(1\), got a float \(1\.5\)",
        ),
        ({"extra": None}, {"extra": (1,)}, r"state\.extra: expected a tuple of length 1, got None"),
        ({"extra": True}, {"extra": 1}, r"state\.extra: expected an int \(1\), got a bool \(True\)"),
        (
            {"opt_state": Moments(torch.ones(1), 1)},
            {"opt_state": (torch.ones(1), 1)},
            r"state\.opt_state: expected a tuple of length 2, got a NamedTuple Moments",
        ),
        (
            {"opt_state": Moments(torch.ones(1), 1)},
            {"opt_state": Best(1.0, 1)},
            r"state\.opt_state: expected a record Best, got a NamedTuple Moments",
        ),
        (
            {"extra": Best(1.0, 2)},
            {"extra": Moments(torch.ones(1), 1)},
            r"state\.extra: expected a NamedTuple Moments, got a record Best",
        ),
        (
            {"hooks": {"best": Best(1.0, 2)}},
            {"hooks": {"best": Best(1.0, "x")}},
            r"state\.hooks\['best'\]\.at: expected a str \('x'\), got an int \(2\)",
        ),
        (
            {"rng": 3},
            {"rng": 4, "data": "cursor"},
            r"state\.data: expected a str \('cursor'\), got an int \(0\)",
        ),
    ],
)
def test_strict_errors_name_file_and_path(tmp_path, saved, like, message):
    path = saved_at_12(tmp_path, TrainState(max_iter=20, **saved))
    with pytest.raises(CheckpointMismatch, match=r"ckpt-00000012\.safetensors: " + message):
        checkpoint.load(path, like=TrainState(max_iter=20, **like))


def test_a_record_field_missing_from_the_file(tmp_path):
    @attrs.frozen
    class Grown:
        score: float
        at: int
        _note: str = "x"
        seen: tuple = attrs.field(init=False, default=())
        patience: int = 3

    path = saved_at_12(tmp_path, TrainState(max_iter=20, extra=Best(1.0, 2)))
    with pytest.raises(
        CheckpointMismatch, match=r"state\.extra\.patience: field in the template but missing"
    ):
        checkpoint.load(path, like=TrainState(max_iter=20, extra=Grown(1.0, 2)))


def test_a_template_validator_that_refuses_the_saved_values_is_a_mismatch(tmp_path):
    @attrs.frozen
    class Positive:
        n: int = attrs.field(validator=attrs.validators.gt(0))

    @attrs.frozen
    class Any_:
        n: int

    path = saved_at_12(tmp_path, TrainState(max_iter=20, extra=Any_(-1)))
    with pytest.raises(
        CheckpointMismatch, match=r"state\.extra: the saved fields do not make a .*Positive: 'n' must be > 0"
    ):
        checkpoint.load(path, like=TrainState(max_iter=20, extra=Positive(1)))


def test_tensors_go_to_the_template_tensors_device(tmp_path):
    state = TrainState(
        max_iter=1, params={"w": torch.ones(2)}, metrics=fl.Metrics().record(0, {"l": torch.tensor(1.0)})
    )
    path = checkpoint.save(state, tmp_path / "c")
    loaded = checkpoint.load(path, like=TrainState(max_iter=1, params={"w": torch.empty(2, device="meta")}))
    assert loaded.params["w"].device.type == "meta"
    assert loaded.metrics.latest("l")[1].device.type == "meta"


def test_load_takes_like_as_a_state():
    with pytest.raises(TypeError, match=r"like= a fnloop\.TrainState"):
        checkpoint.load("x", like={"params": {}})  # type: ignore[arg-type]


# -- metrics and hooks -----------------------------------------------------------------------------


def test_metrics_come_from_the_file(tmp_path):
    state = full_state()
    like = attrs.evolve(state, metrics=fl.Metrics(window=3))
    loaded = checkpoint.load(checkpoint.save(state, tmp_path / "c"), like=like)
    testing.assert_identical(loaded.metrics, state.metrics)


def like_of(state: TrainState, **changes) -> TrainState:
    return attrs.evolve(state, **changes)


def test_unknown_hook_states_are_unclaimed_and_claim_back(tmp_path):
    state = full_state()
    path = checkpoint.save(state, checkpoint.path_for(tmp_path, 12))
    loaded = checkpoint.load(path, like=like_of(state, hooks={}))
    best = loaded.hooks["best"]
    assert type(best) is fl.Unclaimed
    assert best.where == f"{path}: state.hooks['best']"
    testing.assert_identical(best.claim(Best(0.0, 0)), state.hooks["best"])
    assert loaded.hooks["count"].claim(0) == 12
    with pytest.raises(
        CheckpointMismatch, match=r"ckpt-00000012\.safetensors: state\.hooks\['best'\]: expected an int"
    ):
        best.claim(0)


def test_known_hook_states_are_strict_and_a_hook_without_a_saved_state_starts_fresh(tmp_path):
    state = full_state()
    path = checkpoint.save(state, tmp_path / "c")
    loaded = checkpoint.load(path, like=like_of(state, hooks={"count": 0, "new": "fresh"}))
    assert loaded.hooks["count"] == 12
    assert loaded.hooks["new"] == "fresh"
    assert type(loaded.hooks["best"]) is fl.Unclaimed


def test_the_run_claims_or_drops_unclaimed_hook_states(tmp_path):
    state = TrainState(max_iter=3, iteration=1, hooks={"steps": 1, "gone": (1, 2)})
    loaded = checkpoint.load(checkpoint.save(state, tmp_path / "c"), like=TrainState(max_iter=3))

    def count(s, phase, n):
        return s, n + (phase is fl.Phase.AFTER_STEP)

    with pytest.warns(fl.UnclaimedHookState, match=r"'gone' \(.*c: state\.hooks\['gone'\]\)"):
        final = fl.run(loaded, lambda s, b: s, [None] * 2, [fl.stateful("steps", 0, count)])
    assert final.hooks == {"steps": 3}


def test_unclaimed_states_survive_another_save(tmp_path):
    state = full_state()
    first = checkpoint.load(checkpoint.save(state, tmp_path / "a"), like=like_of(state, hooks={}))
    again = checkpoint.load(checkpoint.save(first, tmp_path / "b"), like=state)
    testing.assert_identical(again, state)


# -- damage and safety -----------------------------------------------------------------------------


class Evil:
    """Unpickling this creates the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def malicious_files(tmp_path):
    marker = str(tmp_path / "pwned")
    yield "pickle", pickle.dumps(Evil(marker)), marker
    torch.save({"w": torch.zeros(1), "evil": Evil(marker)}, tmp_path / "evil.pt")
    yield "torch.save", (tmp_path / "evil.pt").read_bytes(), marker


@pytest.mark.parametrize("kind", ["pickle", "torch.save"])
def test_loading_a_malicious_file_runs_no_code(tmp_path, kind):
    payload, marker = next((p, m) for k, p, m in malicious_files(tmp_path) if k == kind)
    directory = tmp_path / "ckpt"
    path = checkpoint.path_for(directory, 5)
    directory.mkdir()
    path.write_bytes(payload)
    with pytest.raises(DamagedCheckpoint, match=r"ckpt-00000005\.safetensors: not a checkpoint"):
        checkpoint.load(path, like=TrainState(max_iter=1))
    with pytest.raises(CheckpointError):
        checkpoint.read_raw(path)
    with pytest.warns(CheckpointWarning, match=r"ckpt-00000005\.safetensors"):
        assert checkpoint.latest(directory, like=TrainState(max_iter=1)) is None
    assert not os.path.exists(marker)


def test_a_plain_torch_save_file_is_not_a_checkpoint(tmp_path):
    torch.save({"w": torch.zeros(3)}, tmp_path / "c")
    with pytest.raises(DamagedCheckpoint, match="not a checkpoint"):
        checkpoint.load(tmp_path / "c", like=TrainState(max_iter=1))


def test_a_foreign_safetensors_file_is_not_a_checkpoint(tmp_path):
    safetensors.torch.save_file({"w": torch.zeros(3)}, tmp_path / "c", metadata={"format": "pt"})
    with pytest.raises(DamagedCheckpoint, match=r"c: not an fnloop checkpoint: .* no 'fnloop.format'"):
        checkpoint.load(tmp_path / "c", like=TrainState(max_iter=1))


def test_every_truncation_is_detected_and_names_the_file(tmp_path):
    state = full_state()
    path = checkpoint.save(state, tmp_path / "ckpt-00000012.safetensors")
    data = path.read_bytes()
    for size in sorted({0, 1, 7, 8, 9, 100, len(data) // 2, len(data) - 4, len(data) - 1}):
        path.write_bytes(data[:size])
        with pytest.raises(DamagedCheckpoint, match=r"ckpt-00000012\.safetensors: "):
            checkpoint.load(path, like=state)


def test_bit_flips_are_detected_and_name_the_file(tmp_path):
    state = TrainState(max_iter=20, params={"w": torch.randn(64)}, extra="text")
    path = checkpoint.save(state, tmp_path / "ckpt-00000012.safetensors")
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    skeleton_at = data.index(b"text")
    for at, bit in [(len(data) - 1, 0), (8 + header + 17, 5), (skeleton_at, 1)]:
        flipped = bytearray(data)
        flipped[at] ^= 1 << bit
        path.write_bytes(flipped)
        with pytest.raises(DamagedCheckpoint, match=r"ckpt-00000012\.safetensors: checksum mismatch"):
            checkpoint.load(path, like=state)


def test_a_missing_file_is_a_checkpoint_error(tmp_path):
    with pytest.raises(DamagedCheckpoint, match=r"nothing\.safetensors: cannot read the file"):
        checkpoint.load(tmp_path / "nothing.safetensors", like=TrainState(max_iter=1))


def file_with_version(path, version: str) -> None:
    skeleton = json.dumps({"kind": "record", "type": "fnloop.TrainState", "fields": []})
    checksum = checkpoint._transfer._digest(skeleton, [], version)  # every format from 2 on checks this way
    metadata = {"fnloop.format": version, "fnloop.skeleton": skeleton, "fnloop.checksum": checksum}
    safetensors.torch.save_file({}, path, metadata=metadata)


def test_a_newer_format_is_refused_naming_both_versions(tmp_path):
    path = checkpoint.path_for(tmp_path, 3)
    file_with_version(path, "3")
    message = (
        r"ckpt-00000003\.safetensors: written in checkpoint format 3, but this fnloop reads formats 1, 2"
    )
    with pytest.raises(CheckpointError, match=message + r".*Upgrade fnloop"):
        checkpoint.load(path, like=TrainState(max_iter=1))
    with pytest.raises(CheckpointError, match=message):
        checkpoint.latest(tmp_path, like=TrainState(max_iter=1))


def test_a_skeleton_of_another_fnloop_is_an_error_not_a_crash(tmp_path):
    file_with_version(tmp_path / "c", "1")
    with pytest.raises(CheckpointMismatch, match=r"c: state\.max_iter: TrainState fields differ"):
        checkpoint.load(tmp_path / "c", like=TrainState(max_iter=1))


# -- latest and the directory ----------------------------------------------------------------------


def test_checkpoints_lists_newest_first_and_ignores_other_files(tmp_path):
    for i in (3, 100_000_000, 12):
        checkpoint.path_for(tmp_path, i).write_bytes(b"")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / ".ckpt-00000099.safetensors.123.0badcafe.tmp").write_bytes(b"partial")
    names = [p.name for p in checkpoint.checkpoints(tmp_path)]
    assert names == ["ckpt-100000000.safetensors", "ckpt-00000012.safetensors", "ckpt-00000003.safetensors"]
    assert checkpoint.checkpoints(tmp_path / "missing") == []


def test_latest_skips_damaged_files_with_a_warning(tmp_path):
    states = {i: attrs.evolve(full_state(), iteration=i) for i in (4, 8, 12, 16)}
    for i, s in states.items():
        checkpoint.save(s, checkpoint.path_for(tmp_path, i))
    newest = checkpoint.path_for(tmp_path, 16)
    newest.write_bytes(newest.read_bytes()[:-10])
    checkpoint.path_for(tmp_path, 12).write_bytes(b"garbage")
    with pytest.warns(CheckpointWarning) as caught:
        found = checkpoint.latest(tmp_path, like=full_state())
    testing.assert_identical(found, states[8])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert re.search(r"ckpt-00000016\.safetensors: truncated", messages[0])
    assert re.search(r"ckpt-00000012\.safetensors: not a checkpoint", messages[1])


def test_latest_of_an_empty_or_missing_directory_is_none(tmp_path):
    assert checkpoint.latest(tmp_path, like=TrainState(max_iter=1)) is None
    assert checkpoint.latest(tmp_path / "missing", like=TrainState(max_iter=1)) is None


def test_latest_raises_when_an_intact_checkpoint_does_not_fit_the_template(tmp_path):
    checkpoint.save(full_state(), checkpoint.path_for(tmp_path, 12))
    like = attrs.evolve(full_state(), params={"other": torch.zeros(1)})
    with pytest.raises(CheckpointMismatch, match=r"ckpt-00000012\.safetensors: state\.params"):
        checkpoint.latest(tmp_path, like=like)


def test_resume_with_latest_or_state(tmp_path):
    state = TrainState(max_iter=5)
    assert (checkpoint.latest(tmp_path, like=state) or state) is state
    checkpoint.save(attrs.evolve(state, iteration=3), checkpoint.path_for(tmp_path, 3))
    assert (checkpoint.latest(tmp_path, like=state) or state).iteration == 3


# -- atomicity -------------------------------------------------------------------------------------


class Crash(Exception):
    pass


def crash_after(n: int):
    calls = []

    def write(fd, view, offset):
        calls.append(offset)
        if len(calls) > n:
            raise Crash("disk gone")
        return real_pwrite(fd, view, offset)

    return write


real_pwrite = checkpoint._transfer._pwrite


@pytest.mark.parametrize(
    "crash",
    [
        lambda mp: mp.setattr(checkpoint._writing, "_pwrite", crash_after(1)),
        lambda mp: mp.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(Crash("fsync"))),
        lambda mp: mp.setattr(os, "replace", lambda a, b: (_ for _ in ()).throw(Crash("rename"))),
    ],
    ids=["mid-write", "fsync", "rename"],
)
def test_a_crash_mid_save_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch, crash):
    old = full_state()
    path = checkpoint.save(old, checkpoint.path_for(tmp_path, 12))
    new = attrs.evolve(old, params={k: v + 1 for k, v in old.params.items()})
    with monkeypatch.context() as mp:
        crash(mp)
        with pytest.raises(Crash):
            checkpoint.save(new, path)
    testing.assert_identical(checkpoint.load(path, like=old), old)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_leftovers_of_a_hard_crash_are_ignored_then_removed(tmp_path, monkeypatch):
    old = full_state()
    path = checkpoint.save(old, checkpoint.path_for(tmp_path, 12))
    with monkeypatch.context() as mp:  # a kill -9: no cleanup runs
        mp.setattr(checkpoint._writing, "_pwrite", crash_after(1))
        mp.setattr(os, "unlink", lambda p: None)
        with pytest.raises(Crash):
            checkpoint.save(attrs.evolve(old, iteration=13), checkpoint.path_for(tmp_path, 13))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / f".ckpt-00000014.safetensors.{int(dead.stdout)}.0badcafe.tmp").write_bytes(b"x")
    (tmp_path / f".ckpt-00000015.safetensors.{os.getppid()}.0badcafe.tmp").write_bytes(b"x")  # alive
    assert len(list(tmp_path.iterdir())) == 4
    assert checkpoint.checkpoints(tmp_path) == [path]
    testing.assert_identical(checkpoint.latest(tmp_path, like=old), old)
    checkpoint.save(old, checkpoint.path_for(tmp_path, 20))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [
        f".ckpt-00000015.safetensors.{os.getppid()}.0badcafe.tmp",
        path.name,
        "ckpt-00000020.safetensors",
    ]


def test_many_pieces_on_threads_and_the_portable_path_write_the_same_file(tmp_path, monkeypatch):
    state = full_state()
    plain = checkpoint.save(state, tmp_path / "plain").read_bytes()
    monkeypatch.setattr(checkpoint._transfer, "_THREADED", 0)
    threaded = checkpoint.save(state, tmp_path / "threaded")
    assert threaded.read_bytes() == plain
    testing.assert_identical(checkpoint.load(threaded, like=state), state)
    monkeypatch.setattr(checkpoint._transfer, "_PIECE", 8)  # a format constant: both sides change together
    monkeypatch.setattr(checkpoint._transfer, "_POSITIONAL", False)
    portable = checkpoint.save(state, tmp_path / "portable")
    testing.assert_identical(checkpoint.load(portable, like=state), state)
    monkeypatch.setattr(checkpoint._transfer, "_POSITIONAL", True)
    testing.assert_identical(checkpoint.load(portable, like=state), state)
