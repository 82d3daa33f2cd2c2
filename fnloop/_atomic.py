"""Writing into a checkpoint directory safely: one live run per directory, each file atomic.

A file is written under a temporary name, flushed to disk, then renamed onto
its path: a crash at any moment leaves either the old file or the new one,
never a mix. A crash can leave the temporary file behind; ``remove_leftovers``
removes those of processes that are gone.

A run holds its directory (``claim`` ... ``release``, or ``holding``) with an
OS-level lock on a file inside it, ``.fnloop.lock``, which holds the PID of
the process. The kernel drops the lock when the process dies, so a crash
never leaves a stale lock. Claims are counted per process, so that the hooks
of one run may share a directory; another process is refused at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: no lock, as before
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "LOCK_NAME",
    "DirectoryInUse",
    "claim",
    "holding",
    "holds",
    "release",
    "remove_leftovers",
    "write_atomically",
]

LOCK_NAME = ".fnloop.lock"
"""The file in a checkpoint directory that a live run holds locked; it holds the run's PID."""

_TEMP = re.compile(r"\..+\.(\d+)(?:@([A-Za-z0-9_-]*))?\.[0-9a-f]{8}\.tmp")
# The machine in a temporary name: on a filesystem that several machines share (the ranks of a
# sharded checkpoint write into one directory), a process id says nothing of another machine's.
_HOST = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:64]
_in_flight: set[str] = set()  # temporary names this process is writing now


def write_atomically(path: Path, write: Callable[[int], object]) -> None:
    """Make ``path`` the file that ``write`` writes to the descriptor it is given, or leave it untouched.

    Raises:
        OSError: the file cannot be written; an existing file at ``path`` is untouched.

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     write_atomically(Path(d) / "f", lambda fd: os.write(fd, b"new"))
        ...     (Path(d) / "f").read_bytes(), os.listdir(d)
        (b'new', ['f'])
    """
    temp_name = f".{path.name}.{os.getpid()}@{_HOST}.{secrets.token_hex(4)}.tmp"
    temp = path.with_name(temp_name)
    _in_flight.add(temp_name)
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        try:
            write(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    finally:
        _in_flight.discard(temp_name)
    # The rename itself must reach the disk to survive a power loss.
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove_leftovers(directory: Path) -> None:
    """Remove temporary files of saves that were interrupted (their process is gone, or is this one)."""
    for name in os.listdir(directory):
        match = _TEMP.fullmatch(name)
        if match is None or name in _in_flight or match[2] not in (None, _HOST):
            continue  # not a leftover, or another machine's: its processes are not seen from here
        pid = int(match[1])
        if pid == os.getpid() or not _alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(directory / name)


def _alive(pid: int) -> bool:
    if os.name != "posix":  # os.kill(pid, 0) would not just probe there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class DirectoryInUse(RuntimeError):
    """Another live process holds this checkpoint directory; the message names the directory and the process.

    Two runs writing checkpoints into one directory would abandon and prune
    each other's files, and ``latest`` could resume the other run's state.
    """


_held: dict[str, list[Any]] = {}  # real path -> [descriptor of its lock file, claims, owner or None]
_guard = threading.Lock()


def _forked() -> None:
    """In a forked child (a DataLoader worker, say): let go of the parent's locks.

    A child shares its parent's open lock files, and an ``flock`` lasts while
    any process holds one: children outliving a killed parent would keep its
    directory held, and a restart would be refused in the name of a dead
    process. Closing the child's copies leaves the parent's locks as they are.
    """
    for fd, *_ in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def claim(directory: Path) -> None:
    """Hold ``directory`` for this process, creating it if needed; each claim needs one ``release``.

    Raises:
        DirectoryInUse: another process holds ``directory``.
        NotADirectoryError: ``directory`` is an existing file.

    Examples:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> claim(d); claim(d); holds(d)
        True
        >>> release(d), release(d), holds(d)
        (True, True, False)
    """
    with contextlib.suppress(FileExistsError):
        directory.mkdir(parents=True, exist_ok=True)
    if not directory.is_dir():
        raise NotADirectoryError(
            f"{directory}: checkpoints go into a directory, and this is an existing file. "
            "Give the checkpoint hook a directory of its own."
        )
    _take(
        directory,
        directory / LOCK_NAME,
        "two runs checkpointing into one directory would abandon and prune each other's files. Wait "
        "for that run to end or stop it, or give this run a directory of its own.",
    )


def claim_file(path: Path, owner: object = None) -> None:
    """Hold the file ``path`` (a log) for this process, as ``claim`` holds a directory; ``release`` it.

    The lock lives beside it (``.<name>.lock``): the file itself is replaced
    when a resumed run cuts it back, and a lock on it would go with it. With
    an ``owner`` (a ``log`` hook's writers), the file is that owner's alone
    while held: another owner in this process is refused too, so two ``log``
    hooks, of one run or of two runs in one process, never share a file.

    Raises:
        DirectoryInUse: another process, or another owner in this one, holds ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _take(
        path,
        path.parent / f".{path.name}.lock",
        "two runs writing one log would cut back and interleave each other's lines. Wait for that "
        "run to end or stop it, or give this run a log of its own.",
        owner,
    )


def _take(target: Path, lock: Path, why: str, owner: object = None) -> None:
    key = os.path.realpath(target)
    with _guard:
        if key in _held:
            entry = _held[key]
            if owner is not None and entry[2] is not None and entry[2] is not owner:
                raise DirectoryInUse(
                    f"{target} is written by another log hook of this process: two log hooks on one "
                    "file would write every line twice and cut back each other's lines on resume. "
                    "Give each log hook its own file, or put both writers' metrics in one log hook."
                )
            entry[1] += 1
            if entry[2] is None:
                entry[2] = owner
            return
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise DirectoryInUse(
                f"{target} is in use by another live run ({holder}, per {lock}): {why}"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        _held[key] = [fd, 1, owner]


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        return f"process {int(os.pread(fd, 32, 0))}"
    return "a process that has not written its PID yet"


def release(directory: Path, owner: object = None) -> bool:
    """Give back one claim on ``directory`` (or a file); the last one unlocks it.

    Returns whether a claim was given back: without one, or with ``owner``
    not the one holding it, nothing happens.
    """
    key = os.path.realpath(directory)
    with _guard:
        entry = _held.get(key)
        if entry is None or (owner is not None and entry[2] is not None and entry[2] is not owner):
            return False
        entry[1] -= 1
        if entry[1] == 0:
            del _held[key]
            os.close(entry[0])
        return True


def holds(directory: Path) -> bool:
    """Whether this process holds ``directory``."""
    return os.path.realpath(directory) in _held


@contextlib.contextmanager
def holding(directory: Path) -> Iterator[None]:
    """Hold ``directory`` for the duration of the block (see ``claim``)."""
    claim(directory)
    try:
        yield
    finally:
        release(directory)
