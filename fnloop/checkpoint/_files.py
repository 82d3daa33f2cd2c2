"""Checkpoint files: save, load and find them, moving the bytes and checking the checksum.

The file's header is ``fnloop.checkpoint._safetensors``, the skeleton
``fnloop.checkpoint._codec``, the state's policy ``fnloop.checkpoint._state_codec``
and the atomic write ``fnloop._atomic``.
"""

from __future__ import annotations

import errno
import os
import re
import warnings
from pathlib import Path
from typing import Any

from fnloop._core.messages import a_path, got
from fnloop._core.state import TrainState
from fnloop.checkpoint._codec import (
    CheckpointError,
    DamagedCheckpoint,
)
from fnloop.checkpoint._reading import _check, _opened, _streamed, read
from fnloop.checkpoint._safetensors import (
    read_header,
)
from fnloop.checkpoint._sharded import Index, index_of, load_sharded, reshard, save_sharded
from fnloop.checkpoint._split import load_split, save_joined
from fnloop.checkpoint._state_codec import encode_state, fill_state
from fnloop.checkpoint._writing import write_file

__all__ = ["CheckpointWarning", "checkpoints", "latest", "load", "path_for", "read_raw", "save"]

StrPath = str | os.PathLike[str]

_NAME = re.compile(r"ckpt-(\d{8,})\.safetensors")


class CheckpointWarning(UserWarning):
    """``latest`` skipped a damaged checkpoint file; the message names it and says why."""


def checked_path(value: object, name: str, where: str, *, written: bool = False) -> StrPath:
    """``value``, refused unless it is a non-empty str or ``os.PathLike`` of one.

    ``None`` or ``""`` would read the current directory, or nothing, without
    a word. A NUL byte in a path to read is left to the file system calls,
    which say so as a ``CheckpointError``; in a path to write (``written``)
    it is refused here.
    """
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str):
        raise TypeError(f"{where}: '{name}' must be a str or os.PathLike ({got(value)}).")
    if not path:
        raise ValueError(
            f"{where}: '{name}' is empty; give the path of the run's checkpoint "
            f"{'directory' if name == 'directory' else 'file'}, for example 'runs/a/ckpt'."
        )
    if written:
        a_path(path, name, where)
    return value  # type: ignore[return-value]


def path_for(directory: StrPath, iteration: int) -> Path:
    """The file a checkpoint of ``iteration`` has in ``directory``: ``ckpt-{iteration:08d}.safetensors``.

    Raises:
        ValueError: ``iteration`` is not a non-negative int.

    Examples:
        >>> path_for("run/ckpt", 12).name
        'ckpt-00000012.safetensors'
    """
    checked_path(directory, "directory", "path_for()")
    if type(iteration) is not int or iteration < 0:
        raise ValueError(f"'iteration' must be a non-negative int (got {iteration!r}).")
    return Path(directory) / f"ckpt-{iteration:08d}.safetensors"


def checkpoints(directory: StrPath) -> list[Path]:
    """The checkpoint files in ``directory`` (named as ``path_for`` names them), newest first.

    Temporary files of saves in progress (or interrupted) are not listed.
    A missing directory has none.

    Examples:
        >>> checkpoints("no/such/directory")
        []
    """
    checked_path(directory, "directory", "checkpoints()")
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except ValueError as exc:  # a NUL byte
        raise CheckpointError(f"{directory!r:.200}: not a usable directory name ({exc})") from None
    except OSError as exc:
        what = "a loop of symbolic links" if exc.errno == errno.ELOOP else f"not a readable directory ({exc})"
        raise CheckpointError(
            f"{os.fspath(directory)!r:.200} is {what}; checkpoints are read from a directory: give the "
            "path of one (a link to a directory is fine)."
        ) from None
    found = [(int(m[1]), name) for name in names if (m := _NAME.fullmatch(name))]
    return [Path(directory) / name for _, name in sorted(found, reverse=True)]


def save(state: TrainState, path: StrPath) -> Path:
    """Write ``state`` to ``path`` atomically, creating the directory if needed.

    The file is written under a temporary name in the same directory, flushed
    to disk, and renamed onto ``path``: a crash at any moment leaves either
    the old file or the new one, never a mix. Leftovers of interrupted saves
    in that directory are removed. Tensors are saved from CPU memory; a tensor
    reached twice is stored once.

    A sharded state is saved as one part per rank (``fnloop.checkpoint._sharded``);
    a tensor-parallel one (``state.tensor``) as the whole state, written by rank 0
    from every rank's slices (``fnloop.checkpoint._split``): both are collectives,
    called by every rank.

    Args:
        state: the state to save; it must have no pending ``effects``.
        path: the file to write (usually ``path_for(directory, state.iteration)``).

    Returns:
        ``path``, as a ``pathlib.Path``.

    Raises:
        TypeError: ``state`` is not a TrainState, or holds something a
            checkpoint cannot hold (a function, an arbitrary object); the
            message names its path.
        ValueError: ``state`` has pending effects.
        OSError: the file cannot be written; an existing file at ``path`` is untouched.

    Examples:
        >>> import tempfile, torch
        >>> state = TrainState(max_iter=10, params={"w": torch.ones(2)})
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = save(state, path_for(d, state.iteration))
        ...     load(path, like=state).params
        {'w': tensor([1., 1.])}
    """
    if type(state) is not TrainState:
        raise TypeError(f"save() expected a fnloop.TrainState, got {state!r:.80} (a {type(state).__name__}).")
    checked_path(path, "path", "save()", written=True)
    if state.effects:
        labels = [e.label or repr(e.perform) for e in state.effects]
        raise ValueError(
            f"cannot save a state with {len(state.effects)} pending effect(s) {labels}: effects carry "
            "code, which a checkpoint does not hold. Save from an effect (the fold performs effects on "
            "the state with its effects cleared), or drop them: attrs.evolve(state, effects=())."
        )
    if state.tensor is not None:  # a collective: rank 0 writes the whole state, one tensor at a time
        return save_joined(state, Path(path), write_file)
    if state.shards is not None:
        return save_sharded(state, Path(path), write_file)
    skeleton, tensors = encode_state(state)
    write_file(Path(path), skeleton, tensors)
    return Path(path)


def load(path: StrPath, *, like: TrainState) -> TrainState:
    """The state saved in ``path``, checked against and built like the template ``like``.

    Strict for the record's fields: a missing, unexpected or mismatched entry
    (kind, dtype, shape, record fields, dict keys, tuple length) is an error
    naming the file and the entry's path. Records are rebuilt with the
    template's classes, tensors placed on the template tensor's device.
    ``metrics`` come from the file as saved. Hook states are lenient, as the
    seed trainer is: one the template knows (``like.hooks[name]``) is checked
    against it; one it does not know becomes an ``fnloop.Unclaimed`` that the
    run's hook of that name claims (or the fold drops, with a warning); a hook
    of the template with no saved state keeps its template value.

    Args:
        path: a file written by ``save``.
        like: a state built by the same code as the saved one (its values are not used).

    Returns:
        The saved state.

    Raises:
        DamagedCheckpoint: the file is missing, unreadable, truncated, corrupted
            (checksum) or not an fnloop checkpoint.
        CheckpointMismatch: the file is intact but does not fit ``like``.
        CheckpointError: the file was written in another format version. All
            three are ``CheckpointError``s and name the file.

    Examples:
        >>> import tempfile
        >>> state = TrainState(max_iter=10, iteration=4, hooks={"steps": 4})
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = save(state, path_for(d, 4))
        ...     loaded = load(path, like=TrainState(max_iter=10))
        >>> loaded.iteration, loaded.hooks["steps"].claim(0)
        (4, 4)
    """
    if type(like) is not TrainState:
        raise TypeError(
            f"load() expected like= a fnloop.TrainState, got {like!r:.80} (a {type(like).__name__})."
        )
    checked_path(path, "path", "load()")
    index = _index(path)
    if like.tensor is not None:  # this rank's slices (or their chunks) of the whole state saved
        return load_split(Path(path), like, lambda at, whole: _loaded(at, whole, index))
    return _loaded(Path(path), like, index)


def _loaded(path: Path, like: TrainState, index: Index | None) -> TrainState:
    """The checkpoint ``path`` as ``like`` lays it out: this rank's part, resharded, or whole."""
    if index is not None or like.shards is not None:
        return load_sharded(path, like, index)
    _, raw = read(path, like)
    return fill_state(raw, like, f"{path}: state")


def _index(path: StrPath) -> Index | None:
    """The index of the sharded checkpoint ``path`` (its header alone is read), or ``None``."""
    with _opened(path) as file:
        metadata, start, entries = read_header(file, str(path))
        try:
            return index_of(metadata, str(path))
        except DamagedCheckpoint:  # a malformed index: said as a checksum mismatch if the bytes changed
            _check(_streamed(file, start, entries, str(path)), metadata, entries, str(path))
            raise


def latest(directory: StrPath, *, like: TrainState) -> TrainState | None:
    """The newest checkpoint in ``directory`` that loads, skipping damaged files; ``None`` if none.

    A damaged file (truncated, corrupted, unreadable) is skipped with a
    ``CheckpointWarning`` naming it and why. A file that is intact but does
    not fit ``like``, or is of another format version, raises: resuming from
    an older checkpoint, or from scratch, would hide that the code changed.

    To continue a run, ``resume(directory, like=template)`` does this and
    checks the run's settings against the template.

    Raises:
        CheckpointMismatch: the newest intact checkpoint does not fit ``like``.
        CheckpointError: the newest intact checkpoint is of another format version.

    Examples:
        >>> latest("no/such/directory", like=TrainState(max_iter=1)) is None
        True
    """
    if type(like) is not TrainState:
        raise TypeError(f"latest() expected like= a fnloop.TrainState, got {like!r:.80}.")
    checked_path(directory, "directory", "latest()")
    from fnloop.distributed import world_size

    if world_size() == 1:
        return _newest(directory, like)[1]
    return _agreed(directory, like)


def _agreed(directory: StrPath, like: TrainState) -> TrainState | None:
    """``latest`` on several ranks: the newest checkpoint every rank loads, each checking what it reads.

    Rank 0 lists the candidates (a save may be in flight, so the ranks'
    listings could differ). For each, newest first, every rank loads it,
    checking the bytes it reads (its own part of a sharded checkpoint, or
    every part when it reshards), and the ranks compare their verdicts: a
    checkpoint any rank finds damaged is skipped for the one before, on every
    rank, with the warning a single process gives. An error that is no damage
    (a mismatch with the template, a file rank 0 lists that another rank
    cannot see) is raised on every rank.
    """
    from fnloop.distributed import broadcast_object, gather_object, rank

    candidates = broadcast_object([os.fspath(p) for p in checkpoints(directory)] if rank() == 0 else None)
    for path in candidates:
        state: TrainState | None = None
        try:
            if not os.path.lexists(path):
                raise CheckpointError(
                    f"{path}: rank 0 lists this checkpoint, but rank {rank()} finds no such file; every "
                    "rank reads the checkpoints rank 0 lists, so a run on several machines needs its "
                    "checkpoint directory on a filesystem they share, at the same path."
                )
            state = _checked(Path(path), like)
            verdict: tuple[str, str] = ("ok", "")
        except DamagedCheckpoint as exc:
            verdict = ("damaged", str(exc))
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
            verdict, error = ("error", f"{type(exc).__name__}: {exc}"), exc
        verdicts = gather_object(verdict)
        failed = [(r, text) for r, (kind, text) in enumerate(verdicts) if kind == "error"]
        if failed:
            if verdict[0] == "error":
                raise error
            r, text = failed[0]
            raise CheckpointError(f"{path}: rank {r} could not load it ({text})")
        damage = [(r, text) for r, (kind, text) in enumerate(verdicts) if kind == "damaged"]
        if not damage:
            return state
        said = "; ".join(f"rank {r}: {text}" for r, text in damage)
        warnings.warn(f"skipping a damaged checkpoint: {said}", CheckpointWarning, stacklevel=3)
    return None


def _newest(directory: StrPath, like: TrainState) -> tuple[Path | None, TrainState | None]:
    """The newest checkpoint of ``directory`` that loads, and its path; damaged ones skipped.

    A file is this run's only if it is a file of the directory itself (not a
    symbolic link, which may point into another run) and holds the iteration
    its name says; others are skipped as damage, with a warning.
    """
    for path in checkpoints(directory):
        try:
            return path, _checked(path, like)
        except DamagedCheckpoint as exc:
            warnings.warn(f"skipping a damaged checkpoint: {exc}", CheckpointWarning, stacklevel=3)
    return None, None


def _checked(path: Path, like: TrainState) -> TrainState:
    """The checkpoint ``path`` loaded, if it is this run's: a file of the directory holding the iteration it names."""
    if path.is_symlink():
        raise DamagedCheckpoint(
            f"{path}: a symbolic link (to {os.readlink(path)}), not a checkpoint this run wrote; "
            "copy the file in to resume from it"
        )
    state = load(path, like=like)
    named = int(_NAME.fullmatch(path.name)[1])  # type: ignore[index]
    if state.iteration != named:
        raise DamagedCheckpoint(
            f"{path}: its name says iteration {named}, it holds {state.iteration}; a file renamed "
            "by hand or copied from another run"
        )
    return state


def read_raw(path: StrPath) -> tuple[dict[str, str], Any]:
    """A checkpoint's metadata and its state as plain data, without a template.

    For tools that inspect checkpoints without the training code (``fnloop
    inspect`` / ``diff``). The tree is made of dicts, lists, tuples, numbers,
    strings and CPU tensors; records come back as dicts of their fields
    (``Record``, with ``.type`` the saved class's name).

    Returns:
        ``(metadata, tree)``: the file's ``fnloop.*`` metadata other than the
        skeleton (format, version, checksum), and the state's fields.

    Raises:
        CheckpointError: as ``load``, for everything but the template.

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     meta, tree = read_raw(save(TrainState(max_iter=3, extra=(1, 2.5)), path_for(d, 0)))
        >>> meta["fnloop.format"], tree["max_iter"], tree["extra"]
        ('2', 3, (1, 2.5))
    """
    checked_path(path, "path", "read_raw()")
    index = _index(path)
    metadata, raw = read(path) if index is None else reshard(Path(path), index, None)
    return {k: v for k, v in metadata.items() if k != "fnloop.skeleton"}, raw
