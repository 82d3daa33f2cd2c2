"""The bytes of a checkpoint file: tensors moved in pieces, positionally, and checksummed as they go."""

from __future__ import annotations

import ctypes
import os
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["_bytes", "_digest", "_pread", "_pwrite", "_stream", "_transfer"]

_PIECE = 1 << 24  # the checksum covers each tensor in pieces of this many bytes: part of the format
_THREADED = 1 << 25  # below this many bytes of tensors, threads cost more than they save
_POSITIONAL = hasattr(os, "pwrite") and hasattr(os, "preadv")


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy; valid while ``tensor`` lives."""
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * size).from_address(tensor.data_ptr())).cast("B")


def _transfer(
    fd: int, views: list[memoryview], start: int, io: Callable[[int, memoryview, int], None]
) -> list[list[int]]:
    """``io`` every view to or from ``fd``, laid out from byte ``start``; the CRC-32s of their pieces.

    The checksum covers each tensor in pieces of ``_PIECE`` bytes. Pieces are
    independent, so for a large file several threads read or write them and
    checksum them at once (``os.preadv``, ``os.pwrite`` and ``zlib.crc32`` all
    release the GIL): the checksum then costs next to nothing.
    """
    pieces, offset = [], start
    for i, view in enumerate(views):
        pieces += [(i, offset + at, view[at : at + _PIECE]) for at in range(0, len(view), _PIECE)]
        offset += len(view)

    def one(piece: tuple[int, int, memoryview]) -> int:
        io(fd, piece[2], piece[1])
        return zlib.crc32(piece[2])

    workers = min(
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 4
    )
    if offset - start < _THREADED or workers < 2 or not _POSITIONAL:
        results = [one(piece) for piece in pieces]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="fnloop-checkpoint") as pool:
            results = list(pool.map(one, pieces))
    crcs: list[list[int]] = [[] for _ in views]
    for (i, _, _), crc in zip(pieces, results):
        crcs[i].append(crc)
    return crcs


def _stream(
    fd: int, spans: list[tuple[int, int]], start: int, each: Callable[[int, memoryview], None] | None = None
) -> list[list[int]]:
    """The CRC-32s of the pieces of each span ``(begin, end)`` of ``fd``'s bytes from ``start``, read
    through one buffer of a piece: the memory of one piece, whatever the file's size.

    ``each(i, piece)``, if given, sees every piece of span ``i`` in order; the
    view is reused for the next piece, so it must not be kept.
    """
    view = memoryview(bytearray(min(_PIECE, max((end - begin for begin, end in spans), default=0))))
    crcs: list[list[int]] = []
    for i, (begin, end) in enumerate(spans):
        crcs.append([])
        for at in range(begin, end, _PIECE):
            piece = view[: min(_PIECE, end - at)]
            _pread(fd, piece, start + at)
            crcs[-1].append(zlib.crc32(piece))
            if each is not None:
                each(i, piece)
    return crcs


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    if not _POSITIONAL:
        os.lseek(fd, offset, os.SEEK_SET)
    done = 0
    while done < len(view):
        chunk = view[done:]
        done += os.pwrite(fd, chunk, offset + done) if _POSITIONAL else os.write(fd, chunk)


def _pread(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        if _POSITIONAL:
            n = os.preadv(fd, [view[done:]], offset + done)
        else:
            os.lseek(fd, offset + done, os.SEEK_SET)
            with open(fd, "rb", buffering=0, closefd=False) as file:
                n = file.readinto(view[done:]) or 0
        if n == 0:
            raise EOFError(f"{len(view) - done} bytes missing at byte {offset + done}")
        done += n


def _digest(
    skeleton: str, entries: Iterable[tuple[str, dict[str, Any], list[int]]], version: int | str = 1
) -> str:
    """The checksum of a file of format ``version`` (as its ``fnloop.format`` field spells it).

    From format 2 on, the checksum covers the version field too, whatever the
    version: a reader checks a file's integrity before it trusts its version.
    """
    # Over names in sorted order, so a file re-laid out by another safetensors writer still checks.
    seed = "" if str(version) == "1" else f"fnloop.format={version}\n"
    digest = zlib.crc32((seed + skeleton).encode("utf-8", "surrogatepass"))
    for key, entry, crcs in sorted(entries, key=lambda e: e[0]):
        line = f"\n{key}\t{entry['dtype']}\t{entry['shape']}\t{' '.join(f'{c:08x}' for c in crcs)}"
        digest = zlib.crc32(line.encode("utf-8", "surrogatepass"), digest)
    return f"crc32:{digest:08x}"


_SYNCED = 1 << 22
"""Bytes written between two flushes to disk: what the page cache holds of the file at most."""
_SMALL = 1 << 20
"""A piece below this many bytes is left to the page cache (a norm's weight): flushing costs more."""


def written_out(fd: int, view: memoryview, at: int) -> None:
    """``view`` written at byte ``at`` of ``fd`` in pieces, each flushed to disk and dropped from the page
    cache, which is charged to the writer's memory (a container's limit counts it): a file larger than
    that limit is written under it, and never holds more than a piece of it in memory."""
    if not hasattr(os, "posix_fadvise"):
        _pwrite(fd, view, at)
        return
    for begin in range(0, len(view), _SYNCED):
        piece = view[begin : begin + _SYNCED]
        _pwrite(fd, piece, at + begin)
        if len(piece) >= _SMALL:
            os.fdatasync(fd)
            os.posix_fadvise(fd, at + begin, len(piece), os.POSIX_FADV_DONTNEED)
