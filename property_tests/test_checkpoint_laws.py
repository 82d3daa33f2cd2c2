"""Checkpoint laws: save/load round trips, hook states claimed back, and damage only ever a CheckpointError."""

from __future__ import annotations

import contextlib
import copy
import json
import zlib
from typing import Any, NamedTuple

import attrs
import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import given
from hypothesis import strategies as st

from fnloop import TrainState, Unclaimed, checkpoint, testing
from fnloop.checkpoint import CheckpointError
from fnloop.checkpoint._codec import DTYPES


@attrs.frozen
class Pair:
    left: Any
    right: Any


class Point(NamedTuple):
    x: Any
    y: Any


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Small tensors of any savable dtype, 0-d and empty ones included, with random bits."""
    dtype = draw(st.sampled_from(sorted(DTYPES, key=str)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    seed = draw(st.integers(0, 2**16))
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return (raw % 2 if dtype is torch.bool else raw).view(dtype).reshape(shape)


SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
KEYS = st.text(max_size=4) | st.integers(-3, 3)


def trees() -> st.SearchStrategy[Any]:
    """Nested data a checkpoint holds: scalars, tensors, lists, tuples, dicts, records, NamedTuples."""
    return st.recursive(
        SCALARS | tensors(),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.lists(inner, max_size=3).map(tuple)
            | st.dictionaries(KEYS, inner, max_size=3)
            | st.builds(Pair, inner, inner)
            | st.builds(Point, inner, inner)
        ),
        max_leaves=8,
    )


@st.composite
def rich_states(draw: st.DrawFn) -> TrainState:
    """``testing.states()`` with mixed-dtype tensors, and trees in opt_state, extra and hooks."""
    base = draw(testing.states())
    names = st.sampled_from(["w", "b", "fc.weight", "bn.running_mean"])
    return attrs.evolve(
        base,
        params={**base.params, **draw(st.dictionaries(names, tensors(), max_size=2))},
        buffers=draw(st.dictionaries(names, tensors(), max_size=2)),
        opt_state=draw(trees()),
        extra=draw(trees()),
        hooks={**base.hooks, **draw(st.dictionaries(st.text(max_size=4), trees(), max_size=3))},
    )


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoint_laws")


@given(rich_states())
def test_load_of_save_is_identity(directory, state):
    path = checkpoint.save(state, directory / "round-trip.safetensors")
    testing.assert_identical(checkpoint.load(path, like=state), state)


@given(rich_states())
def test_hook_states_unknown_to_the_template_claim_back(directory, state):
    path = checkpoint.save(state, directory / "claim.safetensors")
    loaded = checkpoint.load(path, like=attrs.evolve(state, hooks={}))
    assert list(loaded.hooks) == list(state.hooks)
    for name, value in loaded.hooks.items():
        assert type(value) is Unclaimed
        testing.assert_identical(value.claim(state.hooks[name]), state.hooks[name])
    testing.assert_identical(attrs.evolve(loaded, hooks=state.hooks), state)


def json_values() -> st.SearchStrategy[Any]:
    leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    )


def header_shaped(value: Any, rest: bytes) -> bytes:
    header = json.dumps(value).encode()
    return len(header).to_bytes(8, "little") + header + rest


GARBAGE = (
    st.binary(max_size=200)
    | st.builds(header_shaped, json_values(), st.binary(max_size=64))
    | st.builds(
        header_shaped,
        st.fixed_dictionaries(
            {
                "__metadata__": st.fixed_dictionaries(
                    {"fnloop.format": st.just("1")}, optional={"fnloop.skeleton": st.text()}
                )
            },
            optional={"t": json_values()},
        ),
        st.binary(max_size=64),
    )
)


@given(GARBAGE)
def test_random_bytes_only_raise_checkpoint_error(directory, data):
    path = directory / "garbage.safetensors"
    path.write_bytes(data)
    with pytest.raises(CheckpointError):
        checkpoint.load(path, like=TrainState(max_iter=1))
    with pytest.raises(CheckpointError):
        checkpoint.read_raw(path)


@given(rich_states(), st.data())
def test_a_damaged_file_loads_identically_or_raises_checkpoint_error(directory, state, data):
    path = checkpoint.save(state, directory / "damaged.safetensors")
    raw = bytearray(path.read_bytes())
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="size")]
    else:
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            at = data.draw(st.integers(0, len(raw) - 1), label="at")
            if data.draw(st.booleans(), label="flip a bit"):
                raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
            else:
                raw[at] = data.draw(st.integers(0, 255), label="byte")
    path.write_bytes(bytes(raw))
    try:
        loaded = checkpoint.load(path, like=state)
    except CheckpointError:
        return
    testing.assert_identical(loaded, state)  # never a silently different state


def write_crafted(path, skeleton: Any, tensors: dict[str, torch.Tensor]) -> None:
    """A file with a valid checksum around any skeleton: what a hostile writer can produce."""
    text = json.dumps(skeleton)
    entries = [
        (
            key,
            {"dtype": DTYPES[t.dtype], "shape": list(t.shape)},
            [zlib.crc32(checkpoint._transfer._bytes(t))] if t.numel() else [],
        )
        for key, t in tensors.items()
    ]
    metadata = {
        "fnloop.format": "1",
        "fnloop.skeleton": text,
        "fnloop.checksum": checkpoint._transfer._digest(text, entries),
    }
    safetensors.torch.save_file(tensors, path, metadata=metadata)


def subtrees(node: Any) -> int:
    kids = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    return 1 + sum(subtrees(k) for k in kids)


def splice(node: Any, index: int, new: Any) -> tuple[Any, int]:
    """``node`` with its ``index``-th subtree (depth first) replaced by ``new``."""
    if index == 0:
        return new, -1
    index -= 1
    if isinstance(node, (dict, list)):
        items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        for key, child in items:
            size = subtrees(child)
            if index < size:
                node[key], _ = splice(child, index, new)
                return node, -1
            index -= size
    return node, index


@given(rich_states(), st.data())
def test_a_hostile_skeleton_only_raises_checkpoint_error(directory, state, data):
    saved = checkpoint.save(state, directory / "source.safetensors")
    with safetensors.safe_open(saved, "pt") as f:
        skeleton = json.loads(f.metadata()["fnloop.skeleton"])
        names = f.keys()
        stored = {key: f.get_tensor(key) for key in names}
    index = data.draw(st.integers(0, subtrees(skeleton) - 1), label="node")
    hostile, _ = splice(copy.deepcopy(skeleton), index, data.draw(json_values(), label="replacement"))
    path = directory / "hostile.safetensors"
    write_crafted(path, hostile, stored)
    for read in (lambda: checkpoint.load(path, like=state), lambda: checkpoint.read_raw(path)):
        with contextlib.suppress(CheckpointError):
            read()
