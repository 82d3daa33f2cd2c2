"""Data parallel on ``torch.distributed``: the same script on one process or under ``torchrun``.

fnloop uses PyTorch's own engine: ``torchrun`` starts the processes (or, on
one machine, from a script or a notebook, ``launch(fn, nprocs=N)`` does, with
the environment ``torchrun`` gives), ``torch.distributed`` connects them (gloo on CPU, NCCL on GPU),
and the compiled step averages the gradients across ranks with functional
collectives inside its one graph. Every rank holds the whole state, identical
by construction; rank 0 alone performs effects (checkpoints, writers, the
progress bar).

A script needs no change: under ``torchrun`` (its environment variables set,
``WORLD_SIZE`` above 1) the first of ``fl.init``, ``fl.train_step``,
``fl.data.batches``, ``fl.run`` or ``fl.checkpoint.resume`` to run joins the
process group, unless the script has done so itself. ``setup`` does it
explicitly, with a timeout of your choice.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from fnloop._launch import launch
from fnloop._shared_run import BEAT, LIFE, STORE_WAIT, AgreedStop, SharedRun, current_run  # noqa: F401 - re-exported

__all__ = ["DEFAULT_TIMEOUT", "device", "is_main", "launch", "rank", "setup", "world_size"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
"""How long a collective waits for the other ranks before it fails (a rank died or hangs)."""


def _launched() -> bool:
    """Whether this process was started by ``torchrun`` (or a launcher setting the same variables)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    except ValueError:
        return False


def setup(*, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
    """Join the process group that ``torchrun`` describes in the environment; nothing otherwise.

    The backend is gloo for CPU tensors and NCCL for CUDA ones (PyTorch's
    default); on a machine with GPUs this process's device becomes
    ``cuda:LOCAL_RANK``. A process group the script initialized itself is
    used as it is. Either way the group is left at a clean exit
    (``destroy_process_group``), unless the script has left it already.
    Called for you by ``fl.init``, ``fl.train_step``, ``fl.data.batches``,
    ``fl.run`` and ``fl.checkpoint.resume``; call it first to choose
    ``timeout``.

    Args:
        timeout: how long a collective waits for the other ranks before it
            fails, so that one rank's death stops the others within that time.

    Examples:
        >>> setup()  # a single process: nothing to join
        >>> rank(), world_size(), is_main()
        (0, 1, True)
    """
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"setup(timeout=...) expects a datetime.timedelta, got {timeout!r:.80}.")
    if not dist.is_available():
        return
    if dist.is_initialized():  # the script's own group: left at exit as one joined here is
        _leave_at_exit()
        return
    if not _launched():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # Not torchrun, or a store of each attempt's own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
        dist.init_process_group(timeout=timeout)
    else:
        # torchrun's shared store outlives a restart, keys and all: without a prefix of the
        # attempt's own, a restarted rank reads its peers' addresses of the attempt before, and
        # gloo's connect is refused, or waits until the timeout, on a port nobody listens on.
        _check_one_count_of_restarts()
        store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"fnloop/attempt_{attempt}/default_pg", store)
        dist.init_process_group(store=store, rank=rank, world_size=size, timeout=timeout)
    _leave_at_exit()


def _leave_at_exit() -> None:
    """Register ``_leave`` with ``atexit``, once per process."""
    global _leaving
    if not _leaving:
        _leaving = True
        atexit.register(_leave)


_leaving = False


def _check_one_count_of_restarts() -> None:
    """Refuse restarts over a shared store on several machines, whose agents count restarts apart."""
    machines = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if machines > 1 and restarts > 0:
        raise RuntimeError(
            f"torchrun --max-restarts={restarts} on {machines} machines with torchrun's shared store: "
            "each machine's torchrun counts restarts on its own (a machine started again counts "
            "from 0, a healthy one restarted for the change counts none), so the ranks of one "
            "attempt cannot agree on which attempt they are in, and the store keeps the keys of "
            "the attempts before. Give each attempt a store of its own: set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every machine's environment (see "
            "docs/distributed.md#several-machines), or run with --max-restarts=0."
        )


def _leave() -> None:
    """At a clean exit, leave the process group (``destroy_process_group``): the one ``setup``
    joined, or the script's own that fnloop used.

    A gloo group left to the interpreter's teardown can abort the process
    after all its work is done (SIGABRT, "terminate called without an active
    exception"): a worker thread of the group that frees a collective's
    tensors late, once the interpreter is finalizing, cannot take the GIL
    and is ended inside a destructor. Leaving frees the group, whose
    destructor joins those threads while the interpreter still runs, so
    nothing it holds outlives it: unless the script's own objects (a step at
    module level) still hold the group. After an unhandled exception the
    group is left as it is: another rank may still be inside a collective,
    and leaving could wait on it.
    """
    unfinished = current_run()
    if unfinished is not None:  # a run that never reached its end: its signs of life stop first
        unfinished.close()
    if hasattr(sys, "last_value") or not dist.is_initialized():
        return
    # Garbage first: a step (often in a reference cycle) holds the group in its compiled graph's
    # collectives, and a group freed only by the interpreter's final collection aborts the same way.
    _meshes.clear()
    _forget_defaults_that_hold_groups()
    gc.collect()
    dist.destroy_process_group()


def _forget_defaults_that_hold_groups() -> None:
    """Set to ``None`` the default arguments of ``torch.distributed.nn.functional`` that hold a group.

    That module's functions take ``group=group.WORLD``, evaluated when it is
    imported, and the functional collectives import it on their first eager
    call: after the group was joined, so the defaults hold the group itself
    and ``destroy_process_group`` can no longer free it (its gloo threads then
    live on into the interpreter's teardown). ``None`` is what those
    functions read as the default group, so they mean the same after.
    """
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None:  # not imported: no defaults were evaluated
        return
    for function in vars(module).values():
        defaults = getattr(function, "__defaults__", None)
        if defaults and any(isinstance(value, dist.ProcessGroup) for value in defaults):
            function.__defaults__ = tuple(None if isinstance(v, dist.ProcessGroup) else v for v in defaults)


def _group() -> Any:
    """The process group the step averages over, or ``None`` in a single process."""
    setup()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


_meshes: dict[tuple[Any, ...], tuple[Any, ...]] = {}
"""(the world group's id, its size, the mesh's shape) -> this process's groups of it, made once."""


def mesh_groups(replicas: int) -> tuple[Any, Any]:
    """This rank's groups of a 2-D mesh of ``replicas`` copies (HSDP): ``(shard group, replica group)``.

    torch's ``DeviceMesh`` of shape ``(replicas, world / replicas)``, dimensions
    named ``("replicate", "shard")`` as FSDP2's HSDP names them: each copy is a
    block of consecutive ranks (under ``torchrun``, a machine's processes when
    the block is a machine's size), and the replica group links the ranks of
    the same place in each copy. Made on first use, by every rank (making
    process groups is a collective).
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = world_size()
    key = (id(dist.group.WORLD), world, replicas)
    if key not in _meshes:
        mesh = init_device_mesh(
            device().type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
        )
        _meshes[key] = (mesh.get_group("shard"), mesh.get_group("replicate"))
    shard, across = _meshes[key]
    return shard, across


def tensor_groups(degree: int) -> tuple[Any, Any]:
    """This rank's groups of a tensor-parallel run: ``(the ranks splitting its copy's layers, the copies)``.

    Blocks of ``degree`` consecutive ranks split the layers (a machine's
    processes, where the fast links are); the second group links the ranks
    of the same place in each copy (``None`` for one copy). Made on first use,
    by every rank.
    """
    world = world_size()
    if world == degree:
        return _group(), None
    return mesh_groups(world // degree)


def sharded_tensor_groups(degree: int, replicas: int) -> tuple[Any, Any, Any, Any]:
    """This rank's groups of a tensor-parallel run whose copies shard the state (2-D; 3-D with ``replicas``).

    torch's ``DeviceMesh`` of shape ``(replicas, shards, degree)``, named
    ``("replicate", "shard", "tensor")`` as torchtitan names its mesh: blocks
    of ``degree`` consecutive ranks split the layers, ``shards`` such blocks
    shard one copy, and ``replicas`` copies keep it. Returns ``(tensor group,
    shard group, replica group or None, data group)``, the data group linking
    every rank of the same place in its block (all the copies' shards). Made
    on first use, by every rank.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = world_size()
    shape = (replicas, world // (replicas * degree), degree)
    key = (id(dist.group.WORLD), world, shape)
    if key not in _meshes:
        mesh = init_device_mesh(device().type, shape, mesh_dim_names=("replicate", "shard", "tensor"))
        across = mesh.get_group("replicate") if replicas > 1 else None
        data = mesh.get_group("shard") if replicas == 1 else tensor_groups(degree)[1]
        _meshes[key] = (mesh.get_group("tensor"), mesh.get_group("shard"), across, data)
    split, shard, across, data = _meshes[key]
    return split, shard, across, data


def rank() -> int:
    """This process's rank (0 in a single process)."""
    setup()
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """How many processes train together (1 in a single process)."""
    setup()
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    """Whether this process is rank 0, the one that performs effects."""
    return rank() == 0


def device() -> torch.device:
    """The device this rank trains on: ``cuda:LOCAL_RANK`` on a machine with GPUs, else the CPU.

    Examples:
        >>> device().type in ("cpu", "cuda")
        True
    """
    setup()
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def broadcast_tensors(tensors: list[torch.Tensor]) -> None:
    """Overwrite each tensor with rank 0's value, in place (no-op in a single process)."""
    group = _group()
    if group is None:
        return
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor, src=0, group=group)


def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (pickled; for small values such as a path)."""
    group = _group()
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather_object(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (pickled; for small values such as a verdict)."""
    group = _group()
    if group is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out
