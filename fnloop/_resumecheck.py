"""Check that a job, interrupted and resumed from its checkpoints, ends as the job run straight through.

``check_resume(job, directory)`` runs the user's job in fresh processes, each
in a directory of its own under ``directory``:

* ``straight/``: the job from start to end;
* ``kill-K/``: the job killed (SIGKILL) once K steps are done and their
  effects performed, then run again: it resumes from the newest checkpoint on
  disk, which may be older than K (a crash between two checkpoints);
* ``preempt-K/``: the job sent SIGTERM once K steps are done: the fold stops
  at the next boundary, saves through the job's checkpoint hook on the way
  out, and the job is run again.

Then it compares, for each interruption, the final states (every field, the
machine's clock left out), the fingerprints of each step (the first step that
differs), and the files the job's writers left. Each run's own files are in
``RUN/job/`` (the job's directory) and ``RUN/check/`` (the check's).
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from fnloop._core.messages import got
from fnloop._resumefiles import CHECKPOINT, file_differences, first_step, part, step_hint

__all__ = ["Interruption", "ResumeCheckError", "ResumeReport", "check_resume"]

HOW = ("kill", "preempt")
"""The interruptions: ``kill`` (SIGKILL, no chance to save) and ``preempt`` (SIGTERM, a graceful stop)."""

_CHILD = "import sys; from fnloop._resumechild import child; child(sys.argv[1:])"
"""What a fresh interpreter runs for one run of the job (its arguments follow)."""

_LAST = 3000
"""Characters of a failed child's output the report quotes."""


class ResumeCheckError(RuntimeError):
    """The check could not compare: the job failed, or cannot be run as the check runs it."""


@attrs.frozen
class Interruption:
    """One interrupted and resumed run, against the straight one.

    ``how`` (``"kill"`` or ``"preempt"``) was asked for once ``at`` steps
    were done, and came at the boundary where ``done`` were (after the call
    holding step ``at``, in a run of several steps per call); the job run
    again began at ``resumed_from``. ``differences`` says what
    differs from the straight run, most telling first; empty when nothing does.
    """

    how: str
    at: int
    done: int
    resumed_from: int
    differences: tuple[str, ...]

    @property
    def identical(self) -> bool:
        """The resumed run ended as the straight one: states, steps and files."""
        return not self.differences

    def __str__(self) -> str:
        came = f" (after the call holding it, at {self.done})" if self.done != self.at else ""
        head = f"{self.how} at {self.at}{came}, resumed from {self.resumed_from}"
        if self.identical:
            return f"{head}: identical"
        return f"{head}: DIFFERS\n" + "\n".join(f"  - {d}" for d in self.differences)


@attrs.frozen
class ResumeReport:
    """What ``check_resume`` found: the straight run's length and each interruption's result."""

    steps: int
    interruptions: tuple[Interruption, ...]

    @property
    def identical(self) -> bool:
        """Every interrupted run, resumed, ended as the straight one."""
        return all(i.identical for i in self.interruptions)

    def __str__(self) -> str:
        verdict = "resumes exactly" if self.identical else "does NOT resume exactly"
        lines = [f"the job {verdict} ({self.steps} steps, {len(self.interruptions)} interruptions)"]
        return "\n".join([*lines, *(str(i) for i in self.interruptions)])


def check_resume(
    job: str | Callable[[Path], Any],
    directory: str | os.PathLike[str],
    *,
    at: Sequence[int] | None = None,
    how: Sequence[str] = HOW,
    timeout: float = 3600.0,
) -> ResumeReport:
    """Run ``job`` straight, then interrupted and resumed, each in a fresh process; compare the ends.

    Args:
        job: a function ``job(directory) -> (state, step, batches, hooks)``
            building the run as the training script does, resume included
            (``fl.checkpoint.resume(directory / "ckpt", like=state)``), with
            every file it writes under ``directory``; or its name,
            ``"module:function"``. It must be importable in a fresh process
            (defined in a module, not in ``__main__`` or a notebook).
        directory: where the runs go, one folder each (it should be empty).
        at: the numbers of steps done when an interruption comes. By
            default one halfway between the first two checkpoints the
            straight run kept (a crash between two), or one step after the
            only one, or halfway through the run.
        how: which interruptions, each at every ``at``: ``"kill"``, ``"preempt"``.
        timeout: seconds each process may take.

    Returns:
        A ``ResumeReport``; ``report.identical`` when every resumed run ended
        as the straight one. Print it for what differs, and where.

    Raises:
        ResumeCheckError: the job failed run straight through, takes no
            directory, or an ``at`` is outside the run.
    """
    at, how, timeout = _arguments(at, how, timeout)  # refused before the straight run is paid for
    entry = _entry(job)
    root = Path(directory)
    straight = root / "straight"
    _launch(entry, straight, timeout=timeout, expect=(0,), what="the job run straight through")
    ran = json.loads((straight / "check" / "run.json").read_text())
    steps, began = int(ran["iteration"]), int(ran["began"])
    if began != 0:
        raise ResumeCheckError(
            f"the straight run began at iteration {began}, not 0: the job resumed from a checkpoint "
            f"already there. Give check_resume an empty directory (got {root})."
        )
    stops = list(at) if at is not None else _default_stops(straight / "job", steps)
    for k in stops:
        if not 0 < k < steps:
            raise ResumeCheckError(
                f"check_resume(at={k}): the job runs {steps} steps, so an interruption comes once "
                f"1 to {steps - 1} are done"
            )
    found = [_interrupted(entry, root, straight, h, k, timeout) for k in stops for h in how]
    return ResumeReport(steps, tuple(found))


def _arguments(
    at: object, how: object, timeout: object
) -> tuple[tuple[int, ...] | None, tuple[str, ...], float]:
    """``check_resume``'s ``at``, ``how`` and ``timeout``, checked: an empty list would check nothing."""
    if isinstance(how, str) or not isinstance(how, Sequence):
        raise ValueError(
            f"check_resume(how=...) takes a list of interruptions from {list(HOW)} ({got(how)}); "
            f"for one, pass how=[{how!r}]."
        )
    if not how:
        raise ValueError(
            "check_resume(how=[]) would interrupt nothing and then report that the job resumes exactly: "
            f"pass at least one of {list(HOW)}, or leave how out for both."
        )
    for h in how:
        if h not in HOW:
            raise ValueError(f"check_resume(how=...) takes {', '.join(map(repr, HOW))} ({got(h)}).")
    if at is not None:
        if isinstance(at, (str, bytes)) or not isinstance(at, Sequence):
            raise ValueError(
                f"check_resume(at=...) takes a list of step counts ({got(at)}); for one, pass at=[{at!r}]."
            )
        if not at:
            raise ValueError(
                "check_resume(at=[]) would interrupt nothing and then report that the job resumes exactly: "
                "pass the numbers of steps done when an interruption comes, or leave at out for a default."
            )
        for k in at:
            if type(k) is not int or k < 1:
                raise ValueError(
                    f"check_resume(at=...) takes whole numbers of steps done, 1 or more ({got(k)})."
                )
    if type(timeout) not in (int, float) or not 0 < timeout < float("inf"):  # type: ignore[operator]
        raise ValueError(
            f"check_resume(timeout=...) takes the seconds each process may take, a positive finite "
            f"number ({got(timeout)})."
        )
    return (None if at is None else tuple(at)), tuple(how), float(timeout)  # type: ignore[arg-type]


def _entry(job: str | Callable[[Path], Any]) -> str:
    """``"module:function"`` for ``job``, checked to take the run's directory."""
    if isinstance(job, str):
        if not all(job.rpartition(":")[::2]):
            raise ResumeCheckError(f"expected the job as module:function, got {job!r}")
        return job
    module, name = getattr(job, "__module__", None), str(getattr(job, "__qualname__", ""))
    if module == "__main__":  # the script itself: by its module's name (python -m) or its file
        main = sys.modules["__main__"]
        spec = getattr(main, "__spec__", None)
        module = spec.name if spec is not None else getattr(main, "__file__", None)
    if module is None or "<" in name:
        raise ResumeCheckError(
            f"the job {job!r:.80} cannot be imported by a fresh process (a lambda, a nested function, "
            "or one defined in an interactive session): the check runs it in new processes. Define it "
            "at the top level of a module or script, and pass it or its name 'module:function'."
        )
    if not _takes_one(job):
        raise ResumeCheckError(
            f"the job {name}{inspect.signature(job)} cannot be called with one argument, the run's "
            "directory; check_resume runs it several times, "
            "each in a directory of its own: define it as job(directory) -> (state, step, batches, "
            "hooks), with every file under directory"
        )
    return f"{module}:{name}"


def _takes_one(job: Callable[..., Any]) -> bool:
    """Whether ``job(directory)`` is a valid call."""
    try:
        inspect.signature(job).bind(Path())
    except TypeError:
        return False
    return True


def _default_stops(job_directory: Path, steps: int) -> list[int]:
    """Halfway between the first two checkpoints the straight run kept, one step after the only one, or halfway through the run."""
    saved = sorted(set(_saved_iterations(job_directory)) - {0, steps})
    if len(saved) >= 2 and saved[1] - saved[0] >= 2:
        return [(saved[0] + saved[1]) // 2 + 1 if saved[1] - saved[0] > 2 else saved[0] + 1]
    if saved and saved[0] + 1 < steps:
        return [saved[0] + 1]
    return [max(1, steps // 2)]


def _saved_iterations(directory: Path) -> list[int]:
    """The iterations of the checkpoints anywhere under ``directory``."""
    return [int(m[1]) for path in directory.rglob("ckpt-*") if (m := CHECKPOINT.fullmatch(path.name))]


def _launch(
    entry: str, run: Path, *options: str, timeout: float, expect: tuple[int, ...], what: str
) -> subprocess.CompletedProcess[str]:
    """The child ``child([ENTRY, RUN, *OPTIONS])`` (``_resumechild.py``) in a fresh interpreter, its output kept in ``RUN/check``."""
    (run / "check").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
    argv = [sys.executable, "-c", _CHILD, entry, str(run), *options]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)  # noqa: S603 - this interpreter
    (run / "check" / "output.txt").write_text(done.stdout + done.stderr)
    if done.returncode not in expect:
        raise ResumeCheckError(
            f"{what} exited with {done.returncode} (expected {' or '.join(map(str, expect))}); "
            f"its output ({run / 'check' / 'output.txt'}) ends:\n{(done.stdout + done.stderr)[-_LAST:]}"
        )
    return done


def _interrupted(entry: str, root: Path, straight: Path, how: str, k: int, timeout: float) -> Interruption:
    run = root / f"{how}-{k}"
    code = -signal.SIGKILL if how == "kill" else 128 + signal.SIGTERM
    _launch(
        entry,
        run,
        "--stop",
        str(k),
        "--how",
        how,
        timeout=timeout,
        expect=(code,),
        what=f"the run {how}ed at {k}",
    )
    done = int(json.loads((run / "check" / "interrupted.json").read_text())["done"])
    saved = sorted(set(_saved_iterations(run / "job")))
    against = str(straight / "check" / "final.safetensors")
    _launch(
        entry,
        run,
        "--against",
        against,
        timeout=timeout,
        expect=(0,),
        what=f"the run resumed after the {how} at {k}",
    )
    ran = json.loads((run / "check" / "run.json").read_text())
    began = int(ran["began"])
    differences: list[str] = []
    if began == 0 and any(s > 0 for s in saved):
        differences.append(
            f"the job did not resume: run again, it began at iteration 0 though the interrupted run "
            f"left checkpoints of {saved}. Build the state with fl.checkpoint.resume(..., like=state)."
        )
    if ran["difference"] is not None:
        differences.append(
            f"final state: {ran['difference']} ({part(ran['difference'])}; the straight run's value first)"
        )
    step = first_step(straight / "check" / "fingerprints.jsonl", run / "check" / "fingerprints.jsonl")
    if step is not None:
        first = "the first step after the resume" if step == began else f"step {step}"
        differences.append(f"the steps part at {first} (resumed at {began}): {step_hint(step, began)}")
    differences += file_differences(straight / "job", run / "job")
    return Interruption(how, k, done, began, tuple(differences))
