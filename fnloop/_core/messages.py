"""Pieces of error messages shared by the validators, and the validators many records share."""

from __future__ import annotations

import os
from pathlib import Path

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


def a_path(value: object, name: str = "path", where: str = "") -> str:
    """``value`` as a path string (``os.fspath``), refused unless it is a non-empty str or ``os.PathLike``.

    A NUL byte is refused too: no file system can name a file with one.
    ``where`` (``"fnloop.writers.csv()"``) begins the messages, when given.

    Examples:
        >>> a_path("runs/a")
        'runs/a'
    """
    at = f"{where}: " if where else ""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{at}'{name}' must be a str or os.PathLike ({got(value)}).")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"{at}'{name}' must be a str or os.PathLike of a str ({got(value)}).")
    if not path:
        raise ValueError(
            f"{at}'{name}' is empty; give the path to write to, for example 'runs/a/metrics.jsonl'."
        )
    nul = path.find("\0")
    if nul >= 0:
        raise ValueError(
            f"{at}'{name}' holds a NUL byte at position {nul} (got {path!r:.80}), which no file "
            "system allows in a path; give the path without it."
        )
    return path


def unwritable(path: Path, *, directory: bool) -> str | None:
    """Why a run could not write ``path`` (a directory if ``directory``, else a file), or ``None``.

    The nearest part of ``path`` that exists decides: a file where a directory
    must be, a directory where the file must be, or a directory not writable.

    Examples:
        >>> import tempfile
        >>> unwritable(Path(tempfile.mkdtemp()) / "runs" / "metrics.csv", directory=False) is None
        True
    """
    if path.exists() and not directory and path.is_dir():
        return f"{path} is a directory, not a file"
    existing = path if directory or not path.exists() else path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


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
