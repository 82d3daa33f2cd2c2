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
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._core.messages import got
from fnloop._core.shards import sharded_tensors
from fnloop._core.state import TrainState

__all__ = ["load_state_dict", "state_dict", "unshard"]

_EXTRA_STATE = "_extra_state"  # torch's key suffix for a module's get_extra_state()


def state_dict(state: TrainState, model: torch.nn.Module | None = None) -> OrderedDict[str, torch.Tensor]:
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

    Args:
        state: a state whose params and buffers came from ``fnloop.init(model, ...)``.
        model: the module, for its exact keys and order (needed for tied weights).

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
    if state.shards is not None:
        state = unshard(state)
    tensors = {**state.params, **state.buffers}
    if model is None:
        return OrderedDict((key, _detached(tensors[key])) for key in _module_order(state))
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"'model' must be a torch.nn.Module or None ({got(model)}).")
    # A tied weight is one parameter under several names; the state keeps the first name only.
    alias = {id(t): name for name, t in (*model.named_parameters(), *model.named_buffers())}
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, value in model.state_dict(keep_vars=True).items():
        name = key if key in tensors else alias.get(id(value))
        if name in tensors:
            out[key] = _detached(tensors[name])
        elif key.endswith(_EXTRA_STATE):
            out[key] = value
        else:
            raise KeyError(
                f"the model has {key!r} but the state has no such parameter or buffer (it has "
                f"{_some(tensors)}): pass the module the state was built from, fnloop.init(model, ...)."
            )
    return out


def unshard(state: TrainState) -> TrainState:
    """The whole state of a sharded one: every rank's chunks of each tensor gathered, padding cut off.

    A collective: every rank of the run calls it, and each gets the whole
    state (``shards`` is ``None``), its parameters and optimizer state as
    ``fnloop.init`` without ``shard=`` would have them. A state that is not
    sharded is returned as it is. ``state_dict`` calls it for a sharded state.

    Examples:
        >>> import fnloop as fl
        >>> state = fl.init(torch.nn.Linear(3, 2), fl.optim.adamw(1e-3), seed=0, max_iter=1, shard="full")
        >>> state.shards.mode, unshard(state).shards, unshard(state).params["weight"].shape
        ('full', None, torch.Size([2, 3]))
    """
    if type(state) is not TrainState:
        raise TypeError(f"unshard() expected a fnloop.TrainState ({got(state)}).")
    if state.shards is None:
        return state
    whole = _gatherer(state)
    params = {k: whole(v) for k, v in state.params.items()}
    return attrs.evolve(state, params=params, opt_state=pytree.tree_map(whole, state.opt_state), shards=None)


def whole_params(state: TrainState) -> dict[str, torch.Tensor]:
    """The whole parameters of ``state``: gathered from every rank if they are sharded (a collective)."""
    if state.shards is None or not state.shards.params:
        return dict(state.params)
    whole = _gatherer(state)
    return {k: whole(v) for k, v in state.params.items()}


def _gatherer(state: TrainState) -> Any:
    """``tensor -> the whole tensor`` for ``state``'s chunks (other tensors as they are)."""
    import torch.distributed as dist

    from fnloop.distributed import _group, mesh_groups

    shards = state.shards
    assert shards is not None
    chunks = sharded_tensors(state.params, state.opt_state, shards)
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


def _module_order(state: TrainState) -> list[str]:
    """The state's keys grouped by module: its parameters, then its buffers."""
    by_module: dict[str, list[str]] = {}
    for key in (*state.params, *state.buffers):
        by_module.setdefault(key.rpartition(".")[0], []).append(key)
    return [key for keys in by_module.values() for key in keys]


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    # The very tensor when it is already detached: a caller holding it then counts as a reference,
    # so the fold never donates (writes in place) a tensor someone kept.
    return tensor.detach() if tensor.requires_grad else tensor


def _some(keys: Mapping[str, object]) -> str:
    names = list(keys)
    return ", ".join(map(repr, names[:5])) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


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
                    f"{_some({**params, **buffers})}). Is it the state_dict of the model the state was built "
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
            f"state_dict lacks {_some(dict.fromkeys(missing))} of the state. Give every parameter and "
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
