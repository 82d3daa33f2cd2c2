"""A run's configuration: a typed record of its settings, from TOML or YAML files and ``--key=value`` flags.

Write the settings as an attrs record (frozen, as the state is), each field
typed, with a default and a docstring; nested records make sections::

    @attrs.frozen
    class Settings:
        steps: int = 500
        \"\"\"How many steps to train.\"\"\"
        lr: float = 0.1
        \"\"\"The peak learning rate.\"\"\"

    settings = fnloop.config.parse(Settings)   # python train.py --config run.toml --lr=0.3
    state = fnloop.init(model, optimizer, seed=0, max_iter=settings.steps, config=settings)

``parse`` reads the command line with jsonargparse, the parser behind
LightningCLI: ``--config FILE`` (TOML for ``.toml``, YAML or JSON otherwise;
several, each over the one before), then flags over the files, a nested
record's fields as ``--section.key=value``; ``--help`` lists every setting with
its type, default and docstring; ``--print_config`` prints the settings as
parsed. ``init(..., config=...)`` keeps the record in ``state.config`` as plain
data, so every checkpoint holds it, ``fnloop inspect`` shows it, ``fnloop
diff`` compares it, and ``fnloop.checkpoint.resume`` names each setting that
changed since the run was saved.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

import attrs

from fnloop._core.config import changes, plain
from fnloop._core.messages import got

__all__ = ["as_dict", "changes", "parse", "parser"]

T = TypeVar("T")

MISSING = 'fnloop.config needs jsonargparse, the parser behind LightningCLI. Install it with: pip install "jsonargparse[signatures,toml]" (from a checkout of fnloop: pip install -e ".[config]")'

_TOML = (".toml",)


def _jsonargparse() -> Any:
    try:
        import jsonargparse
    except ImportError as exc:
        raise ImportError(MISSING) from exc
    return jsonargparse


def _record_class(cls: object, where: str) -> None:
    if not (isinstance(cls, type) and attrs.has(cls)):
        raise TypeError(
            f"{where} expected the class of the run's settings, an attrs record such as "
            f"@attrs.frozen class Settings: lr: float = 0.1 ({got(cls)}); see docs/config.md."
        )


def parser(cls: type, *, prog: str | None = None, description: str | None = None, mode: str = "yaml") -> Any:
    """The jsonargparse ``ArgumentParser`` that ``parse`` reads the settings ``cls`` with.

    ``mode`` is how the files and values are read: ``"yaml"`` (YAML and
    JSON) or ``"toml"``; ``parse`` picks it from the ``--config`` files'
    names. Most scripts need ``parse`` alone: keep every setting in the
    record, so that the checkpoints hold them all.

    Raises:
        TypeError: ``cls`` is not an attrs class.
        ImportError: jsonargparse is not installed (``pip install "jsonargparse[signatures,toml]"``).
    """
    _record_class(cls, "fnloop.config.parser()")
    jsonargparse = _jsonargparse()
    jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
    doc = (cls.__doc__ or "").strip().split("\n\n")[0] or None
    made = jsonargparse.ArgumentParser(prog=prog, description=description or doc, parser_mode=mode)
    made.add_argument(
        "--config",
        action="config",
        help="a file of settings: TOML (.toml), YAML or JSON; several apply in order, flags over them",
    )
    made.add_class_arguments(cls, None, fail_untyped=True, sub_configs=True)
    return made


def _mode(args: Sequence[str]) -> str:
    """``"toml"`` when the ``--config`` files are TOML, else ``"yaml"``; refuses a mix."""
    files = [b for a, b in itertools.pairwise(args) if a == "--config"]
    files += [a.partition("=")[2] for a in args if a.startswith("--config=")]
    toml = {f.lower().endswith(_TOML) for f in files}
    if len(toml) > 1:
        raise ValueError(
            f"--config was given TOML and other files ({files}): one run's files are read in one "
            "format. Write them all as TOML, or all as YAML."
        )
    return "toml" if toml == {True} else "yaml"


def _booleans(cls: type, prefix: str = "") -> set[str]:
    """The dotted names of ``cls``'s bool fields, nested records' included."""
    found: set[str] = set()
    with contextlib.suppress(NameError):  # a type named by a string the module lacks: as written
        attrs.resolve_types(cls)
    for field in attrs.fields(cls):
        if field.type is bool or field.type == "bool":
            found.add(prefix + field.name)
        elif isinstance(field.type, type) and attrs.has(field.type):
            found |= _booleans(field.type, f"{prefix}{field.name}.")
    return found


def _as_typed(cls: type, argv: list[str]) -> list[str]:
    """``argv`` with flags written as argparse users write them, as jsonargparse reads them.

    ``--max-iter`` is ``--max_iter``; a bool setting alone (``--eager``) is
    ``--eager=true``, and ``--no-eager`` is ``--eager=false``. Values are left as they are.
    """
    booleans = _booleans(cls)
    out = []
    for i, arg in enumerate(argv):
        if not arg.startswith("--") or arg == "--":
            out.append(arg)
            continue
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        bare = not eq and (i + 1 == len(argv) or argv[i + 1].startswith("--"))
        if bare and name in booleans:
            arg = f"--{name}=true"
        elif bare and name.startswith("no_") and name[3:] in booleans:
            arg = f"--{name[3:]}=false"
        else:
            arg = f"--{name}{eq}{value}"
        out.append(arg)
    return out


def parse(
    cls: type[T],
    args: Sequence[str] | None = None,
    *,
    prog: str | None = None,
    description: str | None = None,
) -> T:
    """The settings ``cls`` (an attrs class) read from ``args`` (``sys.argv[1:]`` if None).

    Defaults come from ``cls``; each ``--config FILE`` sets what it names,
    in order (TOML for ``.toml``; YAML, of which JSON is a part, otherwise);
    each ``--key=value`` (or ``--key value``) flag then sets one field, a
    nested record's as ``--section.key=value``. As with argparse, a dash is an
    underscore (``--max-iter`` sets ``max_iter``), and a bool setting may be
    given alone (``--eager``; ``--no-eager`` for false). Values are checked against
    the fields' types, and the record is built through its own ``__init__``
    (its validators run). ``--help`` lists the settings with their types,
    defaults and docstrings; ``--print_config`` prints them as parsed, as a
    file ``--config`` reads.

    An unknown flag, a wrong type or a missing file ends the program with
    the parser's message and status 2, as any command-line tool does.

    Raises:
        TypeError: ``cls`` is not an attrs class.
        ValueError: TOML and YAML files are mixed.
        ImportError: jsonargparse is not installed (``pip install "jsonargparse[signatures,toml]"``).

    Examples:
        >>> @attrs.frozen
        ... class Settings:
        ...     steps: int = 500
        ...     lr: float = 0.1
        >>> parse(Settings, ["--lr=0.3"])
        Settings(steps=500, lr=0.3)
    """
    _record_class(cls, "fnloop.config.parse()")
    if args is not None and (isinstance(args, (str, bytes)) or not all(isinstance(a, str) for a in args)):
        raise TypeError(
            f"fnloop.config.parse(cls, args): args is a list of the command line's words, as "
            f"sys.argv[1:] ({got(args)}); pass [{args!r}] for one, or args.split() for a line."
        )
    argv = _as_typed(cls, list(sys.argv[1:] if args is None else args))
    if prog is None and args is None:
        prog = os.path.basename(sys.argv[0]) or None
    made = parser(cls, prog=prog, description=description, mode=_mode(argv))
    found = made.instantiate(made.parse_args(argv))
    fields = attrs.fields(cls)  # type: ignore[arg-type]
    return cls(**{f.alias: found[f.name] for f in fields if f.init})


def as_dict(config: object) -> dict[str, Any]:
    """``config`` (an attrs record, a dataclass or a mapping) as the plain dict a state keeps.

    Examples:
        >>> @attrs.frozen
        ... class Settings:
        ...     lr: float = 0.1
        ...     betas: tuple = (0.9, 0.99)
        >>> as_dict(Settings())
        {'lr': 0.1, 'betas': (0.9, 0.99)}
    """
    found = plain(config, "as_dict(config)")
    if found is None:
        raise TypeError("as_dict() expected the run's settings, got None.")
    return found
