"""The ranks of a launch watched until they end, what they leave in its folder, and what the caller is raised when one fails.

A rank writes what ``fn`` returned (rank 0) or raised, whole or not at all
(``written``); the caller reads the first failure's report and raises the
rank's own exception with its traceback as the cause, or ``RankFailed``
saying how the process ended (``failure``).
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing.connection
import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_POLL = 0.2
"""Seconds between two looks at the ranks' reports while they run (a failure is seen within this)."""

__all__ = [
    "RankFailed",
    "RankTraceback",
    "failure",
    "write_report",
    "returned",
    "ended",
    "saved",
    "watched",
    "written",
]


LEFT_NO_REPORT = (
    "It failed as it started, or was ended from outside; what it printed says why. With "
    "start_method='spawn' a rank that cannot import fn or unpickle its arguments ends so: fn must "
    "be importable (a module's top level, not a local function), and a script must start its work "
    'under `if __name__ == "__main__":`.'
)

ENDED_INSIDE = (
    "A signal from outside ended it (a kill, the machine's out-of-memory killer, a scheduler "
    "reclaiming the machine), or a native crash inside torch or a library did; what it printed "
    "says which. A fnloop run that checkpoints resumes from its last checkpoint when launched again."
)

AT_EXIT = (
    "Something it left running failed at the process's exit: a process group the interpreter's "
    "teardown leaves can abort it (SIGABRT, 'terminate called without an active exception'). "
    "fnloop leaves the group it joined at exit; one fn joined itself must be left by fn "
    "(torch.distributed.destroy_process_group()) before it returns."
)


class RankFailed(RuntimeError):
    """A rank of a launch failed, and the exception it raised cannot be raised in the caller.

    Raised by ``launch`` when the rank that failed first was killed or exited
    without an exception of ``fn`` (a signal, ``os._exit``, ``sys.exit(1)``, a
    spawned process that could not import ``fn``), or when its exception
    could not be carried across processes (it did not pickle); the message
    names the rank and how it ended, and the rank's traceback, when there is
    one, is its ``__cause__``.
    """


class RankTraceback(Exception):
    """The traceback a failed rank printed, in its process: the ``__cause__`` of what ``launch`` raises.

    Python prints it above the exception itself, as ``concurrent.futures``
    prints a worker's traceback; ``str()`` of it is the traceback's text.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text}"""'


def saved(value: object, file: io.BufferedWriter, what: str) -> None:
    try:
        torch.save(value, file)
    except Exception as exc:
        raise TypeError(
            f"{what} cannot be pickled, so it cannot come back to the caller of fl.distributed.launch "
            f"({type(exc).__name__}: {exc}). Return tensors, numbers, strings, and dicts, lists or "
            "tuples of them (fl.state_dict(state) for a state's tensors), or write it to a file."
        ) from exc


def written(path: Path, write: Callable[[io.BufferedWriter], object]) -> None:
    """Write ``path`` whole or not at all: the caller reads a report only once it is complete."""
    part = path.with_name(path.name + ".part")
    with part.open("wb") as file:
        write(file)
    os.replace(part, path)


def write_report(folder: Path, rank: int, exc: Exception) -> None:
    """What rank ``rank`` raised: when (to tell the first failure), its traceback, and itself if it pickles."""
    facts = {
        "time": time.time(),
        "traceback": "".join(traceback.format_exception(exc)),
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "carried": True,
    }
    try:
        written(folder / f"raised{rank}", lambda f: torch.save(exc, f))
    except Exception:  # noqa: BLE001 - its attributes may not pickle: carry it without them
        bare = type(exc).__new__(type(exc))
        bare.args = exc.args
        for note in getattr(exc, "__notes__", []):
            bare.add_note(note)
        bare.add_note("fnloop.distributed.launch: its attributes do not pickle, and were dropped.")
        try:
            written(folder / f"raised{rank}", lambda f: torch.save(bare, f))
        except Exception:  # noqa: BLE001 - not even its arguments pickle: the caller gets its text
            facts["carried"] = False
    written(folder / f"failed{rank}", lambda f: f.write(json.dumps(facts).encode()))


def failure(
    folder: Path, rank: int, world: int, exitcode: int | None
) -> tuple[BaseException, BaseException | None]:
    """The exception to raise for rank ``rank``'s failure, and its ``__cause__`` (the rank's traceback)."""
    where = f"rank {rank} of {world}"
    report = folder / f"failed{rank}"
    if (folder / f"done{rank}").exists():
        return RankFailed(
            f"{where} {_how(exitcode)} after fn returned, as its process ended. " + AT_EXIT
        ), None
    if not report.exists() and (folder / f"started{rank}").exists():
        return RankFailed(
            f"{where} {_how(exitcode)} while fn ran, without raising an exception. " + ENDED_INSIDE
        ), None
    if not report.exists():
        return RankFailed(
            f"{where} {_how(exitcode)} before fn began, without raising an exception. " + LEFT_NO_REPORT
        ), None
    facts = json.loads(report.read_text())
    cause = RankTraceback(facts["traceback"])
    error: BaseException | None = None
    if facts["carried"]:
        with contextlib.suppress(Exception):
            error = torch.load(folder / f"raised{rank}", map_location="cpu", weights_only=False)
    if not isinstance(error, BaseException):
        error = RankFailed(
            f"{where} raised {facts['type']}: {facts['message']} (the exception itself cannot be "
            "pickled or rebuilt here, so it is given as this RuntimeError; the rank's traceback is above)"
        )
        return error, cause
    error.add_note(
        f"fnloop.distributed.launch: raised on {where}, the first rank to fail (its traceback is above); "
        "the other ranks were then ended."
    )
    return error, cause


def _how(exitcode: int | None) -> str:
    """How a process ended, from its exit code: ``multiprocessing``'s negative codes are signals."""
    if exitcode is None:
        return "did not end"
    if exitcode < 0:
        return f"was killed by {_signal_name(-exitcode)}"
    if exitcode > 128:
        return f"exited with code {exitcode} (128 + {_signal_name(exitcode - 128)}: stopped by that signal)"
    return f"exited with code {exitcode}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def returned(folder: Path) -> Any:
    """What ``fn`` returned on rank 0; ``None`` when it ended without returning (``sys.exit(0)``)."""
    path = folder / "returned"
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


def watched(processes: list[Any], folder: Path, grace_period: float) -> int | None:
    """Wait for every rank to end; the rank that failed first, the others ended once one failed."""
    live = {process.sentinel: rank for rank, process in enumerate(processes)}
    reports = [folder / f"failed{rank}" for rank in range(len(processes))]
    died: dict[int, float] = {}
    try:
        while live and not died and not any(report.exists() for report in reports):
            # A rank found dead here died after this moment: the time it counts for, against the
            # reports of the ranks its death made fail (their collectives with it), written later.
            since = time.time()
            for sentinel in multiprocessing.connection.wait(list(live), timeout=_POLL):
                rank = live.pop(sentinel)  # type: ignore[call-overload]
                processes[rank].join()
                if processes[rank].exitcode != 0:
                    died[rank] = since
    except KeyboardInterrupt:  # as a terminal's Ctrl-C would: the ranks stop after their step
        ended(processes, grace_period, signal.SIGINT)
        raise
    ended(processes, grace_period, signal.SIGTERM)
    when = dict(died)
    for rank, report in enumerate(reports):
        if report.exists():
            when[rank] = json.loads(report.read_text())["time"]
    return min(when, key=lambda rank: when[rank]) if when else None


def ended(processes: list[Any], grace_period: float, first: signal.Signals) -> None:
    """End the ranks still running: ``first`` now, SIGKILL after ``grace_period`` seconds; all joined."""
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, first)
    deadline = time.monotonic() + grace_period
    try:
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:  # a second Ctrl-C while waiting kills them at once
        for process in alive:
            if process.is_alive():
                process.kill()
            process.join()
