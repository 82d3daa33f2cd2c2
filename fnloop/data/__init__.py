"""Deterministic, resumable batch streams: ``batches`` over a dataset, ``resumable`` over a list or DataLoader.

A stream's position is the number of batches it has given, kept in
``state.data`` and saved with every checkpoint, so a resumed run continues
with the next batch.
"""

from fnloop._core.stream import DataRestarts
from fnloop.data._batches import Batch, Batches, batches
from fnloop.data._members import PerMemberBatches, per_member
from fnloop.data._one_pass import one_pass
from fnloop.data._resumable import Resumable, resumable

__all__ = [
    "Batch",
    "Batches",
    "DataRestarts",
    "PerMemberBatches",
    "Resumable",
    "batches",
    "one_pass",
    "per_member",
    "resumable",
]
