"""Tensor parallelism: each layer of a plan split across a group of ranks, its collectives in the step's graph.

Megatron-LM's scheme, in the vocabulary of torch's ``parallelize_module``
and torchtitan's plans. A plan (``TensorPlan``, ``tensor_plans.py``) names
modules by pattern and gives each a style:

==============  ==========================================  ================================================
style           what a rank holds                           the collectives (forward / backward)
==============  ==========================================  ================================================
``colwise``     a ``Linear``'s output features and bias     input: identity / all-reduce; output stays split
``rowwise``     a ``Linear``'s input features               output: all-reduce / identity; bias added after
``gathered``    as ``colwise``                              as ``colwise``; output all-gathered / sliced
``vocab``       an ``Embedding``'s rows (the vocabulary)    ids outside the rows masked; output all-reduce
``sequence``    its parameters whole, a slice of the        parameters: identity / all-reduce of their gradients
                sequence of its input (a norm)
``split``       nothing split; its input cut on the         input: this rank's slice / all-gather
                sequence (where the layers begin)
``gather``      nothing split; its input's sequence         input: all-gather / reduce-scatter
                gathered (an attention, an MLP)
==============  ==========================================  ================================================

With ``sequence``, ``split`` or ``gather`` in the plan (sequence parallelism,
Megatron-LM's and torchtitan's), the activations between the layers are held
in slices of the sequence (dimension 1): the module holding column-wise layers
(``gather``, torchtitan's ``PrepareModuleInput``) all-gathers its input's
sequence, whose reduce-scatter in the backward sums what the column-wise
layers' inputs got; each row-wise layer reduce-scatters its output on the
sequence instead of the all-reduce (all-gather in the backward); the head
(``gathered``) gathers its own input.

So a column-wise layer followed by a row-wise one (attention's projections,
an MLP) costs one all-reduce in the forward and one in the backward.
``transformers``' ``Conv1D`` (GPT-2's, weight ``[in, out]``) takes the same
styles. A fused projection of ``parts`` side by side (``("colwise", 3)``,
GPT-2's query-key-value) is split part by part. Attributes that count what
is split (heads, widths) are divided by the degree while the step runs
(``TensorPlan.divide``), so the module's own code runs on its slices.

The transformation is a way of holding the model (``tensor_hold``): the
module holds this rank's slices, with hooks that run the collectives; the
gradient stage around it is a single run's, and its gradients are this
rank's slices of the whole gradients. Copies of the group (``W = T x D``)
average their gradients as data parallel does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch
from torch.nn.utils._named_member_accessor import swap_tensor

from fnloop._core.shards import Shards
from fnloop._core.tensor_parallel import TensorParallel, local_slice
from fnloop._step.collectives import Groups, done, summed
from fnloop._step.holding import holding as plain_holding
from fnloop._step.tensor_functions import (
    Copy,
    GatherLast,
    GatherSequence,
    Reduce,
    ScatterSequence,
    SplitSequence,
    module_hooks,
    summed_parameters,
    whole_masks,
)
from fnloop.distributed import sharded_tensor_groups, tensor_groups

__all__ = ["Hold", "TensorSquares", "tensor_hold", "tensor_parallel_groups", "tensor_slices"]

Hold = Callable[[dict[str, torch.Tensor]], contextlib.AbstractContextManager[None]]
"""How a gradient stage holds the model on the tensors it is given (``value_and_grad``'s ``hold``)."""


def tensor_parallel_groups(degree: int, world: int, shards: Shards | None = None) -> Groups:
    """The groups of a tensor-parallel run of ``world`` ranks: ``degree`` consecutive ranks split the layers.

    Their copies are data parallel, or with ``shards`` shard the state (each
    place in a block sharding its slices, ``shards.replicas`` copies of that).
    """
    if shards is not None:
        split, shard, across, data = sharded_tensor_groups(degree, shards.replicas)
        return Groups(data, shard, across, world // degree, tensor=split)
    split, copies = tensor_groups(degree)
    if copies is None:
        return Groups(tensor=split)
    return Groups(copies, None, None, world // degree, tensor=split)


def tensor_slices(tensors: Mapping[str, torch.Tensor], tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's slices of the split tensors of ``tensors`` (whole ones), the others as they are."""
    split = {n: (dim, parts) for n, dim, parts in tp.params}
    return {
        name: local_slice(t, *split[name], tp.degree, tp.rank) if name in split else t
        for name, t in tensors.items()
    }


def tensor_hold(model: torch.nn.Module, tp: TensorParallel, group: Any, hold: Hold | None = None) -> Hold:
    """How the step holds ``model`` on this rank's slices (``value_and_grad``'s ``hold``): the collectives hooked in.

    ``hold``: how the model holds the slices given (a sharded state's,
    gathered block by block, ``blocks.held_by_blocks``); else as they are.
    """
    modules = dict(model.named_modules())
    degree, rank = tp.degree, tp.rank
    holding = hold or functools.partial(plain_holding, model)

    # Under sequence parallelism the row-wise outputs are scattered on the sequence, and the inputs of the
    # modules that hold the column-wise layers ("gather", and the head) gathered on it.
    reduce = ScatterSequence if tp.sequence else Reduce

    def reduced(out: torch.Tensor) -> torch.Tensor:
        return reduce.apply(out, group)

    @contextlib.contextmanager
    def held(tensors: dict[str, torch.Tensor]) -> Iterator[None]:
        copied = _Copies(lambda x: Copy.apply(x, group))
        gathered = _Copies(lambda x: GatherSequence.apply(x, group))
        with contextlib.ExitStack() as stack:
            for name, style, _ in tp.layers:
                module = modules[name]
                if style == "rowwise" and getattr(module, "bias", None) is not None:
                    stack.enter_context(_rowwise(module, reduced))
                elif style == "vocab":
                    stack.enter_context(_hooked(module, *_vocab(module, tp, group)))
                    stack.enter_context(_set(module, "padding_idx", _local_padding(module, tp)))
                elif style == "rowwise":
                    stack.enter_context(_hooked(module, None, reduced))
                elif style == "sequence":
                    stack.enter_context(summed_parameters(module, group))
                elif style == "split":
                    stack.enter_context(
                        _hooked(module, lambda x: SplitSequence.apply(x, group, degree, rank), None)
                    )
                elif style == "gather":
                    stack.enter_context(_hooked(module, gathered, None))
                else:
                    head = style == "gathered"
                    after = (lambda out: GatherLast.apply(out, group, degree, rank)) if head else None
                    before = copied if not tp.sequence else (gathered if head else None)
                    stack.enter_context(_hooked(module, before, after))
            # dropout on a rank's heads: its part of one process's masks
            stack.enter_context(whole_masks([modules[n] for n in _attentions(tp)], degree, rank))
            for name, attribute in tp.divided:
                module = modules[name]
                stack.enter_context(_set(module, attribute, getattr(module, attribute) // degree))
            stack.enter_context(holding(tensors))
            yield

    return held


def _attentions(tp: TensorParallel) -> list[str]:
    """The modules holding column-wise layers (an attention's query, key and value; an MLP's): where heads are split."""
    parents = [name.rpartition(".")[0] for name, style, _ in tp.layers if style == "colwise"]
    return [name for name in dict.fromkeys(parents) if name]


class _Copies:
    """A column-wise layer's input passed through ``copy`` (``Copy``, or ``GatherSequence``), once per input tensor.

    Layers that read one input (attention's query, key and value; an MLP's
    gate and up projections) share its copy, so its gradient, summed from all
    of them first, is all-reduced once: one collective per block, as
    Megatron-LM's fused projections have. Each input is kept while the model
    is held, so that its ``id`` stays its own.
    """

    def __init__(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.copy = copy
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        found = self.seen.get(id(x))
        if found is None:
            found = self.seen[id(x)] = (x, self.copy(x))
        return found[1]


@contextlib.contextmanager
def _rowwise(module: torch.nn.Module, reduced: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """A row-wise layer with a bias: run without it, the bias added once after the sum over the ranks (``reduced``).

    The bias is the one the module holds when it runs (a sharded state's
    gathered then), set aside for the call and put back.
    """
    biases: list[torch.Tensor] = []

    def before(m: torch.nn.Module, args: tuple) -> None:
        bias = m.bias
        assert isinstance(bias, torch.Tensor)
        biases.append(swap_tensor(m, "bias", torch.zeros_like(bias)))

    def after(m: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        bias = biases.pop()
        swap_tensor(m, "bias", bias)
        return reduced(out) + bias

    with module_hooks([module], before, after):
        yield


def _vocab(
    module: torch.nn.Module, tp: TensorParallel, group: Any
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    assert isinstance(module, torch.nn.Embedding)
    rows = module.num_embeddings // tp.degree
    start = tp.rank * rows
    outside: list[torch.Tensor] = []

    def before(ids: torch.Tensor) -> torch.Tensor:
        away = (ids < start) | (ids >= start + rows)
        outside.append(away)
        return (ids - start).masked_fill(away, 0)

    def after(out: torch.Tensor) -> torch.Tensor:
        return Reduce.apply(out.masked_fill(outside.pop().unsqueeze(-1), 0.0), group)

    return before, after


def _local_padding(module: torch.nn.Module, tp: TensorParallel) -> int | None:
    assert isinstance(module, torch.nn.Embedding)
    padding = module.padding_idx
    rows = module.num_embeddings // tp.degree
    if padding is None or not tp.rank * rows <= padding < (tp.rank + 1) * rows:
        return None
    return padding - tp.rank * rows


@contextlib.contextmanager
def _hooked(
    module: torch.nn.Module,
    before: Callable[[torch.Tensor], torch.Tensor] | None,
    after: Callable[[torch.Tensor], torch.Tensor] | None,
) -> Iterator[None]:
    """``module`` with its first input (positional, or else by keyword) passed through ``before`` and its output
    through ``after`` for the block."""

    def first(m: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        assert before is not None
        if args:
            return (before(args[0]), *args[1:]), kwargs
        key = next(iter(kwargs))
        return args, {**kwargs, key: before(kwargs[key])}

    def output(m: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        assert after is not None
        return after(out)

    with module_hooks([module], first if before else None, output if after else None, with_kwargs=True):
        yield


@contextlib.contextmanager
def _set(module: torch.nn.Module, attribute: str, value: Any) -> Iterator[None]:
    before = getattr(module, attribute)
    setattr(module, attribute, value)
    try:
        yield
    finally:
        setattr(module, attribute, before)


@attrs.frozen
class TensorSquares:
    """The sums over the whole model of a tensor-parallel step's update (``SquaresSum``).

    A split tensor's sum of squares is the sum of its slices'; a whole one is
    counted once, from the group's first rank. ``group``: the ranks of one
    copy of the model. Where each place of the group shards its slices
    (``chunks``, over ``shard_group``), a chunk's squares are added over the
    shards too, and a tensor each shard holds whole is counted from the
    first shard (``first_shard``).
    """

    names: frozenset[str]
    first: bool
    group: Any
    chunks: frozenset[str] = frozenset()
    first_shard: bool = True
    shard_group: Any = None

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the group, and the shards (a count of non-finite gradients, say)."""
        if self.shard_group is not None:
            value = done(summed(value, self.shard_group))
        return done(summed(value, self.group))

    def own(self, tensors: Mapping[str, torch.Tensor], names: list[str], dtype: torch.dtype) -> torch.Tensor:
        """``[len(names)]``: each tensor's part of its sum of squares held here (a whole one's on the first rank)."""
        return torch.stack(
            [
                torch.linalg.vector_norm(tensors[n], dtype=dtype).square()
                * (1.0 if (n in self.names or self.first) and (n in self.chunks or self.first_shard) else 0.0)
                for n in names
            ]
        )

    def squares(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self(self.own(tensors, list(tensors), dtype))

    def statistics(self, tensors: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
        """For ``Squares``: each tensor's part, to be summed over the group with the others."""
        return dict(zip(names, self.own(tensors, names, torch.float32).unbind()))
