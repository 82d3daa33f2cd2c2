"""Lists and DataLoaders that resume: a cursor over a re-iterable source, and the warning for one that restarts."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping, Set
from typing import Any, Protocol, runtime_checkable

import attrs
from torch.utils.data import DataLoader, RandomSampler

from fnloop._core.messages import got
from fnloop.data._batches import Batch, _cursor, _mix

__all__ = ["KeepsPosition", "Resumable", "resumable"]


_NO_GENERATOR = (
    "fnloop.data.resumable: this DataLoader shuffles (a RandomSampler) without a generator, so each "
    "epoch's order comes from the global RNG and a resumed run cannot see the order the interrupted "
    "one saw. Pass generator=torch.Generator().manual_seed(seed) to the DataLoader (resumable then "
    "re-seeds it at every epoch from (seed, epoch)), or give a function epoch -> loader."
)


def _shuffle_seed(source: object) -> int | None:
    """The seed of a shuffling DataLoader's generator, as it was when wrapped.

    A sampler that draws has a ``generator`` attribute: torch's ``RandomSampler``
    and the others, and torchdata's own ``RandomSampler`` (not a subclass).
    """
    if not isinstance(source, DataLoader) or not (
        isinstance(source.sampler, RandomSampler) or hasattr(source.sampler, "generator")
    ):
        return None
    generator = source.sampler.generator or source.generator
    if generator is None:
        raise ValueError(_NO_GENERATOR)
    return generator.initial_seed()


@runtime_checkable
class KeepsPosition(Protocol):
    """A source that saves and restores its own position, as torchdata's ``StatefulDataLoader`` and
    a Hugging Face ``IterableDataset`` do (torchdata's ``Stateful``)."""

    def state_dict(self) -> Any:
        """Its position now, as plain data."""

    def load_state_dict(self, state: Any) -> None:
        """Go back to the position ``state``."""


@attrs.frozen(kw_only=True)
class Resumable:
    """A re-iterable (a list, a ``DataLoader``) as an endless stream that resumes from its cursor.

    Build one with ``resumable``. Epoch ``e`` is ``iter(source)`` (after
    setting up the epoch, see ``resumable``) or ``source(e)`` for a
    function. The cursor counts batches: ``iter_from(cursor)`` skips that
    many, whole epochs of a sized source without touching them, the rest by
    iterating (for a loader, loading them: O(cursor % len)). For a source
    that keeps its own position (``stateful``) the cursor is
    ``{"epoch": e, "position": source.state_dict()}``, loaded back into it.

    Examples:
        >>> stream = resumable([10, 20, 30])
        >>> it = stream.iter_from(4)
        >>> next(it), next(it)
        ((20, 5), (30, 6))
    """

    source: Any
    seed: int | None = None
    """The seed of a shuffling DataLoader's generator; it is re-seeded from ``(seed, epoch)``."""

    @property
    def stateful(self) -> bool:
        """Whether the source keeps its own position (``KeepsPosition``): that is then the cursor."""
        return isinstance(self.source, KeepsPosition)

    def epoch(self, epoch: int) -> Iterable[Any]:
        """The batches of epoch ``epoch``, in order."""
        source = self.source
        if not _iterable(source):
            return source(epoch)  # type: ignore[no-any-return]
        sampler = getattr(source, "sampler", None)
        if callable(getattr(sampler, "set_epoch", None)):
            # DistributedSampler and the like draw each epoch's order from it.
            sampler.set_epoch(epoch)  # type: ignore[union-attr]
        if self.seed is not None:
            generator = source.sampler.generator or source.generator
            generator.manual_seed(_mix(self.seed, epoch))
        return source  # type: ignore[no-any-return]

    def iter_from(self, cursor: int) -> Iterator[tuple[Batch, int]]:
        """The stream from ``cursor`` on, as ``(batch, cursor after it)`` pairs.

        Args:
            cursor: ``state.data``: batches already consumed (0 at the start),
                or, for a stateful source, the position it saved.

        Returns:
            An endless iterator; the first pair carries ``cursor + 1`` (for a
            stateful source, its position after that batch).

        Raises:
            TypeError: ``cursor`` is not an int, or not a stateful source's position.
            ValueError: ``cursor`` is negative, or an epoch gives no batch.
        """
        if self.stateful and type(cursor) is not int:
            return self._stateful(saved=cursor)
        return self._from(_cursor(cursor, "iter_from", "Resumable"))

    def __iter__(self) -> Iterator[Batch]:
        return (batch for batch, _ in self.iter_from(0))

    def _stateful(self, saved: Any = None, skip: int = 0) -> Iterator[tuple[Batch, Any]]:
        """From the position ``saved`` (``{"epoch": e, "position": source.state_dict()}``), or from
        the start after ``skip`` batches; the cursor after each batch is the same pair.

        The epoch is fnloop's: each begins as a DataLoader's does here (its generator re-seeded
        from ``(seed, epoch)``, ``set_epoch`` on its sampler, or on the source itself, as a
        Hugging Face ``IterableDataset`` has), and the source's own state restores the position
        within it. So the order of every later epoch depends on the epoch alone, not on how the
        loader's generator moved before the interruption (torchdata 0.11's without workers moved
        differently after a resume, and later epochs came in another order).
        """
        source = self.source
        epoch, resumed = 0, saved is not None
        if resumed:
            epoch, position = _position(saved)
        self._begin(epoch)
        batches: Iterable[Any] = _restored(source, position, epoch) if resumed else source
        while True:
            empty = True
            for batch in batches:
                empty = False
                if skip:
                    skip -= 1
                    continue
                # A copy: a loader's state_dict() may share dicts it goes on changing (torchdata's
                # without workers), which would move a saved cursor on after it was saved.
                yield batch, {"epoch": epoch, "position": copy.deepcopy(source.state_dict())}
            if empty and not resumed:  # a position saved at an epoch's end resumes with an empty rest
                raise ValueError(f"fnloop.data.resumable: an epoch of {source!r:.80} gave no batch.")
            resumed = False
            epoch += 1
            self._begin(epoch)
            batches = source

    def _begin(self, epoch: int) -> None:
        """Set the source up for epoch ``epoch``, as ``epoch`` does, and tell it the epoch if it asks."""
        self.epoch(epoch)
        if callable(getattr(self.source, "set_epoch", None)):
            self.source.set_epoch(epoch)

    def _from(self, cursor: int) -> Iterator[tuple[Batch, Any]]:
        # A stateful source counted from 0 (a fresh run), or from a cursor a plain stream counted.
        return self._stateful(skip=cursor) if self.stateful else self._counted(cursor)

    def _counted(self, cursor: int) -> Iterator[tuple[Batch, int]]:
        epoch, skip = 0, cursor
        while True:
            batches = self.epoch(epoch)
            size = _size(batches)
            if size is not None and 0 < size <= skip:
                epoch, skip = epoch + 1, skip - size
                continue
            empty = True
            for batch in batches:
                empty = False
                if skip:
                    skip -= 1
                    continue
                cursor += 1
                yield batch, cursor
            if empty:
                raise ValueError(
                    f"fnloop.data.resumable: epoch {epoch} of {self.source!r:.80} gave no batch; the "
                    "stream repeats epochs forever, so each must give at least one."
                )
            epoch += 1


def _restored(source: Any, position: Any, epoch: int) -> Iterator[Any]:
    """``source`` from the saved ``position``: its own state loaded back, and its iterator begun.

    torchdata's ``StatefulDataLoader`` checks a position only when its
    iterator begins, with bare ``assert``s: one saved with another number of
    workers is refused so. Here the refusal says what differs and the fix.
    """
    try:
        source.load_state_dict(position)
        return iter(source)
    except AssertionError as exc:
        saved, now = _saved_workers(position), getattr(source, "num_workers", None)
        if saved is not None and now is not None and saved != now:
            differs = (
                f"the position was saved by a loader with num_workers={saved}, and this one has "
                f"num_workers={now}. Build the loader with num_workers={saved} to resume"
            )
        else:
            differs = (
                "a loader's position resumes only in a loader built as the one that saved it (the same "
                "dataset, batch_size, sampler and num_workers). Build it so to resume"
            )
        said = f": {exc}" if str(exc) else ", bare"
        raise ValueError(
            f"fnloop.data.resumable: the {type(source).__name__} refused the position saved in state.data "
            f"(epoch {epoch}) with an {type(exc).__name__}{said}: {differs}, or start the data of the "
            "resumed state afresh (attrs.evolve(state, data=0))."
        ) from exc


def _saved_workers(position: Any) -> int | None:
    """The ``num_workers`` of the torchdata ``StatefulDataLoader`` that saved ``position``, if it says."""
    if not isinstance(position, dict):
        return None
    if "_num_yielded" in position:  # torchdata's state of a loader without workers
        return 0
    snapshot = position.get("_snapshot")
    main = snapshot.get("_main_snapshot") if isinstance(snapshot, dict) else None
    workers = main.get("_num_workers") if isinstance(main, dict) else None
    return workers if type(workers) is int else None


def _position(saved: Any) -> tuple[int, Any]:
    """The epoch and the source's own state that a stateful source's cursor holds."""
    if type(saved) is not dict or set(saved) != {"epoch", "position"} or type(saved["epoch"]) is not int:
        raise TypeError(
            "fnloop.data.resumable: this source keeps its own position, so its cursor is "
            f'{{"epoch": int, "position": source.state_dict()}} ({got(saved)}). It comes from '
            "state.data of a run over the same kind of source; a run that counted batches (an int) "
            "resumes too."
        )
    return saved["epoch"], saved["position"]


def _not_batches(source: object) -> str:
    """Why ``source``, iterable as it is, is not a list of batches, and what to pass instead."""
    if isinstance(source, Mapping):
        why = "iterating a dict gives its keys, not its values"
        fix = "Pass list(source.values()) for the values, or a list of dict batches"
    elif isinstance(source, Set):
        why = "a set has no order, so no epoch could be given again in the same order"
        fix = "Pass a list (sorted(source), say)"
    else:
        why = "iterating it gives its characters (for bytes, their codes) one by one"
        fix = "Pass a list of batches ([source] for one batch that is this string)"
    return (
        f"fnloop.data.resumable: the source must be a re-iterable of batches ({got(source)}): {why}. "
        f"{fix}, or a function epoch -> iterable."
    )


def _iterable(source: object) -> bool:
    return hasattr(source, "__iter__")


def _size(batches: object) -> int | None:
    try:
        return len(batches)  # type: ignore[arg-type]
    except TypeError:
        return None


def resumable(source: Iterable[Any] | Callable[[int], Iterable[Any]]) -> Resumable:
    """An endless stream over ``source``, one epoch after another, that resumes from ``state.data``.

    The fold keeps its cursor (batches consumed) in ``state.data``, so a
    checkpoint holds it and a resumed run continues with the batch it would
    have seen. Each epoch must give the same batches whenever it is iterated:

    * a list of batches, or a ``DataLoader`` that does not shuffle: as is;
    * a ``DataLoader(..., shuffle=True, generator=torch.Generator().manual_seed(s))``:
      before each epoch the generator is re-seeded from ``(s, epoch)``, and a
      sampler with ``set_epoch`` (``DistributedSampler``) is told the epoch;
    * a function ``epoch -> iterable`` for anything else (augmentation seeded
      by the epoch, say): it is called once per epoch;
    * a source that keeps its own position, with ``state_dict()`` and
      ``load_state_dict()`` (torchdata's ``StatefulDataLoader``, a Hugging
      Face ``IterableDataset``): its state after each batch is the cursor,
      with the epoch, and each epoch is begun as above.

    Skipped batches of a partial epoch are iterated (a loader loads them);
    ``batches`` jumps there for free.

    Args:
        source: a re-iterable (a list, a ``DataLoader``, torchdata's
            ``StatefulDataLoader``), or a function of the epoch returning one.

    Returns:
        A ``Resumable`` with ``iter_from(cursor)``.

    Raises:
        TypeError: ``source`` is a one-shot iterator (a generator), a str or
            bytes (characters are no batches), a dict (its keys are not), a set
            (it has no order), or neither iterable nor callable.
        ValueError: ``source`` is empty, or a shuffling ``DataLoader`` without
            a generator. A stateful source's position saved by a loader built
            otherwise (another ``num_workers``) is refused when the resumed
            run begins, with a ``ValueError`` naming what differs.

    Examples:
        >>> import fnloop as fl
        >>> seen = lambda state, batch: fl.record(state, x=batch)
        >>> stream = resumable([1.0, 2.0, 3.0])
        >>> half = fl.run(fl.TrainState(max_iter=2), seen, stream)
        >>> rest = fl.run(attrs.evolve(half, max_iter=4), seen, stream)
        >>> rest.data, rest.metrics.latest("x")
        (4, (3, 1.0))
    """
    if _iterable(source):
        if isinstance(source, (str, bytes, bytearray, Mapping, Set)):
            raise TypeError(_not_batches(source))
        if isinstance(source, Iterator):
            raise TypeError(
                f"fnloop.data.resumable: the source must be iterable again from its start (got "
                f"{source!r:.80} that is a {type(source).__name__}, a one-shot iterator). Pass the list or "
                "DataLoader itself, or a function epoch -> iterable."
            )
        # A source keeping its own position is not asked its length: a loader's len() is part of its state.
        if not isinstance(source, KeepsPosition) and _size(source) == 0:
            raise ValueError(
                f"fnloop.data.resumable: the source is empty ({got(source)}); the stream repeats its "
                "epochs forever, so each must give at least one batch. Pass a source that gives batches "
                "(a DataLoader with drop_last=True gives none from fewer samples than batch_size)."
            )
    elif not callable(source):
        raise TypeError(
            f"fnloop.data.resumable: the source must be a re-iterable (a list, a DataLoader) or a function "
            f"epoch -> iterable ({got(source)})."
        )
    return Resumable(source=source, seed=_shuffle_seed(source))
