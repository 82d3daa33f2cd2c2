"""Checkpoints of a tensor-parallel state: written whole by rank 0, read by any layout.

A state whose layers are split across ranks (``TrainState.tensor``) is saved
as the state it stands for: every rank sends rank 0 its slices one tensor at
a time (``fl.unshard(..., rank0_only=True)``), and rank 0 writes one ordinary
checkpoint of the whole state; every rank returns once it is on disk, or
raises what rank 0 met. The file is the one a whole run writes, so it loads
at any tensor degree, whole, in one process, or back at the layout that saved
it: there each rank reads the file and keeps its slices (``load_split``),
bit for bit what it held.

Rank 0 holds the whole state while it writes (the export of one rank at a
time, ``fnloop.save_weights``, streams a file instead; a checkpoint's entries
are not streamed yet). Hook states are saved as they are: one that holds a
rank's slices (``fl.hooks.ema``'s average) is refused, since its file could
hold only rank 0's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._core.shards import chunk, sharded_tensors
from fnloop._core.state import TrainState
from fnloop._core.tensor_parallel import TensorParallel, local_slice, split_tensors, whole_shape

__all__ = ["load_split", "save_joined"]


def save_joined(state: TrainState, path: Path, write: Callable[[TrainState, Path], object]) -> Path:
    """Write the whole state of the tensor-parallel ``state`` to ``path`` (a collective; rank 0 writes)."""
    from fnloop._export import unshard
    from fnloop.distributed import broadcast_object

    tensor = state.tensor
    assert tensor is not None
    _refuse_split_hooks(state, tensor)
    whole = unshard(state, rank0_only=True)
    failed: BaseException | None = None
    if whole is not None:
        try:
            write(whole, path)
        except BaseException as exc:  # noqa: BLE001 - every rank hears of it, rank 0 raises it
            failed = exc
    said = broadcast_object(None if failed is None else f"{type(failed).__name__}: {failed}")
    if failed is not None:
        raise failed
    if said is not None:
        raise OSError(f"save(): rank 0 could not write the checkpoint {path}: {said}")
    return path


def load_split(path: Path, like: TrainState, read: Callable[[Path, TrainState], TrainState]) -> TrainState:
    """The whole state saved in ``path``, as this rank's slices of ``like``'s layout (``read(path, template)`` reads it).

    Where ``like`` shards its slices too, each slice is cut into this rank's chunk.
    """
    tensor, shards = like.tensor, like.shards
    assert tensor is not None
    split = split_tensors(like.params, like.opt_state, tensor, shards)
    chunks = {} if shards is None else sharded_tensors(like.params, like.opt_state, shards)

    def whole_shaped(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or (id(t) not in split and id(t) not in chunks):
            return t
        shape = whole_shape(t, tensor, shards, split.get(id(t)), chunks.get(id(t)))
        return torch.empty(shape, dtype=t.dtype, device=t.device)

    template = attrs.evolve(
        like,
        params={k: whole_shaped(v) for k, v in like.params.items()},
        opt_state=pytree.tree_map(whole_shaped, like.opt_state),
        tensor=None,
        shards=None,
    )
    whole = read(path, template)

    def mine(kept: Any, saved: Any) -> Any:
        if not isinstance(kept, torch.Tensor):
            return saved
        if id(kept) in split:
            saved = local_slice(saved, *tensor.split(split[id(kept)]), tensor.degree, tensor.rank)
        if shards is not None and id(kept) in chunks:
            saved = chunk(saved, shards, chunks[id(kept)])
        return saved

    params = {k: mine(like.params[k], v) for k, v in whole.params.items()}
    opt_state = pytree.tree_map(mine, like.opt_state, whole.opt_state)
    return attrs.evolve(whole, params=params, opt_state=opt_state, tensor=tensor, shards=shards)


def _refuse_split_hooks(state: TrainState, tensor: TensorParallel) -> None:
    """Refuse a hook state that holds a rank's slices: a whole checkpoint would keep rank 0's alone."""
    own = {id(t) for t in state.params.values()}
    for name, value in state.hooks.items():
        if set(split_tensors(state.params, value, tensor, state.shards)) - own:
            raise NotImplementedError(
                f"save(): state.hooks[{name!r}] holds this rank's slices of the split layers (an "
                "average of the parameters, say), and a checkpoint of a tensor-parallel state holds "
                "the whole state, where such a hook's state would be rank 0's alone. Leave that hook "
                "out of a tensor-parallel run for now, or drop its state before saving."
            )
