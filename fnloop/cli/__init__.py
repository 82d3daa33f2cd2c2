"""The ``fnloop`` command: look into checkpoints without the training code.

``fnloop inspect CKPT`` prints what a checkpoint holds, ``fnloop diff A B``
tells where two checkpoints differ, ``fnloop replay ...`` replays a run
(``fnloop.replay``), and ``fnloop check-resume JOB DIR`` checks that a job
interrupted and resumed ends as the job run straight (``fnloop.replay.check_resume``). Checkpoints are read with ``fnloop.checkpoint.read_raw``,
so neither the model nor the hooks are needed. See ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from fnloop.checkpoint import CheckpointError, checkpoints
from fnloop.cli import _diff, _inspect

__all__ = ["main", "parser"]

_SUMMARY = "Inspect, compare and replay fnloop checkpoints, and check a job's resume."
_EPILOG = "A CKPT may also be a checkpoint directory: its newest checkpoint is used."


# -- replay ------------------------------------------------------------------------------------------


def _replay(args: argparse.Namespace) -> int:
    try:
        replay = importlib.import_module("fnloop.replay")
    except ModuleNotFoundError as exc:
        if exc.name != "fnloop.replay":
            raise
        print("fnloop replay: error: this fnloop has no fnloop.replay module", file=sys.stderr)
        return 2
    return int(replay.main(list(args.args)) or 0)


# -- check-resume ------------------------------------------------------------------------------------


def _check_resume(args: argparse.Namespace) -> int:
    from fnloop.replay import ResumeCheckError, check_resume

    try:
        report = check_resume(
            args.job, args.dir, at=args.at, how=args.how or ("kill", "preempt"), timeout=args.timeout
        )
    except ResumeCheckError as exc:
        print(f"fnloop check-resume: error: {exc}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.identical else 1


# -- a run directory --------------------------------------------------------------------------------


def _check_not_a_run_directory(name: str) -> None:
    """Raise, naming the checkpoint directories inside, if ``name`` is a run's directory (``ckpt/``, ``best/``)."""
    path = Path(name)
    if not path.is_dir() or checkpoints(path):
        return
    inside = sorted(str(sub) for sub in path.iterdir() if sub.is_dir() and checkpoints(sub))
    if inside:
        raise CheckpointError(
            f"{path}: a run directory; its checkpoints are in {', '.join(inside)} (pass one of these)"
        )


# -- the command -------------------------------------------------------------------------------------


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number (got {text!r})")
    return value


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``fnloop`` command."""
    from fnloop import __version__

    top = argparse.ArgumentParser(prog="fnloop", description=_SUMMARY, epilog=_EPILOG)
    top.add_argument("--version", action="version", version=f"fnloop {__version__}")
    sub = top.add_subparsers(dest="command", metavar="COMMAND", required=True)

    inspect = sub.add_parser(
        "inspect",
        help="show what a checkpoint holds",
        description="Show a checkpoint: iteration, format, every field, each tensor with its dtype, "
        "shape and a summary (norm, mean, min, max), hook states, the latest value of each "
        "metric, and the file's size. Needs no training code.",
        epilog=_EPILOG,
    )
    inspect.add_argument("ckpt", metavar="CKPT", help="a checkpoint file (or directory)")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of aligned text")
    inspect.set_defaults(run=_inspect.run)

    diff = sub.add_parser(
        "diff",
        help="compare two checkpoints, leaf by leaf",
        description="Compare two checkpoints leaf by leaf: which entries differ and by how much "
        "(max abs difference for tensors, both values for others), and which exist in one file "
        "only. Runs are compared, not clocks: what the wall clock wrote is left out (--clock "
        "compares it). Exit status: 0 identical (bit for bit, or within --atol), 1 different, 2 error.",
        epilog=_EPILOG,
    )
    diff.add_argument("a", metavar="A", help="a checkpoint file (or directory)")
    diff.add_argument("b", metavar="B", help="another one")
    diff.add_argument(
        "--atol", type=_tolerance, default=None, metavar="X",
        help="count floats and tensors whose max abs difference is at most X as equal (ints stay exact)",
    )  # fmt: skip
    diff.add_argument(
        "--ignore", action="append", default=[], metavar="PATH",
        help="skip an entry and everything under it, e.g. --ignore extra; repeatable",
    )  # fmt: skip
    diff.add_argument(
        "--clock", action="store_true",
        help="also compare what the machine measured (the metrics time, data_time and max_mem, a timer's "
        "state, and state.time in files of earlier versions), which two runs of the same job never "
        "share; left out by default",
    )  # fmt: skip
    diff.set_defaults(run=_diff.run)

    check = sub.add_parser(
        "check-resume",
        help="check that a job, interrupted and resumed, ends as the job run straight",
        description="Run JOB straight, then killed (SIGKILL) and preempted (SIGTERM) at each --at and run "
        "again, each in a fresh process in a folder of its own under DIR; compare each resumed run's "
        "final state, its steps' fingerprints and its writers' files with the straight run's. JOB is "
        "module:function, a function job(directory) -> (state, step, batches, hooks) that builds the "
        "run as the training script does, resume included. Exit status: 0 every resumed run ended as "
        "the straight one, 1 one did not, 2 error.",
    )
    check.add_argument("job", metavar="JOB", help="module:function, taking the run's directory")
    check.add_argument("dir", metavar="DIR", help="an empty directory for the runs")
    check.add_argument(
        "--at", type=int, action="append", metavar="K",
        help="interrupt once K steps are done; repeatable (default: between the first two checkpoints)",
    )  # fmt: skip
    check.add_argument(
        "--how", action="append", choices=("kill", "preempt"),
        help="which interruption; repeatable (default: both)",
    )  # fmt: skip
    check.add_argument("--timeout", type=float, default=3600.0, metavar="S", help="seconds per process")
    check.set_defaults(run=_check_resume)

    replay = sub.add_parser(
        "replay",
        help="replay a run and check it step by step (see 'fnloop replay --help')",
        description="Forwarded to fnloop.replay.",
        add_help=False,
    )
    replay.add_argument("args", nargs=argparse.REMAINDER, help="the arguments of fnloop replay")
    replay.set_defaults(run=_replay)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fnloop`` command with ``argv`` (default: ``sys.argv[1:]``); return its exit status.

    Exit status 0 on success (``diff``: the files are identical), 1 when
    ``diff`` finds a difference, 2 for an error: a damaged or missing
    checkpoint prints its ``CheckpointError`` message. ``--help`` and usage
    errors exit through ``SystemExit`` as with any argparse program.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["replay"]:
        # argparse would take options meant for replay (--help, -x) for its own.
        args = argparse.Namespace(command="replay", args=argv[1:], run=_replay)
    else:
        args = parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        for name in (getattr(args, "ckpt", None), getattr(args, "a", None), getattr(args, "b", None)):
            if name is not None:
                _check_not_a_run_directory(name)
        code = run(args)
        sys.stdout.flush()
    except CheckpointError as exc:
        print(f"fnloop {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RecursionError:
        # The reader decodes whatever depth the interpreter allows; showing it may take more.
        print(
            f"fnloop {args.command}: error: the checkpoint holds data nested too deeply to show "
            f"(deeper than Python's recursion limit, {sys.getrecursionlimit()}).",
            file=sys.stderr,
        )
        return 2
    except BrokenPipeError:
        # The reader went away (`fnloop inspect x | head`). As Python's docs advise: no traceback,
        # and no second error when the interpreter flushes stdout on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code
