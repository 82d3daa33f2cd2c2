"""The trained weights and the ``nn.Module``: a state's tensors as a ``state_dict``, and back.

fnloop never changes the model it is given: training produces a state, whose
``params`` and ``buffers`` are keyed like ``model.named_parameters()`` and
``model.named_buffers()``. ``state_dict`` hands them to ``model.load_state_dict``
(for inference, ``torch.export``, sharing); ``load_state_dict`` starts a state
from a pretrained ``state_dict``. See ``docs/export.md``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Literal, overload

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._core.messages import got
from fnloop._core.shards import sharded_tensors
from fnloop._core.state import TrainState
from fnloop._core.tensor_parallel import joined, split_tensors
from fnloop._weights import model_keys, module_order, some_names, to_rank0

__all__ = ["load_state_dict", "state_dict", "unshard"]


def state_dict(
    state: TrainState, model: torch.nn.Module | None = None, *, rank0_only: bool = False
) -> OrderedDict[str, torch.Tensor]:
    """``state``'s parameters and buffers as a ``state_dict`` that ``model.load_state_dict`` accepts strictly.

    Without ``model``, every parameter and buffer of the state, each module's
    parameters followed by its buffers, modules in the order they first
    appear. With ``model`` (the module the state was built from), exactly the
    keys of ``model.state_dict()`` in its order: tied weights under each of
    their names, non-persistent buffers left out, a module's extra state
    (``get_extra_state``) taken from ``model``, as fnloop does not train it.

    The tensors are the state's own (no copy; ``model.state_dict()`` shares
    the module's the same way): ``load_state_dict`` and ``torch.save`` copy
    them, so clone one only to write into it.

    Of a sharded state it is a collective (every rank calls it): each rank
    gets the whole model, gathered, or with ``rank0_only`` rank 0 alone does,
    each rank's chunks sent to it one at a time, and every other rank an empty
    dict, holding no more than its share meanwhile (FSDP2's full state dict with
    ``cpu_offload``). To write the weights to a file without any rank holding
    them whole, ``fnloop.save_weights``.

    Args:
        state: a state whose params and buffers came from ``fnloop.init(model, ...)``.
        model: the module, for its exact keys and order (needed for tied weights).
        rank0_only: the whole model on rank 0 alone, an empty dict elsewhere.

    Returns:
        An ``OrderedDict`` of name -> tensor, detached.

    Raises:
        TypeError: ``state`` is not a TrainState, or ``model`` not a module.
        KeyError: ``model`` has an entry the state lacks (the state was built
            from another model).

    Examples:
        >>> import fnloop as fl
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        >>> state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
        >>> list(fl.state_dict(state, model)) == list(model.state_dict())
        True
        >>> model.load_state_dict(fl.state_dict(state))
        <All keys matched successfully>
    """
    if type(state) is not TrainState:
        raise TypeError(f"state_dict() expected a fnloop.TrainState ({got(state)}).")
    if type(rank0_only) is not bool:
        raise TypeError(f"state_dict(rank0_only=...) must be a bool ({got(rank0_only)}).")
    if rank0_only:
        tensors = _on_rank0(state)
        if tensors is None:
            return OrderedDict()
    else:
        state = unshard(state)
        tensors = {**state.params, **state.buffers}
    if model is None:
        return OrderedDict((key, _detached(tensors[key])) for key in module_order(state))
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"'model' must be a torch.nn.Module or None ({got(model)}).")
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, name, value in model_keys(tensors, model):
        out[key] = value if name is None else _detached(tensors[name])
    return out


@overload
def unshard(state: TrainState, *, rank0_only: Literal[False] = False) -> TrainState: ...
@overload
def unshard(state: TrainState, *, rank0_only: bool) -> TrainState | None: ...
def unshard(state: TrainState, *, rank0_only: bool = False) -> TrainState | None:
    """The whole state of a sharded or tensor-parallel one: every rank's chunks (or slices) of each tensor gathered.

    A collective: every rank of the run calls it, and each gets the whole
    state (``shards`` and ``tensor`` are ``None``), its parameters and optimizer
    state as ``fnloop.init`` without ``shard=`` or ``tensor=`` would have them. With ``rank0_only``,
    rank 0 alone gets it, each tensor sent to it one block at a time, and
    every other rank gets ``None``, holding no more than its share meanwhile.
    A state that is not sharded is returned as it is (``None`` on the other
    ranks with ``rank0_only``). ``state_dict`` calls it for a sharded state.

    Examples:
        >>> import fnloop as fl
        >>> state = fl.init(torch.nn.Linear(3, 2), fl.optim.adamw(1e-3), seed=0, max_iter=1, shard="full")
        >>> state.shards.mode, unshard(state).shards, unshard(state).params["weight"].shape
        ('full', None, torch.Size([2, 3]))
    """
    if type(state) is not TrainState:
        raise TypeError(f"unshard() expected a fnloop.TrainState ({got(state)}).")
    if type(rank0_only) is not bool:
        raise TypeError(f"unshard(rank0_only=...) must be a bool ({got(rank0_only)}).")
    if rank0_only:
        from fnloop.distributed import rank

        whole = whole_on_rank0(state)
        params = {k: whole(v) for k, v in state.params.items()}
        opt_state = pytree.tree_map(whole, state.opt_state)
        whole_state = attrs.evolve(state, params=params, opt_state=opt_state, shards=None, tensor=None)
        return whole_state if rank() == 0 else None
    if state.tensor is None and state.shards is None:
        return state
    whole = _wholes(state)
    params = {k: whole(v) for k, v in state.params.items()}
    opt_state = pytree.tree_map(whole, state.opt_state)
    return attrs.evolve(state, params=params, opt_state=opt_state, shards=None, tensor=None)


def whole_params(state: TrainState) -> dict[str, torch.Tensor]:
    """The whole parameters of ``state``: gathered from every rank if they are sharded or split (a collective)."""
    if state.tensor is None and (state.shards is None or not state.shards.params):
        return dict(state.params)
    whole = _wholes(state)
    return {k: whole(v) for k, v in state.params.items()}


def _wholes(state: TrainState) -> Any:
    """``tensor -> the whole tensor`` for ``state``'s chunks and slices: the chunks gathered, then the slices joined."""
    gathered = (lambda t: t) if state.shards is None else _gatherer(state)
    if state.tensor is None:
        return gathered
    joined = _joiner(state)
    return lambda t: joined(t, gathered(t))


def _gatherer(state: TrainState) -> Any:
    """``tensor -> the whole tensor`` for ``state``'s chunks (other tensors as they are)."""
    import torch.distributed as dist

    from fnloop.distributed import _group, mesh_groups, sharded_tensor_groups

    shards = state.shards
    assert shards is not None
    chunks = sharded_tensors(state.params, state.opt_state, shards)
    if state.tensor is not None:  # the shards of this place in the tensor-parallel blocks
        group = sharded_tensor_groups(state.tensor.degree, shards.replicas)[1] if shards.world > 1 else None
    else:
        group = _group() if shards.replicas == 1 else mesh_groups(shards.replicas)[0]  # the ranks of one copy

    def whole(tensor: Any) -> Any:
        name = chunks.get(id(tensor))
        if name is None:
            return tensor
        if group is not None:
            every = tensor.new_empty((shards.world * tensor.shape[0], *tensor.shape[1:]))
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name
            gather(every, tensor.contiguous(), group=group)
            tensor = every
        return tensor[: shards.whole(name)]

    return whole


def _joiner(state: TrainState) -> Any:
    """``(tensor, its value) -> the whole tensor`` for a tensor-parallel ``state``'s slices (``tensor``'s value
    ``value``, its chunks gathered), gathered from its copy's ranks."""
    import torch.distributed as dist

    from fnloop.distributed import tensor_groups

    tensor = state.tensor
    assert tensor is not None
    split = split_tensors(state.params, state.opt_state, tensor, state.shards)
    group = tensor_groups(tensor.degree)[0]

    def whole(t: Any, value: Any) -> Any:
        name = split.get(id(t))
        if name is None or group is None:
            return value
        every = [torch.empty_like(value) for _ in range(tensor.degree)]
        dist.all_gather(every, value.contiguous(), group=group)
        return joined(every, *tensor.split(name))

    return whole


def _on_rank0(state: TrainState) -> dict[str, torch.Tensor] | None:
    """``state``'s whole parameters and buffers on rank 0, gathered one at a time; ``None`` elsewhere."""
    from fnloop.distributed import rank

    whole = whole_on_rank0(state)
    tensors = {name: whole(t) for name, t in (*state.params.items(), *state.buffers.items())}
    return tensors if rank() == 0 else None


def whole_on_rank0(state: TrainState) -> Any:
    """``tensor -> the whole tensor`` on rank 0 (a tensor of ``state`` sent to it one block at a time),
    and on the other ranks their own tensor, sent; anything else as it is. Called for the same tensors
    in the same order on every rank."""
    pieces, whole_shape = to_rank0(state)

    def whole(tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        arrived = pieces(tensor, tensor)
        if arrived is None:
            return tensor
        blocks = list(arrived)
        joined = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        rows = whole_shape(tensor)[0] if tensor.ndim else None
        return joined if rows is None or joined.shape[0] == rows else joined[:rows]

    return whole


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    # The very tensor when it is already detached: a caller holding it then counts as a reference,
    # so the fold never donates (writes in place) a tensor someone kept.
    return tensor.detach() if tensor.requires_grad else tensor


def load_state_dict(
    state: TrainState, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True
) -> TrainState:
    """``state`` with its parameters and buffers replaced by those of ``state_dict``.

    Each tensor is copied into a new tensor of the state's layout, dtype and
    device; names, shapes and dtypes must match the state's. ``opt_state``,
    ``iteration`` and everything else are kept as they are: for a state fresh
    from ``fnloop.init``, ``opt_state`` is what the optimizer's ``init`` gives
    for any weights of these shapes (fnloop's optimizers start from zeros), so
    this is a pretrained start. For a state in the middle of a run, rebuild
    the optimizer's state if the new weights should not inherit its moments:
    ``attrs.evolve(s, opt_state=fnloop.init(model, optimizer, seed=s.rng,
    max_iter=s.max_iter).opt_state)`` (``init`` leaves frozen parameters out
    of it). The other way to
    a pretrained start is ``model.load_state_dict(pretrained)`` before
    ``fnloop.init(model, ...)``.

    Args:
        state: the state to start from (usually ``fnloop.init(model, ...)``).
        state_dict: name -> tensor, as ``model.state_dict()`` or a file gives it.
            A second name of a tied weight (the same storage as an entry the
            state has) is accepted and skipped.
        strict: every parameter and buffer of the state must be given, and
            nothing else; with ``strict=False`` the missing keep their value
            and unknown names are ignored (shapes and dtypes are still checked).

    Returns:
        A new state; ``state`` and ``state_dict`` are not changed and share no memory with it.

    Raises:
        KeyError: with ``strict``, a name is missing or unexpected.
        ValueError: a tensor's shape or dtype differs from the state's.
        TypeError: a value is not a tensor.

    Examples:
        >>> import fnloop as fl
        >>> model = torch.nn.Linear(2, 1)
        >>> state = fl.init(model, fl.optim.adamw(1e-3), seed=0, max_iter=10)
        >>> pretrained = {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}
        >>> fl.load_state_dict(state, pretrained).params["weight"]
        tensor([[1., 1.]])
    """
    if type(state) is not TrainState:
        raise TypeError(f"load_state_dict() expected a fnloop.TrainState ({got(state)}).")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"'state_dict' must be a mapping from name to tensor ({got(state_dict)}).")
    params, buffers = dict(state.params), dict(state.buffers)
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{key!r}] must be a tensor ({got(value)}).")
        target = params if key in params else buffers if key in buffers else None
        if target is None:
            if strict and not _tied(key, value, state_dict, params):
                raise KeyError(
                    f"state_dict has {key!r}, which the state has no parameter or buffer for (it has "
                    f"{some_names({**params, **buffers})}). Is it the state_dict of the model the state was built "
                    "from? Drop the extra entries, or pass strict=False to ignore them."
                )
            continue
        like = target[key]
        if value.shape != like.shape or value.dtype != like.dtype:
            raise ValueError(
                f"state_dict[{key!r}] must be a {like.dtype} tensor of shape {tuple(like.shape)} as in the "
                f"state (got a {value.dtype} tensor of shape {tuple(value.shape)}). Convert it "
                f"(tensor.to({like.dtype})) or build the state from the model these weights belong to."
            )
        target[key] = torch.empty_like(like).copy_(value.detach())
    missing = [k for k in (*state.params, *state.buffers) if k not in state_dict]
    if strict and missing:
        raise KeyError(
            f"state_dict lacks {some_names(dict.fromkeys(missing))} of the state. Give every parameter and "
            "buffer, or pass strict=False to keep the state's values for the missing ones (a "
            "non-persistent buffer, registered with persistent=False, is never in a module's state_dict)."
        )
    return attrs.evolve(state, params=params, buffers=buffers)


def _tied(
    key: str, value: torch.Tensor, given: Mapping[str, torch.Tensor], params: Mapping[str, object]
) -> bool:
    """Whether ``given[key]`` is a second name of a parameter the state has (tied weights)."""
    return any(
        name in params and isinstance(other, torch.Tensor) and _same(other, value)
        for name, other in given.items()
        if name != key
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )
