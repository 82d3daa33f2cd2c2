"""One run of the job a resume check runs, in a fresh interpreter: straight, interrupted, or resumed.

``fnloop/_resumecheck.py`` starts it (``child([ENTRY, RUN, *OPTIONS])``); it
records each step's fingerprints, interrupts itself where told (SIGKILL or
SIGTERM once the effects of step K are done), and saves the final state and
how it differs from the straight run's.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from fnloop._core.phase import Phase
from fnloop._core.state import TrainState, request
from fnloop._resumecheck import HOW, ResumeCheckError

__all__ = ["child"]


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


def child(argv: Sequence[str]) -> None:
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
