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
import contextlib
import datetime
import gc
import os
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from fnloop._core.signals import _Stop
from fnloop._launch import launch

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
    exception": its worker threads outlive the interpreter, and free a
    collective's tensors without it). After an
    unhandled exception the group is left as it is: another rank may still be
    inside a collective, and leaving could wait on it.
    """
    if _current is not None:  # a run that never reached its end: its signs of life stop first
        _current.close()
    if hasattr(sys, "last_value") or not dist.is_initialized():
        return
    # Garbage first: a step (often in a reference cycle) holds the group in its compiled graph's
    # collectives, and a group freed only by the interpreter's final collection aborts the same way.
    _meshes.clear()
    gc.collect()
    dist.destroy_process_group()


def _group() -> Any:
    """The process group the step averages over, or ``None`` in a single process."""
    setup()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


_meshes: dict[tuple[int, int, int], tuple[Any, Any]] = {}
"""(the world group's id, its size, copies) -> this process's (shard group, replica group), made once."""


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
    return _meshes[key]


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

BEAT = 0.5
"""Seconds between two signs of life of a rank in a sharded run (see ``SharedRun``)."""

LIFE = 3.0
"""Seconds without a sign of life, or without news of a rank's end, after which it is taken to be gone."""

STORE_WAIT = 60.0
"""Seconds a run's end waits for the thread giving its signs of life to leave its store call."""


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

    It is also the run's board in the store (``SharedRun``): each rank's signs
    of life, and where each rank's run ended when it failed, which a sharded
    save waiting for another rank's part reads to tell a slow rank from one
    that will never write it.
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
        self.run = SharedRun(self.store, f"fnloop/run/{_runs}", rank)

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

    def ended(self, iteration: int | None) -> None:
        self.run.ended(iteration)

    def close(self) -> None:
        self.run.close()


class SharedRun:
    """What the ranks of a sharded run tell each other through the store while it lasts.

    * Signs of life: a thread of each rank bumps a counter every ``BEAT``
      seconds; a rank whose counter has not moved for ``LIFE`` seconds is gone
      (it died, or its machine did).
    * Ends: a rank whose run failed says at which iteration its last
      consistent state is (``None``: it has none, its state is torn) before
      ``AFTER_TRAIN``, where a checkpoint hook saves that state.

    A sharded save waiting for another rank's part asks ``absent``: a rank
    that is gone, or whose run ended elsewhere, or that is still inside the
    run when this one's ended (a step's collective waits for this rank, which
    will never come), will never write it.
    """

    def __init__(self, store: Any, prefix: str, rank: int) -> None:
        self.store, self.prefix, self.rank = store, prefix, rank
        self.end: int | None = None
        self.ended_at: float | None = None
        """When (``time.monotonic``) this rank's run ended by a failure; ``None`` while it goes on."""
        self._seen: dict[int, tuple[bytes, float, float | None]] = {}
        """Each rank's last count of beats, when it was first seen so, and when one was last seen to come."""
        self._done = threading.Event()
        self._beats = threading.Thread(target=self._beat, name="fnloop-alive", daemon=True)
        self._beats.start()
        global _current
        _current = self

    def _beat(self) -> None:
        key = f"{self.prefix}/alive/{self.rank}"
        try:
            while not self._done.is_set():
                self.store.add(key, 1)
                self._done.wait(BEAT)
        except Exception:  # noqa: BLE001 - the store is gone with the group: nobody is left to tell
            return

    def ended(self, iteration: int | None) -> None:
        """This rank's run failed; its last consistent state is at ``iteration`` (``None``: torn)."""
        self.end, self.ended_at = iteration, time.monotonic()
        with contextlib.suppress(Exception):  # a store gone with the group: the others time out
            self.store.set(
                f"{self.prefix}/ended/{self.rank}", "torn" if iteration is None else str(iteration)
            )

    def absent(self, ranks: list[int], iteration: int) -> str | None:
        """Why one of ``ranks`` will never write its part of the save of ``iteration``; ``None`` if all may."""
        now = time.monotonic()
        for r in ranks:
            alive = self.store.get(f"{self.prefix}/alive/{r}") if self._has(f"alive/{r}") else b""
            seen = self._seen.get(r)
            if seen is None:
                self._seen[r] = (alive, now, None)
            elif seen[0] != alive:  # a beat since the last look: it lives
                self._seen[r] = (alive, now, now)
            elif now - seen[1] > LIFE:
                return f"rank {r} has shown no sign of life for {LIFE:.0f} s (it died, or its machine did)"
            if self.ended_at is None or self.end != iteration:
                continue  # this rank's run goes on, or this is an earlier save in flight
            if self._has(f"ended/{r}"):
                theirs = self.store.get(f"{self.prefix}/ended/{r}").decode()
                if theirs != str(iteration):
                    return f"rank {r}'s run ended at iteration {theirs}, this rank's at {iteration}"
                continue
            # Still inside the run: seen beating since this rank's run ended, and silent about an end.
            # Not seen beating yet (a first look): wait, it may be dead, which its silence then says.
            beat = self._seen[r][2]
            if beat is not None and beat > self.ended_at and now - self.ended_at > LIFE:
                return (
                    f"this rank's run failed at iteration {iteration}, and rank {r} is still inside "
                    f"the run {LIFE:.0f} s later (alive, a step's collective waiting for this rank)"
                )
        return None

    def _has(self, key: str) -> bool:
        return bool(self.store.check([f"{self.prefix}/{key}"]))

    def close(self) -> None:
        """The run is over: no more signs of life, once the thread that gave them has ended.

        It is waited for, up to ``STORE_WAIT`` seconds (a store call on a loaded machine can take
        seconds): a daemon thread still inside a store call when the interpreter finalizes aborts
        the process after all its work is done ("terminate called without an active exception":
        Python ends the thread by unwinding through a C++ frame that may not be unwound). Only a
        store that stopped answering (its host is gone) leaves it running, to die with the process.
        """
        global _current
        self._done.set()
        self._beats.join(timeout=STORE_WAIT)
        if _current is self:
            _current = None


_current: SharedRun | None = None


def current_run() -> SharedRun | None:
    """The sharded run this process is in (its board in the store), or ``None``."""
    return _current


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
