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

import argparse
import csv
import importlib
import importlib.util
import inspect
import io
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from fnloop._core.messages import got
from fnloop._core.phase import Phase
from fnloop._core.state import TrainState, request
from fnloop._measured import CLOCK_METRICS

__all__ = ["Interruption", "ResumeCheckError", "ResumeReport", "check_resume"]

HOW = ("kill", "preempt")
"""The interruptions: ``kill`` (SIGKILL, no chance to save) and ``preempt`` (SIGTERM, a graceful stop)."""

_CHILD = "import sys; from fnloop._resumecheck import _child; _child(sys.argv[1:])"
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


_CHECKPOINT = re.compile(r"ckpt-(\d{8,})(\.part-\d+-of-\d+)?\.safetensors")
"""A checkpoint's file, as ``fl.checkpoint.path_for`` names it (or a part of a sharded one)."""


def _saved_iterations(directory: Path) -> list[int]:
    """The iterations of the checkpoints anywhere under ``directory``."""
    return [int(m[1]) for path in directory.rglob("ckpt-*") if (m := _CHECKPOINT.fullmatch(path.name))]


def _launch(
    entry: str, run: Path, *options: str, timeout: float, expect: tuple[int, ...], what: str
) -> subprocess.CompletedProcess[str]:
    """The child ``_child([ENTRY, RUN, *OPTIONS])`` in a fresh interpreter, its output kept in ``RUN/check``."""
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
            f"final state: {ran['difference']} ({_part(ran['difference'])}; the straight run's value first)"
        )
    step = _first_step(straight / "check" / "fingerprints.jsonl", run / "check" / "fingerprints.jsonl")
    if step is not None:
        first = "the first step after the resume" if step == began else f"step {step}"
        differences.append(f"the steps part at {first} (resumed at {began}): {_step_hint(step, began)}")
    differences += _files(straight / "job", run / "job")
    return Interruption(how, k, done, began, tuple(differences))


_PARTS = (
    ("state.params", "the parameters"),
    ("state.buffers", "the buffers"),
    ("state.opt_state", "the optimizer state"),
    ("state.rng", "the random state (RNG)"),
    ("state.data", "the data position (state.data)"),
    ("state.hooks", "a hook's state"),
    ("state.metrics", "the metrics"),
)


def _part(where: str) -> str:
    """Which part of the state ``where`` (a ``first_difference`` path) is in."""
    for prefix, part in _PARTS:
        if where.startswith(prefix):
            return part
    return "the field " + where.split(":")[0].split("[")[0]


def _step_hint(step: int, began: int) -> str:
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


def _first_step(straight: Path, resumed: Path) -> int | None:
    """The first step whose fingerprints differ between the two logs (a step only one has counts)."""
    from fnloop.replay import read_log

    a, b = read_log(straight), read_log(resumed) if resumed.exists() else {}
    for step in sorted(set(a) | set(b)):
        if a.get(step) != b.get(step):
            return step
    return None


# -- the writers' files -----------------------------------------------------------------------------


def _files(straight: Path, resumed: Path) -> list[str]:
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
        if not path.is_file() or _CHECKPOINT.fullmatch(path.name) or "mlruns" in parts:
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


# -- the child process ------------------------------------------------------------------------------


@attrs.frozen(repr=False)
class _Interrupt:
    """At ``AFTER_STEP`` of the call that brings the run to ``at`` steps: ``how`` this process, once its effects are done.

    A call of several steps is interrupted after it, at the first boundary
    with ``at`` steps or more done; ``log`` records that boundary. It fires
    once: a kill ends the process, and the fold stops at that boundary on
    the SIGTERM of a preemption.
    """

    at: int
    how: str
    log: Path

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase is not Phase.AFTER_STEP or state.iteration + 1 < self.at:
            return state
        return request(state, self._interrupt, f"{self.how} this process")

    def _interrupt(self, state: TrainState) -> None:
        self.log.write_text(json.dumps({"done": state.iteration}))
        os.kill(os.getpid(), signal.SIGKILL if self.how == "kill" else signal.SIGTERM)

    def __repr__(self) -> str:
        return f"interrupt({self.at}, {self.how!r})"


def _imported(module: str) -> Any:
    """The module ``module`` names, or the script at that path (imported as a module, not run as ``__main__``)."""
    if not module.endswith(".py"):
        return importlib.import_module(module)
    spec = importlib.util.spec_from_file_location("__resume_check_job__", module)
    if spec is None or spec.loader is None:
        raise ResumeCheckError(f"cannot import the script {module}")
    found = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = found
    spec.loader.exec_module(found)
    return found


def _child(argv: Sequence[str]) -> None:
    import fnloop as fl
    from fnloop._core.steps import adapt
    from fnloop._core.tree import first_difference
    from fnloop._measured import without_clock
    from fnloop.replay import fingerprints

    parser = argparse.ArgumentParser(prog="fnloop check-resume (a run)")
    parser.add_argument("job")
    parser.add_argument("run", type=Path)
    parser.add_argument("--stop", type=int)
    parser.add_argument("--how", choices=HOW)
    parser.add_argument("--against")
    args = parser.parse_args(argv)
    module, _, name = args.job.rpartition(":")
    job: Any = _imported(module)
    for part in name.split("."):
        job = getattr(job, part)
    check = args.run / "check"
    state, step, batches, hooks = job(args.run / "job")
    began = state.iteration
    extra: list[Any] = [fingerprints(check / "fingerprints.jsonl")]
    if args.stop is not None:
        extra.append(_Interrupt(args.stop, args.how, check / "interrupted.json"))
    per_call = adapt(step, donate=False).per_call
    if per_call > 1:  # hooks act at a call's boundaries alone
        extra = [fl.on(Phase.AFTER_STEP, fl.every(per_call, hook)) for hook in extra]
    final = fl.run(state, step, batches, [*hooks, *extra])
    mine = fl.save(final, check / "final.safetensors")
    difference = None
    if args.against is not None:
        theirs = fl.load(args.against, like=final)
        difference = first_difference(without_clock(theirs), without_clock(fl.load(mine, like=final)))
    report = {"began": began, "iteration": final.iteration, "difference": difference}
    (check / "run.json").write_text(json.dumps(report))
