"""What a resume check compares between two runs of a job: the part of the state, the first step apart, the files.

``fnloop/_resumecheck.py`` runs the job straight and interrupted; this says
how the runs differ: which part of the state a difference is in, the first
step whose fingerprints part and what that points to, and the files the
job's writers left (JSON lines and CSV without the clock's metrics).
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

from fnloop._measured import CLOCK_METRICS

__all__ = ["CHECKPOINT", "file_differences", "first_step", "part", "step_hint"]

CHECKPOINT = re.compile(r"ckpt-(\d{8,})(\.part-\d+-of-\d+)?\.safetensors")
"""A checkpoint's file, as ``fl.checkpoint.path_for`` names it (or a part of a sharded one)."""


_PARTS = (
    ("state.params", "the parameters"),
    ("state.buffers", "the buffers"),
    ("state.opt_state", "the optimizer state"),
    ("state.rng", "the random state (RNG)"),
    ("state.data", "the data position (state.data)"),
    ("state.hooks", "a hook's state"),
    ("state.metrics", "the metrics"),
)


def part(where: str) -> str:
    """Which part of the state ``where`` (a ``first_difference`` path) is in."""
    for prefix, part in _PARTS:
        if where.startswith(prefix):
            return part
    return "the field " + where.split(":")[0].split("[")[0]


def step_hint(step: int, began: int) -> str:
    if step == began:
        return (
            "the resumed step saw other batches or other random draws than the straight run's "
            "(a data source that restarts instead of going on from state.data, or randomness "
            "outside the state), or a hook or schedule read something the checkpoint does not hold"
        )
    if step < began:
        return (
            "before the interruption: the job is not the same run twice, resumed or not (something "
            "outside the seed and the state: the wall clock, an unseeded generator; or kernels that "
            "are not deterministic: fl.train_step(..., deterministic=True))"
        )
    return (
        "after the first resumed steps matched: something outside the state (a hook's memory kept "
        "in a closure or a global, the wall clock) changes the run later"
    )


def first_step(straight: Path, resumed: Path) -> int | None:
    """The first step whose fingerprints differ between the two logs (a step only one has counts)."""
    from fnloop.replay import read_log

    a, b = read_log(straight), read_log(resumed) if resumed.exists() else {}
    for step in sorted(set(a) | set(b)):
        if a.get(step) != b.get(step):
            return step
    return None


def file_differences(straight: Path, resumed: Path) -> list[str]:
    """What differs between the files the two runs' writers left (checkpoints and hidden files aside)."""
    a, b = _written(straight), _written(resumed)
    found = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            found.append(f"file {name}: only in the {'resumed' if name in b else 'straight'} run")
        else:
            what = _file_difference(a[name], b[name])
            if what is not None:
                found.append(f"file {name}: {what}")
    return found


def _written(directory: Path) -> dict[str, Path]:
    """The files under ``directory`` a run's writers left, by relative name.

    Left out: checkpoints (their states are compared), hidden files (locks,
    saves in progress), TensorBoard's event files and MLflow's store (named by
    the time, the host or a random run id: never shared by two runs).
    """
    found = {}
    for path in sorted(directory.rglob("*")):
        parts = path.relative_to(directory).parts
        if not path.is_file() or CHECKPOINT.fullmatch(path.name) or "mlruns" in parts:
            continue
        if path.name.startswith("events.out.tfevents"):
            continue  # named by the time and host it was written at: never shared by two runs
        if not any(part.startswith(".") for part in parts):
            found["/".join(parts)] = path
    return found


def _file_difference(a: Path, b: Path) -> str | None:
    """How the file ``b`` differs from ``a``: JSON lines and CSV without the clock's metrics, others whole."""
    if a.suffix == ".jsonl":
        return _lines_difference(_jsonl(a), _jsonl(b))
    if a.suffix == ".csv":
        return _lines_difference(_csv_rows(a), _csv_rows(b))
    if a.suffix == ".safetensors":  # a state (the best one, say): compared as fnloop diff does
        from fnloop.checkpoint import CheckpointError
        from fnloop.cli._diff import differences

        try:
            found = differences(a, b)
        except CheckpointError:
            found = None  # not a state: its bytes are compared
        if found is not None:
            return None if not found else "the states differ: " + "; ".join(found[:3])
    left, right = a.read_bytes(), b.read_bytes()
    if left == right:
        return None
    try:
        return _lines_difference(left.decode().splitlines(), right.decode().splitlines())
    except UnicodeDecodeError:
        return f"the bytes differ ({len(right)} bytes, the straight run's {len(left)})"


def _jsonl(path: Path) -> list[Any]:
    rows: list[Any] = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            rows.append(line)
            continue
        rows.append(
            {k: v for k, v in row.items() if k not in CLOCK_METRICS} if isinstance(row, dict) else row
        )
    return rows


def _csv_rows(path: Path) -> list[Any]:
    rows = list(csv.reader(io.StringIO(path.read_text())))
    if not rows:
        return rows
    kept = [i for i, name in enumerate(rows[0]) if name not in CLOCK_METRICS]
    return [[row[i] for i in kept if i < len(row)] for row in rows]


def _lines_difference(a: list[Any], b: list[Any]) -> str | None:
    again = ""
    if len(b) > len(a) and _repeats(b) > _repeats(a):
        again = f" ({len(b)} lines, the straight run's {len(a)}: lines written again after the resume, by a writer that does not cut back)"
    for number, (x, y) in enumerate(zip(a, b), 1):
        if x != y:
            return f"line {number} is {_short(y)}, the straight run's {_short(x)}{again}"
    if len(a) != len(b):
        return again[2:-1] if again else f"{len(b)} lines, the straight run's {len(a)}"
    return None


def _repeats(rows: list[Any]) -> int:
    """How many rows repeat an earlier one's iteration (or, without one, the whole row)."""
    keys = [
        row.get("iteration", json.dumps(row, sort_keys=True)) if isinstance(row, dict) else json.dumps(row)
        for row in rows
    ]
    return len(keys) - len(set(keys))


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return repr(text if len(text) <= 120 else text[:117] + "...")
