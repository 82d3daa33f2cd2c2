"""Lists and DataLoaders that resume: a cursor over a re-iterable source, and the warning for one that restarts."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
from torch.utils.data import DataLoader, RandomSampler

from fnloop._core.messages import got
from fnloop.data._batches import Batch, _cursor, _mix

__all__ = ["Resumable", "resumable"]


_NO_GENERATOR = (
    "fnloop.data.resumable: this DataLoader shuffles (a RandomSampler) without a generator, so each "
    "epoch's order comes from the global RNG and a resumed run cannot see the order the interrupted "
    "one saw. Pass generator=torch.Generator().manual_seed(seed) to the DataLoader (resumable then "
    "re-seeds it at every epoch from (seed, epoch)), or give a function epoch -> loader."
)


def _shuffle_seed(source: object) -> int | None:
    """The seed of a shuffling DataLoader's generator, as it was when wrapped."""
    if not isinstance(source, DataLoader) or not isinstance(source.sampler, RandomSampler):
        return None
    generator = source.sampler.generator or source.generator
    if generator is None:
        raise ValueError(_NO_GENERATOR)
    return generator.initial_seed()


@attrs.frozen(kw_only=True)
class Resumable:
    """A re-iterable (a list, a ``DataLoader``) as an endless stream that resumes from an int cursor.

    Build one with ``resumable``. Epoch ``e`` is ``iter(source)`` (after
    setting up the epoch, see ``resumable``) or ``source(e)`` for a
    function. ``iter_from(cursor)`` skips ``cursor`` batches: whole epochs of a
    sized source without touching them, the rest by iterating (for a loader,
    loading them: O(cursor % len)).

    Examples:
        >>> stream = resumable([10, 20, 30])
        >>> it = stream.iter_from(4)
        >>> next(it), next(it)
        ((20, 5), (30, 6))
    """

    source: Any
    seed: int | None = None
    """The seed of a shuffling DataLoader's generator; it is re-seeded from ``(seed, epoch)``."""

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
            cursor: batches already consumed (``state.data``; 0 at the start).

        Returns:
            An endless iterator; the first pair carries ``cursor + 1``.

        Raises:
            TypeError: ``cursor`` is not an int.
            ValueError: ``cursor`` is negative, or an epoch gives no batch.
        """
        return self._from(_cursor(cursor, "iter_from", "Resumable"))

    def __iter__(self) -> Iterator[Batch]:
        return (batch for batch, _ in self.iter_from(0))

    def _from(self, cursor: int) -> Iterator[tuple[Batch, int]]:
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
      by the epoch, say): it is called once per epoch.

    Skipped batches of a partial epoch are iterated (a loader loads them);
    ``batches`` jumps there for free.

    Args:
        source: a re-iterable (a list, a ``DataLoader``, torchdata's
            ``StatefulDataLoader``), or a function of the epoch returning one.

    Returns:
        A ``Resumable`` with ``iter_from(cursor)``.

    Raises:
        TypeError: ``source`` is a one-shot iterator (a generator), or neither
            iterable nor callable.
        ValueError: a shuffling ``DataLoader`` without a generator.

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
        if isinstance(source, Iterator):
            raise TypeError(
                f"fnloop.data.resumable: the source must be iterable again from its start (got "
                f"{source!r:.80} that is a {type(source).__name__}, a one-shot iterator). Pass the list or "
                "DataLoader itself, or a function epoch -> iterable."
            )
    elif not callable(source):
        raise TypeError(
            f"fnloop.data.resumable: the source must be a re-iterable (a list, a DataLoader) or a function "
            f"epoch -> iterable ({got(source)})."
        )
    return Resumable(source=source, seed=_shuffle_seed(source))
