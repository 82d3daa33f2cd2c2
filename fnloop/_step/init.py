"""``init``: a state built from a model and an optimizer, whole or this rank's chunks."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fnloop._core.config import plain
from fnloop._core.messages import got
from fnloop._core.shards import Shards
from fnloop._core.state import TrainState
from fnloop._core.tensor_parallel import TensorParallel, local_slice
from fnloop._step.eval import plain_module
from fnloop._step.kernel import frozen
from fnloop._step.materialize import InitWeights, is_meta, materialized
from fnloop._step.sharding import kept_of, parts, state_shards
from fnloop._step.tensor import tensor_slices
from fnloop._step.tensor_plans import TensorPlan, tensor_layout
from fnloop.distributed import broadcast_tensors
from fnloop.optim import Optimizer
from fnloop.optim._inject import refuse_tensor_settings

__all__ = ["init"]


def init(
    model: torch.nn.Module,
    optimizer: Optimizer,
    *,
    seed: int,
    max_iter: int,
    extra: Any = None,
    config: Any = None,
    shard: str | None = None,
    replicate: int = 1,
    init_weights: InitWeights | None = None,
    tensor: int = 1,
    tensor_plan: TensorPlan | Mapping[str, Any] | None = None,
    donate_model: bool = False,
) -> TrainState:
    """A state for training ``model`` with ``optimizer`` from iteration 0.

    ``params`` and ``buffers`` are detached copies keyed like
    ``model.named_parameters()`` and ``model.named_buffers()``; the model itself
    is never changed by fnloop, unless ``donate_model``. ``opt_state`` is the optimizer's for the
    parameters to train: those the model marks ``requires_grad=False`` are
    kept in ``params`` and never trained (see ``train_step``).

    Args:
        model: the module whose parameters and buffers are trained (one
            wrapped by ``torch.compile`` is unwrapped: the names stay plain).
        optimizer: a pure optimizer (``fnloop.optim``); its ``init`` builds ``opt_state``.
        seed: the run's seed (``state.rng``); the step's randomness is a function
            of ``(seed, iteration)``.
        max_iter: how many steps the run takes.
        extra: your own data, kept in ``state.extra``.
        config: the run's configuration (an attrs record such as
            ``fnloop.config.parse`` gives, a dataclass or a mapping), kept in
            ``state.config`` as plain data: saved in every checkpoint, shown by
            ``fnloop inspect``, and compared by ``resume`` (see ``docs/config.md``).
        shard: split the state across the data-parallel ranks (``torchrun``):
            ``"full"`` shards parameters, gradients and optimizer state (as
            FSDP2's ``fully_shard``); ``"optimizer"`` shards gradients and
            optimizer state and keeps the parameters whole on every rank (ZeRO-2).
            Each parameter of at least one dimension is split on its first
            one; ``state.shards`` records how, and ``train_step`` reads it. See
            ``docs/distributed.md#sharded-training``. ``None``: every rank holds
            the whole state.
        replicate: with ``shard``, keep this many copies of the sharded state
            (HSDP, FSDP2's 2-D mesh; torchtitan's replicate degree): each
            block of ``world / replicate`` consecutive ranks (a machine's
            processes, say) shards one copy, and the copies are replicas of one
            another. Gradients are reduce-scattered within a block and
            all-reduced across blocks. See ``docs/distributed.md#a-2-d-mesh``.
        init_weights: for a model built on the meta device (its tensors have
            no memory yet), ``init_weights(module)`` fills a module's own
            tensors in place; without it, each module's ``reset_parameters()``.
            The tensors are made one module at a time, each kept only as the
            state needs it (this rank's rows, when sharded), from a seed of
            ``seed`` and the module's name. See
            ``docs/distributed.md#a-model-larger-than-one-process``.
        tensor: split each layer of the plan across this many consecutive
            ranks (tensor parallelism, Megatron-LM's; torchtitan's
            ``tensor_parallel_degree``); the world is ``tensor`` times the
            number of copies, which train as data parallel, or with ``shard``
            shard each place's slices among them (torchtitan's 2-D mesh; 3-D
            with ``replicate``). ``state.tensor`` records the split. See
            ``docs/distributed.md#tensor-parallelism``.
        tensor_plan: how the layers are split (a ``TensorPlan``, or its
            ``layers`` dict: module pattern -> ``"colwise"``, ``"rowwise"``,
            ``"gathered"``, ``"vocab"``, or torch's ``ColwiseParallel()`` /
            ``RowwiseParallel()``); ``None``: the built-in plan of a
            ``transformers`` Llama, Mistral, Qwen2 or GPT-2.
        donate_model: the state takes the model's parameters and buffers
            instead of copying them, and the model is left on the meta device
            (its structure, no memory), which is all a step needs of it: the
            weights are held once, and never twice, not even while ``init``
            runs. Buffers not in ``state_dict`` (``persistent=False``) are
            copied and stay in the model. To run the module itself again,
            ``model.load_state_dict(fnloop.state_dict(state, model), assign=True)``.
            See ``docs/concepts.md#memory-the-modules-own-tensors``.

    Examples:
        >>> import fnloop as fl
        >>> s = fl.init(torch.nn.Linear(3, 2), fl.optim.sgd(0.1), seed=0, max_iter=10)
        >>> sorted(s.params), s.params["weight"].requires_grad
        (['bias', 'weight'], False)
    """
    model = plain_module(model, "init")
    _refuse_fsdp(model)
    _refuse_donated(model)
    if type(donate_model) is not bool:
        raise TypeError(f"init(donate_model=...) must be a bool ({got(donate_model)}).")
    if not isinstance(optimizer, Optimizer):
        kind = type(optimizer)
        where = "torch.optim" if isinstance(optimizer, torch.optim.Optimizer) else kind.__module__
        raise TypeError(
            f"init() expected a fnloop.optim.Optimizer, got a {where}.{kind.__qualname__}; "
            "fnloop's optimizers are pure functions of the state: build one with "
            "fnloop.optim.sgd/adam/adamw (the same numbers as torch.optim's)."
        )
    refuse_tensor_settings(optimizer, "init")
    if type(seed) is not int or seed < 0:
        raise ValueError(f"'seed' must be a non-negative int ({got(seed)}).")
    config = plain(config, "init(config=...)")  # refused before any tensor is made
    fixed = frozen(model, "init")
    if init_weights is not None and not callable(init_weights):
        raise TypeError(f"init(init_weights=...) must be a function of a module ({got(init_weights)}).")
    split = tensor_layout(model, tensor, tensor_plan)
    shards = state_shards(shard, replicate, dict(model.named_parameters()), split)
    made = is_meta(model)
    if made:  # made here, module by module, each rank's part kept
        params, buffers, trained = _materialized(model, seed, init_weights, shards, split)
    else:
        params, buffers = _taken(model) if donate_model else _copied(model)
        # Data parallel: every rank starts from rank 0's initialization, as DistributedDataParallel does.
        broadcast_tensors([*params.values(), *buffers.values()])
        params, trained = parts(params if split is None else tensor_slices(params, split), shards)
    state = TrainState(
        max_iter=max_iter,
        params=params,
        buffers=buffers,
        opt_state=optimizer.init({k: v for k, v in trained.items() if k not in fixed}),
        rng=seed,
        extra=extra,
        config=config,
        shards=shards,
        tensor=split,
    )
    if donate_model and not made:  # last: a refusal above leaves the model as it was
        _left_on_meta(model)
    return state


_DONATED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""The modules ``init(..., donate_model=True)`` left on the meta device."""


def _copied(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's parameters and buffers, copied."""
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    return params, buffers


def _taken(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's parameters and buffers as they are (their memory, no copy); a buffer ``state_dict`` leaves out copied."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    kept = _not_saved(model)
    buffers = {name: b.detach().clone() if name in kept else b.detach() for name, b in model.named_buffers()}
    return params, buffers


def _not_saved(model: torch.nn.Module) -> set[str]:
    """The names of ``model``'s buffers that ``state_dict`` leaves out (``persistent=False``)."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        for name in module._non_persistent_buffers_set
    }


def _left_on_meta(model: torch.nn.Module) -> None:
    """``model``'s parameters and saved buffers replaced by meta tensors of their shapes (the state holds their memory).

    A parameter used by several modules (tied) is replaced by one meta
    ``Parameter`` in all of them, so the names still resolve as one tensor.
    """
    meta: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in meta:
            made = torch.empty_like(t, device="meta")
            meta[id(t)] = (
                torch.nn.Parameter(made, t.requires_grad) if isinstance(t, torch.nn.Parameter) else made
            )
        return meta[id(t)]

    for module in model.modules():
        # Set as attributes, so a module that keeps its own list of them (an LSTM's _flat_weights) lets go too.
        for name, p in list(module._parameters.items()):
            if p is not None:
                setattr(module, name, empty(p))
        for name, b in list(module._buffers.items()):
            if b is not None and name not in module._non_persistent_buffers_set:
                setattr(module, name, empty(b))
    _DONATED.add(model)


def _refuse_donated(model: torch.nn.Module) -> None:
    """Refuse a module whose weights an earlier ``init(..., donate_model=True)`` gave to its state, with the fix."""
    if model in _DONATED and is_meta(model):
        raise ValueError(
            "init(): this model's weights were given to a state by init(..., donate_model=True), and the "
            "model holds meta tensors (no values) in their place; a second init would make new random "
            "weights. Go on from that state (fl.run(state, ...)), or give the model the weights back "
            "first: model.load_state_dict(fl.state_dict(state, model), assign=True)."
        )


def _materialized(
    model: torch.nn.Module,
    seed: int,
    init_weights: InitWeights | None,
    shards: Shards | None,
    split: TensorParallel | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The params, buffers and trained tensors of a model on the meta device, made module by module.

    Only with ``shard="full"`` is a parameter kept as this rank's chunk alone,
    and with ``tensor`` as this rank's slice.
    """
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    keep = kept_of(shards)
    if split is not None:
        keep = _slicing(split, keep)
    for name, tensor, parameter in materialized(model, seed, init_weights, keep):
        (params if parameter else buffers)[name] = tensor
    params, trained = parts({name: params[name] for name, _ in model.named_parameters()}, shards, made=True)
    return params, buffers, trained


def _slicing(
    split: TensorParallel, keep: Callable[[str, torch.Tensor], torch.Tensor]
) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """What a rank keeps of a tensor made whole: what ``keep`` keeps of its slice of a split parameter, else of it."""
    dims = {n: (dim, parts) for n, dim, parts in split.params}

    def kept(name: str, whole: torch.Tensor) -> torch.Tensor:
        if name in dims:
            return keep(name, local_slice(whole, *dims[name], split.degree, split.rank))
        return keep(name, whole)

    return kept


def _refuse_fsdp(model: torch.nn.Module) -> None:
    """Refuse a module FSDP2's ``fully_shard`` wrapped (DTensor parameters), with the fix."""
    if "torch.distributed.tensor" not in sys.modules:  # nothing can be a DTensor yet
        return
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise TypeError(
                f"init(): the model's parameter {name!r} is a DTensor (the module was wrapped by "
                "fully_shard, or parallelized); fnloop shards the state itself, keeping the module "
                "plain. Build the model without fully_shard and pass "
                "fnloop.init(..., shard='full') (or 'optimizer'): see docs/distributed.md#sharded-training."
            )
