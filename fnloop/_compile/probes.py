"""Remember inductor's CPU vector-instruction probes, so a warm process does not rerun them.

Before it loads or builds C++ for the CPU, inductor checks which vector
instruction sets (AVX2, AVX-512, their bf16/VNNI/AMX extensions) it may use:
it compiles a tiny library for each (kept in its cache) and then, in every new
process, starts a fresh Python interpreter to ``dlopen`` it. On this machine
those interpreters took 1.0-1.2 s of the 1.5 s a warm step spent loading its
graph, in every process.

The answer depends only on the probe library and on what runs it, so it is
kept in a small file beside fnloop's compile cache, keyed on the library's path
(inductor names it by the compiler's version, the instruction set's flags,
torch's version and the probe's code), its size and modification time, the
CPU's flags, torch's version and build, and the Python executable. Another
machine, compiler, torch or CPU finds no entry and probes as before. Probes run
while fnloop compiles or loads a graph only; inductor keeps each answer for the
rest of the process either way.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from fnloop._atomic import write_atomically
from fnloop._compile.patches import probe_load

__all__ = ["remembered_probes"]

_FILE = "cpu-probes.json"
_lock = threading.Lock()
"""Serializes this process's writes of the record (probes may run on inductor's threads)."""


@functools.cache
def _machine() -> str:
    """The CPU and the software around the probe, without anything per process."""
    flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    parts = (
        platform.machine(),
        platform.processor(),
        flags,
        torch.backends.cpu.get_cpu_capability(),
        torch.__version__,
        torch.version.git_version,
        sys.executable,
        os.environ.get("LD_LIBRARY_PATH", ""),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _entry(output_path: str) -> str | None:
    try:
        stat = os.stat(output_path)
    except OSError:
        return None
    return hashlib.sha256(
        repr((_machine(), output_path, stat.st_size, stat.st_mtime_ns)).encode()
    ).hexdigest()


def _read(path: Path) -> dict[str, bool]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, bool)}


def _write(path: Path, answers: dict[str, bool]) -> None:
    data = json.dumps(answers).encode()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda fd: os.write(fd, data))


@contextlib.contextmanager
def remembered_probes(directory: Path | None) -> Iterator[None]:
    """Inside, inductor's ``dlopen`` probes answer from ``directory``'s record when it has one.

    Args:
        directory: the folder of the record (fnloop's compile cache); ``None``
            leaves inductor alone.

    Examples:
        >>> with remembered_probes(None):
        ...     pass
    """
    if directory is None:
        yield
        return
    record = directory / _FILE

    def answer(original: Callable[[Any, str], bool], isa: Any, output_path: str) -> bool:
        key = _entry(output_path)
        if key is None:
            return original(isa, output_path)
        known = _read(record).get(key)
        if known is not None:
            return known
        found = original(isa, output_path)
        with _lock:
            answers = _read(record)
            answers[key] = found
            _write(record, answers)
        return found

    with probe_load(answer):
        yield
