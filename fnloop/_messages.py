"""Pieces of error messages shared by the validators."""

from __future__ import annotations


def got(value: object) -> str:
    """``got <value> that is a(n) <type>``, as attrs words it, with the article right.

    >>> got(-1), got("x")
    ('got -1 that is an int', "got 'x' that is a str")
    """
    name = type(value).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return f"got {value!r:.80} that is {article} {name}"
