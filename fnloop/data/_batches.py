"""Deterministic, resumable batch streams.

A stream is a value: its configuration (dataset, batch size, seed, ...) and
nothing else. Its position is a plain int, the number of global batches
already consumed, which the fold keeps in ``state.data``; so a checkpoint
holds it and a resumed run continues with the very batch it would have seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader, default_collate

from fnloop._core.messages import got
from fnloop.data._datasets import check_samples_by_index, described, kind_of, rows_of, same_data

__all__ = ["Batch", "Batches", "batches"]

Batch = Any
"""What a stream yields: a tensor, a tuple of tensors, or what ``collate_fn`` returns."""

_MASK = (1 << 64) - 1
_WORKER_SALT = 0x5EED_10AD


def _fmix(z: int) -> int:
    # splitmix64's finalizer: nearby (seed, epoch) pairs get unrelated generator seeds.
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _mix(*words: int) -> int:
    h = 0x9E3779B97F4A7C15
    for w in words:
        h = _fmix((h + (w & _MASK)) & _MASK)
    return h


def _int(low: int) -> Callable[[object, attrs.Attribute, object], None]:
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if type(value) is not int:
            raise TypeError(
                f"fnloop.data.batches: '{attribute.name}' must be an int >= {low} "
                f"({got(value)}). Pass a Python int, e.g. int({value!r})."
            )
        if value < low:
            raise ValueError(
                f"fnloop.data.batches: '{attribute.name}' must be an int >= {low} (got {value!r})."
            )

    return check


def _seed(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if type(value) is not int:
        raise TypeError(
            f"fnloop.data.batches: 'seed' must be an int ({got(value)}). "
            "The order of epoch e is a function of (seed, e); pass the run's seed, e.g. seed=0."
        )


def _bool(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if type(value) is not bool:
        raise TypeError(f"fnloop.data.batches: '{attribute.name}' must be a bool ({got(value)}).")


def _collate(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not callable(value):
        raise TypeError(
            f"fnloop.data.batches: 'collate_fn' must be callable or None ({got(value)}). It receives "
            "a list of samples and returns a batch."
        )


@attrs.frozen(kw_only=True)
class Batches:
    """A deterministic stream of batches that resumes from an int cursor.

    Build one with ``batches``. The stream never ends: it cycles epochs,
    each in the order ``torch.randperm(n)`` drawn from a generator seeded by
    ``(seed, epoch)``, never from the global RNG.

    Attributes:
        batches_per_epoch: global batches in one epoch.

    Examples:
        >>> stream = batches(torch.arange(6), batch_size=2, seed=0, shuffle=False)
        >>> [b.tolist() for b, _ in zip(stream, range(4))]
        [[0, 1], [2, 3], [4, 5], [0, 1]]
        >>> next(stream.iter_from(2))
        (tensor([4, 5]), 3)
    """

    dataset: Any = attrs.field(repr=described, eq=attrs.cmp_using(eq=same_data), hash=False)
    batch_size: int = attrs.field(validator=_int(1))
    seed: int = attrs.field(validator=_seed)
    shuffle: bool = attrs.field(default=True, validator=_bool)
    drop_last: bool = attrs.field(default=True, validator=_bool)
    num_workers: int = attrs.field(default=0, validator=_int(0))
    collate_fn: Callable[[list[Any]], Batch] | None = attrs.field(default=None, validator=_collate)
    rank: int = attrs.field(default=0, validator=_int(0))
    world_size: int = attrs.field(default=1, validator=_int(1))

    def __attrs_post_init__(self) -> None:
        check_samples_by_index(self.dataset)
        n, b, ws = rows_of(self.dataset), self.batch_size, self.world_size
        where = "fnloop.data.batches"
        if n == 0:
            raise ValueError(
                f"{where}: the dataset is empty (got 0 samples); a stream needs at least one batch."
            )
        if self.drop_last and b > n:
            raise ValueError(
                f"{where}: batch_size={b} is larger than the dataset ({n} samples), so with drop_last=True "
                f"an epoch has no batch. Use batch_size <= {n}, or drop_last=False for one smaller batch."
            )
        if self.rank >= ws:
            raise ValueError(
                f"{where}: rank must be in [0, world_size) (got rank={self.rank}, world_size={ws})."
            )
        if b % ws:
            near = " or ".join(f"batch_size={m}" for m in (b - b % ws, b - b % ws + ws) if m)
            raise ValueError(
                f"{where}: batch_size={b} is the global batch size and must split evenly over "
                f"world_size={ws} ranks (got a remainder of {b % ws}). Use a multiple of {ws}, e.g. {near}."
            )
        last = n % b
        if not self.drop_last and ws > 1 and 0 < last < ws:
            raise ValueError(
                f"{where}: with drop_last=False the last batch of every epoch has {last} samples, fewer "
                f"than world_size={ws}, so some rank would get an empty batch. Use drop_last=True, or a "
                f"batch_size for which {n} % batch_size is 0 or at least {ws}."
            )
        if kind_of(self.dataset) != "map" and (self.num_workers or self.collate_fn is not None):
            raise ValueError(
                f"{where}: num_workers and collate_fn apply to map-style datasets (got num_workers="
                f"{self.num_workers}, collate_fn={self.collate_fn!r} with a tensor dataset). Tensors are "
                "gathered by indexing in this process, which beats worker processes; drop those "
                "arguments, or wrap the tensors in torch.utils.data.TensorDataset."
            )

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in one epoch: ``n // batch_size``, rounded up when ``drop_last=False``."""
        n, b = rows_of(self.dataset), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def epoch_of(self, cursor: int) -> int:
        """The epoch the batch at ``cursor`` belongs to.

        Examples:
            >>> batches(torch.arange(10), batch_size=5, seed=0).epoch_of(3)
            1
        """
        return _cursor(cursor, "epoch_of") // self.batches_per_epoch

    def iter_from(self, cursor: int) -> Iterator[tuple[Batch, int]]:
        """The stream from ``cursor`` on, as ``(batch, cursor after it)`` pairs.

        Skipped batches are neither generated nor loaded: the stream jumps to
        epoch ``cursor // batches_per_epoch`` and starts at batch
        ``cursor % batches_per_epoch`` of it.

        Args:
            cursor: global batches already consumed (``state.data``; 0 at the start).

        Returns:
            An endless iterator; the first pair carries ``cursor + 1``.

        Raises:
            TypeError: ``cursor`` is not an int.
            ValueError: ``cursor`` is negative.

        Examples:
            >>> stream = batches(torch.arange(4), batch_size=2, seed=0, shuffle=False)
            >>> it = stream.iter_from(1)
            >>> next(it), next(it)
            ((tensor([2, 3]), 2), (tensor([0, 1]), 3))
        """
        cursor = _cursor(cursor, "iter_from")
        if self.num_workers and kind_of(self.dataset) == "map":
            return self._from_workers(cursor)
        return self._in_process(cursor)

    def __iter__(self) -> Iterator[Batch]:
        return (batch for batch, _ in self.iter_from(0))

    def _order(self, epoch: int) -> torch.Tensor:
        n = rows_of(self.dataset)
        if not self.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=torch.Generator().manual_seed(_mix(self.seed, epoch)))

    def _indices(self, cursor: int) -> Iterator[torch.Tensor]:
        """This rank's indices for each batch from ``cursor`` on."""
        b, per_epoch = self.batch_size, self.batches_per_epoch
        epoch, start = divmod(cursor, per_epoch)
        while True:
            order = self._order(epoch)
            for k in range(start, per_epoch):
                idx = order[k * b : (k + 1) * b]
                # Full batches split into contiguous slices of batch_size // world_size.
                yield torch.tensor_split(idx, self.world_size)[self.rank] if self.world_size > 1 else idx
            epoch, start = epoch + 1, 0

    def _fetch(self, idx: torch.Tensor) -> Batch:
        data = self.dataset
        kind = kind_of(data)
        if kind == "tensor":
            return data[idx]
        if kind == "columns":
            return tuple(t[idx] for t in data)
        keys = idx.tolist()
        # The same fetch as DataLoader's, so num_workers=0 and > 0 give equal batches.
        getitems = getattr(data, "__getitems__", None)
        samples = getitems(keys) if getitems else [data[i] for i in keys]
        return (self.collate_fn or default_collate)(samples)

    def _in_process(self, cursor: int) -> Iterator[tuple[Batch, int]]:
        for after, idx in enumerate(self._indices(cursor), cursor + 1):
            yield self._fetch(idx), after

    def _from_workers(self, cursor: int) -> Iterator[tuple[Batch, int]]:
        loader = DataLoader(
            self.dataset,
            batch_sampler=_IndexLists(self, cursor),
            num_workers=self.num_workers,
            collate_fn=self.collate_fn or default_collate,
            # Without a generator DataLoader draws its worker seed from the global RNG.
            generator=torch.Generator().manual_seed(_mix(self.seed, cursor, _WORKER_SALT)),
        )
        # One loader for the whole (endless) stream: workers start once, not every epoch,
        # and shut down when this generator is closed or collected.
        for after, batch in enumerate(loader, cursor + 1):
            yield batch, after


@attrs.frozen
class _IndexLists:
    stream: Batches
    cursor: int

    def __iter__(self) -> Iterator[list[int]]:
        return (idx.tolist() for idx in self.stream._indices(self.cursor))


def _cursor(cursor: object, where: str, owner: str = "Batches") -> int:
    if type(cursor) is not int:
        raise TypeError(
            f"{owner}.{where}: cursor must be an int ({got(cursor)}). "
            "It counts the global batches already consumed: state.data, 0 at the start of a run."
        )
    if cursor < 0:
        raise ValueError(
            f"{owner}.{where}: cursor must be >= 0 (got {cursor}). It counts the global batches "
            "already consumed: state.data, 0 at the start of a run."
        )
    return cursor


def _distributed() -> tuple[int, int]:
    from fnloop.distributed import rank, world_size

    return rank(), world_size()


def batches(
    dataset: Any,
    *,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    drop_last: bool = True,
    num_workers: int = 0,
    collate_fn: Callable[[list[Any]], Batch] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> Batches:
    """A deterministic, resumable, endless batch stream over ``dataset``.

    The order of epoch ``e`` is a pure function of ``(seed, e)``; the global
    RNG is never touched. ``iter_from(cursor)`` resumes at any batch without
    generating or loading the ones before it, so a resumed run sees exactly
    the batches an uninterrupted one would.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``), a tensor,
            or a tuple of equal-length tensors (a batch is then a tuple of their
            rows, gathered by indexing: the fast path).
        batch_size: the *global* batch size; each of ``world_size`` ranks gets a
            contiguous ``batch_size // world_size`` share of every global batch.
        seed: seeds the order of every epoch.
        shuffle: ``False`` keeps the dataset's own order in every epoch.
        drop_last: drop the last, smaller batch of each epoch.
        num_workers: load map-style datasets in this many worker processes
            (``torch.utils.data.DataLoader``); the batches are identical to ``0``.
        collate_fn: turns a list of samples into a batch; ``default_collate`` if None.
        rank: this process's rank; ``torch.distributed.get_rank()`` when a process
            group is initialized, else 0.
        world_size: ``torch.distributed.get_world_size()`` when initialized, else 1.

    Returns:
        A ``Batches``: picklable, comparable, with ``iter_from(cursor)``.

    Raises:
        TypeError: ``dataset`` is not a dataset, or an argument has the wrong type.
        ValueError: an empty dataset, unequal tensor lengths, a ``batch_size`` that is
            not positive, too large for ``drop_last`` or not divisible by ``world_size``.

    Examples:
        >>> xs = torch.arange(10.0)
        >>> stream = batches((xs, 2 * xs), batch_size=4, seed=0)
        >>> stream.batches_per_epoch
        2
        >>> (x, y), cursor = next(stream.iter_from(0))
        >>> x.shape, cursor, torch.equal(y, 2 * x)
        (torch.Size([4]), 1, True)
        >>> resumed, cursor = next(stream.iter_from(3))  # the 2nd batch of epoch 1
        >>> cursor
        4

    See Also:
        ``fnloop.run``, which keeps the cursor in ``state.data``.
    """
    if rank is None or world_size is None:
        default_rank, default_world = _distributed()
        rank = default_rank if rank is None else rank
        world_size = default_world if world_size is None else world_size
    return Batches(
        dataset=dataset,
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        drop_last=drop_last,
        num_workers=num_workers,
        collate_fn=collate_fn,
        rank=rank,
        world_size=world_size,
    )
