"""The trained weights out of a sharded run without any rank holding them whole: one block at a time.

``save_weights`` writes a state's parameters and buffers as one safetensors
file (what ``from_pretrained`` and ``safetensors.torch.load_file`` read). Of a
sharded state, each rank sends rank 0 its chunk of one tensor after another,
and rank 0 writes each chunk at its place in the file as it arrives, flushing
it out of the page cache: rank 0 holds its share plus one chunk, every other
rank its share alone (FSDP2's full state dict with ``cpu_offload`` holds a
whole tensor). ``state_dict(state, rank0_only=True)`` and ``unshard(state,
rank0_only=True)`` take the tensors to rank 0 the same way (``to_rank0``).
See ``docs/export.md#a-model-larger-than-one-rank``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from fnloop._atomic import write_atomically
from fnloop._core.messages import got
from fnloop._core.shards import sharded_tensors
from fnloop._core.state import TrainState
from fnloop._core.tensor_parallel import TensorParallel, joined, split_tensors, whole_shape
from fnloop.checkpoint._safetensors import framed, layout
from fnloop.checkpoint._transfer import _bytes, _pwrite, written_out

__all__ = ["model_keys", "module_order", "save_weights", "some_names", "to_rank0"]

_EXTRA_STATE = "_extra_state"  # torch's key suffix for a module's get_extra_state()

Pieces = Callable[[torch.Tensor, torch.Tensor], "Iterator[torch.Tensor] | None"]
"""``(tensor, payload) -> payload's whole tensor as row blocks, one at a time`` on rank 0, ``None`` elsewhere."""


def to_rank0(state: TrainState) -> tuple[Pieces, Callable[[torch.Tensor], torch.Size]]:
    """How ``state``'s tensors reach rank 0, one block at a time: ``(pieces, whole_shape)``.

    ``pieces(tensor, payload)`` sends ``payload`` (``tensor`` itself, a
    parameter, buffer or optimizer state's tensor of ``state``, or it cast) to
    rank 0. For a tensor that holds a chunk, each other rank of the first copy
    sends its chunk (every such rank calls it for the same tensors in the same
    order), and rank 0 gets an iterator of the chunks in rank order, each
    received when the one before has been taken: it holds one at a time. The iterator must be run to its end (the senders wait for
    it). A whole tensor costs nothing: rank 0 keeps its own.
    ``whole_shape(tensor)`` is the shape of the whole tensor (a chunk's last
    rows are padding beyond it).
    """
    import torch.distributed as dist

    from fnloop.distributed import _group, rank

    first = rank() == 0
    if state.tensor is not None and _group() is not None:
        return _slices_to_rank0(state, state.tensor, first)
    shards = state.shards
    chunks = {} if shards is None else sharded_tensors(state.params, state.opt_state, shards)
    if shards is None or not chunks or _group() is None:  # nothing to gather: one process's chunks are whole
        return (lambda tensor, payload: iter([payload]) if first else None), (lambda tensor: tensor.shape)

    def received(payload: torch.Tensor) -> Iterator[torch.Tensor]:
        yield payload
        for source in range(1, shards.world):  # the first copy's ranks are 0 .. world - 1
            block = torch.empty_like(payload)
            dist.recv(block, src=source)
            yield block
            del block  # one block held at a time

    def pieces(tensor: torch.Tensor, payload: torch.Tensor) -> Iterator[torch.Tensor] | None:
        if id(tensor) not in chunks:
            return iter([payload]) if first else None
        if first:
            return received(payload.contiguous())
        if shards.replica == 0:  # the copies are equal: the first one's ranks send
            dist.send(payload.contiguous(), dst=0)
        return None

    def whole_shape(tensor: torch.Tensor) -> torch.Size:
        name = chunks.get(id(tensor))
        return tensor.shape if name is None else torch.Size((shards.whole(name), *tensor.shape[1:]))

    return pieces, whole_shape


def _slices_to_rank0(
    state: TrainState, tensor: TensorParallel, first: bool
) -> tuple[Pieces, Callable[[torch.Tensor], torch.Size]]:
    """``to_rank0`` of a tensor-parallel state: each split tensor's slices sent to rank 0 by the first copy's ranks, joined there.

    Where the copies shard the state too, each slice comes as its shards'
    chunks (the rank of shard ``s`` of place ``t`` in the first copy is
    ``s * degree + t``), put together on rank 0 first.
    """
    import torch.distributed as dist

    from fnloop.distributed import rank

    shards = state.shards
    split = split_tensors(state.params, state.opt_state, tensor, shards)
    chunks = {} if shards is None else sharded_tensors(state.params, state.opt_state, shards)

    def sources(t: torch.Tensor) -> list[list[int]]:
        """For each place holding a slice of ``t`` (one, if it is whole), the ranks holding its chunks, in order."""
        places = range(tensor.degree) if id(t) in split else range(1)
        held = range(shards.world) if shards is not None and id(t) in chunks else range(1)
        return [[s * tensor.degree + p for s in held] for p in places]

    def slice_on_rank0(t: torch.Tensor, payload: torch.Tensor, ranks: list[int]) -> torch.Tensor:
        blocks = []
        for source in ranks:
            blocks.append(payload.contiguous() if source == 0 else torch.empty_like(payload))
            if source:
                dist.recv(blocks[-1], src=source)
        if shards is None or id(t) not in chunks:
            return blocks[0]
        return torch.cat(blocks)[: shards.whole(chunks[id(t)])]

    def pieces(t: torch.Tensor, payload: torch.Tensor) -> Iterator[torch.Tensor] | None:
        if id(t) not in split and id(t) not in chunks:
            return iter([payload]) if first else None
        every = sources(t)
        if first:
            slices = [slice_on_rank0(t, payload, ranks) for ranks in every]
            return iter([joined(slices, *tensor.split(split[id(t)])) if id(t) in split else slices[0]])
        if any(rank() in ranks for ranks in every):
            dist.send(payload.contiguous(), dst=0)
        return None

    return pieces, lambda t: whole_shape(t, tensor, shards, split.get(id(t)), chunks.get(id(t)))


def save_weights(
    state: TrainState,
    path: str | os.PathLike[str],
    model: torch.nn.Module | None = None,
    *,
    dtype: torch.dtype | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``state``'s parameters and buffers to ``path`` as one safetensors file, tensor by tensor.

    With ``model`` (the module the state was built from), the keys of
    ``model.state_dict()``, each tensor once: a tied weight under
    its first name, as ``save_pretrained`` writes it, and no non-persistent
    buffer; so ``from_pretrained`` of a folder holding this file as
    ``model.safetensors`` and the model's ``config.json`` gives the trained
    model. Without ``model``, every parameter and buffer of the state, under
    the state's names. The file is written under a
    temporary name and renamed onto ``path`` when whole: a failure leaves what
    was there.

    A sharded state (``init(..., shard=...)``): a collective, every rank calls
    it. Each rank sends rank 0 its chunk of one tensor after another, and
    rank 0 writes each at its place as it arrives, flushed out of the page
    cache every 4 MiB: rank 0 holds its share of the state plus one chunk, the
    other ranks their share alone, so a model larger than one rank's memory is
    exported under the memory it trained in. In a
    run of several ranks that is not sharded, rank 0 writes; every rank
    returns once the file is whole.

    Args:
        state: a state from ``fnloop.init``, ``fnloop.run`` or ``fnloop.load``.
        path: the file to write (``.../model.safetensors``); its folder is made.
        model: the module, for its exact keys (tied weights once, non-persistent buffers left out).
        dtype: a floating dtype to write the floating tensors in
            (``torch.bfloat16``); ``None`` keeps each tensor's own.
        metadata: text to keep in the file's header, beside ``format: pt``
            (which ``transformers`` reads).

    Returns:
        ``path``, as a ``Path``.

    Raises:
        TypeError: ``state``, ``model``, ``dtype`` or ``metadata`` is not as described.
        KeyError: ``model`` has an entry the state lacks.
        OSError: the file could not be written (on every rank).

    Examples:
        >>> import tempfile, safetensors.torch, fnloop as fl
        >>> state = fl.init(torch.nn.Linear(3, 2), fl.optim.sgd(0.1), seed=0, max_iter=1)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     file = fl.save_weights(state, f"{d}/model.safetensors")
        ...     sorted(safetensors.torch.load_file(file))
        ['bias', 'weight']
    """
    if type(state) is not TrainState:
        raise TypeError(f"save_weights() expected a fnloop.TrainState ({got(state)}).")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"save_weights(dtype=...) must be a floating torch.dtype or None ({got(dtype)}).")
    if metadata is not None and not (
        isinstance(metadata, Mapping) and all(type(k) is str and type(v) is str for k, v in metadata.items())
    ):
        raise TypeError(f"save_weights(metadata=...) must map str to str ({got(metadata)}).")
    from fnloop.distributed import broadcast_object, rank

    path = Path(path)
    pieces, whole_shape = to_rank0(state)
    tensors = {**state.params, **state.buffers}

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        floating = dtype is not None and tensor.is_floating_point()
        return tensor.detach().to(dtype) if floating else tensor.detach()

    def kept_as(tensor: torch.Tensor) -> torch.Tensor:  # the whole tensor's shape and dtype, no memory
        dtype_ = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        return torch.empty(whole_shape(tensor), dtype=dtype_, device="meta")

    if model is None:
        names = {name: name for name in module_order(state)}
    else:  # key -> the state's name, each tensor once
        names, seen = {}, set()
        for key, name, _ in model_keys(tensors, model):
            if name is not None and name not in seen:
                names[key] = name
                seen.add(name)
    entries = layout({key: kept_as(tensors[name]) for key, name in names.items()})
    # Every rank gathers in the layout's order; rank 0 writes each tensor as its pieces arrive.
    arriving = ((key, pieces(tensors[names[key]], cast(tensors[names[key]]))) for key in entries)
    failure = None
    if rank() == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(
                path, lambda fd: _write(fd, entries, arriving, {"format": "pt", **(metadata or {})})
            )
        except OSError as error:
            failure = error
    for _, blocks in arriving:  # what rank 0 did not take (it failed first), and the other ranks' part
        for _ in blocks or ():
            pass
    # Rank 0's verdict to every rank: a barrier too, so every rank returns with the file whole.
    if broadcast_object(failure is not None):
        raise (
            failure
            if failure is not None
            else OSError(f"save_weights: rank 0 could not write {str(path)!r}; see its error.")
        )
    return path


def module_order(state: TrainState) -> list[str]:
    """The state's keys grouped by module: its parameters, then its buffers."""
    by_module: dict[str, list[str]] = {}
    for key in (*state.params, *state.buffers):
        by_module.setdefault(key.rpartition(".")[0], []).append(key)
    return [key for keys in by_module.values() for key in keys]


def model_keys(
    tensors: Mapping[str, torch.Tensor], model: torch.nn.Module
) -> list[tuple[str, str | None, Any]]:
    """``(key, name in tensors, value)`` for each entry of ``model.state_dict()``, in its order.

    A tied weight is one parameter under several names, and the state keeps
    the first name only: the others map to it. A module's extra state has no
    name (``None``) and ``model``'s own value.

    Raises:
        KeyError: ``model`` has an entry ``tensors`` lacks (the state was built from another model).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"'model' must be a torch.nn.Module or None ({got(model)}).")
    alias = {id(t): name for name, t in (*model.named_parameters(), *model.named_buffers())}
    found: list[tuple[str, str | None, Any]] = []
    for key, value in model.state_dict(keep_vars=True).items():
        name = key if key in tensors else alias.get(id(value))
        if name in tensors:
            found.append((key, name, value))
        elif key.endswith(_EXTRA_STATE):
            found.append((key, None, value))
        else:
            raise KeyError(
                f"the model has {key!r} but the state has no such parameter or buffer (it has "
                f"{some_names(tensors)}): pass the module the state was built from, fnloop.init(model, ...)."
            )
    return found


def some_names(keys: Mapping[str, object]) -> str:
    names = list(keys)
    return ", ".join(map(repr, names[:5])) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _write(
    fd: int,
    entries: dict[str, dict[str, Any]],
    arriving: Iterator[tuple[str, Iterator[torch.Tensor] | None]],
    metadata: dict[str, str],
) -> None:
    """Write the header, then each tensor's blocks at their place as they arrive.

    On a failure, the blocks of the tensor at hand are still received; the
    caller receives the rest.
    """
    head = framed(metadata, entries)
    _pwrite(fd, memoryview(head), 0)
    start = len(head)
    for name, blocks in arriving:
        begin, end = entries[name]["data_offsets"]
        at, failure = start + begin, None
        for block in blocks or ():  # taken to the end, even after a failure: the senders wait for each
            if at < start + end and failure is None:  # past the end: the last chunk's padding rows
                block = block.cpu().contiguous()
                view = _bytes(block)[: start + end - at]
                try:
                    written_out(fd, view, at)
                except OSError as error:
                    failure = error
                at += len(view)
            del block  # one block held at a time: the next is received into new memory (view: unused now)
        if failure is not None:
            raise failure
