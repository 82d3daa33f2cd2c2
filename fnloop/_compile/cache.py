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
import platform
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fnloop._atomic import write_atomically
from fnloop._compile.identity import installed, local_files, settings
from fnloop._core.messages import got

__all__ = ["CompileCache", "default_cache", "graph_key", "start_key"]

_log = logging.getLogger(__name__)

ENV = "FNLOOP_CACHE_DIR"
"""The environment variable naming the cache's folder (``off``: no cache)."""

_FORMAT = b"fnloop-compiled-graph 1\n"
"""The first line of every cache file; a new format changes it, so old files are never read."""

_SUFFIX = ".graph"
_LOCK = ".lock"
_START = b"fnloop-start 1\n"
"""The first line of every start file (``start_key``): the graph a step's key found, without tracing."""
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
        return found if isinstance(found, dict) and isinstance(found.get("graph"), str) else None

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


# --------------------------------------------------------------------------- the key


def graph_key(graph: torch.fx.GraphModule, leaves: Sequence[torch.Tensor], options: Mapping[str, Any]) -> str:
    """A hash of everything that shapes what inductor builds from ``graph`` called on ``leaves``.

    Examples:
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> x = torch.ones(3)
        >>> g = make_fx(lambda t: [t * 2])(x)
        >>> h = make_fx(lambda t: [t * 3])(x)
        >>> graph_key(g, [x], {}) == graph_key(g, [x], {}), graph_key(g, [x], {}) == graph_key(h, [x], {})
        (True, False)
    """
    hasher = hashlib.sha256()

    def put(*parts: object) -> None:
        for part in parts:
            hasher.update(repr(part).encode())
            hasher.update(b"\x00")

    put(_FORMAT, torch.__version__, torch.version.git_version, torch.version.cuda, torch.version.hip)
    put(sys.version, platform.machine(), sys.platform)
    _put_graph(put, hasher, graph, "")
    storages: dict[tuple[str, int], int] = {}
    for index, leaf in enumerate(leaves):
        shares = _storage(leaf, storages, index)
        put(tuple(leaf.shape), leaf.stride(), leaf.storage_offset(), leaf.dtype, leaf.requires_grad, shares)
        put(*_device(leaf.device))
    # Inductor lowers some ops otherwise under torch's deterministic algorithms (an accumulating index_put).
    put(_inductor_config(options), torch.are_deterministic_algorithms_enabled())
    return hasher.hexdigest()


def start_key(
    identity: str,
    structure: str,
    leaves: Sequence[torch.Tensor],
    options: Mapping[str, Any],
    no_random: str | None,
) -> str:
    """A hash of everything a step's graph depends on, computed without tracing it (see ``identity.py``).

    ``identity``: the ``fingerprint`` of what the traced function reads
    (the model, the loss function, the optimizer, ...); ``structure``: the
    call's structure, as text; ``leaves``: the call's tensors, of which the
    signature counts, as in ``graph_key``; ``options``: inductor's settings
    as given; ``no_random``: the refusal a graph drawing from the generator
    meets. Beside them: the code (``installed``, ``local_files``), torch's
    settings, the machine and this file's format.
    """
    hasher = hashlib.sha256()

    def put(*parts: object) -> None:
        for part in parts:
            hasher.update(repr(part).encode())
            hasher.update(b"\x00")

    put(_START, identity, structure, no_random, installed(), local_files(), settings())
    put(platform.machine(), sys.platform)
    storages: dict[tuple[str, int], int] = {}
    for index, leaf in enumerate(leaves):
        shares = _storage(leaf, storages, index)
        put(tuple(leaf.shape), leaf.stride(), leaf.storage_offset(), leaf.dtype, leaf.requires_grad, shares)
        put(*_device(leaf.device))
    put(_inductor_config(options))
    return hasher.hexdigest()


def _put_graph(put: Any, hasher: Any, graph: torch.fx.GraphModule, prefix: str) -> None:
    put(prefix, graph.code)
    for node in graph.graph.nodes:
        if node.op != "get_attr":
            continue
        value = _attribute(graph, node.target)
        if isinstance(value, torch.fx.GraphModule):
            _put_graph(put, hasher, value, f"{prefix}{node.target}.")
        elif isinstance(value, torch.Tensor):
            put(node.target, tuple(value.shape), value.stride(), value.dtype, *_device(value.device))
            # The value itself: a closure's tensor is baked into the graph.
            hasher.update(
                value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            )
        else:
            put(node.target, *_opaque(value))


def _attribute(graph: torch.nn.Module, target: str) -> Any:
    value: Any = graph
    for name in target.split("."):
        value = getattr(value, name)
    return value


def _opaque(value: object) -> tuple[object, ...]:
    """What identifies an attribute that is neither a tensor nor a graph, without any per-process id."""
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    described: list[object] = [kind]
    for name in ("group_name", "group_desc"):
        with contextlib.suppress(Exception):
            described.append((name, getattr(value, name)))
    with contextlib.suppress(Exception):
        described.append(("size", value.size()))  # type: ignore[attr-defined]
    if isinstance(value, (int, float, str, bool, bytes, type(None))):
        described.append(value)
    return tuple(described)


def _storage(leaf: torch.Tensor, seen: dict[tuple[str, int], int], index: int) -> int:
    """The index of the first leaf sharing ``leaf``'s storage: aliasing shapes the graph, addresses must not."""
    try:
        pointer = leaf.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return index
    return seen.setdefault((str(leaf.device), pointer), index)


def _device(device: torch.device) -> tuple[object, ...]:
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return (device.type, torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))
    return (device.type,)


def _inductor_config(options: Mapping[str, Any]) -> str:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(dict(options)):
        settings = inductor_config.save_config_portable()
    return repr(
        (
            sorted(settings.items(), key=_first),
            sorted(functorch_config.save_config_portable().items(), key=_first),
        )
    )


def _first(item: tuple[str, Any]) -> str:
    return item[0]


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    """A context that does nothing (no cache, no probe memo)."""
    yield
