"""How the fold reads its batches: from the saved cursor where the stream can, and a warning where it restarts."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

from fnloop._core.state import TrainState

__all__ = ["DataRestarts", "ResumableBatches", "restarts", "stream"]


@runtime_checkable
class ResumableBatches(Protocol):
    """Batches that go on from a saved cursor: ``iter_from(cursor)``, the batches from there on.

    The cursor is ``state.data``; the batches put the cursor of each batch
    they yield beside it (see ``fnloop.data.resumable`` and ``fnloop.data.batches``).
    """

    def iter_from(self, cursor: Any, /) -> Iterator[Any]: ...


class DataRestarts(UserWarning):
    """A resumed run was given batches that start again from the first one.

    The fold warns once per run when the state's iteration is above 0 and
    ``batches`` is a plain iterable (no ``iter_from``): a list or a
    ``DataLoader`` cannot skip what the interrupted run consumed, so the
    resumed run sees the first batches again. Wrap it in ``resumable``, or
    use ``batches``. A sized iterable shorter than ``max_iter`` could not
    have fed the run from iteration 0, so it is taken to be the remaining
    batches and does not warn.
    """


def restarts(batches: Iterable[Any], iteration: int, max_iter: int) -> str | None:
    """Why a resumed run over ``batches`` restarts its data, or None when it does not.

    Examples:
        >>> restarts([1, 2, 3], 1, 3) is not None, restarts([2, 3], 1, 3), restarts([1, 2, 3], 0, 3)
        (True, None, None)
    """
    if iteration == 0 or isinstance(batches, ResumableBatches):
        return None
    try:
        if len(batches) < max_iter:  # type: ignore[arg-type]
            return None
    except TypeError:
        pass
    return (
        f"this run resumes at iteration {iteration}, but its batches ({type(batches).__name__}) have no "
        "iter_from(cursor), so they start again from the first batch: the resumed run sees the batches "
        "of iterations 0, 1, ... again, and state.data stays where it was. To continue the data, wrap "
        "them: fnloop.data.resumable(loader_or_list) (its cursor is saved in state.data), or use "
        "fnloop.data.batches(dataset, batch_size=..., seed=...). If these are the remaining batches on "
        "purpose, silence this with warnings.simplefilter('ignore', fnloop.data.DataRestarts)."
    )


def stream(batches: Iterable[Any], state: TrainState) -> tuple[Iterator[Any], bool]:
    """An iterator over ``batches`` from ``state.data`` where they resume, and whether they do."""
    if isinstance(batches, ResumableBatches):
        return batches.iter_from(state.data), True
    restart = restarts(batches, state.iteration, state.max_iter)
    if restart is not None:
        warnings.warn(restart, DataRestarts, stacklevel=4)
    return iter(batches), False
