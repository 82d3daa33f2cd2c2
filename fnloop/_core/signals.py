"""Signals during a run: SIGTERM and SIGINT stop the fold after the current step."""

from __future__ import annotations

import contextlib
import signal
import threading
import warnings
from collections.abc import Callable, Iterator

__all__ = ["Preempted", "SlowStart"]


class Preempted(SystemExit):
    """``run`` stopped early because the process received SIGTERM.

    Raised after the current step finished and ``AFTER_TRAIN`` ran (so a
    checkpoint hook saved the last consistent state, which ``exc.state``
    holds). A ``SystemExit`` with code ``128 + signal``: uncaught, the process
    exits with 143, as a process killed by SIGTERM would, and never with 0.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name} after the current step"


class _Stop:
    """The signal the run was asked to stop by, if any, and how many came; set by the handler."""

    signum: int | None = None
    count: int = 0

    def at(self, iteration: int) -> int | None:
        """The signal to stop by at the boundary where ``iteration`` steps are done, or ``None`` to go on."""
        return self.signum

    def ended(self, iteration: int | None) -> None:
        """The run failed, its last consistent state at ``iteration`` (``None``: torn); a stop shared by ranks tells them."""

    def close(self) -> None:
        """The run is over."""


_FORCE = 3
"""The Ctrl-C that stops a run at once, wherever it is (the state may then be torn)."""


@contextlib.contextmanager
def _signals(enabled: bool) -> Iterator[_Stop | None]:
    # Handlers live only for the duration of `run`, and only in the main thread
    # (Python delivers signals there alone). Signals ask the fold to stop after
    # the current step; a third Ctrl-C stops at once.
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield None
        return
    stop = _Stop()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: object) -> None:
        # Deferred to the end of the step: an in-place step cut between two
        # kernels would leave a state that is neither the old nor the new one.
        stop.count += 1
        if stop.signum is None:
            stop.signum = signum
        if signum == signal.SIGINT and stop.count >= _FORCE:
            for sig, old in previous.items():
                signal.signal(sig, old)
            raise KeyboardInterrupt

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


_TIME_UP = 0
"""What a ``_Deadline`` stops by, in place of a signal's number (no signal has 0)."""


class TimeUp(Exception):
    """The run's ``max_time`` passed: ``run`` catches it and returns ``exc.state``, saved by then."""


FIRST_CALL = 0.25
"""The share of a run's ``max_time`` past which its first call (a compile, mostly) is worth a warning."""

_SLOW_START = (
    "run(max_time={limit:g}): the run's start and its first step took {took:.1f} s, {share:.0%} of its time "
    "limit (a compiled step compiles then: 5-120 s cold, about 1-5 s from a warm cache). The limit counts "
    "that time, so {left} Raise max_time to leave the steps their time; a second run of the same "
    "script starts from the compile cache."
)


class _Deadline(_Stop):
    """A stop at the first boundary once ``seconds`` of ``clock`` have passed, or by the signal ``local`` got.

    At the first boundary it warns once if the start and the first call took
    ``FIRST_CALL`` of the time or more: the compile counts against the limit.
    """

    def __init__(self, local: _Stop | None, clock: Callable[[], float], seconds: float) -> None:
        self.local, self.clock, self.seconds = local, clock, seconds
        self.start = clock()
        self.end = self.start + seconds
        self.first = True

    @property
    def signum(self) -> int | None:  # type: ignore[override]
        """A signal's number if one came, ``_TIME_UP`` once the time is up, else ``None``."""
        if self.local is not None and self.local.signum is not None:
            return self.local.signum
        now = self.clock()
        if self.first:
            self.first = False
            took = now - self.start
            if took >= FIRST_CALL * self.seconds:
                left = (
                    "the run stops after its first step, before any later hook's turn comes."
                    if now >= self.end
                    else f"{self.end - now:.1f} s are left for the others."
                )
                message = _SLOW_START.format(
                    limit=self.seconds, took=took, share=took / self.seconds, left=left
                )
                warnings.warn(message, SlowStart, stacklevel=2)
        return _TIME_UP if now >= self.end else None


class SlowStart(UserWarning):
    """A run under ``max_time`` took a large share of its limit to start and take its first step (a compile)."""


def _interruption(signum: int) -> BaseException:
    if signum == _TIME_UP:
        return TimeUp()
    return KeyboardInterrupt() if signum == signal.SIGINT else Preempted(signum)
