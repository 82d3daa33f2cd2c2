"""Writing one checkpoint file: the tensors' bytes, then the header with their checksum in front, atomically.

The layout and header are ``fnloop.checkpoint._safetensors``'s, the bytes
moved and checksummed by ``fnloop.checkpoint._transfer``, the file replaced
atomically by ``fnloop._atomic``. ``save``, a sharded state's parts
(``_sharded``) and a tensor-parallel state's streamed file (``_split``) all
write through ``write_file``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fnloop._atomic import remove_leftovers, write_atomically
from fnloop.checkpoint._safetensors import FORMAT_VERSION, INDEX, PLACEHOLDER, covered, header, layout
from fnloop.checkpoint._transfer import _bytes, _digest, _pwrite, _transfer, written_out

__all__ = ["write_file"]


def write_file(
    path: Path,
    skeleton: Any,
    tensors: dict[str, Any],
    index: str | None = None,
    arriving: Callable[[str], torch.Tensor] | None = None,
) -> str:
    """Write a checkpoint file of ``skeleton`` and ``tensors`` atomically (and ``index``); its checksum.

    ``arriving(key)``: the tensor of ``key``, asked for when its bytes are
    written, in the file's order, where ``tensors`` holds its shape and dtype
    alone (a meta tensor): a state no process holds whole is written one
    tensor at a time.
    """
    text = json.dumps(skeleton, separators=(",", ":"), allow_nan=False)
    covers = text if index is None else covered({"fnloop.skeleton": text, INDEX: index})
    entries = layout(tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path.parent)
    written: list[str] = []

    def write(fd: int) -> None:
        # The tensors first, so their checksum is known when the header is written in front of them.
        start = len(header(text, entries, PLACEHOLDER, index))
        if arriving is None:
            crcs = _transfer(fd, [_bytes(tensors[key]) for key in entries], start, _pwrite)
        else:
            crcs = []
            for key, entry in entries.items():
                tensor = tensors[key]
                if tensor.device.type == "meta":
                    tensor = arriving(key).detach().cpu().contiguous()
                # Each flushed and dropped from the page cache as save_weights does: the cache is charged
                # to the writer's memory, and the file may be larger than a rank may hold.
                crcs += _transfer(fd, [_bytes(tensor)], start + entry["data_offsets"][0], written_out)
                del tensor  # one arrived tensor held at a time
        checksum = _digest(covers, zip(entries, entries.values(), crcs), FORMAT_VERSION)
        _pwrite(fd, memoryview(header(text, entries, checksum, index)), 0)
        written.append(checksum)

    write_atomically(path, write)
    return written[0]
