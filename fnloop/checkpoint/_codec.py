"""A tree of data as a JSON skeleton plus named tensors, and back: the checkpoint's data model.

``encode`` turns a tree (``None``, bools, ints, floats, strs, lists, tuples,
dicts, attrs records, NamedTuples and tensors) into a JSON-able *skeleton*
whose every node says what it is, with the tensors set aside under their path.
``decode`` reads a skeleton back *without* the code that made it: records come
back as ``Record`` dicts. ``fnloop.checkpoint._fill`` then checks that plain tree against
a template built from code, and ``fnloop.checkpoint._state_codec`` applies the
checkpoint's policy to a whole ``TrainState``. Nothing here touches a file;
``fnloop.checkpoint`` does.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from fnloop._core.phase import Phase
from fnloop._core.state import Unclaimed
from fnloop._core.tree import children, record_fields

__all__ = [
    "DTYPES",
    "SAVABLE",
    "CheckpointError",
    "CheckpointMismatch",
    "DamagedCheckpoint",
    "Record",
    "decode",
    "encode",
    "is_namedtuple",
    "type_name",
    "with_article",
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


def type_name(cls: type) -> str:
    """The name a checkpoint records for a record of class ``cls``: its module and qualified name."""
    return f"{cls.__module__}.{cls.__qualname__}"


def is_namedtuple(value: object) -> bool:
    """Whether ``value`` is a NamedTuple (a tuple whose class has ``_fields``)."""
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def with_article(noun: str) -> str:
    """``noun`` after "a" or "an", for messages: ``with_article("int")`` is ``'an int'``."""
    return f"{'an' if noun[:1] in 'aeiouAEIOU' else 'a'} {noun}"


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
            fields = [(name, getattr(value, name)) for name in record_fields(kind) or ()]
            return {"kind": "record", "type": type_name(kind), "fields": self.pairs(fields, path, ".")}
        if is_namedtuple(value):
            fields = list(zip(kind._fields, value))
            return {"kind": "namedtuple", "type": type_name(kind), "fields": self.pairs(fields, path, ".")}
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
        what = "a function" if inspect.isroutine(value) else with_article(kind.__name__)
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

    Raises:
        TypeError: the tree holds something a checkpoint cannot hold; the path is named.

    Examples:
        >>> skeleton, tensors = encode({"w": torch.zeros(2), "lr": 0.5})
        >>> skeleton["items"][1]
        ['lr', {'kind': 'float', 'value': '0.5'}]
        >>> list(tensors)
        ["state['w']"]
    """
    skeleton, tensors, _ = encode_keyed(tree, path)
    return skeleton, tensors


def encode_keyed(tree: Any, path: str = "state") -> tuple[Any, dict[str, torch.Tensor], dict[int, str]]:
    """``encode``, and the key each of the tree's own tensors is stored under (``id(tensor) -> key``)."""
    encoder = _Encoder()
    try:
        skeleton = encoder.node(tree, path)
        return skeleton, encoder.tensors, {i: key for i, (key, _) in encoder.seen.items()}
    except RecursionError:
        where = _deepest(tree, path)
    raise TypeError(
        f"{where}: nested deeper than a checkpoint can hold (Python's recursion limit, "
        f"{sys.getrecursionlimit()} frames, is reached at about half as many levels); {SAVABLE}. "
        "Keep hook states and extra shallow: a flat list or a tensor instead of nested lists."
    )


def _deepest(tree: Any, path: str, depth: int = 200) -> str:
    """The path of the first node ``depth`` levels down in ``tree``, walked without recursion."""
    stack = [(tree, path, 0)]
    while stack:
        node, at, level = stack.pop()
        if level >= depth:
            shown = at if len(at) <= 120 else at[:100] + "..."
            return f"{shown} ({level} levels down)"
        kind = type(node)
        if kind is Unclaimed:
            stack.append((node.data, at, level))
        elif kind is Record:
            stack += [(v, f"{at}.{k}", level + 1) for k, v in node.items()]
        elif (kids := children(node)) is not None:
            stack += [(v, at + step, level + 1) for step, v in kids]
    return path


def _malformed(where: str, what: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(f"{where}: malformed skeleton: {what}. The file was not written by fnloop.")


def _field_names(node: dict[str, Any], where: str, key: str) -> list[list[Any]]:
    pairs = node.get(key)
    if type(pairs) is not list or not all(type(p) is list and len(p) == 2 for p in pairs):
        raise _malformed(where, f"'{key}' is not a list of [name, node] pairs")
    return pairs


def decode(node: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    """The plain tree a skeleton describes: containers, numbers, strings, tensors and ``Record``s.

    ``where`` prefixes every error message (file and path).

    Raises:
        DamagedCheckpoint: the skeleton is not one ``encode`` writes.

    Examples:
        >>> skeleton, tensors = encode((1, 2.5, "x"))
        >>> decode(skeleton, tensors, "example: state")
        (1, 2.5, 'x')
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
            if type(text) is not str:
                raise TypeError
            return float(text)
        except (TypeError, ValueError):
            raise _malformed(where, f"bad float {text!r:.40}") from None
    if tag == "tensor":
        return _decode_tensor(node, tensors, where)
    if tag == "phase":
        name = node.get("name")
        if type(name) is not str or name not in Phase.__members__:
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
