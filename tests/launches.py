"""Launches of worker scripts under torchrun: why a rank died, and a launch run again after a native crash."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def why(done: subprocess.CompletedProcess[str]) -> str:
    """The lines that say why a rank died: a native abort prints no traceback but the faulthandler's
    frames (kept whole, with what the process said just before: a C++ or libc message)."""
    found, lines = [], done.stderr.splitlines()
    for i, line in enumerate(lines):
        if "Fatal Python error" in line:
            found += lines[max(0, i - 6) : i + 30]
        elif any(w in line for w in ("Error", "terminate", "what()", "Abort", "Segmentation", " done")):
            found.append(line)
    return "\n".join(found[-60:])


def ok(done: subprocess.CompletedProcess[str], kept: Path | None = None) -> None:
    """The launch succeeded; else its tail and, last, why a rank died (a report cut short keeps its end).

    ``kept``: where the whole of what it printed is written when it failed.
    """
    if done.returncode and kept is not None:
        kept.write_text(done.stdout + "\n--- stderr\n" + done.stderr)
    where = f"\n--- all of it in {kept}" if done.returncode and kept is not None else ""
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-5000:] + "\n--- why\n" + why(done) + where


def native_crash(done: subprocess.CompletedProcess[str]) -> bool:
    """Whether a rank died of a native crash (faulthandler's report of SIGABRT or SIGSEGV)."""
    return bool(done.returncode) and any(
        f"Fatal Python error: {k}" in done.stderr for k in ("Aborted", "Segmentation")
    )


def again_after_native_crash(
    tmp: Path, run: Callable[[], subprocess.CompletedProcess[str]], what: str
) -> None:
    """``ok(run())``, run once more from the same files if a rank died of a native crash.

    A rank of a compiled gloo launch (sharded, or world-size-invariant) has died of SIGABRT
    mid-run, in a native thread (no Python error; the faulthandler shows the main thread waiting
    on a gloo collective inside the compiled step), in CI runs and rarely here, and never
    where the same jobs ran alone. Until it is understood, such a launch runs again once from
    the files it started with (everything its jobs read and write is under ``tmp``, or read
    only), so that CI keeps checking fnloop's results. The crash is not hidden: each one is
    appended to ``conftest.NATIVE_CRASHES`` with its report, and the suite's summary counts
    them. A second crash, or any other failure, fails the launch.
    """
    from conftest import NATIVE_CRASHES

    before = tmp.with_name(tmp.name + "-before")
    shutil.copytree(tmp, before)
    done = run()
    if native_crash(done):
        with NATIVE_CRASHES.open("a") as log:
            log.write(f"\n--- {time.strftime('%H:%M:%S')} {what}, {tmp.name}\n{why(done)}\n")
        shutil.rmtree(tmp)
        shutil.copytree(before, tmp)
        done = run()
    ok(done, tmp.with_name(tmp.name + "-output.log"))
