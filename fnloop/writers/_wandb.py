"""The Weights & Biases writer. Re-exported by ``fnloop.writers``.

W&B keeps a run's history on its server, and it can cut it back itself: its
rewind, ``wandb.init(id=..., resume_from="<id>?_step=<s>")``, keeps the history
up to step ``s`` and takes new rows from ``s + 1`` on (the client starts the
run at ``s + 1``: wandb-core's ``runbranch/rewind.go``). So a run resumed at
iteration ``k`` continues the same W&B run, by its id, rewound to ``k - 1``:
the lines the interrupted attempt logged at ``k`` and later are replaced, as
the JSON lines file is cut back to the lines before ``k``.

Every attempt of a run must know the id without being told it by the one
before (a killed process tells nothing): it is ``id=``, as Lightning's
``WandbLogger(id=...)``, or, without one, a digest of the project and
``name=``. A writer with neither makes a new W&B run at each attempt.

The writer holds its run as the file writers hold a file: a lock file in W&B's
directory, ``wandb/fnloop/.<id>.json.lock`` (``fnloop._atomic``'s, which the
kernel drops with its process), and beside it ``wandb/fnloop/<id>.json``, the
record that an attempt of this id began there, so a restart from iteration 0
rewinds the run too instead of adding a second history to it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs

from fnloop._atomic import DirectoryInUse, claim_file, write_atomically
from fnloop._atomic import release as release_claim
from fnloop._core.messages import a_path, got
from fnloop.writers._line import _writable

__all__ = ["Wandb", "wandb"]


class _Line(Protocol):
    """What the writer reads of a ``fnloop.writers.Line`` (which imports this module: no import back)."""

    iteration: int

    def values(self) -> dict[str, float]: ...


WANDB_MISSING = (
    "fnloop.writers.wandb needs Weights & Biases' client (wandb 0.19.10 or later), which is not "
    'installed. Install it with: pip install "wandb>=0.19.10" (from a checkout of fnloop: pip install -e ".[wandb]")'
)

WANDB_TOO_OLD = (
    "fnloop.writers.wandb needs wandb 0.19.10 or later, for wandb.init(reinit='create_new') (one W&B "
    "run per writer, however many runs the process has), and this is wandb {version}. Upgrade it with: "
    'pip install -U "wandb>=0.19.10"'
)

IN_USE = (
    "two writers of one W&B run would log every step twice and rewind each other's history when one "
    "resumes. Wait for that run to end or stop it, or give this run another id= (or name=)."
)

_RESERVED = "/\\#?%:;,'"  # what W&B refuses in a run id (wandb.init's docs and its settings' check)


def _module() -> Any:
    """The ``wandb`` module, refused with the fix when it is missing or too old for ``reinit='create_new'``."""
    try:
        import wandb as module
    except ImportError as exc:
        raise ImportError(WANDB_MISSING) from exc
    version = str(getattr(module, "__version__", "0"))
    if tuple(int(n) for n in re.findall(r"\d+", version)[:3]) < (0, 19, 10):
        raise ImportError(WANDB_TOO_OLD.format(version=version))
    return module


# -- what the writer is built from ---------------------------------------------------------------------

_WHAT = {
    "project": "the W&B project's name, such as 'digits'",
    "name": "the run's display name, such as name='seed-0'; without id=, the run's id is derived from it",
    "id": (
        "the W&B run id every attempt of the run shares, such as id='seed-0' (Lightning's "
        "WandbLogger(id=...)); a resumed run rewinds the run of that id"
    ),
    "entity": "the W&B user or team the project belongs to; None for your default entity",
    "mode": "'online', 'offline', or None for W&B's default (WANDB_MODE, else online)",
}


def _text(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """attrs validator: a non-empty str, or ``None`` for every field but ``project``."""
    optional = attribute.name != "project"
    if value is None and optional:
        return
    if not isinstance(value, str):
        wanted = "a str or None" if optional else "a non-empty str"
        raise TypeError(f"'{attribute.name}' must be {wanted} ({got(value)}): {_WHAT[attribute.name]}.")
    if not value.strip():
        wanted = "a non-empty str or None" if optional else "a non-empty str"
        raise ValueError(f"'{attribute.name}' must be {wanted} ({got(value)}): {_WHAT[attribute.name]}.")
    reserved = {"id": _RESERVED, "project": "/\\#?%:"}.get(attribute.name, "")
    if any(c in value for c in reserved) or (attribute.name == "id" and value != value.strip()):
        raise ValueError(
            f"'{attribute.name}' must hold none of the characters {' '.join(reserved)} and no leading or "
            f"trailing space ({got(value)}): W&B refuses them in a {attribute.name}. "
            f"{_WHAT[attribute.name][0].upper()}{_WHAT[attribute.name][1:]}."
        )


def _mode(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value not in (None, "online", "offline"):
        raise ValueError(f"'mode' must be 'online', 'offline' or None ({got(value)}): {_WHAT['mode']}.")


def _dir(value: object) -> str | None:
    return None if value is None else a_path(value, "dir", where="fnloop.writers.wandb()")


def _json(value: object, where: str) -> Any:
    """``value`` as JSON data, refused with its place in the config when it is not."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(
                    f"'config' keys must be str: {where} has the key {key!r}, {got(key)[4:]}. W&B keeps "
                    "the config as JSON, whose keys are strings; convert it (str(key))."
                )
        return {key: _json(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise TypeError(
        f"{where} must be JSON data: a number, str, bool, None, list or mapping ({got(value)}). W&B keeps "
        "the config as JSON; convert the value before passing it (str(path), enum.value, ...)."
    )


def _config_pairs(value: object) -> tuple[tuple[str, str], ...]:
    """``config`` as the record keeps it: (key, the value as JSON text) pairs, W&B's own ConfigItem."""
    if value is None:
        return ()
    if attrs.has(type(value)):
        value = attrs.asdict(value)  # type: ignore[arg-type]
    if isinstance(value, Mapping):
        data = _json(value, "config")
        return tuple((key, json.dumps(item)) for key, item in data.items())
    if isinstance(value, tuple) and all(
        isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(x, str) for x in pair) for pair in value
    ):
        return value  # the record's own (attrs.evolve)
    raise TypeError(
        f"'config' must be a mapping, an attrs instance or None ({got(value)}): the run's settings, "
        "such as config={'lr': 0.1, 'seed': 0}, logged once as the W&B run's config."
    )


def derived_id(project: str, name: str) -> str:
    """The run id of a writer given ``name=`` and no ``id=``: the same in every attempt of the run.

    Examples:
        >>> derived_id("digits", "seed-0")
        'fnloop-090d3f4c06ec96be'
    """
    digest = hashlib.sha256(json.dumps([project, name]).encode("utf-8")).hexdigest()
    return f"fnloop-{digest[:16]}"


# -- the live runs of this process ---------------------------------------------------------------------

_LIVE: dict[tuple[int, str, str | None, Any], Any] = {}
"""(process id, root directory, run id or None, the writer) -> the live ``wandb.Run``; a fork opens its own."""


@attrs.frozen
class Wandb:
    """Logs metrics to a Weights & Biases run; build it with ``fnloop.writers.wandb``."""

    project: str = attrs.field(validator=_text)
    name: str | None = attrs.field(validator=_text)
    id: str | None = attrs.field(validator=_text)
    entity: str | None = attrs.field(validator=_text)
    dir: str | None = attrs.field(converter=_dir)
    mode: str | None = attrs.field(validator=_mode)
    config: tuple[tuple[str, str], ...] = attrs.field(converter=_config_pairs)

    @property
    def run_id(self) -> str | None:
        """The W&B run id every attempt shares: ``id``, else derived from the project and ``name``; or None."""
        if self.id is not None:
            return self.id
        return None if self.name is None else derived_id(self.project, self.name)

    @property
    def root(self) -> str:
        """The directory W&B's ``wandb`` directory is in: ``dir``, else ``$WANDB_DIR``, else the working one."""
        return os.path.abspath(self.dir or os.environ.get("WANDB_DIR") or os.getcwd())

    @property
    def target(self) -> str | None:
        """The record of the run in W&B's directory, ``<root>/wandb/fnloop/<id>.json``; None without an id.

        ``log`` refuses two of its writers with one target: they would log every step twice.
        """
        run_id = self.run_id
        return None if run_id is None else os.path.join(self.root, "wandb", "fnloop", f"{run_id}.json")

    def _what(self) -> str:
        return f"W&B run {self.run_id!r} (project {self.project!r}, directory {self.root})"

    def claim(self, owner: object = None) -> None:
        """Hold the run for ``owner``: refused (``DirectoryInUse``) while another live process, or another
        owner in this one, holds it. A run without ``id`` or ``name`` is never shared: nothing to hold."""
        target = self.target
        if target is None:
            return
        try:
            claim_file(Path(target), owner)
        except DirectoryInUse as exc:
            raise DirectoryInUse(
                f"{self._what()} is held by another writer: {exc} For W&B: {IN_USE}"
            ) from None

    def release(self, owner: object = None) -> bool:
        """Give back one ``claim`` by ``owner``; whether one was (``True`` for a run that holds nothing)."""
        target = self.target
        return True if target is None else release_claim(Path(target), owner)

    @property
    def _key(self) -> tuple[int, str, str | None, Any]:
        return (os.getpid(), self.root, self.run_id, self if self.run_id is None else None)

    def start(self, iteration: int) -> None:
        """Open the W&B run: a new one at iteration 0, else the same run rewound to ``iteration - 1``.

        A run of this id already begun from this directory (a restart from 0
        after a kill) is rewound to step 0. A run this process left open (an
        attempt that raised) is finished first, as failed (exit code 1).
        """
        self._finish(exit_code=1)
        module = _module()
        run_id, target = self.run_id, self.target
        options: dict[str, Any] = {
            "project": self.project,
            "entity": self.entity,
            "name": self.name,
            "dir": self.root,
            "mode": self.mode,
            "config": {key: json.loads(text) for key, text in self.config},
            "reinit": "create_new",  # this writer's own run: other runs of the process go on
        }
        if run_id is None:
            if iteration > 0:
                warnings.warn(
                    f"fnloop.writers.wandb: this run resumes at iteration {iteration}, but the writer has "
                    "no id= or name=, so W&B starts a new run: the history before the resume is in the "
                    "run of the earlier attempt. Give the writer the same id= (or name=) in every "
                    "attempt of a run.",
                    stacklevel=3,
                )
        else:
            options["id"] = run_id
            if iteration > 0 or (target is not None and os.path.exists(target)):
                options["resume_from"] = f"{run_id}?_step={max(iteration - 1, 0)}"
        Path(self.root).mkdir(parents=True, exist_ok=True)
        _LIVE[self._key] = module.init(**options)
        if target is not None:
            record = {"id": run_id, "project": self.project, "entity": self.entity, "name": self.name}
            data = json.dumps(record).encode("utf-8")
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            write_atomically(Path(target), lambda fd: os.write(fd, data))

    def write(self, line: _Line) -> None:
        """Log the newest value of each metric at W&B step ``line.iteration``.

        Two lines of one iteration (a metric recorded at the end of the run,
        after the line of its last step) make one row: W&B merges the logs of
        one step until a later step is logged.
        """
        run = _LIVE.get(self._key)
        if run is None:  # written without a start (a writer used on its own)
            self.start(0)
            run = _LIVE[self._key]
        run.log(line.values(), step=line.iteration)

    def close(self) -> None:
        """Finish the W&B run, if this process has it open."""
        self._finish(exit_code=None)

    def _finish(self, exit_code: int | None) -> None:
        run = _LIVE.pop(self._key, None)
        if run is not None:
            run.finish(exit_code=exit_code)


def wandb(
    project: str = "fnloop",
    *,
    name: str | None = None,
    id: str | None = None,
    entity: str | None = None,
    dir: str | os.PathLike[str] | None = None,
    mode: str | None = None,
    config: Mapping[str, Any] | Any | None = None,
) -> Wandb:
    """A writer of metrics to a Weights & Biases run, in ``project`` (of ``entity``, your default if None).

    Each write logs the newest value of each metric at W&B step
    ``iteration`` (the JSON lines' numbers; W&B's ``_step``); ``config`` (a
    mapping, or an attrs instance, converted with ``attrs.asdict``) is the
    run's config, given to ``wandb.init`` when an attempt begins.

    Give every attempt of a run the same ``id`` (Lightning's
    ``WandbLogger(id=...)``), or the same ``name`` (the id is then
    ``fnloop-<digest of project and name>``, see ``derived_id``). A run
    resumed at iteration ``k`` then continues that W&B run, rewound with
    ``resume_from="<id>?_step=<k - 1>"``: W&B keeps its history up to step
    ``k - 1`` (archiving the rest) and takes the resumed run's rows from
    ``k`` on, so nothing is repeated or abandoned past the resume. A run
    started from 0 with the id of a run begun in the same directory (a
    restart after a kill before any checkpoint) is rewound to step 0. Without
    ``id`` or ``name`` each attempt is a new W&B run (a resume warns).

    While a live process writes the run, another writer of that id in the
    same W&B directory (``dir``, else ``$WANDB_DIR``, else the working
    directory) is refused with ``fnloop.hooks.DirectoryInUse`` before it
    writes anything, as a log file held by a run is; so is a second ``log``
    hook of one process on it. The lock dies with its process: the run of a
    killed attempt is taken over by the next. Writers in other directories,
    or on other machines, are not seen from here.
    Needs wandb 0.19.10 or later (``pip install -e ".[wandb]"`` from a checkout).

    Raises:
        TypeError: an argument of the wrong type (``id`` not a str,
            ``config`` not a mapping or holding something that is not JSON
            data, ...).
        ValueError: ``project``, ``name``, ``id`` or ``entity`` empty; a
            character W&B refuses in ``project`` or ``id``; ``mode`` not
            ``'online'``, ``'offline'`` or None; ``dir`` a directory the run
            cannot write.

    Examples:
        >>> writer = wandb("digits", name="seed-0", config={"lr": 0.1, "layers": [64, 64]})
        >>> writer.run_id, writer.config
        ('fnloop-090d3f4c06ec96be', (('lr', '0.1'), ('layers', '[64, 64]')))
    """
    writer = Wandb(project=project, name=name, id=id, entity=entity, dir=dir, mode=mode, config=config)
    if writer.dir is not None:
        _writable("wandb", writer.dir, directory=True)
    return writer
