"""fnloop's compile cache: one file per compiled graph, keyed on the traced graph itself.

A compiled step costs 5-20 s to build. inductor keeps its own caches, but even
with them warm a new process spent about 1.5 s more than needed before its
first step: mostly in inductor checking, in fresh Python subprocesses, that the
CPU's vector instructions can be loaded (``probes``), and in working out its
own cache keys. This cache keeps what ``torch._inductor.standalone_compile``
built as one file per graph, named by a hash of everything that shapes the
graph:

- the traced graph's code (every op, its arguments and the scalars baked in),
  and that of any nested graph;
- the value, dtype, shape and strides of every tensor constant in it (a tensor
  a closure captured, say), and the type and group of any other attribute (a
  process group of a collective);
- each input's shape, strides, storage offset, dtype and device, and which
  inputs share storage;
- the torch version and build, Python's version, the machine, the device
  (a GPU's name and compute capability), inductor's whole configuration with
  fnloop's options applied, and this file's format version.

Nothing in it is per process (no ids, addresses or temporary names), so every
process, and every rank of a distributed run, finds the same file. Since the
key is the traced graph, a change to the loss function that changes the graph
misses, and one that does not (a comment, a renamed variable) hits, rightly.

Each file carries a checksum of its contents: a damaged or truncated file is
ignored and rebuilt, never loaded. Files are written to a temporary name, then
renamed, so a reader never sees half of one.

One compile per machine: the processes that need one graph at once (the ranks
of a job, a test suite's workers) take turns at the graph's lock file
(``<key>.lock``, an ``flock``). The first compiles and saves; the others wait,
then load what it saved. The kernel releases the lock when its holder dies,
however it dies, so a rank killed while compiling never blocks the next run.

Where it lives: ``$FNLOOP_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/fnloop``
(``~/.cache/fnloop``), in a ``compile`` folder. ``FNLOOP_CACHE_DIR=off`` turns
it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fnloop._atomic import write_atomically
from fnloop._compile.keys import GRAPH_FORMAT as _FORMAT
from fnloop._compile.keys import START_FORMAT as _START
from fnloop._compile.keys import graph_key, start_key
from fnloop._core.messages import got

__all__ = ["CompileCache", "default_cache", "graph_key", "start_key"]  # the keys: keys.py

_log = logging.getLogger(__name__)

ENV = "FNLOOP_CACHE_DIR"
"""The environment variable naming the cache's folder (``off``: no cache)."""


_SUFFIX = ".graph"
_LOCK = ".lock"
_START_SUFFIX = ".start"


def default_directory() -> Path | None:
    """Where the cache lives by default: ``$FNLOOP_CACHE_DIR``, else the user's cache folder; ``None`` if off."""
    configured = os.environ.get(ENV)
    if configured is not None:
        if configured.strip().lower() in ("", "0", "off", "false", "no", "none"):
            return None
        return Path(configured).expanduser() / "compile"
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(home) / "fnloop" / "compile"


def default_cache() -> CompileCache | None:
    """A cache in ``default_directory()``, or ``None`` when the cache is turned off."""
    directory = default_directory()
    return None if directory is None else CompileCache(directory)


class CompileCache:
    """A folder of compiled graphs, one file per key; counts its hits, misses and rejected files.

    Args:
        directory: the folder; created at the first write.

    Examples:
        >>> import tempfile
        >>> cache = CompileCache(tempfile.mkdtemp())
        >>> cache.load("0" * 64) is None, cache.misses
        (True, 1)
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(
                f"'directory' must be a str or a path ({got(directory)}); pass the folder the "
                f"compiled graphs go to, or set ${ENV}."
            )
        self.directory = Path(directory)
        self.hits = 0
        self.misses = 0
        self.rejected = 0
        """Files found but not used: damaged, truncated, or refused by torch when loaded."""

    def path(self, key: str) -> Path:
        """The file of ``key``."""
        return self.directory / f"{key}{_SUFFIX}"

    @contextlib.contextmanager
    def claimed(self, key: str) -> Iterator[None]:
        """Hold the machine's lock of ``key`` for the block: one process at a time builds that graph.

        A process that finds the lock taken waits for it; by then the graph is
        usually saved, and it loads it. The lock is an ``flock`` on
        ``<key>.lock``, which the kernel releases when its holder exits or is
        killed. Where there is no ``fcntl`` (Windows) or the folder cannot be
        written, the block runs without one.
        """
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not on POSIX
            yield
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory / f"{key}{_LOCK}", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def load(self, key: str) -> Any:
        """The compiled graph saved under ``key``, or ``None`` (missing, damaged, or not loadable)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self.misses += 1
            return None
        payload = _checked(data)
        compiled = None if payload is None else _deserialize(payload)
        if compiled is None:
            _log.warning("fnloop: ignoring the damaged compile cache file %s; compiling again", path)
            self.rejected += 1
            self.misses += 1
            return None
        self.hits += 1
        return compiled

    def save(self, key: str, compiled: Any) -> bool:
        """Keep ``compiled`` (what ``standalone_compile`` returned) under ``key``; whether it was written."""
        saveable = getattr(compiled, "is_saveable", None)
        if saveable is None or not saveable():
            return False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=self.directory) as scratch:
                raw = os.path.join(scratch, "artifact")
                compiled.save(path=raw, format="binary")
                payload = Path(raw).read_bytes()
            digest = hashlib.sha256(payload).hexdigest().encode()
            _write_atomic(self.path(key), _FORMAT + digest + b"\n" + payload)
        except (OSError, RuntimeError, AssertionError) as exc:
            # A read-only or full disk costs the next process a compile, never this run.
            _log.warning("fnloop: could not write the compile cache file for %s: %s", key, exc)
            return False
        return True

    def forget(self, key: str) -> None:
        """Remove the graph of ``key``, if it is there (a file that would not load)."""
        with contextlib.suppress(OSError):
            self.path(key).unlink()

    def start(self, key: str) -> dict[str, Any] | None:
        """What the start file of ``key`` (``start_key``) holds: the graph's key and what its trace learned; ``None`` if missing or damaged."""
        try:
            data = (self.directory / f"{key}{_START_SUFFIX}").read_bytes()
        except OSError:
            return None
        payload = _checked(data, _START)
        if payload is None:
            return None
        try:
            found = json.loads(payload)
        except ValueError:
            return None
        fields = {"graph": str, "draws": bool, "context": object, "accumulates": list, "random": bool}
        whole = isinstance(found, dict) and all(isinstance(found.get(k), t) for k, t in fields.items())
        return found if whole else None  # a file of another fnloop: trace instead

    def keep_start(self, key: str, record: dict[str, Any]) -> bool:
        """Write the start file of ``key``: ``record`` names the graph (``graph``: its key here) and what its trace learned."""
        try:
            payload = json.dumps(record, sort_keys=True).encode()
        except (TypeError, ValueError):  # a context that is not JSON's: later starts trace
            return False
        if json.loads(payload) != record:  # a tuple or a key that would not come back as it was
            return False
        digest = hashlib.sha256(payload).hexdigest().encode()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _write_atomic(self.directory / f"{key}{_START_SUFFIX}", _START + digest + b"\n" + payload)
        except OSError as exc:
            _log.warning("fnloop: could not write the compile cache's start file %s: %s", key, exc)
            return False
        return True

    def __repr__(self) -> str:
        return f"CompileCache({str(self.directory)!r})"


def _checked(data: bytes, header: bytes = _FORMAT) -> bytes | None:
    """The payload of a cache file, or ``None`` if its header or checksum is wrong."""
    if not data.startswith(header):
        return None
    rest = data[len(header) :]
    digest, newline, payload = rest.partition(b"\n")
    if not newline or hashlib.sha256(payload).hexdigest().encode() != digest:
        return None
    return payload


def _deserialize(payload: bytes) -> Any:
    from torch._inductor import CompiledArtifact

    with tempfile.TemporaryDirectory() as scratch:
        raw = os.path.join(scratch, "artifact")
        Path(raw).write_bytes(payload)
        try:
            return CompiledArtifact.load(path=raw, format="binary")
        except Exception as exc:  # noqa: BLE001 -- another torch's file, or one its checks refuse: compile instead
            _log.warning("fnloop: torch could not load a compile cache file: %s", exc)
            return None


def _write_atomic(path: Path, data: bytes) -> None:
    def write(fd: int) -> None:
        with os.fdopen(fd, "wb", closefd=False) as file:
            file.write(data)

    # As a checkpoint is written: a crash leaves the old file or none, never half of one.
    write_atomically(path, write)


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    """A context that does nothing (no cache, no probe memo)."""
    yield
