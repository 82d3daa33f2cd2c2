"""The collectives a step runs inside its graph, and the groups it runs them over.

Every transformation that talks to other ranks takes what it needs from
here: torch's functional collectives (which trace into the graph, under
either of the names torch has given them), ``done`` for an eager one, the
process groups of a layout (``Groups``), and the averages built from them.
No transformation imports another; they meet here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from fnloop._step.kernel import Grads

__all__ = [
    "Groups",
    "across_copies",
    "all_gather",
    "all_ranks",
    "all_reduced_mean",
    "all_to_all",
    "averaged",
    "by_dtype",
    "done",
    "groups_of",
    "reduce_scatter",
    "summed",
]


@attrs.frozen
class Groups:
    """The process groups a step talks over, and how many ranks train in all.

    Args:
        every: all the ranks: the loss, the metrics, the buffers and the
            gradients of tensors kept whole are averaged over them.
        shard: the ranks of one copy of the state, each holding its chunks:
            chunks are gathered and gradients reduce-scattered within it.
        across: the ranks holding the same chunks in each copy (HSDP), whose
            chunks' gradients are all-reduced; ``None``: one copy.
        size: the number of ranks in ``every``; 1 in one process, where
            the groups are ``None`` and nothing is exchanged.
        tensor: the ranks that split each layer of one copy of the model
            (tensor parallelism), ``every`` then linking the copies; ``None``: none.
    """

    every: Any = None
    shard: Any = None
    across: Any = None
    size: int = 1
    tensor: Any = None


def groups_of(replicas: int, ranks: int, group: Any) -> Groups:
    """The groups of a run of ``ranks`` ranks in ``replicas`` copies, ``group`` being every rank's (``None``: one process)."""
    if group is None:
        return Groups()
    if replicas == 1:
        return Groups(group, group, None, ranks)
    from fnloop.distributed import mesh_groups

    shard, across = mesh_groups(replicas)
    return Groups(group, shard, across, ranks)


def _funcol() -> Any:
    import torch.distributed._functional_collectives as funcol

    return funcol


def done(tensor: torch.Tensor) -> torch.Tensor:
    """The collective's result, waited for when it runs eagerly (traced, the graph waits where it is used).

    An eager collective left pending would outlive the Python reference to its
    input (a chunk the step is about to replace), which gloo may still be reading.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def all_gather(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``tensor`` end to end on the first dimension, in rank order."""
    funcol = _funcol()
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # the newer name
    return done(gather(tensor, 0, group))


def reduce_scatter(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's chunk (first dimension) of the sum over the ranks of ``tensor``."""
    funcol = _funcol()
    scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor  # the newer name
    return done(scatter(tensor, "sum", 0, group))


def all_to_all(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` cut in equal chunks, chunk ``k`` sent to rank ``k``; what each rank sent this one, in rank order."""
    return done(_funcol().all_to_all_single(tensor, None, None, group))


def summed(value: torch.Tensor, group: Any) -> torch.Tensor:
    """``value`` summed over the ranks (an all-reduce): a global norm's sum of squares, say."""
    return _funcol().all_reduce(value, "sum", group)


def all_ranks(flag: torch.Tensor, group: Any) -> torch.Tensor:
    """Whether the 0-d bool ``flag`` holds on every rank."""
    return _funcol().all_reduce(flag.to(torch.float32), "min", group) > 0


def by_dtype(tensors: Mapping[str, torch.Tensor]) -> dict[torch.dtype, list[str]]:
    """The names of ``tensors`` by dtype, in order: what one collective of tensors put end to end takes."""
    groups: dict[torch.dtype, list[str]] = {}
    for name, tensor in tensors.items():
        groups.setdefault(tensor.dtype, []).append(name)
    return groups


def all_reduced_mean(wholes: Mapping[str, torch.Tensor], group: Any, world: int) -> dict[str, torch.Tensor]:
    """The mean over ranks of each of ``wholes``, all of a dtype in one all-reduce."""
    out = {}
    for names in by_dtype(wholes).values():
        flat = (
            done(_funcol().all_reduce(torch.cat([wholes[n].reshape(-1) for n in names]), "sum", group))
            / world
        )
        for n, part in zip(names, flat.split([wholes[n].numel() for n in names])):
            out[n] = part.view(wholes[n].shape)
    return out


def across_copies(sums: Mapping[str, torch.Tensor], groups: Groups) -> dict[str, torch.Tensor]:
    """The mean over every rank of chunks summed within one copy: summed across the copies too (HSDP)."""
    if groups.across is None:
        return {name: t / groups.size for name, t in sums.items()}
    return all_reduced_mean(sums, groups.across, groups.size)


def averaged(found: Grads, group: Any, grads: bool = True) -> Grads:
    """``found`` averaged over the ranks of ``group``; its gradients left as they are unless ``grads``.

    One all-reduce per dtype over the gradients, the loss, the metrics and
    the floating buffers (BatchNorm's running statistics) put end to end.
    Integer buffers (counters) agree already.
    """
    size = torch.distributed.get_world_size(group)
    named = {
        **({("g", k): v for k, v in found.grads.items()} if grads else {}),
        ("l", ""): found.loss,
        **{("m", k): v.float() for k, v in found.metrics.items()},
        **{("b", k): v for k, v in found.buffers.items() if v.is_floating_point()},
    }
    by: dict[torch.dtype, list[tuple[Any, torch.Tensor]]] = {}
    for key, value in named.items():
        by.setdefault(value.dtype, []).append((key, value))
    out: dict[Any, torch.Tensor] = {}
    for entries in by.values():
        flat = torch.cat([v.reshape(-1) for _, v in entries])
        flat = _funcol().all_reduce(flat, "sum", group) / size
        for (key, value), part in zip(entries, flat.split([v.numel() for _, v in entries])):
            out[key] = part.view(value.shape)
    return Grads(
        {k: out["g", k] for k in found.grads} if grads else found.grads,
        {k: out.get(("b", k), v) for k, v in found.buffers.items()},
        out["l", ""],
        {k: out["m", k] for k in found.metrics},
    )
