"""The MLflow runs of one name: their tags, who writes one, which an attempt continues and which it replaces.

The tags are the ones ``_mlflow.py``'s docstring explains (``fnloop.run_key``,
``fnloop.owner``, ``fnloop.history``, ``fnloop.resumed_from``); these read them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from fnloop._atomic import _HOST, _alive

__all__ = [
    "FROM",
    "HISTORY",
    "KEY",
    "OWNER",
    "PARTIAL",
    "WHOLE",
    "drop_run",
    "writer_of",
    "this_process",
    "newest_whole",
    "replaced",
    "run_key",
]

KEY = "fnloop.run_key"
OWNER = "fnloop.owner"
HISTORY = "fnloop.history"
FROM = "fnloop.resumed_from"
PARTIAL, WHOLE = "partial", "whole"


def run_key(run_name: str) -> str:
    """The digest of ``run_name`` that tags its runs: MLflow's filter takes it whatever quotes the name holds."""
    return hashlib.sha256(run_name.encode("utf-8")).hexdigest()


def process_start(pid: int) -> str:
    """When process ``pid`` started (Linux: ticks after boot), which a later process given its id does not
    share; ``""`` where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]


def this_process() -> str:
    """This process, as ``fnloop.owner`` names the process writing a run."""
    pid = os.getpid()
    return f"{pid}@{_HOST}/{process_start(pid)}"


def writer_of(run: Any, mine: set[str]) -> tuple[int, str] | None:
    """The process (id, machine) writing ``run`` now, or ``None``: it ended, or its process is gone.

    A process of another machine cannot be checked from here: it counts as
    live. This process writes only the runs in ``mine``.
    """
    if run.info.status != "RUNNING":
        return None
    pid, _, rest = run.data.tags.get(OWNER, "").partition("@")
    host, _, started = rest.partition("/")
    if not pid.isdigit():
        return None
    if host != _HOST:
        return int(pid), host
    if int(pid) == os.getpid():
        return (int(pid), host) if run.info.run_id in mine else None
    if _alive(int(pid)) and process_start(int(pid)) in ("", started):
        return int(pid), host
    return None


def newest_whole(attempts: list[Any]) -> Any:
    """The run a resumed attempt continues: the newest whole run no whole run continues, or ``None``."""
    whole = [run for run in attempts if run.data.tags.get(HISTORY) == WHOLE]
    continued = {run.data.tags.get(FROM) for run in whole}
    heads = [run for run in whole if run.info.run_id not in continued]
    return max(heads, key=lambda run: run.info.start_time, default=None)


def replaced(attempts: list[Any], source: Any) -> list[Any]:
    """The runs a new attempt replaces, each after the runs it continued (a kill between two deletions
    leaves the rest linked to the newest run): ``source`` and every run a killed attempt left (still
    RUNNING, or partial), with the runs each whole one continued. A run that ended whole and that no
    run continued is no attempt of this one (an earlier run of the name): it stays."""
    by_id = {run.info.run_id: run for run in attempts}
    roots = [] if source is None else [source]
    roots += [run for run in attempts if run.info.status == "RUNNING" or run.data.tags.get(HISTORY) != WHOLE]
    order: list[Any] = []
    seen: set[str] = set()
    for root in roots:
        chain = []
        at = root
        while at is not None and at.info.run_id not in seen:
            seen.add(at.info.run_id)
            chain.append(at)
            at = by_id.get(at.data.tags.get(FROM, "")) if at.data.tags.get(HISTORY) == WHOLE else None
        order += reversed(chain)
    return order


def drop_run(client: Any, run: Any) -> None:
    """End ``run`` as KILLED if it is still RUNNING (its writer is gone), then delete it (soft)."""
    if run.info.status == "RUNNING":
        client.set_terminated(run.info.run_id, "KILLED")
    client.delete_run(run.info.run_id)
