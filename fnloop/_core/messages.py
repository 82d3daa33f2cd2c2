"""Pieces of error messages shared by the validators, and the validators many records share."""

from __future__ import annotations

import os

import attrs


def got(value: object) -> str:
    """``got <value> that is a(n) <type>``, as attrs words it, with the article right.

    Examples:
        >>> got(-1), got("x")
        ('got -1 that is an int', "got 'x' that is a str")
    """
    return f"got {value!r:.80} that is {a_type(value)}"


def a_type(value: object) -> str:
    """``a(n) <type>`` of ``value``, with the article right.

    Examples:
        >>> a_type(1), a_type("x")
        ('an int', 'a str')
    """
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def describe(obj: object) -> str:
    """A short name for ``obj`` in reprs and messages: a function's (or callable's) name, else its repr.

    Examples:
        >>> describe(len), describe(3)
        ('len', '3')
    """
    name = getattr(obj, "__qualname__", None)
    if callable(obj) and isinstance(name, str) and not isinstance(obj, type):
        return name
    return repr(obj)


def a_path(value: object, name: str = "path") -> str:
    """``value`` as a path string (``os.fspath``), refused unless it is a non-empty str or ``os.PathLike``.

    Examples:
        >>> a_path("runs/a")
        'runs/a'
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"'{name}' must be a str or os.PathLike ({got(value)}).")
    path = os.fspath(value)
    if not path:
        raise ValueError(f"'{name}' is empty; give the path to write to, for example 'runs/a/metrics.jsonl'.")
    return path


# The attrs validators most records share; a record-specific one lives beside its record.


def positive_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """attrs validator: an int of at least 1."""
    if type(value) is not int or value < 1:
        raise ValueError(f"'{attribute.name}' must be a positive int ({got(value)}).")


def non_negative_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """attrs validator: an int of at least 0."""
    if type(value) is not int or value < 0:
        raise ValueError(f"'{attribute.name}' must be a non-negative int ({got(value)}).")


def non_empty_str(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """attrs validator: a str with at least one character (a hook state's name, say)."""
    if type(value) is not str or not value:
        raise ValueError(f"'{attribute.name}' must be a non-empty str ({got(value)}).")
