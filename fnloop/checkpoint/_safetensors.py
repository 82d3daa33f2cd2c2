"""The checkpoint file's layout: a safetensors header with fnloop's metadata, written and checked.

A safetensors file is an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the tensors' bytes.
fnloop's metadata in the header holds the format version, the fnloop
version, the checksum and the JSON skeleton of the state. ``header`` builds
the header for ``layout``'s entries; ``read_header`` reads and checks one
without reading the tensors. Moving the bytes and checking the checksum is
``fnloop.checkpoint``'s part.
"""

from __future__ import annotations

import io
import json
import math
import os
from typing import Any

import torch

from fnloop._version import __version__
from fnloop.checkpoint._codec import DTYPES, CheckpointError, DamagedCheckpoint

__all__ = [
    "FORMAT_VERSION",
    "PLACEHOLDER",
    "READABLE",
    "Entry",
    "check_format",
    "damaged",
    "framed",
    "header",
    "layout",
    "read_header",
]

FORMAT_VERSION = 2
"""The version of the file layout this fnloop writes; files of versions not in ``READABLE`` are refused.

Every version from 2 on keeps the safetensors layout and seeds its checksum
with its own version field (``fnloop.checkpoint`` computes it), so a reader
of any version tells a damaged version field from an intact newer file.
"""

READABLE = ("1", "2")
"""The format versions this fnloop reads: 1 (checksum without the version) and 2."""

PLACEHOLDER = "crc32:00000000"
"""A checksum as long as every checksum, to size the header before the checksum is known."""

Entry = tuple[str, torch.dtype, list[int], int, int]
"""A tensor as the header describes it: its name, dtype, shape, and the bytes it spans in the data."""

_CODES = {code: dtype for dtype, code in DTYPES.items()}
_MAX_HEADER = 100_000_000  # safetensors' own limit
_LIMIT = 1 << 63  # torch's sizes are int64
# The fewest bytes a tensor takes: in the skeleton, '{"kind":"tensor","key":"","dtype":"","shape":[]}';
# in the header as well, '"":{"dtype":"U8","shape":[],"data_offsets":[0,0]},' and that node escaped.
_MIN_NODE = 48
_MIN_TENSOR = 2 * _MIN_NODE
_FEW = 1024  # headers of so few tensors are cheap to parse, and then say better what they are


def layout(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """The header entries of ``tensors``, in the order their bytes follow each other in the file.

    Examples:
        >>> layout({"step": torch.tensor(3, dtype=torch.int8), "w": torch.zeros(2)})
        {'w': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]}, 'step': {'dtype': 'I8', 'shape': [], 'data_offsets': [8, 9]}}
    """
    # Widest items first, so every tensor starts aligned to its item size, as safetensors does.
    order = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())
    entries: dict[str, dict[str, Any]] = {}
    offset = 0
    for key, tensor in order:
        size = tensor.numel() * tensor.element_size()
        entries[key] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    return entries


def header(
    skeleton: str, entries: dict[str, dict[str, Any]], checksum: str, index: str | None = None
) -> bytes:
    """The bytes in front of the tensors: the header's length, then the header, padded to 8 bytes.

    Examples:
        >>> len(header("null", {}, PLACEHOLDER)) % 8
        0
    """
    metadata = {
        "fnloop.format": str(FORMAT_VERSION),
        "fnloop.version": _version(),
        "fnloop.checksum": checksum,
        "fnloop.skeleton": skeleton,
        **({} if index is None else {INDEX: index}),
    }
    return framed(metadata, entries)


def framed(metadata: dict[str, str], entries: dict[str, dict[str, Any]]) -> bytes:
    """A safetensors header of ``metadata`` and ``entries``: its length, then it, padded to 8 bytes.

    Examples:
        >>> head = framed({"format": "pt"}, {})
        >>> len(head) % 8, int.from_bytes(head[:8], "little") == len(head) - 8, head[8:].strip()
        (0, True, b'{"__metadata__":{"format":"pt"}}')
    """
    text = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # tensors start 8-byte aligned, as safetensors does
    return len(text).to_bytes(8, "little") + text


INDEX = "fnloop.shards"
"""The metadata entry of a sharded checkpoint's index (rank 0's part): its layout and the other parts."""


def covered(metadata: dict[str, str]) -> str:
    """What the checksum covers besides the tensors: the skeleton, and a sharded checkpoint's index."""
    index = metadata.get(INDEX)
    return metadata["fnloop.skeleton"] if index is None else f"{metadata['fnloop.skeleton']}\n{INDEX}={index}"


def _version() -> str:
    return __version__


def damaged(name: str, what: str) -> DamagedCheckpoint:
    """The error for the file ``name`` that is not an intact checkpoint, saying ``what`` is wrong."""
    return DamagedCheckpoint(f"{name}: {what}")


def read_header(file: io.BufferedReader, name: str) -> tuple[dict[str, str], int, list[Entry]]:
    """The fnloop metadata and the tensors' entries of the open file ``file``, named ``name`` in errors.

    Reads the header only, and checks it completely before anything is
    allocated: a safetensors header with fnloop's metadata, entries of known
    dtypes whose shapes hold their byte ranges, ranges that follow each other
    to the file's real end, and no more tensors than the header can describe.
    The format version is not checked here: only once the checksum has shown
    the file intact (``check_format``), so that a damaged version field reads
    as damage, not as a newer format.

    Returns:
        ``(metadata, start, entries)``: the header's metadata, the byte at
        which the tensors start, and the tensors in the order of their bytes.

    Raises:
        DamagedCheckpoint: not an fnloop checkpoint, truncated, or a malformed header.
    """
    size = os.fstat(file.fileno()).st_size
    prefix = file.read(8)
    length = int.from_bytes(prefix, "little")
    if len(prefix) < 8 or length > min(size - 8, _MAX_HEADER):
        raise damaged(name, f"not a checkpoint, or truncated: {size} bytes hold no safetensors header")
    text = file.read(length)
    # Parsing costs about ten times the text in memory: refuse, before parsing, a header that lists
    # more tensors than its length can describe (each takes an entry and a node in the skeleton).
    claimed = text.count(b'"data_offsets"')
    if len(text) < length or (claimed > _FEW and claimed * _MIN_TENSOR > length):
        raise damaged(name, f"a malformed header: {length} bytes cannot describe {claimed} tensors")
    try:
        head = json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError):
        raise damaged(name, "the safetensors header is not valid JSON (corrupted or truncated)") from None
    if type(head) is not dict or type(head.get("__metadata__")) is not dict:
        raise damaged(name, "not an fnloop checkpoint: the safetensors header has no metadata")
    metadata = head.pop("__metadata__")
    if "fnloop.format" not in metadata:
        raise damaged(name, "not an fnloop checkpoint: its safetensors metadata has no 'fnloop.format'")
    if not all(type(v) is str for v in metadata.values()) or "fnloop.skeleton" not in metadata:
        raise damaged(name, "the fnloop metadata is incomplete")
    if len(head) > metadata["fnloop.skeleton"].count('"tensor"'):
        raise damaged(name, f"the header lists {len(head)} tensors, more than its skeleton refers to")
    entries = sorted((_entry(key, spec, name) for key, spec in head.items()), key=lambda e: e[3])
    data_size, offset = size - 8 - length, 0
    for key, _, _, begin, end in entries:
        if begin != offset:
            raise damaged(name, f"tensor {key!r:.60} does not start where the previous one ends")
        offset = end
    if offset != data_size:
        what = "truncated" if offset > data_size else "has bytes after its last tensor"
        raise damaged(
            name, f"{what}: the header describes {offset} bytes of tensors, the file holds {data_size}"
        )
    return metadata, 8 + length, entries


def check_format(metadata: dict[str, str], name: str) -> None:
    """Refuse an intact file (its checksum checked) of a format version this fnloop does not read.

    Raises:
        CheckpointError: the file is of another format version; the message
            says which fnloop reads it.
    """
    version = metadata["fnloop.format"]
    if version in READABLE:
        return
    if version.isascii() and version.isdigit() and len(version) < 10:
        newer = int(version) > FORMAT_VERSION
        raise CheckpointError(
            f"{name}: written in checkpoint format {int(version)}, but this fnloop reads formats "
            f"{', '.join(READABLE)} only. "
            + ("Upgrade fnloop to load it." if newer else "Load it with the fnloop version that wrote it.")
        )
    raise damaged(name, f"unknown checkpoint format {version!r:.40}")


def _entry(key: str, spec: Any, name: str) -> Entry:
    bad = damaged(name, f"tensor {key!r:.60} has a malformed header entry")
    if type(spec) is not dict or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise bad
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    dtype = _CODES.get(code) if type(code) is str else None
    if dtype is None or type(shape) is not list or not all(type(d) is int and 0 <= d < _LIMIT for d in shape):
        raise bad
    if math.prod(d for d in shape if d) >= _LIMIT:  # torch's sizes are int64, even with no element
        raise bad
    if type(offsets) is not list or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise bad
    begin, end = offsets
    if not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
        raise bad
    return key, dtype, shape, begin, end
