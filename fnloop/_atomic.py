"""Writing a file atomically: under a temporary name, flushed to disk, then renamed onto its path.

A crash at any moment leaves either the old file or the new one, never a mix.
A crash can leave the temporary file behind; ``remove_leftovers`` removes
those of processes that are gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path

__all__ = ["remove_leftovers", "write_atomically"]

_TEMP = re.compile(r"\..+\.(\d+)\.[0-9a-f]{8}\.tmp")
_in_flight: set[str] = set()  # temporary names this process is writing now


def write_atomically(path: Path, write: Callable[[int], None]) -> None:
    """Make ``path`` the file that ``write`` writes to the descriptor it is given, or leave it untouched.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     write_atomically(Path(d) / "f", lambda fd: os.write(fd, b"new"))
    ...     (Path(d) / "f").read_bytes(), os.listdir(d)
    (b'new', ['f'])

    Raises:
        OSError: the file cannot be written; an existing file at ``path`` is untouched.
    """
    temp_name = f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
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
        if match is None or name in _in_flight:
            continue
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
