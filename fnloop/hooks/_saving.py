"""The checkpoint hook: the state saved into a directory after a step and when the run ends, in the training thread or off it."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from fnloop._atomic import DirectoryInUse, claim, holding, holds, release
from fnloop._core.background import BackgroundFailed, Job
from fnloop._core.messages import a_path, got, unwritable
from fnloop._core.phase import Phase
from fnloop._core.state import TrainState, request
from fnloop._export import unshard
from fnloop.checkpoint import CheckpointWarning, checkpoints, path_for, save
from fnloop.checkpoint._sharded import orphans, parts_of

if TYPE_CHECKING:
    from fnloop.hooks._checkpoint import _BestUpdate

__all__ = ["BackgroundFailed", "Checkpoint", "DirectoryInUse", "checkpoint"]

_ABANDONED = re.compile(r"ckpt-(\d{8,})\.safetensors\.abandoned")

_BACKGROUND_FIX = (
    "The checkpoints written before it are untouched (a save replaces no file until the new one is "
    "whole), and AFTER_TRAIN then saves the run's last consistent state. Fix the cause (free space, "
    "permissions, the mount) and resume with fnloop.checkpoint.resume(directory, like=...); with "
    "checkpoint(..., background=False) such an error is raised in the phase that saves."
)


def _a_directory(value: object) -> str:
    return a_path(value, "directory")


def _keep(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(
            f"'{attribute.name}' must be a positive int or None to keep every checkpoint ({got(value)})."
        )


def _a_bool(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if type(value) is not bool:
        raise TypeError(f"'{attribute.name}' must be a bool ({got(value)}).")


def _directory(caller: str, directory: str | os.PathLike[str]) -> Path:
    """``directory`` as a Path, refused at once if the first save could not write there (an existing file)."""
    path = Path(a_path(directory, "directory", caller))
    try:
        path.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(
                f"{caller} directory {os.fspath(directory)!r} is a loop of symbolic links; checkpoints "
                "go into a directory. Give a directory path (a link to a directory is fine)."
            ) from None
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"{caller} directory {os.fspath(directory)!r} is an existing file; checkpoints go into a "
            "directory. Give a directory path (it is created if missing)."
        )
    why = unwritable(path, directory=True)
    if why is not None:
        raise ValueError(
            f"{caller} cannot write into the directory {os.fspath(directory)!r}: {why}. Give a directory "
            "the run may create or write to."
        )
    return path


@attrs.frozen(repr=False)
class Checkpoint:
    """Save the state into ``directory``; build it with ``checkpoint``."""

    acts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.BEFORE_TRAIN, Phase.AFTER_STEP, Phase.AFTER_TRAIN})
    """The phases it may change the state in; the fold does not call it in the others."""

    directory: str = attrs.field(converter=_a_directory)
    keep: int | None = attrs.field(validator=_keep)
    background: bool = attrs.field(default=False, validator=_a_bool)

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase is Phase.BEFORE_TRAIN:
            # Before the first step: a second run on this directory is refused at once.
            return request(state, _Do(self, Checkpoint.claim), f"hold {self.directory}", claim=True)
        if phase is Phase.AFTER_STEP:
            # Performed once every hook of the phase has run, on the state the
            # next iteration starts from (iteration == i + 1).
            if self.background:
                return request(
                    state,
                    _Do(self, Checkpoint.hand_over),
                    f"checkpoint into {self.directory}, in the background",
                    everywhere=_sharded(state),
                )
            return request(
                state,
                _Do(self, Checkpoint.save),
                f"checkpoint into {self.directory}",
                everywhere=_sharded(state),
            )
        if phase is Phase.AFTER_TRAIN:
            # The run ended, by success, failure or signal: save the state it
            # ended with, as the fold entered AFTER_TRAIN (before any hook's
            # end-of-run changes), unless that iteration is saved already.
            return request(
                state,
                _Do(self, Checkpoint.finish),
                f"final checkpoint into {self.directory}",
                start=True,
                everywhere=_sharded(state),
            )
        return state

    def claim(self, state: TrainState) -> None:
        """Hold the directory until ``finish``; refused if another process holds it."""
        claim(Path(self.directory))

    def finish(self, state: TrainState) -> None:
        """Save ``state`` unless saved already, then give the directory back.

        A run that does not hold the directory (another process held it at
        ``BEFORE_TRAIN``) writes nothing into it.
        """
        directory = Path(self.directory)
        try:
            if holds(directory) or _a_part(state):
                self.save_once(state)
        finally:
            release(directory)

    def save(self, state: TrainState) -> Path:
        """Write ``state`` as ``ckpt-{iteration}``; keep the newest ``keep`` up to it.

        Checkpoints of later iterations belong to a run this one replaces (it
        was restarted from an older state): they are renamed ``*.abandoned``,
        with a warning, so that ``latest`` resumes this run; the newest
        ``keep`` of those stay too. Files that vanish meanwhile (removed by
        hand) are passed over.

        Raises:
            DirectoryInUse: another process holds the directory.
        """
        path, said = self._write(state)
        for warning in said:
            warnings.warn(warning, stacklevel=2)
        return path

    def hand_over(self, state: TrainState) -> Job:
        """``save`` as a job for the run's writer thread, which the fold gives it.

        No copy is made: the state is a value, and while the save reads it the
        fold lets no donating step write into its tensors. One save is in
        flight at a time: the writer waits for the one before to finish. Its
        warnings, and its failure as a ``BackgroundFailed``, reach the
        training thread at the next phase boundary. A tensor-parallel state's
        slices are sent to rank 0 here, on the training thread; rank 0's
        writer writes the whole state.
        """
        path = path_for(self.directory, state.iteration)
        if state.tensor is not None:  # the slices gathered here (collectives stay on this thread)
            whole = unshard(state, rank0_only=True)
            if whole is None:  # another rank's: its slices are sent, rank 0 writes
                return Job(list, reads=state, what=f"the checkpoint into {path}", fix=_BACKGROUND_FIX)
            state = whole
        return Job(
            functools.partial(self._saved, state),
            reads=state,
            what=f"the checkpoint of iteration {state.iteration} into {path}",
            fix=_BACKGROUND_FIX,
        )

    def _saved(self, state: TrainState) -> list[Warning]:
        return self._write(state)[1]

    def _write(self, state: TrainState) -> tuple[Path, list[Warning]]:
        if _a_part(state):  # another rank's part of a sharded checkpoint: rank 0 holds and prunes
            return save(state, path_for(self.directory, state.iteration)), []
        with holding(Path(self.directory)):
            return self._save(state)

    def _save(self, state: TrainState) -> tuple[Path, list[Warning]]:
        """``state`` written, the files it replaces set aside, the oldest pruned; and the warnings to give."""
        iteration = state.iteration
        path = save(state, path_for(self.directory, iteration))
        said: list[Warning] = []
        older = []
        for other in checkpoints(self.directory):
            number = _iteration_of(other)
            if number > iteration:
                aside = other.with_name(other.name + ".abandoned")
                try:
                    other.replace(aside)
                    for part in parts_of(other):
                        part.replace(part.with_name(part.name + ".abandoned"))
                except FileNotFoundError:
                    continue
                said.append(
                    CheckpointWarning(
                        f"{other} is newer than the state just saved (iteration {iteration}): it belongs "
                        f"to a run this one replaces, and is renamed {aside.name} so that latest() "
                        "resumes this run. Save forks into a directory of their own."
                    )
                )
            elif number < iteration:
                older.append(other)
        if self.keep is not None:
            for old in older[self.keep - 1 :] + _abandoned(self.directory)[self.keep :]:
                with contextlib.suppress(FileNotFoundError):
                    old.unlink()
                for part in parts_of(old):
                    with contextlib.suppress(FileNotFoundError):
                        part.unlink()
        if state.shards is not None:
            for part in orphans(Path(self.directory), iteration):
                with contextlib.suppress(FileNotFoundError):
                    part.unlink()
        return path, said

    def save_once(self, state: TrainState) -> Path:
        """``save``, unless the iteration of ``state`` is saved already."""
        path = path_for(self.directory, state.iteration)
        exists = path.exists()
        if state.tensor is not None:  # rank 0's file: every rank joins its save, or none does
            from fnloop.distributed import broadcast_object

            exists = broadcast_object(exists)
        return path if exists else self.save(state)

    def __repr__(self) -> str:
        more = ", background=True" if self.background else ""
        return f"checkpoint({self.directory!r}, keep={self.keep!r}{more})"


def _sharded(state: TrainState) -> bool:
    """Whether every rank saves ``state``: it is sharded, and each rank writes its part; or split
    (tensor parallel), and each rank sends rank 0 its slices."""
    return state.shards is not None or state.tensor is not None


def _a_part(state: TrainState) -> bool:
    """Whether this process saves another rank's part than rank 0's (which is the index, or the
    whole file of a tensor-parallel state), or waits for it."""
    if state.tensor is not None:
        from fnloop.distributed import rank

        return rank() != 0
    return state.shards is not None and state.shards.global_rank != 0


def _iteration_of(path: Path) -> int:
    return int(path.name.removeprefix("ckpt-").split(".")[0])


def _abandoned(directory: str) -> list[Path]:
    """The ``*.abandoned`` checkpoints in ``directory``, newest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m[1]), name) for name in names if (m := _ABANDONED.fullmatch(name))]
    return [Path(directory) / name for _, name in sorted(found, reverse=True)]


def checkpoint(
    directory: str | os.PathLike[str], keep: int | None = 5, background: bool = False
) -> Checkpoint:
    """A hook saving the state into ``directory`` after a step and when the run ends.

    Wrap it to choose the period: ``every(1000, checkpoint("run/ckpt"))``. It
    acts in two phases:

    * ``AFTER_STEP`` of step ``i``: it requests a save of the state the fold
      has once every hook of the phase has run, which holds ``iteration ==
      i + 1``. So the checkpoint is the state a resumed run starts from,
      wherever the hook sits in the list.
    * ``AFTER_TRAIN`` (which ``every`` always lets through): it saves the state
      the run ended with, unless that iteration is saved already. After a
      failure or a SIGTERM that is the last consistent state, so nothing done
      since the last period is lost.

    Files are ``ckpt-{iteration:08d}.safetensors``, written atomically; the
    newest ``keep`` stay (``None`` keeps all). A sharded state
    (``fnloop.init(..., shard=...)``) is saved by every rank, each its part
    beside that file, which rank 0 writes last as the index (see
    ``docs/distributed.md#sharded-checkpoints``). Resume with
    ``fnloop.checkpoint.latest(directory, like=state)``.

    The run holds the directory from ``BEFORE_TRAIN`` to the end of
    ``AFTER_TRAIN`` (an OS-level lock on ``.fnloop.lock`` in it, which the
    kernel drops if the process dies): a second process checkpointing into
    it is refused before its first step, and writes nothing there.

    With ``background=True`` the ``AFTER_STEP`` save runs in a writer thread
    and the run goes on (see "Saves off the training path" in the docs):

    * the state is handed over as it is, with no copy; while the save reads
      it, the fold lets no donating step write into its tensors (the step
      copies instead: one extra state of memory at most);
    * one save is in flight at a time: the next one waits for it;
    * a failure of the save is raised in the training thread at the next
      phase boundary, as a ``BackgroundFailed`` naming the iteration and the
      file, chained to the error; the files written before are untouched;
    * ``AFTER_TRAIN``, however the run ended, first waits for the save in
      flight, then saves as above; pruning and setting files aside happen in
      the writer thread, after the file is in place.

    It is off by default: a save then fails in the phase that saves, and a
    run's memory peak stays where it is. Turn it on where saves cost steps.

    Args:
        directory: where the files go (created if missing).
        keep: how many of the newest checkpoints stay; ``None`` keeps all.
        background: save in a writer thread after a step, as above.

    Raises:
        ValueError: ``keep`` is not a positive int or ``None``, or
            ``directory`` is empty, holds a NUL byte, is an existing file, or
            lies under a file or in a directory the run cannot write.
        TypeError: ``background`` is not a bool.
        DirectoryInUse: (from ``run``, before the first step) another process
            holds ``directory``.
        BackgroundFailed: (from ``run``) a save in the background failed.

    Examples:
        >>> import tempfile, fnloop as fl
        >>> folder = tempfile.mkdtemp()
        >>> final = fl.run(fl.TrainState(max_iter=4), lambda s, b: s, [None] * 4, [fl.every(2, checkpoint(folder))])
        >>> [p.name for p in fl.checkpoint.checkpoints(folder)]
        ['ckpt-00000004.safetensors', 'ckpt-00000002.safetensors']
    """
    _directory("checkpoint()", directory)
    return Checkpoint(directory, keep, background)


@attrs.frozen
class _Do:
    """An effect a checkpoint hook requests, as data: ``action(hook, state)``, ``action`` one of its methods.

    Equal for equal hooks and actions, and picklable, as the hook itself is
    (a bound method would be neither: it compares its hook by identity).
    """

    hook: Checkpoint | _BestUpdate
    action: Callable[[Any, TrainState], object]

    def __call__(self, state: TrainState) -> object:
        return self.action(self.hook, state)  # a Job, from hand_over: the fold gives it to the writer
