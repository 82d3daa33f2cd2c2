"""Checkpoints of a tensor-parallel state: written whole by rank 0, read by any layout.

A state whose layers are split across ranks (``TrainState.tensor``), and
maybe sharded too, is saved as the state it stands for: rank 0 writes one
ordinary checkpoint of the whole state, and as the file's bytes come to each
split or sharded tensor, the ranks holding its slices and chunks send them to
rank 0, which puts it together, writes it and lets it go. So rank 0 holds its
share of the state and one whole tensor at a time, and the file is the one a
whole run writes (the same bytes): it loads at any tensor degree, sharded,
whole in one process, or back at the layout that saved it, where each rank
reads the file and keeps its slices (``load_split``), bit for bit what it
held. Every rank returns once the file is on disk, or raises what rank 0 met.

Hook states are saved as they are: one that holds a rank's slices
(``fl.hooks.ema``'s average) is refused, since its file could hold only rank
0's."""

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
from fnloop.checkpoint._safetensors import layout
from fnloop.checkpoint._state_codec import encode_state_keyed

__all__ = ["load_split", "save_joined"]


def save_joined(state: TrainState, path: Path, write_file: Callable[..., str]) -> Path:
    """Write the whole state of the tensor-parallel ``state`` to ``path`` (a collective; rank 0 writes).

    ``write_file(path, skeleton, tensors, arriving=...)`` writes one file
    (``fnloop.checkpoint._files``). Each split (or sharded) tensor reaches
    rank 0 when the file's bytes come to it, gathered from the ranks holding
    its slices and chunks: rank 0 holds its share of the state and one whole
    tensor at a time. Should writing fail, rank 0 still takes in every tensor
    the others send, and every rank raises what it met.
    """
    from fnloop._export import whole_on_rank0
    from fnloop.distributed import broadcast_object, rank

    tensor = state.tensor
    assert tensor is not None
    _refuse_split_hooks(state, tensor)
    skeleton, tensors, keys = encode_state_keyed(state)
    shards = state.shards
    chunks = {} if shards is None else sharded_tensors(state.params, state.opt_state, shards)
    split = split_tensors(state.params, state.opt_state, tensor, shards)
    mine = {
        id(t): t
        for t in [*state.params.values(), *pytree.tree_leaves(state.opt_state)]
        if isinstance(t, torch.Tensor)
    }
    parts = {keys[i]: mine[i] for i in {*chunks, *split}}  # key -> this rank's part of a whole tensor
    shapes = {
        key: whole_shape(t, tensor, shards, split.get(id(t)), chunks.get(id(t))) for key, t in parts.items()
    }
    for key, shape in shapes.items():  # what the file holds: the whole tensors' shapes, their bytes to come
        tensors[key] = torch.empty(shape, dtype=tensors[key].dtype, device="meta")
    skeleton = _with_shapes(skeleton, shapes)
    order = [key for key in layout(tensors) if key in parts]  # the file's order, the same on every rank
    whole = whole_on_rank0(state)
    arrived = ((key, whole(parts[key])) for key in order)  # a collective each: every rank takes part in each

    def arriving(key: str) -> torch.Tensor:
        found, value = next(arrived)
        assert found == key, (found, key)  # the file asks in the order every rank sends
        return value

    failed: BaseException | None = None
    if rank() == 0:
        try:
            write_file(path, skeleton, tensors, arriving=arriving)
        except BaseException as exc:  # noqa: BLE001 - every rank hears of it, rank 0 raises it
            failed = exc
    for _ in arrived:  # the tensors left to send (all of them, on the other ranks)
        pass
    said = broadcast_object(None if failed is None else f"{type(failed).__name__}: {failed}")
    if failed is not None:
        raise failed
    if said is not None:
        raise OSError(f"save(): rank 0 could not write the checkpoint {path}: {said}")
    return path


def _with_shapes(node: Any, shapes: dict[str, torch.Size]) -> Any:
    """``node`` (a skeleton) with the tensors of ``shapes``' keys given those shapes."""
    if isinstance(node, list):
        return [_with_shapes(v, shapes) for v in node]
    if not isinstance(node, dict):
        return node
    if node.get("kind") == "tensor" and node.get("key") in shapes:
        return {**node, "shape": list(shapes[node["key"]])}
    return {k: _with_shapes(v, shapes) for k, v in node.items()}


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
