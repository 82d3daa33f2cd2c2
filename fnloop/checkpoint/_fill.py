"""Filling a template: a plain decoded tree checked against a template built from code.

``fill`` checks type, shape, dtype, keys and lengths at every path of the
tree ``fnloop.checkpoint._codec.decode`` returns, and rebuilds it with the template's
types, as equinox's ``tree_deserialise`` does. A mismatch is a
``CheckpointMismatch`` that names the path and says how to fix it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from fnloop._core.phase import Phase
from fnloop.checkpoint._codec import SAVABLE, CheckpointMismatch, Record, is_namedtuple, with_article

__all__ = ["FIX_TEMPLATE", "as_plain", "describe", "fill", "mismatch"]

FIX_TEMPLATE = "Build like= with the same code and configuration as the run that wrote the checkpoint."


def describe(value: Any) -> str:
    """A short phrase for ``value``'s kind, for error messages."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    if type(value) is Record:
        what = "NamedTuple" if value.kind == "namedtuple" else "record"
        return f"a {what} {value.type.rsplit('.', 1)[-1]} with fields {list(value)}"
    if attrs.has(type(value)):
        return f"a record {type(value).__qualname__}"
    if is_namedtuple(value):
        return f"a NamedTuple {type(value).__qualname__}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of length {len(value)}"
    if isinstance(value, Mapping):
        return "a dict"
    return "None" if value is None else f"{with_article(type(value).__name__)} ({value!r:.40})"


def mismatch(where: str, what: str) -> CheckpointMismatch:
    """The error for an entry of the file that does not fit the template at ``where``."""
    return CheckpointMismatch(f"{where}: {what}. {FIX_TEMPLATE}")


def _expected(like: Any, data: Any, where: str) -> CheckpointMismatch:
    return mismatch(where, f"expected {describe(like)}, got {describe(data)}")


def _check_names(got: list[Any], want: list[Any], where: str, style: str) -> None:
    if set(got) == set(want):
        return
    missing = [n for n in want if n not in got]
    unexpected = [n for n in got if n not in want]
    step = (lambda n: f".{n}") if style == "." else (lambda n: f"[{n!r}]")
    entry = "field" if style == "." else "entry"
    if missing:
        first, what = missing[0], f"{entry} in the template but missing from the file"
    else:
        first, what = unexpected[0], f"{entry} in the file but not in the template"
    raise mismatch(
        where + step(first), f"{what} (missing from the file: {missing}; not in the template: {unexpected})"
    )


def _build(cls: type, make: Any, where: str) -> Any:
    try:
        return make()
    except Exception as exc:  # a user's validator may raise anything; name the entry
        raise mismatch(where, f"the saved fields do not make a {cls.__qualname__}: {exc}") from exc


def fill(data: Any, like: Any, where: str) -> Any:
    """``data`` (a plain decoded tree) checked against the template ``like`` and rebuilt with its types.

    Strict at every path: the same kinds, the same record fields and dict
    keys, the same tuple and list lengths, tensors of the same dtype and shape
    (placed on the template tensor's device). A float in the template also
    accepts an int. Dict entries keep the file's order.

    Raises:
        CheckpointMismatch: ``data`` does not fit ``like``; the message names the path.

    Examples:
        >>> fill({"w": torch.ones(2)}, {"w": torch.zeros(2)}, "f: state")
        {'w': tensor([1., 1.])}
        >>> try:
        ...     fill({"w": torch.ones(3)}, {"w": torch.zeros(2)}, "f: state")
        ... except CheckpointMismatch as e:
        ...     print(str(e).split(". ")[0])
        f: state['w']: expected shape (2,), got (3,)
    """
    kind = type(like)
    if isinstance(like, torch.Tensor):
        return _fill_tensor(data, like, where)
    if like is None or kind is bool or kind is str or kind is int or kind is Phase:
        if type(data) is not kind:
            raise _expected(like, data, where)
        return data
    if kind is float:
        if type(data) is not float and type(data) is not int:
            raise _expected(like, data, where)
        return data
    if attrs.has(kind):
        if type(data) is not Record or data.kind != "record":
            raise _expected(like, data, where)
        fields = attrs.fields(kind)
        _check_names(list(data), [f.name for f in fields], where, ".")
        values = {f.name: fill(data[f.name], getattr(like, f.name), f"{where}.{f.name}") for f in fields}
        return _build(kind, lambda: _make_attrs(kind, fields, values), where)
    if is_namedtuple(like):
        if type(data) is not Record or data.kind != "namedtuple":
            raise _expected(like, data, where)
        _check_names(list(data), list(like._fields), where, ".")
        values = {n: fill(data[n], v, f"{where}.{n}") for n, v in zip(like._fields, like)}
        return _build(kind, lambda: kind(**values), where)
    if isinstance(like, Mapping):
        if type(data) is not dict:
            raise _expected(like, data, where)
        _check_names(list(data), list(like), where, "[")
        out = {k: fill(v, like[k], f"{where}[{k!r}]") for k, v in data.items()}
        return out if kind is dict else _build(kind, lambda: kind(out), where)
    if isinstance(like, (list, tuple)):
        plain = list if isinstance(like, list) else tuple
        if type(data) is not plain:
            raise _expected(like, data, where)
        if not like and kind is plain:
            # An empty template is a collection that starts empty and grows (a
            # hook's log): it takes the saved entries as they are, if plain data.
            return as_plain(data, where)
        if len(data) != len(like):
            raise mismatch(
                where, f"expected a {plain.__name__} of length {len(like)}, got length {len(data)}"
            )
        items = [fill(d, t, f"{where}[{i}]") for i, (d, t) in enumerate(zip(data, like))]
        return plain(items) if kind is plain else _build(kind, lambda: kind(items), where)
    raise mismatch(where, f"the template holds {describe(like)}, which no checkpoint can hold; {SAVABLE}")


_EMPTY = "the template's sequence is empty, so it gives no type for its entries"


def as_plain(data: Any, where: str, because: str = _EMPTY) -> Any:
    """``data`` as it is, if it holds no record (which plain data cannot rebuild, ``because``)."""
    stack = [data]
    while stack:
        node = stack.pop()
        if type(node) is Record:
            raise mismatch(
                where,
                f"a saved {node.type} record cannot be rebuilt here: {because}. Keep plain data "
                "(numbers, strings, tensors, tuples, dicts) there",
            )
        if isinstance(node, (list, tuple)):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
    return data


def _make_attrs(cls: type, fields: Any, values: dict[str, Any]) -> Any:
    # Through __init__, so the class's validators run, as attrs.evolve does.
    new = cls(**{f.alias: values[f.name] for f in fields if f.init})
    for f in fields:
        if not f.init:
            object.__setattr__(new, f.name, values[f.name])
    return new


def _fill_tensor(data: Any, like: torch.Tensor, where: str) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise _expected(like, data, where)
    if data.dtype != like.dtype:
        got, want = (str(d).removeprefix("torch.") for d in (data.dtype, like.dtype))
        raise mismatch(where, f"expected dtype {want}, got {got}")
    if data.shape != like.shape:
        raise mismatch(where, f"expected shape {tuple(like.shape)}, got {tuple(data.shape)}")
    if data.device != like.device:
        data = data.to(like.device)
    if isinstance(like, torch.nn.Parameter):
        return torch.nn.Parameter(data, requires_grad=like.requires_grad)
    return data.requires_grad_() if like.requires_grad and data.is_floating_point() else data
