"""What a checkpoint holds of a ``TrainState``, and how the state comes back.

``encode_state`` encodes every field but ``effects`` (they carry code) and
``clock`` (what the wall clock read in the current phase: no part of the run).
``fill_state`` rebuilds the state like a template: its fields strictly
(``fnloop.checkpoint._fill.fill``), ``metrics`` as saved (they describe themselves), and
hook states leniently: the ones the template knows strictly, the others as
``Unclaimed`` for the run's hooks to claim.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from fnloop._core.metrics import Metrics
from fnloop._core.shards import Shards
from fnloop._core.state import TrainState, Unclaimed
from fnloop.checkpoint._codec import Record, encode_keyed
from fnloop.checkpoint._fill import as_plain, describe, fill, mismatch

__all__ = ["STATE_FIELDS", "encode_state", "encode_state_keyed", "fill_state"]

STATE_FIELDS = tuple(
    f.name for f in attrs.fields(TrainState) if f.name not in ("effects", "clock", "shards", "tensor")
)
"""The fields of TrainState a checkpoint's entries hold: all but ``effects``, which carry code, ``clock``,
``shards``, which a sharded checkpoint's index holds (``fnloop.checkpoint._sharded``), and ``tensor``
(a tensor-parallel state is saved whole, ``fnloop.checkpoint._split``)."""

_DROPPED = ("time",)
"""Entries files of earlier versions hold and this one reads past: the clock's ``time`` was saved then."""

_ADDED = {"population": None, "config": None}
"""Entries files of earlier versions lack, and the value they stand for there."""


def encode_state(state: TrainState) -> tuple[Any, dict[str, torch.Tensor]]:
    """The skeleton and tensors of ``state`` (``encode`` of its fields but ``effects``)."""
    skeleton, tensors, _ = encode_state_keyed(state)
    return skeleton, tensors


def encode_state_keyed(state: TrainState) -> tuple[Any, dict[str, torch.Tensor], dict[int, str]]:
    """``encode_state``, and the key each of the state's own tensors is stored under (``id -> key``)."""
    return encode_keyed(
        Record({n: getattr(state, n) for n in STATE_FIELDS}, kind="record", type="fnloop.TrainState")
    )


def fill_state(raw: Any, like: TrainState, where: str, shards: Shards | None = None) -> TrainState:
    """The state that ``raw`` (a decoded checkpoint) holds, built like the template ``like``.

    Strict for the record's fields (``fill``); ``metrics`` as saved (its
    tensors on the device of ``like``'s parameters); hook states ``like`` knows
    strictly, the others as ``Unclaimed`` (which keep ``shards``, the layout
    the checkpoint was saved in), and ``like``'s other hooks as they are.

    Raises:
        CheckpointMismatch: an entry does not fit ``like``; the message names it.
    """
    if type(raw) is not Record or raw.kind != "record":
        raise mismatch(where, f"expected a TrainState record, got {describe(raw)}")
    missing = [n for n in STATE_FIELDS if n not in raw and n not in _ADDED]
    unexpected = [n for n in raw if n not in STATE_FIELDS and n not in _DROPPED]
    if missing or unexpected:
        first = (missing or unexpected)[0]
        raise mismatch(
            f"{where}.{first}",
            f"TrainState fields differ (missing from the file: {missing}; unknown here: {unexpected}); "
            "the file was written by another version of fnloop",
        )
    values: dict[str, Any] = {}
    for name in STATE_FIELDS:
        at = f"{where}.{name}"
        if name == "metrics":
            values[name] = _metrics(raw[name], at, _device(like))
        elif name == "hooks":
            values[name] = _hooks(raw[name], like.hooks, at, shards)
        elif name == "data" and type(like.data) is int:
            values[name] = _cursor(raw[name], at)
        elif name == "config" and name in raw:  # as saved: resume compares it with the template's
            values[name] = as_plain(raw[name], at, "a run's configuration is read without a template")
        elif name not in raw:  # an entry files of earlier versions lack
            values[name] = fill(_ADDED[name], getattr(like, name), at)
        else:
            values[name] = fill(raw[name], getattr(like, name), at)
    try:
        return TrainState(**values, shards=like.shards, tensor=like.tensor)
    except (TypeError, ValueError) as exc:
        raise mismatch(where, f"the saved fields do not make a TrainState: {exc}") from exc


def _device(like: TrainState) -> torch.device:
    for tensor in (*like.params.values(), *like.buffers.values()):
        if isinstance(tensor, torch.Tensor):
            return tensor.device
    return torch.device("cpu")


def _metrics(data: Any, where: str, device: torch.device) -> Metrics:
    """Metrics are self-describing: names and entries come from the file, not the template."""
    if type(data) is not Record or set(data) != {"window", "series"} or type(data["series"]) is not dict:
        raise mismatch(where, f"expected a Metrics record (window, series), got {describe(data)}")
    series: dict[str, Any] = {}
    for name, entries in data["series"].items():
        at = f"{where}.series[{name!r}]"
        if type(entries) is not tuple:
            raise mismatch(at, f"expected a tuple of (iteration, value) pairs, got {describe(entries)}")
        out = []
        for i, entry in enumerate(entries):
            ok = type(entry) is tuple and len(entry) == 2 and type(entry[0]) is int
            value = entry[1] if ok else None
            if not ok or not (type(value) in (int, float) or isinstance(value, torch.Tensor)):
                raise mismatch(f"{at}[{i}]", f"expected an (iteration, value) pair, got {describe(entry)}")
            if isinstance(value, torch.Tensor) and value.device != device:
                value = value.to(device)
            out.append((entry[0], value))
        series[name] = tuple(out)
    try:
        return Metrics(window=data["window"], series=series)
    except (TypeError, ValueError) as exc:
        raise mismatch(where, f"the saved fields do not make a Metrics: {exc}") from exc


def _cursor(data: Any, where: str) -> Any:
    """The stream's cursor as saved: a count of batches, or the plain state a stateful loader gave.

    A template's cursor is an int (``fl.init`` starts at 0) while a stateful
    loader's (torchdata's ``StatefulDataLoader``) is its ``state_dict()``,
    which only the run knows: the stream checks it when the run starts.
    """
    return (
        data if type(data) is int else as_plain(data, where, "a stream's cursor is read without a template")
    )


_ABSENT: Any = object()


def _hooks(data: Any, like: Any, where: str, shards: Shards | None) -> dict[str, Any]:
    """Known hook states strictly; unknown ones as ``Unclaimed``; absent ones from the template."""
    if type(data) is not dict or not all(type(k) is str for k in data):
        raise mismatch(where, f"expected a dict of hook states keyed by name, got {describe(data)}")
    hooks: dict[str, Any] = {}
    for name, value in data.items():
        template = like.get(name, _ABSENT)
        at = f"{where}[{name!r}]"
        if template is _ABSENT or type(template) is Unclaimed:
            hooks[name] = Unclaimed(data=value, decode=fill, where=at, shards=shards)
        else:
            hooks[name] = fill(value, template, at)
    for name, value in like.items():
        hooks.setdefault(name, value)
    return hooks
