"""Sharded checkpoints: every rank writes its part, and rank 0's part, written last, is the index.

A sharded state (``TrainState.shards``) is saved as one file per rank, each
an ordinary fnloop checkpoint of that rank's state (its chunks, and the rest,
which every rank holds alike):

* rank ``r > 0`` writes ``ckpt-00000100.part-0000r-of-0000N.safetensors``
  (of a state kept in several copies, HSDP, the first copy's ranks write,
  ``N`` the ranks of one copy);
* rank 0 waits until every other part is on disk, then writes its own part
  under the checkpoint's name, ``ckpt-00000100.safetensors``, with the index
  in its metadata (``fnloop.shards``, covered by its checksum): the layout,
  which entries are chunks of which parameter, and each other part's name and
  checksum.

The index is renamed into place last, atomically, so ``checkpoints`` and
``latest`` see a sharded checkpoint only once every part is complete: a kill
at any moment leaves the previous one as the newest. The ranks meet through
the process group's store (not a collective), so a save may run off the
training path. Parts are read by slices: a rank loading at another world size
reads the rows of its chunks from each part's bytes (``reshard``), after
checking each part's checksum through a small buffer. Nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fnloop._core.shards import MODES, Shards, sharded_tensors
from fnloop._core.state import TrainState
from fnloop.checkpoint._codec import CheckpointError, CheckpointMismatch, DamagedCheckpoint, decode
from fnloop.checkpoint._reading import _check, _opened, _skeleton, _streamed, read
from fnloop.checkpoint._safetensors import INDEX, Entry, damaged, read_header
from fnloop.checkpoint._state_codec import encode_state_keyed, fill_state
from fnloop.checkpoint._transfer import _bytes, _pread

__all__ = ["Index", "index_of", "orphans", "part_path", "parts_of", "reshard", "save_sharded"]

_PART = re.compile(r"(ckpt-(\d{8,}))\.part-(\d{5,})-of-(\d{5,})\.safetensors(\.abandoned)?")

_saves: dict[tuple[str, int], int] = {}
"""(path, rank) -> how many sharded saves of it this process made: the same on every rank."""


def part_path(path: Path, rank: int, world: int) -> Path:
    """Where ``rank`` writes its part of the sharded checkpoint ``path`` (rank 0: ``path`` itself).

    Examples:
        >>> part_path(Path("run/ckpt-00000010.safetensors"), 1, 2).name
        'ckpt-00000010.part-00001-of-00002.safetensors'
    """
    if rank == 0:
        return path
    stem = path.name.removesuffix(".safetensors")
    return path.with_name(f"{stem}.part-{rank:05d}-of-{world:05d}.safetensors")


def parts_of(path: Path) -> list[Path]:
    """The part files beside ``path`` that belong to it (of any world size), whether or not it exists.

    The parts of a checkpoint set aside (``*.abandoned``) are set aside with it.
    """
    aside = path.name.endswith(".abandoned")
    stem = path.name.removesuffix(".abandoned").removesuffix(".safetensors")
    try:
        names = os.listdir(path.parent)
    except FileNotFoundError:
        return []
    found = [(n, m) for n in sorted(names) if (m := _PART.fullmatch(n))]
    return [path.with_name(n) for n, m in found if m[1] == stem and bool(m[5]) == aside]


def orphans(directory: Path, before: int) -> list[Path]:
    """Parts of saves before iteration ``before`` whose index never landed (the save was interrupted)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(n, m) for n in sorted(names) if (m := _PART.fullmatch(n)) and not m[5] and int(m[2]) < before]
    return [directory / n for n, m in found if not (directory / f"{m[1]}.safetensors").exists()]


class Index:
    """A sharded checkpoint's index, as its metadata holds it: the layout and the other parts."""

    def __init__(self, data: Any, name: str) -> None:
        try:
            self.mode: str = data["mode"]
            self.world: int = data["world"]
            self.rows: dict[str, int] = {str(k): int(v) for k, v in data["rows"]}
            self.chunks: dict[str, str] = {str(k): str(v) for k, v in data["chunks"].items()}
            self.parts: list[tuple[str, str]] = [(str(p["file"]), str(p["checksum"])) for p in data["parts"]]
            ok = self.mode in MODES and type(self.world) is int and len(self.parts) == self.world - 1
            # A part is a file beside the index, named as a part: never a path elsewhere.
            ok = ok and all(_PART.fullmatch(file) for file, _ in self.parts)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok or not all(v in self.rows for v in self.chunks.values()):
            raise damaged(name, "its index of shards is malformed")

    def layout(self, rank: int = 0) -> Shards:
        return Shards(self.mode, self.world, rank, self.rows)


def index_of(metadata: dict[str, str], name: str) -> Index | None:
    """The index in a checkpoint's metadata, or ``None`` for a checkpoint of a whole state."""
    text = metadata.get(INDEX)
    if text is None:
        return None
    try:
        return Index(json.loads(text), name)
    except ValueError:
        raise damaged(name, "its index of shards is not JSON") from None


def _chunks(state: TrainState, keys: dict[int, str]) -> dict[str, str]:
    """The entries of ``state``'s checkpoint that hold chunks: entry key -> parameter name."""
    assert state.shards is not None
    found = sharded_tensors(state.params, state.opt_state, state.shards)
    return {keys[i]: name for i, name in found.items() if i in keys}


def save_sharded(state: TrainState, path: Path, write_file: Callable[..., str]) -> Path:
    """Write this rank's part of the sharded checkpoint ``path``; on rank 0, the index last.

    Every rank of the state's layout calls it, with the same ``path``. Of a
    state kept in several copies (HSDP), the first copy's ranks write it, and
    the others wait until it is whole and write nothing.
    ``write_file(path, skeleton, tensors, index=None) -> checksum`` writes one
    file (``fnloop.checkpoint._files``). Returns the file this rank wrote.

    Raises:
        CheckpointError: another rank will not write its part (or rank 0 its
            index): it is gone, its run ended elsewhere, or the process
            group's timeout passed (see ``_wait``).
    """
    shards = state.shards
    assert shards is not None
    mine = (os.fspath(path.absolute()), shards.global_rank)
    count = _saves[mine] = _saves.get(mine, 0) + 1
    meeting = f"fnloop/ckpt/{path.absolute()}/{count}"
    store = _store() if shards.ranks > 1 else None
    if shards.replica:  # a copy of the state the first copy's ranks write: wait for it to be whole
        assert store is not None
        _wait(store, meeting, {0: f"{meeting}/done"}, path, state.iteration, "rank 0 to write the index")
        return path
    skeleton, tensors, keys = encode_state_keyed(state)
    if shards.rank:
        part = part_path(path, shards.rank, shards.world)
        checksum = write_file(part, skeleton, tensors)
        assert store is not None
        store.set(f"{meeting}/{shards.rank}", json.dumps({"file": part.name, "checksum": checksum}))
        _wait(store, meeting, {0: f"{meeting}/done"}, path, state.iteration, "rank 0 to write the index")
        return part
    parts = []
    if store is not None:
        others = {r: f"{meeting}/{r}" for r in range(1, shards.world)}
        _wait(store, meeting, others, path, state.iteration, "the other ranks to write their parts")
        parts = [json.loads(store.get(key)) for key in others.values()]
    index = {
        "mode": shards.mode,
        "world": shards.world,
        "rows": [list(pair) for pair in shards.rows],
        "chunks": _chunks(state, keys),
        "parts": parts,
    }
    write_file(path, skeleton, tensors, json.dumps(index, separators=(",", ":")))
    if store is not None:
        store.set(f"{meeting}/done", "1")
    return path


def _store() -> Any:
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


POLL = 0.05
"""Seconds between a sharded save's looks in the store for the others' keys. It looks (``check``)
rather than waits (``wait`` with a timeout): each wait that times out is a warning line of c10d's
own, ten a second from a survivor waiting on a dead rank."""


def _wait(store: Any, meeting: str, keys: dict[int, str], path: Path, iteration: int, what: str) -> None:
    """Wait for ``keys`` (rank -> its key in the store); give up as soon as one of those ranks will never set it.

    A rank is given up on when it is gone or its run ended elsewhere
    (``fnloop.distributed.SharedRun.absent``), or when another rank of this
    save gave it up; and after the process group's timeout (``setup``'s) in
    any case. Giving up is said in the store, so the others stop waiting too.
    """
    from fnloop.distributed import current_run

    run = current_run()
    deadline = time.monotonic() + store.timeout.total_seconds()
    abandoned = f"{meeting}/abandoned"
    while True:
        if store.check(list(keys.values())):
            return
        time.sleep(POLL)
        if store.check([abandoned]):
            why = store.get(abandoned).decode()
            raise CheckpointError(f"{path}: the sharded save was given up: {why}. {_KEPT}")
        missing = [r for r, key in keys.items() if not store.check([key])]
        why = None if run is None else run.absent(missing, iteration)
        if why is None and time.monotonic() > deadline:
            why = f"waited {store.timeout} (the process group's timeout) for {what}, in vain; a rank hangs"
        if why is not None:
            store.set(abandoned, why)
            raise CheckpointError(f"{path}: the sharded save was given up: {why}. {_KEPT}")


_KEPT = "The previous checkpoint is still the newest"


def reshard(path: Path, index: Index | None, like: TrainState | None) -> tuple[dict[str, str], Any]:
    """The metadata and plain state of the checkpoint ``path``, laid out as ``like`` is (whole without it).

    ``index`` is the checkpoint's (``None``: a checkpoint of a whole state).
    Each part's checksum is checked through a small buffer, and this rank's
    rows of each chunk are then read from the parts that hold them.
    """
    name = str(path)
    sources = [path] + [path.with_name(file) for file, _ in (index.parts if index else [])]
    headers = [_part_header(p, i, index, name) for i, p in enumerate(sources)]
    metadata, start, entries = headers[0]
    target = like.shards if like is not None else None
    wanted: dict[str, str] = {}
    if like is not None and target is not None:
        _, _, keys = encode_state_keyed(like)
        wanted = _chunks(like, keys)
    source = index.layout() if index else None
    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    for key, dtype, shape, begin, end in entries:
        chunked = index.chunks.get(key) if index else None
        param = chunked or wanted.get(key)
        if param is None:  # whole on every rank: rank 0's
            tensors[key] = _read_rows(
                sources[0], (key, dtype, shape, begin, end), start, 0, shape[0] if shape else 0
            )
            continue
        rows = index.rows[param] if chunked and index else shape[0]
        if target is not None and key in wanted:
            if target.whole(param) != rows:
                raise CheckpointMismatch(
                    f"{name}: state entry {key} has {rows} rows in the checkpoint and "
                    f"{target.whole(param)} in the template; the model changed"
                )
            (a, b), out_rows = target.span(param), target.rows_per_rank(param)
        else:
            (a, b), out_rows = (0, rows), rows
        out = torch.zeros((out_rows, *shape[1:]), dtype=dtype)
        if chunked and source is not None:
            for q, (part, (_, part_start, part_entries)) in enumerate(zip(sources, headers)):
                lo, hi = source.span(param, q)
                lo, hi = max(lo, a), min(hi, b)
                if lo < hi:
                    entry = _entry(part_entries, key, str(part))
                    base = q * source.rows_per_rank(param)
                    out[lo - a : hi - a] = _read_rows(part, entry, part_start, lo - base, hi - base)
        else:
            out[: b - a] = _read_rows(sources[0], (key, dtype, shape, begin, end), start, a, b)
        tensors[key] = out
        shapes[key] = list(out.shape)
    skeleton = _reshaped(_skeleton(metadata), shapes)
    return metadata, decode(skeleton, tensors, f"{name}: state")


def _part_header(
    part: Path, i: int, index: Index | None, name: str
) -> tuple[dict[str, str], int, list[Entry]]:
    """The header of part ``i``, its bytes checked against its checksum (and the index's, for i > 0)."""
    with _opened(part) as file:
        metadata, start, entries = read_header(file, str(part))
        _check(_streamed(file, start, entries, str(part)), metadata, entries, str(part))
    if i and index is not None:
        _named(Path(name), part, index.parts[i - 1][1], metadata)
    return metadata, start, entries


def _named(path: Path, part: Path, checksum: str, metadata: dict[str, str] | None = None) -> None:
    """Refuse ``part`` unless it is the part of ``path`` its index names (by its header's checksum)."""
    if metadata is None:
        with _opened(part) as file:
            metadata, _, _ = read_header(file, str(part))
    if metadata.get("fnloop.checksum") != checksum:
        raise DamagedCheckpoint(
            f"{path}: its part {part.name} is not the one its index names (checksum "
            f"{metadata.get('fnloop.checksum')!r}, the index says {checksum!r}): a part of another save"
        )


def _entry(entries: list[Entry], key: str, name: str) -> Entry:
    for entry in entries:
        if entry[0] == key:
            return entry
    raise damaged(name, f"the part has no entry {key!r}")


def _read_rows(part: Path, entry: Entry, start: int, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of the entry's tensor, read from the file's bytes (a 0-d tensor whole)."""
    _, dtype, shape, begin, end = entry
    out_shape = [hi - lo, *shape[1:]] if shape else []
    out = torch.empty(out_shape, dtype=dtype)
    size = out.numel() * out.element_size()
    if size:
        row = (end - begin) // shape[0] if shape else 0
        fd = os.open(part, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        try:
            _pread(fd, _bytes(out), start + begin + lo * row)
        except EOFError:
            raise damaged(str(part), "truncated while its tensors were read") from None
        finally:
            os.close(fd)
    return out


def _reshaped(node: Any, shapes: dict[str, list[int]]) -> Any:
    """The skeleton with the shapes of the tensors ``shapes`` names changed to theirs."""
    if isinstance(node, list):
        return [_reshaped(n, shapes) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("kind") == "tensor" and node.get("key") in shapes:
        return {**node, "shape": shapes[node["key"]]}
    return {k: _reshaped(v, shapes) for k, v in node.items()}


def load_sharded(path: Path, like: TrainState, index: Index | None) -> TrainState:
    """The state ``like`` describes from the checkpoint ``path``: this rank's part, or resharded."""
    target = like.shards
    same = (
        index is not None
        and target is not None
        and (index.mode, index.world, index.rows) == (target.mode, target.world, dict(target.rows))
    )
    if same:
        assert target is not None
        assert index is not None
        part = part_path(path, target.rank, target.world)
        if target.rank == 0:  # rank 0 chooses the checkpoint every rank loads: every part must be there
            for file, checksum in index.parts:
                _named(path, path.with_name(file), checksum)
        metadata, raw = read(part, like)
        if target.rank:
            _named(path, part, index.parts[target.rank - 1][1], metadata)
        return fill_state(raw, like, f"{part}: state", index.layout(target.rank))
    _, raw = reshard(path, index, like)
    return fill_state(raw, like, f"{path}: state", index.layout() if index else None)
