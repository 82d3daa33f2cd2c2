"""What the ranks of a sharded run agree on through the process group's store: where to stop, who is still alive.

``AgreedStop`` makes every rank stop at the boundary rank 0 announces (a
sharded checkpoint needs every rank's part of one state); ``SharedRun`` is
the run's board: each rank's signs of life, and where a rank's run ended
when it failed, which a sharded save waiting for a part reads to tell a slow
rank from one that will never write it. ``fnloop.distributed`` re-exports them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from fnloop._core.signals import _Stop

__all__ = ["BEAT", "LIFE", "STORE_WAIT", "AgreedStop", "SharedRun", "current_run"]

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
