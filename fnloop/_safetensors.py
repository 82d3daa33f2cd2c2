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

from fnloop._codec import DTYPES, CheckpointError, DamagedCheckpoint

__all__ = ["FORMAT_VERSION", "PLACEHOLDER", "Entry", "damaged", "header", "layout", "read_header"]

FORMAT_VERSION = 1
"""The version of the file layout this fnloop writes; files of another version are refused."""

PLACEHOLDER = "crc32:00000000"
"""A checksum as long as every checksum, to size the header before the checksum is known."""

Entry = tuple[str, torch.dtype, list[int], int, int]
"""A tensor as the header describes it: its name, dtype, shape, and the bytes it spans in the data."""

_CODES = {code: dtype for dtype, code in DTYPES.items()}
_MAX_HEADER = 100_000_000  # safetensors' own limit


def layout(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """The header entries of ``tensors``, in the order their bytes follow each other in the file.

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


def header(skeleton: str, entries: dict[str, dict[str, Any]], checksum: str) -> bytes:
    """The bytes in front of the tensors: the header's length, then the header, padded to 8 bytes.

    >>> len(header("null", {}, PLACEHOLDER)) % 8
    0
    """
    metadata = {
        "fnloop.format": str(FORMAT_VERSION),
        "fnloop.version": _version(),
        "fnloop.checksum": checksum,
        "fnloop.skeleton": skeleton,
    }
    text = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # tensors start 8-byte aligned, as safetensors does
    return len(text).to_bytes(8, "little") + text


def _version() -> str:
    import fnloop  # imported here: fnloop imports this module

    return fnloop.__version__


def damaged(name: str, what: str) -> DamagedCheckpoint:
    """The error for the file ``name`` that is not an intact checkpoint, saying ``what`` is wrong."""
    return DamagedCheckpoint(f"{name}: {what}")


def read_header(file: io.BufferedReader, name: str) -> tuple[dict[str, str], int, list[Entry]]:
    """The fnloop metadata and the tensors' entries of the open file ``file``, named ``name`` in errors.

    Reads the header only, and checks that the file is a safetensors file of
    this format version whose tensors follow each other to its end.

    Returns:
        ``(metadata, start, entries)``: the header's metadata, the byte at
        which the tensors start, and the tensors in the order of their bytes.

    Raises:
        DamagedCheckpoint: not an fnloop checkpoint, truncated, or a malformed header.
        CheckpointError: a checkpoint of another format version.
    """
    size = os.fstat(file.fileno()).st_size
    prefix = file.read(8)
    length = int.from_bytes(prefix, "little")
    if len(prefix) < 8 or length > min(size - 8, _MAX_HEADER):
        raise damaged(name, f"not a checkpoint, or truncated: {size} bytes hold no safetensors header")
    try:
        head = json.loads(file.read(length).decode("utf-8"))
    except (ValueError, RecursionError):
        raise damaged(name, "the safetensors header is not valid JSON (corrupted or truncated)") from None
    if type(head) is not dict or type(head.get("__metadata__")) is not dict:
        raise damaged(name, "not an fnloop checkpoint: the safetensors header has no metadata")
    metadata = head.pop("__metadata__")
    _check_version(metadata, name)
    if not all(type(v) is str for v in metadata.values()) or "fnloop.skeleton" not in metadata:
        raise damaged(name, "the fnloop metadata is incomplete")
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


def _check_version(metadata: dict[str, Any], name: str) -> None:
    version = metadata.get("fnloop.format")
    if version == str(FORMAT_VERSION):
        return
    if version is None:
        raise damaged(name, "not an fnloop checkpoint: its safetensors metadata has no 'fnloop.format'")
    if type(version) is str and version.isascii() and version.isdigit() and len(version) < 10:
        newer = int(version) > FORMAT_VERSION
        raise CheckpointError(
            f"{name}: written in checkpoint format {int(version)}, but this fnloop reads format "
            f"{FORMAT_VERSION} only. "
            + ("Upgrade fnloop to load it." if newer else "Load it with the fnloop version that wrote it.")
        )
    raise damaged(name, f"unknown checkpoint format {version!r:.40}")


def _entry(key: str, spec: Any, name: str) -> Entry:
    bad = damaged(name, f"tensor {key!r:.60} has a malformed header entry")
    if type(spec) is not dict or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise bad
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    dtype = _CODES.get(code) if type(code) is str else None
    if dtype is None or type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise bad
    if type(offsets) is not list or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise bad
    begin, end = offsets
    if not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
        raise bad
    return key, dtype, shape, begin, end
