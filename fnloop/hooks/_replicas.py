"""A check that the ranks of a data-parallel run still hold the same state."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from fnloop._core.phase import Phase
from fnloop._core.shards import sharded_tensors
from fnloop._core.state import TrainState
from fnloop._core.tensor_parallel import split_tensors
from fnloop._core.tree import leaves
from fnloop.distributed import _group

__all__ = ["CheckReplicas", "ReplicasDiverged", "check_replicas"]

_CHECKED = frozenset({Phase.BEFORE_TRAIN, Phase.AFTER_STEP})


class ReplicasDiverged(RuntimeError):
    """The ranks of a data-parallel run hold different states; the message names the first difference."""


def _fingerprints(state: TrainState) -> tuple[list[str], torch.Tensor]:
    """Each tensor's name and two float64 sums (plain, and weighted by position): a cheap fingerprint.

    Of a sharded or tensor-parallel state, the tensors every rank holds alike: each rank's chunks
    and slices differ by design.
    """
    names = ["iteration", "data"]
    rows = [torch.tensor([float(state.iteration), 0.0]), torch.tensor([float(state.data), 0.0])]
    chunks = {} if state.shards is None else sharded_tensors(state.params, state.opt_state, state.shards)
    if state.tensor is not None:
        chunks.update(split_tensors(state.params, state.opt_state, state.tensor, state.shards))
    for field in ("params", "buffers", "opt_state"):
        for path, tensor in leaves(getattr(state, field), field):
            if not isinstance(tensor, torch.Tensor) or id(tensor) in chunks:
                continue
            flat = tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
            weights = torch.arange(flat.numel(), dtype=torch.float64) % 13 + 1
            names.append(path)
            rows.append(torch.stack([flat.sum(), (flat * weights).sum()]))
    return names, torch.stack(rows)


@attrs.frozen(repr=False)
class CheckReplicas:
    """Compare the ranks' states; build it with ``check_replicas``."""

    acts_in: ClassVar[frozenset[Phase]] = _CHECKED
    """Where it is called: it reads the state, never changes it, and raises when the ranks differ."""

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase not in _CHECKED:
            return state
        group = _group()
        if group is None:
            return state
        import torch.distributed as dist

        names, mine = _fingerprints(state)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        when = "when the run started" if phase is Phase.BEFORE_TRAIN else f"after step {state.iteration}"
        for other, theirs in enumerate(everyone[1:], start=1):
            if theirs.shape != everyone[0].shape:
                raise ReplicasDiverged(
                    f"{when}, rank {other} holds {theirs.shape[0]} tensors and rank 0 {everyone[0].shape[0]}: "
                    "the ranks built different states. Build the state with the same code on every rank."
                )
            differs = (theirs != everyone[0]).any(dim=1).nonzero()
            if len(differs):
                name = names[int(differs[0])]
                raise ReplicasDiverged(
                    f"{when}, rank {other} and rank 0 hold different {name} (fingerprints "
                    f"{theirs[int(differs[0])].tolist()} and {everyone[0][int(differs[0])].tolist()}). "
                    "A data-parallel run keeps the ranks identical by construction; they drift when a "
                    "hook or the step does something rank-dependent (reads its own data outside the "
                    "step, writes into the state on one rank)."
                )
        return state

    def __repr__(self) -> str:
        return "check_replicas()"


def check_replicas() -> CheckReplicas:
    """A hook checking that every rank of a data-parallel run holds the same state.

    Off by default: add it as ``fl.every(n, fl.hooks.check_replicas())``. At
    ``BEFORE_TRAIN`` (after a resume, say) and at ``AFTER_STEP`` of the steps
    it is called at, every rank computes a fingerprint of its state (the
    iteration, the data cursor, and two float64 sums per tensor of params,
    buffers and optimizer state), the ranks gather them (one all-gather), and
    every rank raises ``ReplicasDiverged`` naming the step and the first tensor
    that differs. It costs a pass over the state and one collective; in a
    single process it does nothing. It never changes the state.

    Returns:
        The hook.

    Examples:
        >>> import fnloop as fl
        >>> final = fl.run(fl.TrainState(max_iter=2), lambda s, b: s, [None] * 2, [check_replicas()])
        >>> final.iteration
        2
    """
    return CheckReplicas()
