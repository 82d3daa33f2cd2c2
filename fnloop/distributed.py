"""Data parallel on ``torch.distributed``: the same script on one process or under ``torchrun``.

fnloop uses PyTorch's own engine and nothing of its own: ``torchrun`` starts
the processes, ``torch.distributed`` connects them (gloo on CPU, NCCL on GPU),
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

from fnloop._core.signals import _Stop

__all__ = ["DEFAULT_TIMEOUT", "device", "is_main", "rank", "setup", "world_size"]

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
    used as it is. Called for you by ``fl.init``, ``fl.train_step``,
    ``fl.data.batches``, ``fl.run`` and ``fl.checkpoint.resume``; call it
    first to choose ``timeout``.

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
    if not dist.is_available() or dist.is_initialized() or not _launched():
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
    atexit.register(_leave)


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
    """At a clean exit, leave the process group ``setup`` joined (``destroy_process_group``).

    A gloo group left to the interpreter's teardown can abort the process
    after all its work is done (SIGABRT, "terminate called without an active
    exception": its worker threads outlive the interpreter). After an
    unhandled exception the group is left as it is: another rank may still be
    inside a collective, and leaving could wait on it.
    """
    if hasattr(sys, "last_value") or not dist.is_initialized():
        return
    # Garbage first: a step (often in a reference cycle) holds the group in its compiled graph's
    # collectives, and a group freed only by the interpreter's final collection aborts the same way.
    gc.collect()
    dist.destroy_process_group()


def _group() -> Any:
    """The process group the step averages over, or ``None`` in a single process."""
    setup()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


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


_runs = 0  # the sharded runs this process started: the same count on every rank


class AgreedStop(_Stop):
    """A stop every rank obeys at the same boundary: rank 0 announces it, the others read the store.

    A sharded run cannot let rank 0 stop alone, as data parallel does: its
    checkpoint needs every rank's part of the same state. So rank 0, once
    signalled at a boundary, announces the next one through the process
    group's store and stops there; every other rank checks the store at each
    boundary (one lookup) and stops at the announced one. No rank can pass
    that boundary first: the step between needs rank 0's collectives, and
    rank 0 announced before taking it. Signals to the other ranks are ignored,
    as in data parallel.
    """

    def __init__(self, local: _Stop | None, rank: int) -> None:
        from torch.distributed.distributed_c10d import _get_default_store

        global _runs
        _runs += 1
        self.local, self.rank = local, rank
        self.store = _get_default_store()
        self.key = f"fnloop/stop/{_runs}"
        self.signum: int | None = None
        self.boundary: int | None = None

    def at(self, iteration: int) -> int | None:
        """The signal to stop by at the boundary where ``iteration`` steps are done, or ``None`` to go on."""
        if self.boundary is None:
            if self.rank == 0:
                if self.local is None or self.local.signum is None:
                    return None
                self.signum, self.boundary = self.local.signum, iteration + 1
                self.store.set(self.key, f"{self.signum} {self.boundary}")
            else:
                if not self.store.check([self.key]):
                    return None
                signum, boundary = self.store.get(self.key).decode().split()
                self.signum, self.boundary = int(signum), int(boundary)
        return self.signum if iteration >= self.boundary else None


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
