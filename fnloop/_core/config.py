"""A run's configuration as a state holds it: plain data, compared key by key.

``plain(value)`` turns the user's record of settings (an attrs instance, a
dataclass, or a mapping) into the nested dict of str, numbers, bools, ``None``
and tuples that ``TrainState.config`` keeps, which a checkpoint saves and any
process reads back without the user's class. ``changes(saved, now)`` names
what differs between two of them, as ``resume`` and ``fnloop diff`` report it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Mapping
from typing import Any

import attrs

from fnloop._core.messages import got

__all__ = ["changes", "flat", "plain"]

_LEAVES = (str, int, float, bool, type(None))


DEPTH = 100
"""How deep a configuration's records and mappings may nest (a cycle would otherwise recurse forever)."""


def plain(value: object, where: str = "config") -> dict[str, Any] | None:
    """``value`` as ``TrainState.config`` keeps it: a dict of plain data (``None`` stays ``None``).

    An attrs instance or a dataclass becomes the dict of its fields, nested
    records included; lists become tuples; a path becomes its str and an
    enum its value, so that what is saved reads back equal.

    Raises:
        TypeError: ``value`` is not a record or a mapping, or holds something
            a checkpoint could not read back as plain data (a tensor, a
            function, an object of the user's); the message names where.

    Examples:
        >>> @attrs.frozen
        ... class Opt:
        ...     lr: float = 0.1
        ...     betas: tuple = (0.9, 0.99)
        >>> plain({"steps": 10, "opt": Opt(), "tags": ["a", "b"]})
        {'steps': 10, 'opt': {'lr': 0.1, 'betas': (0.9, 0.99)}, 'tags': ('a', 'b')}
    """
    if value is None:
        return None
    found = _node(value, where, 0)
    if not isinstance(found, dict):
        raise TypeError(
            f"'{where}' must be the run's settings: an attrs record, a dataclass or a mapping of names "
            f"to values ({got(value)}); see docs/config.md."
        )
    return found


def _node(value: object, where: str, depth: int) -> Any:
    if type(value) in _LEAVES:
        return value
    if depth > DEPTH:
        raise TypeError(
            f"'{where[:120]}...' nests records, mappings or lists more than {DEPTH} deep (or one holds "
            "itself): a run's configuration is a tree of settings. Flatten it, or keep the deep part "
            "out of the configuration."
        )
    depth += 1
    if isinstance(value, enum.Enum):
        return _node(value.value, where, depth)
    for kind in (bool, int, float, str):  # a subclass of one: as the plain type
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if attrs.has(type(value)):
        fields = attrs.fields(type(value))  # type: ignore[arg-type]
        return {f.name: _node(getattr(value, f.name), f"{where}.{f.name}", depth) for f in fields}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _node(getattr(value, f.name), f"{where}.{f.name}", depth)
            for f in dataclasses.fields(value)
        }
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise TypeError(f"'{where}' has a key that is not a str ({got(key)}); name settings by str.")
            out[key] = _node(item, f"{where}.{key}", depth)
        return out
    if isinstance(value, (list, tuple)):
        return tuple(_node(item, f"{where}[{i}]", depth) for i, item in enumerate(value))
    raise TypeError(
        f"'{where}' is not plain data ({got(value)}): a run's configuration holds str, numbers, bools, "
        "None, lists, mappings and records of those, so that a checkpoint reads it back anywhere. "
        "Keep the setting that builds this object (a name, a number) in the configuration instead."
    )


def flat(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``config`` as dotted keys to leaves (``{"opt": {"lr": 0.1}}`` -> ``{"opt.lr": 0.1}``).

    A key that holds a dot itself is quoted (``{"a.b": 1}`` -> ``{'["a.b"]': 1}``),
    so that it never takes the name of a nested one.

    Examples:
        >>> flat({"a.b": 1, "a": {"b": 2}})
        {'["a.b"]': 1, 'a.b': 2}
    """
    return {_dotted(path): value for path, value in _paths(config or {}, ())}


def _paths(config: Mapping[str, Any], prefix: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
    out: list[tuple[tuple[str, ...], Any]] = []
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out += _paths(value, (*prefix, key))
        else:
            out.append(((*prefix, key), value))
    return out


def _dotted(path: tuple[str, ...]) -> str:
    named = [
        key if key and "." not in key and "[" not in key else f"[{key!r}]".replace("'", '"') for key in path
    ]
    return "".join(k if i == 0 or k.startswith("[") else f".{k}" for i, k in enumerate(named))


def _same(a: object, b: object) -> bool:
    """Equal settings: a NaN equals itself; ``True`` is not ``1``."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def changes(saved: Mapping[str, Any] | None, now: Mapping[str, Any] | None) -> list[str]:
    """What differs from ``saved`` to ``now``, one ``key: saved -> now`` per setting, in dotted keys.

    Examples:
        >>> changes({"lr": 0.1, "opt": {"wd": 0.0}, "old": 1}, {"lr": 0.3, "opt": {"wd": 0.0}, "new": 2})
        ['lr: 0.1 -> 0.3', 'old: 1 -> (absent)', 'new: (absent) -> 2']
    """
    for name, given in (("saved", saved), ("now", now)):
        if given is not None and not isinstance(given, Mapping):
            raise TypeError(
                f"changes() compares two configurations, each a mapping of settings (as state.config "
                f"holds them) or None; '{name}' is not ({got(given)})."
            )
    a, b = flat(saved), flat(now)
    out = []
    for key in [*a, *(k for k in b if k not in a)]:
        if key not in b:
            out.append(f"{key}: {a[key]!r} -> (absent)")
        elif key not in a:
            out.append(f"{key}: (absent) -> {b[key]!r}")
        elif not _same(a[key], b[key]):
            out.append(f"{key}: {a[key]!r} -> {b[key]!r}")
    return out
