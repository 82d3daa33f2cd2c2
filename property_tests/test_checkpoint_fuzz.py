"""Fuzzing checkpoints: whatever the bytes, the saved state or a CheckpointError; never a hang or a blow-up.

Files saved from random states are damaged (bit flips, truncations, extensions)
or edited in their header (entries, metadata, skeleton), with or without a
checksum recomputed to match, as a hostile writer would. ``load`` and
``read_raw`` must give the saved state (or, once the checksum was forged, some
valid state) or a ``CheckpointError``; ``fnloop inspect`` and ``fnloop diff``
must answer with exit code 0, 1 (diff) or 2 and a one-line error, never a
traceback. Each example runs under an alarm (no hang), and the process's peak
memory may grow by little more than the file's size. Bounded under the ``ci``
hypothesis profile; ``HYPOTHESIS_PROFILE=hunt`` runs thousands of examples.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import resource
import signal
import zlib
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fnloop import Phase, TrainState, checkpoint, cli, testing
from fnloop.checkpoint import CheckpointError, DamagedCheckpoint
from fnloop.checkpoint._codec import DTYPES

ALARM_S = 20  # far above any example's real cost: only a hang trips it
SLACK = 64 << 20  # bytes of peak memory any example may add besides a few times the file's size


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(sorted(DTYPES, key=str)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    return (raw % 2 if dtype is torch.bool else raw).view(dtype).reshape(shape)


LEAVES = (
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4) | st.sampled_from(Phase)
)
TREES = st.recursive(
    LEAVES | tensors(),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def states(draw: st.DrawFn) -> TrainState:
    base = draw(testing.states())
    return attrs.evolve(
        base,
        buffers=draw(st.dictionaries(st.sampled_from(["bn.mean", "bn.var"]), tensors(), max_size=2)),
        opt_state=draw(TREES),
        extra=draw(TREES),
        hooks={**base.hooks, **draw(st.dictionaries(st.sampled_from(["h", "best"]), TREES, max_size=2))},
    )


# -- editing a file ---------------------------------------------------------------------------------


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def join(head: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(head).encode()
    return len(text).to_bytes(8, "little") + text + data


def forge_checksum(head: dict[str, Any], data: bytes) -> None:
    """Make the checksum match the (edited) header and data, as a hostile writer can."""
    metadata = head.get("__metadata__")
    if type(metadata) is not dict or type(metadata.get("fnloop.skeleton")) is not str:
        return
    entries = []
    for key, spec in head.items():
        if key == "__metadata__" or type(spec) is not dict:
            continue
        offsets = spec.get("data_offsets")
        ok = type(offsets) is list and len(offsets) == 2 and all(type(o) is int for o in offsets)
        chunk = data[offsets[0] : offsets[1]] if ok else b""
        crcs = [
            zlib.crc32(chunk[i : i + checkpoint._transfer._PIECE])
            for i in range(0, len(chunk), checkpoint._transfer._PIECE)
        ]
        entries.append((key, spec, crcs))
    with contextlib.suppress(Exception):  # a spec without the fields the digest reads: leave it
        metadata["fnloop.checksum"] = checkpoint._transfer._digest(
            metadata["fnloop.skeleton"], entries, metadata.get("fnloop.format", "1")
        )


JSONS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
INTS = st.integers(-3, 40) | st.sampled_from([2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64, 10**12, -(2**63)])
NODES = JSONS | st.fixed_dictionaries(
    {
        "kind": st.sampled_from(
            ["float", "tensor", "phase", "list", "tuple", "dict", "record", "namedtuple", "x"]
        ),
    },
    optional={
        "value": JSONS,
        "name": JSONS | st.sampled_from(list(Phase.__members__)),
        "key": JSONS,
        "dtype": JSONS,
        "shape": st.lists(INTS, max_size=3),
        "items": JSONS,
        "fields": JSONS,
        "type": JSONS,
    },
)


def subtrees(node: Any) -> list[tuple[Any, Any]]:
    """(container, key) of every subtree of a JSON value, depth first."""
    found, stack = [], [node]
    while stack:
        here = stack.pop()
        kids = here.items() if isinstance(here, dict) else enumerate(here) if isinstance(here, list) else ()
        for key, child in kids:
            found.append((here, key))
            stack.append(child)
    return found


@st.composite
def header_edits(draw: st.DrawFn, head: dict[str, Any], data: bytes) -> tuple[dict[str, Any], bytes]:
    """``head`` and ``data`` with one structured edit."""
    keys = [k for k in head if k != "__metadata__"]
    metadata = head["__metadata__"]
    what = draw(
        st.sampled_from(
            [
                "entry",
                "empty",
                "drop entry",
                "add entry",
                "metadata",
                "skeleton",
                "phase",
                "extend",
                "truncate",
            ]
        )
    )
    if what == "entry" and keys:
        spec = head[draw(st.sampled_from(keys))]
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        spec[field] = draw(
            {
                "dtype": st.sampled_from([*DTYPES.values(), "F128", ""]) | JSONS,
                "shape": st.lists(INTS, max_size=4) | JSONS,
                "data_offsets": st.lists(INTS, min_size=2, max_size=2) | JSONS,
            }[field]
        )
    elif what == "empty" and keys:
        # A shape with no element, but a dimension torch cannot hold.
        spec = head[draw(st.sampled_from(keys))]
        spec["shape"] = draw(st.permutations([0, draw(st.sampled_from([2**62, 2**63, 2**64, 10**30]))]))
        if type(spec.get("data_offsets")) is list and spec["data_offsets"]:
            spec["data_offsets"] = [spec["data_offsets"][0]] * 2
    elif what == "phase":
        skeleton = json.loads(metadata["fnloop.skeleton"])
        places = subtrees(skeleton)
        if places:
            container, key = draw(st.sampled_from(places))
            container[key] = {"kind": "phase", "name": draw(JSONS | st.sampled_from(list(Phase.__members__)))}
        metadata["fnloop.skeleton"] = json.dumps(skeleton)
    elif what == "drop entry" and keys:
        del head[draw(st.sampled_from(keys))]
    elif what == "add entry":
        head[draw(st.text(max_size=4))] = draw(
            st.fixed_dictionaries(
                {"dtype": st.sampled_from(list(DTYPES.values())), "shape": st.lists(INTS, max_size=3)},
                optional={"data_offsets": st.lists(INTS, min_size=2, max_size=2)},
            )
        )
    elif what == "metadata":
        key = draw(st.sampled_from(["fnloop.format", "fnloop.checksum", "fnloop.version", "other"]))
        if draw(st.booleans()) and key in metadata:
            del metadata[key]
        else:
            metadata[key] = draw(
                st.sampled_from(["0", "1", "2", "3", "02", "-1", "1e3"]) | st.text(max_size=6)
            )
    elif what == "skeleton":
        skeleton = json.loads(metadata["fnloop.skeleton"])
        places = subtrees(skeleton)
        if places:
            container, key = draw(st.sampled_from(places))
            container[key] = draw(NODES)
        metadata["fnloop.skeleton"] = json.dumps(skeleton)
    elif what == "extend":
        data += draw(st.binary(min_size=1, max_size=64))
    elif what == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    return head, data


# -- what must hold ------------------------------------------------------------------------------------


@contextlib.contextmanager
def bounded(size: int) -> Iterator[None]:
    """No hang (an alarm), and peak memory that grows by little more than ``size``."""

    def hang(signum: int, frame: object) -> None:
        raise TimeoutError(f"an example ran for {ALARM_S} s")

    previous = signal.signal(signal.SIGALRM, hang)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    signal.setitimer(signal.ITIMER_REAL, ALARM_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown <= SLACK + 4 * size, f"peak memory grew by {grown} bytes for a file of {size}"


def command(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, err.getvalue()


def check(path, good, state: TrainState, forged: bool) -> None:
    """The outcomes allowed for the file ``path``, saved from ``state`` and then changed.

    Unless the checksum was forged, a changed file is intact (the change missed
    what the checksum covers) or damaged: never taken for another format or
    another state, so that ``latest`` skips it.
    """
    size = path.stat().st_size
    with bounded(size):
        try:
            loaded = checkpoint.load(path, like=state)
        except DamagedCheckpoint:
            loaded = None
        except CheckpointError:
            assert forged, "a damaged file was not recognized as damaged"
            loaded = None
        if loaded is not None and not forged:
            testing.assert_identical(loaded, state)  # never a silently different state
        with contextlib.suppress(CheckpointError):
            checkpoint.read_raw(path)
        code, err = command("inspect", str(path))
        assert code in (0, 2)
        assert code == 0 or (err.startswith("fnloop inspect: error: ") and "Traceback" not in err)
        code, err = command("inspect", "--json", str(path))
        assert code in (0, 2)
        code, err = command("diff", str(path), str(good))
        assert code in (0, 1, 2)
        assert code != 2 or (err.startswith("fnloop diff: error: ") and "Traceback" not in err)


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


SETTINGS = settings(
    # Each example costs milliseconds: a few times the profile's count (100 or more under ci).
    max_examples=max(100, settings.default.max_examples),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(states(), st.data())
def test_bit_flips_truncations_and_extensions(directory, state, data):
    good = checkpoint.save(state, directory / "good.safetensors")
    raw = bytearray(good.read_bytes())
    how = data.draw(st.sampled_from(["flip", "truncate", "extend"]), label="how")
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            at = data.draw(st.integers(0, len(raw) - 1), label="at")
            raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    elif how == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="size")]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=64), label="tail")
    path = directory / "bad.safetensors"
    path.write_bytes(bytes(raw))
    check(path, good, state, forged=False)


@SETTINGS
@given(states(), st.data(), st.booleans())
def test_structured_header_edits(directory, state, data, forge):
    good = checkpoint.save(state, directory / "good.safetensors")
    head, rest = split(good.read_bytes())
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        head, rest = data.draw(header_edits(head, rest), label="edit")
    if forge:
        forge_checksum(head, rest)
    path = directory / "edited.safetensors"
    path.write_bytes(join(head, rest))
    check(path, good, state, forged=forge)


@SETTINGS
@given(
    st.binary(max_size=300)
    | st.builds(join, st.dictionaries(st.text(max_size=4), JSONS), st.binary(max_size=64))
)
def test_any_bytes(directory, raw):
    path = directory / "any.safetensors"
    path.write_bytes(raw)
    good = checkpoint.save(TrainState(max_iter=1), directory / "good.safetensors")
    check(path, good, TrainState(max_iter=1), forged=True)
