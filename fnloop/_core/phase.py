"""The four phases of a run, in the order the fold visits them."""

from __future__ import annotations

import enum

__all__ = ["Phase"]


class Phase(enum.Enum):
    """Where in a run a hook is being called.

    The fold calls every hook with ``BEFORE_TRAIN`` once, then for each
    iteration ``BEFORE_STEP``, the step itself and ``AFTER_STEP``, and finally
    ``AFTER_TRAIN`` once, also when the run fails.

    Examples:
        >>> [p.name for p in Phase]
        ['BEFORE_TRAIN', 'BEFORE_STEP', 'AFTER_STEP', 'AFTER_TRAIN']
    """

    BEFORE_TRAIN = 0
    BEFORE_STEP = 1
    AFTER_STEP = 2
    AFTER_TRAIN = 3

    def __repr__(self) -> str:
        return f"Phase.{self.name}"
