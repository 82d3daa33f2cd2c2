"""What a dataset is to a batch stream: its kind (a tensor, columns, map-style), its rows, how it is named.

``batches`` takes a map-style dataset, a tensor, or a tuple of equal-length
tensors; these check that it is one, count its samples, describe it for a
message, and tell whether two are the same data (a resumed stream's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset

from fnloop._core.messages import a_type

__all__ = ["DATASET_HELP", "check_samples_by_index", "described", "kind_of", "rows_of", "same_data"]

DATASET_HELP = (
    "Pass a map-style dataset (an object with __len__ and __getitem__ taking an int, "
    "such as torch.utils.data.TensorDataset or a list of samples), a tensor, or a tuple "
    "of equal-length tensors (a batch is then the tuple of their rows)."
)


def kind_of(dataset: Any) -> str:
    if isinstance(dataset, torch.Tensor):
        return "tensor"
    if isinstance(dataset, tuple) and dataset and all(isinstance(t, torch.Tensor) for t in dataset):
        return "columns"
    return "map"


def rows_of(dataset: Any) -> int:
    """The number of samples in ``dataset``, checking that it is a dataset at all."""
    kind = kind_of(dataset)
    if kind == "tensor":
        if dataset.dim() == 0:
            raise ValueError(
                f"fnloop.data.batches: the dataset tensor is 0-d (got {dataset!r}); it has no rows to batch."
            )
        return len(dataset)
    if kind == "columns":
        bad = [i for i, t in enumerate(dataset) if t.dim() == 0]
        if bad:
            raise ValueError(
                f"fnloop.data.batches: tensor {bad[0]} of the dataset tuple is 0-d; every tensor needs rows."
            )
        lengths = [len(t) for t in dataset]
        if len(set(lengths)) > 1:
            raise ValueError(
                f"fnloop.data.batches: the tensors of a dataset tuple must have equal lengths "
                f"(got lengths {lengths}). Row i of every tensor is sample i; trim or pad them to one length."
            )
        return lengths[0]
    if isinstance(dataset, tuple):
        got = ", ".join(type(t).__name__ for t in dataset) or "nothing"
        raise TypeError(
            f"fnloop.data.batches: a tuple dataset must hold tensors only (got a tuple of {got}). "
            "Wrap samples in a list for a map-style dataset, or convert each column with torch.as_tensor."
        )
    if isinstance(dataset, IterableDataset):
        why = "an IterableDataset, which cannot jump to a position without replaying all before it"
    elif not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        why = "which has no __len__ or no __getitem__"
    else:
        return len(dataset)
    raise TypeError(
        f"fnloop.data.batches: the dataset must be indexable with a known length "
        f"(got {type(dataset).__name__}, {why}). {DATASET_HELP}"
    )


def check_samples_by_index(dataset: Any) -> None:
    """Refuse a str, or a dict not keyed by the sample numbers: indexable, but not by sample."""
    if isinstance(dataset, (str, bytes)):
        raise TypeError(
            f"fnloop.data.batches: the dataset is {a_type(dataset)}, whose samples would be its "
            f"characters. {DATASET_HELP}"
        )
    if isinstance(dataset, Mapping) and set(dataset) != set(range(len(dataset))):
        keys = sorted(map(repr, dataset))[:4]
        raise TypeError(
            f"fnloop.data.batches: a dict dataset is read as dataset[i] for the sample numbers i = 0 to "
            f"{len(dataset) - 1}, but this one's keys are {', '.join(keys)}{', ...' * (len(dataset) > 4)}. "
            "For columns, pass a tuple of equal-length tensors (dataset['x'], dataset['y']), or a "
            "torch.utils.data.TensorDataset."
        )


def described(dataset: Any) -> str:
    kind = kind_of(dataset)
    if kind == "tensor":
        return f"<tensor of {len(dataset)} rows, shape {tuple(dataset.shape)}>"
    if kind == "columns":
        return f"<tuple of {len(dataset)} tensors, {len(dataset[0])} rows>"
    try:
        return f"<{type(dataset).__name__} of {len(dataset)} samples>"
    except TypeError:
        return f"<{type(dataset).__name__}>"


def same_data(a: Any, b: Any) -> bool:
    # Tensors compare by value; `==` on them is elementwise. Other datasets by identity.
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if kind_of(a) == kind_of(b) == "columns":
        return len(a) == len(b) and all(same_data(x, y) for x, y in zip(a, b, strict=True))
    return False
