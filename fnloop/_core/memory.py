"""Memory the C allocator keeps after a run's first step: handed back to the system once per run.

A run's first step cannot write into the state it is given (its caller may
still hold it), so it makes the next state beside it; once the fold has
dropped the given one (``fold.py``), its tensors are freed. glibc's malloc
keeps freed heap pages mapped: after a ResNet-18's first step, about 120 MB
that no tensor holds stayed in the process for the rest of the run, and
peak RSS stood at 1.2x the eager loop's (``benchmarks/bench_models.py``).
``malloc_trim(0)`` hands them back (1.08x). It runs once per run, after the
first step; the steady steps are not trimmed, but in two of four fresh
processes they then faulted 48 and 1,543 pages a step where they had
faulted about 1, the heap they grow into being smaller. Elsewhere than
glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable

__all__ = ["hand_back_freed"]


@functools.cache
def _trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim  # glibc's alone (musl has none)
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def hand_back_freed() -> None:
    """Return the heap pages glibc's malloc keeps after frees to the system (``malloc_trim(0)``)."""
    trim = _trim()
    if trim is not None:
        trim(0)
