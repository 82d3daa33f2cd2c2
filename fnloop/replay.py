"""Record a run's fingerprints, replay it, and find the first step where the two differ.

A fingerprint is a float64 sum of every tensor of ``params``, ``buffers`` and
``opt_state``, taken after each step: cheap, and changed by any change of a bit
that matters. ``fingerprints(path)`` records them as JSON lines while a run
trains; ``replay`` runs the same job again from any checkpoint, with effects
off, and compares step by step. ``fnloop replay`` does the same from the
command line for a job named ``module:function``.

``check_resume`` (``fnloop check-resume``) checks a job's resume: it runs the
job straight, then killed and preempted and run again, each in a fresh
process, and says whether each resumed run ended as the straight one, and if
not where it parted: the state's part, the first step, the writers' files.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from fnloop._core.combinators import Hook
from fnloop._core.messages import a_path
from fnloop._core.phase import Phase
from fnloop._core.state import TrainState, request
from fnloop._core.tree import leaves
from fnloop._resumecheck import Interruption, ResumeCheckError, ResumeReport, check_resume
from fnloop._run import Step, scan

__all__ = [
    "Divergence",
    "Interruption",
    "Report",
    "ResumeCheckError",
    "ResumeReport",
    "check_resume",
    "fingerprint",
    "fingerprints",
    "main",
    "read_log",
    "replay",
]


def fingerprint(state: TrainState) -> dict[str, float]:
    """``path -> float64 sum`` for every tensor of ``params``, ``buffers`` and ``opt_state``.

    One host sync for all of them.

    Examples:
        >>> fingerprint(TrainState(max_iter=1, params={"w": torch.ones(3)}))
        {"state.params['w']": 3.0}
    """
    tensors = [
        (path, leaf)
        for field in ("params", "buffers", "opt_state")
        for path, leaf in leaves(getattr(state, field), f"state.{field}")
        if isinstance(leaf, torch.Tensor)
    ]
    if not tensors:
        return {}
    sums = torch.stack([t.detach().to(torch.float64).sum().cpu() for _, t in tensors]).tolist()
    return {path: value for (path, _), value in zip(tensors, sums)}


def _append(path: Path, state: TrainState) -> None:
    line = {"step": state.iteration - 1, "fingerprint": {k: v.hex() for k, v in fingerprint(state).items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as log:
        log.write(json.dumps(line) + "\n")


@attrs.frozen(repr=False)
class Fingerprints:
    """Append each step's fingerprint to a JSON-lines log; build it with ``fingerprints``."""

    path: str = attrs.field(converter=a_path)

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase is not Phase.AFTER_STEP:
            return state
        # Taken from the state the step left once all AFTER_STEP hooks ran.
        return request(state, lambda s: _append(Path(self.path), s), f"fingerprint into {self.path}")

    def __repr__(self) -> str:
        return f"fingerprints({self.path!r})"


def fingerprints(path: str | os.PathLike[str]) -> Hook:
    """A hook appending each step's fingerprint to the JSON-lines file ``path``.

    Each line is ``{"step": i, "fingerprint": {path: float.hex()}}``, written
    after step ``i`` once every ``AFTER_STEP`` hook has run. A resumed run
    appends to the same log; the last line for a step counts. It syncs with
    the device once per recorded step: wrap it in ``every(n, ...)`` to record
    less often.

    Examples:
        >>> import tempfile, fnloop as fl
        >>> log = Path(tempfile.mkdtemp()) / "fp.jsonl"
        >>> step = lambda s, b: fl.TrainState(max_iter=s.max_iter, iteration=s.iteration, params={"w": torch.full((2,), b)})
        >>> _ = fl.run(fl.TrainState(max_iter=2), step, [1.0, 2.0], [fingerprints(log)])
        >>> read_log(log)
        {0: {"state.params['w']": 2.0}, 1: {"state.params['w']": 4.0}}
    """
    return Fingerprints(path)


def read_log(path: str | os.PathLike[str]) -> dict[int, dict[str, float]]:
    """The fingerprints recorded in ``path``: step -> (tensor path -> sum); the last line per step wins.

    Raises:
        ValueError: a line is not a fingerprint record (names the line).
    """
    records: dict[int, dict[str, float]] = {}
    with open(path) as log:
        for number, line in enumerate(log, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                records[int(entry["step"])] = {k: float.fromhex(v) for k, v in entry["fingerprint"].items()}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(
                    f"{path}:{number}: not a fingerprint record ({exc}); expected a line "
                    '{"step": i, "fingerprint": {...}} as fnloop.replay.fingerprints writes'
                ) from None
    return records


@attrs.frozen
class Divergence:
    """The first difference a replay found: after ``step``, ``path`` summed to ``replayed``, not ``recorded``."""

    step: int
    path: str
    recorded: float
    replayed: float

    def __str__(self) -> str:
        return (
            f"diverged at step {self.step}: {self.path} sums to {self.replayed!r} on replay, "
            f"{self.recorded!r} in the record (difference {self.replayed - self.recorded:.3g})"
        )


@attrs.frozen
class Report:
    """What a replay compared: ``compared`` steps, and the first ``divergence`` (``None``: identical)."""

    compared: int
    divergence: Divergence | None

    @property
    def identical(self) -> bool:
        """No step differed."""
        return self.divergence is None

    def __str__(self) -> str:
        if self.divergence is None:
            return f"identical: {self.compared} recorded steps replayed bit for bit"
        return f"{self.divergence} ({self.compared} steps compared)"


def _first_difference(step: int, recorded: dict[str, float], replayed: dict[str, float]) -> Divergence | None:
    for path, value in recorded.items():
        got = replayed.get(path, math.nan)
        if got.hex() != value.hex():
            return Divergence(step, path, value, got)
    return None


def replay(
    state: TrainState,
    step: Step,
    batches: Iterable[Any],
    hooks: Sequence[Hook | None],
    log: str | os.PathLike[str] | dict[int, dict[str, float]],
) -> Report:
    """Run ``step`` and ``hooks`` from ``state`` with effects off, checking each step against ``log``.

    Stops at the first step whose fingerprint differs from the record, and
    says which tensor differs first. Steps the log does not cover are run but
    not compared. ``batches`` should be the job's resumable stream, so that
    the replay sees the batches the recorded run saw from ``state.data`` on.

    Returns:
        A ``Report``: how many steps were compared and the first divergence.
    """
    records = log if isinstance(log, dict) else read_log(log)
    compared = 0
    states = scan(state, step, batches, hooks, effects=False)
    try:
        for current in states:
            done = current.iteration - 1
            if done not in records:
                continue
            compared += 1
            found = _first_difference(done, records.pop(done), fingerprint(current))
            if found is not None:
                return Report(compared, found)
    finally:
        states.close()  # type: ignore[attr-defined]
    return Report(compared, None)


def _job(entry: str) -> Any:
    module, _, name = entry.partition(":")
    if not module or not name:
        raise SystemExit(f"fnloop replay: expected the job as module:function, got {entry!r}")
    sys.path.insert(0, os.getcwd())
    return getattr(importlib.import_module(module), name)


def main(argv: Sequence[str] | None = None) -> int:
    """``fnloop replay JOB --log LOG [--checkpoint CKPT] [--steps N]``; exit 0 identical, 1 diverged.

    ``JOB`` names a function ``module:function`` that returns ``(state, step,
    batches, hooks)`` for a fresh run: the template state, the step, the
    resumable batch stream and the hooks, as the training script builds them.
    """
    parser = argparse.ArgumentParser(
        prog="fnloop replay", description="Replay a job against its fingerprint log."
    )
    parser.add_argument("job", help="module:function returning (state, step, batches, hooks)")
    parser.add_argument("--log", required=True, help="the fingerprint log the run wrote")
    parser.add_argument("--checkpoint", help="start from this checkpoint instead of the job's fresh state")
    parser.add_argument("--steps", type=int, help="replay at most this many steps")
    args = parser.parse_args(argv)
    from fnloop.checkpoint import load

    template, step, batches, hooks = _job(args.job)()
    state = template if args.checkpoint is None else load(args.checkpoint, like=template)
    if args.steps is not None:
        state = attrs.evolve(state, max_iter=min(state.max_iter, state.iteration + args.steps))
    report = replay(state, step, batches, hooks, args.log)
    print(report)
    return 0 if report.identical else 1
