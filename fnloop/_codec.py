"""A tree of data as a JSON skeleton plus named tensors, and back: the checkpoint's data model.

``encode`` turns a tree (``None``, bools, ints, floats, strs, lists, tuples,
dicts, attrs records, NamedTuples and tensors) into a JSON-able *skeleton*
whose every node says what it is, with the tensors set aside under their path.
``decode`` reads a skeleton back *without* the code that made it: records come
back as ``Record`` dicts. ``fill`` then checks that plain tree against a
template built from code (type, shape, dtype, keys and lengths at every path)
and rebuilds it with the template's types, as equinox's ``tree_deserialise``
does. ``encode_state`` and ``fill_state`` apply the checkpoint's policy to a
whole ``TrainState``: no effects, strict fields, self-describing metrics and
lenient hook states. Nothing here touches a file; ``fnloop.checkpoint`` does.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from fnloop._metrics import Metrics
from fnloop._phase import Phase
from fnloop._state import TrainState, Unclaimed

__all__ = [
    "DTYPES",
    "CheckpointError",
    "CheckpointMismatch",
    "DamagedCheckpoint",
    "Record",
    "decode",
    "encode",
    "fill",
    "encode_state",
    "fill_state",
]


class CheckpointError(Exception):
    """A checkpoint could not be read, or does not fit the template; the message names the file."""


class DamagedCheckpoint(CheckpointError):
    """The file is not an intact fnloop checkpoint: unreadable, truncated, corrupted or foreign."""


class CheckpointMismatch(CheckpointError):
    """The file is intact but does not fit the template ``like``; the message names the entry."""


class Record(dict):  # type: ignore[type-arg]
    """A record (an attrs class or a NamedTuple) read without its class: field name -> value.

    ``kind`` is ``"record"`` (attrs) or ``"namedtuple"``; ``type`` is the
    qualified name of the class that was saved, for display only: loading
    rebuilds a record with the template's class.
    """

    __slots__ = ("kind", "type")

    def __init__(self, fields: Any = (), *, kind: str, type: str) -> None:
        super().__init__(fields)
        self.kind = kind
        self.type = type


# torch dtype -> the safetensors code for it. Tensors of other dtypes cannot be saved.
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.complex64: "C64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

SAVABLE = (
    "a checkpoint holds data only: None, bool, int, float, str, list, tuple, dict (str or int keys), "
    "attrs records, NamedTuples and dense tensors of the dtypes safetensors knows"
)
_FIX_SAVE = "Keep code and other objects out of the state: store the data they are built from."
FIX_TEMPLATE = "Build like= with the same code and configuration as the run that wrote the checkpoint."


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        # id(original tensor) -> (key, original); holding the original keeps its id unique.
        self.seen: dict[int, tuple[str, torch.Tensor]] = {}

    def node(self, value: Any, path: str) -> Any:
        kind = type(value)
        if value is None or kind is bool or kind is int or kind is str:
            return value
        if kind is float:
            return {"kind": "float", "value": repr(value)}
        if kind is Phase:
            return {"kind": "phase", "name": value.name}
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if kind is Unclaimed:
            return self.node(value.data, path)
        if kind is Record:
            return {"kind": value.kind, "type": value.type, "fields": self.pairs(value.items(), path, ".")}
        if attrs.has(kind):
            fields = [(f.name, getattr(value, f.name)) for f in attrs.fields(kind)]
            return {"kind": "record", "type": _type_name(kind), "fields": self.pairs(fields, path, ".")}
        if _is_namedtuple(value):
            fields = list(zip(kind._fields, value))
            return {"kind": "namedtuple", "type": _type_name(kind), "fields": self.pairs(fields, path, ".")}
        if isinstance(value, Mapping):
            for key in value:
                if type(key) is not str and type(key) is not int:
                    raise TypeError(
                        f"{path}: cannot save a dict key {key!r:.60} (a {type(key).__name__}); "
                        f"{SAVABLE}. Use str keys."
                    )
            return {"kind": "dict", "items": self.pairs(value.items(), path, "[")}
        if isinstance(value, (list, tuple)):
            items = [self.node(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return {"kind": "list" if isinstance(value, list) else "tuple", "items": items}
        what = "a function" if inspect.isroutine(value) else _a(kind.__name__)
        raise TypeError(f"{path}: cannot save {what} ({value!r:.60}); {SAVABLE}. {_FIX_SAVE}")

    def pairs(self, items: Any, path: str, style: str) -> list[list[Any]]:
        return [[k, self.node(v, f"{path}.{k}" if style == "." else f"{path}[{k!r}]")] for k, v in items]

    def tensor(self, value: torch.Tensor, path: str) -> dict[str, Any]:
        if value.layout is not torch.strided or value.is_quantized or value.device.type == "meta":
            raise TypeError(f"{path}: cannot save a {value.layout} tensor; {SAVABLE}. Save t.to_dense().")
        if value.dtype not in DTYPES:
            raise TypeError(f"{path}: cannot save a tensor of dtype {value.dtype}; {SAVABLE}.")
        shape = list(value.shape)
        dtype = str(value.dtype).removeprefix("torch.")
        seen = self.seen.get(id(value))
        if seen is not None:
            return {"kind": "tensor", "key": seen[0], "dtype": dtype, "shape": shape}
        key = path
        while key in self.tensors:  # distinct paths print alike only with odd keys; stay unique
            key += "'"
        self.seen[id(value)] = (key, value)
        # Views sharing storage need no clone: bytes are written from each tensor's own memory.
        self.tensors[key] = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
        return {"kind": "tensor", "key": key, "dtype": dtype, "shape": shape}


def encode(tree: Any, path: str = "state") -> tuple[Any, dict[str, torch.Tensor]]:
    """The skeleton of ``tree`` and its tensors (CPU, contiguous) keyed by path.

    The same tensor object reached twice is stored once.

    >>> skeleton, tensors = encode({"w": torch.zeros(2), "lr": 0.5})
    >>> skeleton["items"][1]
    ['lr', {'kind': 'float', 'value': '0.5'}]
    >>> list(tensors)
    ["state['w']"]

    Raises:
        TypeError: the tree holds something a checkpoint cannot hold; the path is named.
    """
    encoder = _Encoder()
    return encoder.node(tree, path), encoder.tensors


def _malformed(where: str, what: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(f"{where}: malformed skeleton: {what}. The file was not written by fnloop.")


def _field_names(node: dict[str, Any], where: str, key: str) -> list[list[Any]]:
    pairs = node.get(key)
    if type(pairs) is not list or not all(type(p) is list and len(p) == 2 for p in pairs):
        raise _malformed(where, f"'{key}' is not a list of [name, node] pairs")
    return pairs


def decode(node: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    """The plain tree a skeleton describes: containers, numbers, strings, tensors and ``Record``\\ s.

    ``where`` prefixes every error message (file and path).

    >>> skeleton, tensors = encode((1, 2.5, "x"))
    >>> decode(skeleton, tensors, "example: state")
    (1, 2.5, 'x')

    Raises:
        DamagedCheckpoint: the skeleton is not one ``encode`` writes.
    """
    kind = type(node)
    if node is None or kind is bool or kind is int or kind is str:
        return node
    if kind is not dict:
        raise _malformed(where, f"unexpected {kind.__name__} node")
    tag = node.get("kind")
    if tag == "float":
        text = node.get("value")
        try:
            return float(text)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise _malformed(where, f"bad float {text!r:.40}") from None
    if tag == "tensor":
        return _decode_tensor(node, tensors, where)
    if tag == "phase":
        name = node.get("name")
        if name not in Phase.__members__:
            raise _malformed(where, f"unknown phase {name!r:.40}")
        return Phase[name]
    if tag in ("list", "tuple"):
        items = node.get("items")
        if type(items) is not list:
            raise _malformed(where, f"'items' of a {tag} is not a list")
        out = [decode(v, tensors, f"{where}[{i}]") for i, v in enumerate(items)]
        return out if tag == "list" else tuple(out)
    if tag == "dict":
        out_dict: dict[Any, Any] = {}
        for key, value in _field_names(node, where, "items"):
            if type(key) is not str and type(key) is not int:
                raise _malformed(where, f"dict key {key!r:.40} is not a str or an int")
            out_dict[key] = decode(value, tensors, f"{where}[{key!r}]")
        return out_dict
    if tag in ("record", "namedtuple"):
        name = node.get("type")
        if type(name) is not str:
            raise _malformed(where, "a record without a type name")
        record = Record(kind=tag, type=name)
        for field, value in _field_names(node, where, "fields"):
            if type(field) is not str:
                raise _malformed(where, f"field name {field!r:.40} is not a str")
            record[field] = decode(value, tensors, f"{where}.{field}")
        return record
    raise _malformed(where, f"unknown node kind {tag!r:.40} (written by a newer fnloop?)")


def _decode_tensor(node: dict[str, Any], tensors: Mapping[str, torch.Tensor], where: str) -> torch.Tensor:
    key = node.get("key")
    tensor = tensors.get(key) if type(key) is str else None
    if tensor is None:
        raise _malformed(where, f"tensor {key!r:.60} is not in the file")
    if node.get("dtype") != str(tensor.dtype).removeprefix("torch.") or node.get("shape") != list(
        tensor.shape
    ):
        raise _malformed(where, f"tensor {key!r:.60} is described differently in the skeleton and the header")
    return tensor


def describe(value: Any) -> str:
    """A short phrase for ``value``'s kind, for error messages."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    if type(value) is Record:
        what = "NamedTuple" if value.kind == "namedtuple" else "record"
        return f"a {what} {value.type.rsplit('.', 1)[-1]} with fields {list(value)}"
    if attrs.has(type(value)):
        return f"a record {type(value).__qualname__}"
    if _is_namedtuple(value):
        return f"a NamedTuple {type(value).__qualname__}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of length {len(value)}"
    if isinstance(value, Mapping):
        return "a dict"
    return "None" if value is None else f"{_a(type(value).__name__)} ({value!r:.40})"


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiouAEIOU' else 'a'} {noun}"


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

    >>> fill({"w": torch.ones(2)}, {"w": torch.zeros(2)}, "f: state")
    {'w': tensor([1., 1.])}
    >>> try:
    ...     fill({"w": torch.ones(3)}, {"w": torch.zeros(2)}, "f: state")
    ... except CheckpointMismatch as e:
    ...     print(str(e).split(". ")[0])
    f: state['w']: expected shape (2,), got (3,)

    Raises:
        CheckpointMismatch: ``data`` does not fit ``like``; the message names the path.
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
    if _is_namedtuple(like):
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
            return _plain(data, where)
        if len(data) != len(like):
            raise mismatch(
                where, f"expected a {plain.__name__} of length {len(like)}, got length {len(data)}"
            )
        items = [fill(d, t, f"{where}[{i}]") for i, (d, t) in enumerate(zip(data, like))]
        return plain(items) if kind is plain else _build(kind, lambda: kind(items), where)
    raise mismatch(where, f"the template holds {describe(like)}, which no checkpoint can hold; {SAVABLE}")


def _plain(data: Any, where: str) -> Any:
    stack = [data]
    while stack:
        node = stack.pop()
        if type(node) is Record:
            raise mismatch(
                where,
                f"a saved {node.type} record cannot be rebuilt here: the template's sequence is "
                "empty, so it gives no type for its entries. Keep plain data (numbers, strings, "
                "tensors, tuples, dicts) in a collection that starts empty",
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


STATE_FIELDS = tuple(f.name for f in attrs.fields(TrainState) if f.name != "effects")
"""The fields of TrainState a checkpoint holds: all but ``effects``, which carry code."""


def encode_state(state: TrainState) -> tuple[Any, dict[str, torch.Tensor]]:
    """The skeleton and tensors of ``state`` (``encode`` of its fields but ``effects``)."""
    return encode(
        Record({n: getattr(state, n) for n in STATE_FIELDS}, kind="record", type="fnloop.TrainState")
    )


def fill_state(raw: Any, like: TrainState, where: str) -> TrainState:
    """The state that ``raw`` (a decoded checkpoint) holds, built like the template ``like``.

    Strict for the record's fields (``fill``); ``metrics`` as saved (its
    tensors on the device of ``like``'s parameters); hook states ``like`` knows
    strictly, the others as ``Unclaimed``, and ``like``'s other hooks as they are.

    Raises:
        CheckpointMismatch: an entry does not fit ``like``; the message names it.
    """
    if type(raw) is not Record or raw.kind != "record":
        raise mismatch(where, f"expected a TrainState record, got {describe(raw)}")
    missing = [n for n in STATE_FIELDS if n not in raw]
    unexpected = [n for n in raw if n not in STATE_FIELDS]
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
            values[name] = _hooks(raw[name], like.hooks, at)
        else:
            values[name] = fill(raw[name], getattr(like, name), at)
    try:
        return TrainState(**values)
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


_ABSENT: Any = object()


def _hooks(data: Any, like: Any, where: str) -> dict[str, Any]:
    """Known hook states strictly; unknown ones as ``Unclaimed``; absent ones from the template."""
    if type(data) is not dict or not all(type(k) is str for k in data):
        raise mismatch(where, f"expected a dict of hook states keyed by name, got {describe(data)}")
    hooks: dict[str, Any] = {}
    for name, value in data.items():
        template = like.get(name, _ABSENT)
        at = f"{where}[{name!r}]"
        if template is _ABSENT or type(template) is Unclaimed:
            hooks[name] = Unclaimed(data=value, decode=fill, where=at)
        else:
            hooks[name] = fill(value, template, at)
    for name, value in like.items():
        hooks.setdefault(name, value)
    return hooks
