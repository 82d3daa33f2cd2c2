"""Reading a checkpoint file: its header checked first, its bytes checked against the checksum.

``read`` gives the metadata and the state as plain data (``decode``). With a
template (``like``), the header alone is tried against it before any tensor
gets memory: a file that cannot fit is refused after one pass over its bytes
through a small buffer, which tells an intact file that does not fit
(``CheckpointMismatch``) from a damaged one (``DamagedCheckpoint``), without
holding its tensors. ``read_streamed`` never holds them: each tensor's bytes go
to a sink piece by piece (``fnloop inspect`` summarizes them so).
"""

from __future__ import annotations

import io
import json
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from fnloop._core.state import TrainState
from fnloop.checkpoint._codec import DTYPES, CheckpointError, CheckpointMismatch, DamagedCheckpoint, decode
from fnloop.checkpoint._safetensors import Entry, check_format, covered, damaged, read_header
from fnloop.checkpoint._state_codec import fill_state
from fnloop.checkpoint._transfer import _bytes, _digest, _pread, _stream, _transfer

__all__ = ["Sink", "read", "read_streamed"]

StrPath = str | os.PathLike[str]

try:
    _MEMORY = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # no file bigger loads
except (AttributeError, ValueError, OSError):
    _MEMORY = 1 << 62

_KINDS = {stat.S_IFDIR: "directory", stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket", stat.S_IFCHR: "device"}


class Sink(Protocol):
    """What ``read_streamed`` puts in the tree for a tensor: it has the tensor's ``dtype`` and ``shape``
    and is given the tensor's bytes piece by piece (``add``)."""

    dtype: torch.dtype
    shape: torch.Size

    def add(self, piece: memoryview) -> None:
        """The next piece of the tensor's bytes (a view to read now, not to keep)."""


@contextmanager
def _opened(path: StrPath) -> Iterator[io.BufferedReader]:
    """``path`` open for reading if it is a regular file; any failure a ``DamagedCheckpoint``."""
    try:
        # Not blocking: a FIFO named like a checkpoint would wait for a writer forever.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        what = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise DamagedCheckpoint(f"{path}: cannot read the file: {what}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise damaged(
                str(path), f"not a regular file (a {_KINDS.get(stat.S_IFMT(mode), 'special file')})"
            )
        os.set_blocking(fd, True)
        with open(fd, "rb", closefd=False) as file:
            yield file
    except OSError as exc:
        raise DamagedCheckpoint(f"{path}: cannot read the file: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def read(path: StrPath, like: TrainState | None = None) -> tuple[dict[str, str], Any]:
    """The metadata and the state of the file ``path`` as plain data, its checksum checked.

    Raises:
        CheckpointMismatch: with ``like``, the header shows the file cannot
            fit it; the file is intact (its checksum checked through a buffer of
            one piece), and its tensors were never read into memory.
        DamagedCheckpoint: the file is not an intact fnloop checkpoint.
        CheckpointError: the file is of another format version, or too large to load.
    """
    name = str(path)
    with _opened(path) as file:
        metadata, start, entries = read_header(file, name)
        if sum(end - begin for *_, begin, end in entries) > _MEMORY:  # with overcommit, malloc says yes
            raise _too_large(entries, name)
        skeleton = _skeleton(metadata)
        if like is not None and type(skeleton) is not _Unreadable:
            misfit = _misfit(skeleton, entries, like, f"{path}: state")
            if misfit is not None:
                _check(_streamed(file, start, entries, name), metadata, entries, name)
                raise misfit
        tensors = _tensors(file, metadata, start, entries, name)
    return metadata, _decoded(skeleton, tensors, name)


def read_streamed(
    path: StrPath, sink: Callable[[torch.dtype, torch.Size], Sink]
) -> tuple[dict[str, str], Any]:
    """The metadata and the state of ``path`` as plain data, a ``sink(dtype, shape)`` for each tensor.

    Each sink is given its tensor's bytes piece by piece, through one buffer:
    the memory of a piece, whatever the file's size. The checksum is checked
    before the tree is built.

    Raises:
        DamagedCheckpoint, CheckpointError: as ``read``.
    """
    name = str(path)
    with _opened(path) as file:
        metadata, start, entries = read_header(file, name)
        sinks = {key: sink(dtype, torch.Size(shape)) for key, dtype, shape, _, _ in entries}
        order = list(sinks.values())
        _check(_streamed(file, start, entries, name, lambda i, p: order[i].add(p)), metadata, entries, name)
    return metadata, _decoded(_skeleton(metadata), sinks, name)


def _streamed(
    file: io.BufferedReader,
    start: int,
    entries: list[Entry],
    name: str,
    each: Callable[[int, memoryview], None] | None = None,
) -> list[list[int]]:
    """The CRC-32s of each entry's pieces, read through one buffer (``_stream``)."""
    try:
        return _stream(file.fileno(), [(begin, end) for *_, begin, end in entries], start, each)
    except EOFError:
        raise damaged(name, "truncated while its tensors were read") from None


class _Unreadable(Exception):
    """A skeleton that does not parse; said only once the checksum is checked."""


def _skeleton(metadata: dict[str, str]) -> Any:
    """The parsed skeleton, or an ``_Unreadable`` holding why it does not parse."""
    try:
        return json.loads(metadata["fnloop.skeleton"])
    except (ValueError, RecursionError) as exc:
        return _Unreadable(f"{type(exc).__name__}: {exc}")


def _decoded(skeleton: Any, tensors: Any, name: str) -> Any:
    """The plain tree of a parsed skeleton, its tensors from ``tensors``."""
    try:
        if type(skeleton) is _Unreadable:
            raise skeleton
        return decode(skeleton, tensors, f"{name}: state")
    except (_Unreadable, RecursionError) as exc:
        raise DamagedCheckpoint(f"{name}: the skeleton cannot be read ({exc})") from None


def _misfit(skeleton: Any, entries: list[Entry], like: TrainState, where: str) -> CheckpointMismatch | None:
    """The mismatch the header shows between the file and ``like``, before any tensor is read.

    The state is decoded with placeholder tensors (``meta``: dtype and shape,
    no memory) and filled against ``like``. Only a mismatch of structure,
    dtype or shape counts: one raised by the template's own classes (a
    validator, seeing placeholders) and any other failure are left to the
    full read, which says them with the real values.
    """
    placeholders = {
        key: torch.empty(shape, dtype=dtype, device="meta") for key, dtype, shape, _, _ in entries
    }
    try:
        fill_state(decode(skeleton, placeholders, where), like, where)
    except CheckpointMismatch as exc:
        return exc if exc.__cause__ is None else None
    except Exception:  # noqa: BLE001 - whatever else fails is the full read's to say, with real values
        return None
    return None


def _check(crcs: list[list[int]], metadata: dict[str, str], entries: list[Entry], name: str) -> None:
    """Refuse the file as damaged unless the pieces' ``crcs`` give the checksum its metadata stores."""
    found = [
        (key, {"dtype": DTYPES[dtype], "shape": shape}, c)
        for (key, dtype, shape, _, _), c in zip(entries, crcs)
    ]
    stored = metadata.get("fnloop.checksum")
    if _digest(covered(metadata), found, metadata["fnloop.format"]) != stored:
        raise damaged(
            name,
            f"checksum mismatch (stored {stored!r:.40}): its bytes changed after it "
            "was written, by a disk, transfer or copy error",
        )
    check_format(metadata, name)


def _too_large(entries: list[Entry], name: str) -> CheckpointError:
    total = sum(end - begin for *_, begin, end in entries)
    return CheckpointError(
        f"{name}: its tensors take {total:,} bytes, more memory than this process can get. "
        "Load it on a machine with more memory; if the file is not that large on disk, it is sparse "
        "and damaged."
    )


def _tensors(
    file: io.BufferedReader, metadata: dict[str, str], start: int, entries: list[Entry], name: str
) -> dict[str, torch.Tensor]:
    # Nothing is shaped before the checksum holds, and only tensors with bytes get memory before
    # then: the header is checked, but what it claims is not yet known to be what was written.
    buffers, views = {}, []
    try:
        for key, _, _, begin, end in entries:
            if end > begin:
                buffers[key] = torch.empty(end - begin, dtype=torch.uint8)
                views.append(_bytes(buffers[key]))
    except (RuntimeError, MemoryError):
        raise _too_large(entries, name) from None
    try:
        read = iter(_transfer(file.fileno(), views, start, _pread))
    except EOFError:
        raise damaged(name, "truncated while its tensors were read") from None
    _check([next(read) if key in buffers else [] for key, *_ in entries], metadata, entries, name)
    empty = torch.empty(0, dtype=torch.uint8)
    return {key: buffers.get(key, empty).view(dtype).reshape(shape) for key, dtype, shape, _, _ in entries}
