"""Checkpoint saves off the training path: the stall a save costs the run, in the thread or in the background.

Run: python benchmarks/bench_background_save.py [--mb 200] [--steps 250] [--every 100] [--repeats 3] [--dir DIR]

The state holds about ``--mb`` MB of float32 parameters in 100 tensors,
driven by a cheap pure step that adds one to every parameter, in two kinds:

  * ``out of place``: a plain function, a new state every step;
  * ``donating``: the same with a ``donating`` variant that adds in place, as
    ``fnloop.train_step``'s steps do, so ``run`` writes into the states it
    owns; the unit after a background save hands over copies instead.

For each kind, three variants of the same run, interleaved, in one process,
writing to the same disk:

  * ``no saves``: the run alone;
  * ``synchronous``: ``every(E, checkpoint(dir, keep=1))``;
  * ``background``: ``every(E, checkpoint(dir, keep=1, background=True))``.

Measured, medians over the repeats (the first round warms up and is not counted):

  * the stall: the time the fold spends performing the save's effect in the
    ``AFTER_STEP`` phase that requests it (two effects requested beside it,
    before and after, read the clock): the whole save when synchronous, the
    hand-over (and any wait for the save before it) in the background;
  * the run's wall time, saves and the end of the run's wait for the last one
    included;
  * then, in rounds of their own in a second process (interleaved as well),
    the peak memory above what the process held when the run began:
    ``VmHWM`` (reset before each run through ``/proc/self/clear_refs``) minus
    ``VmRSS`` before it, in MB and in states. That process tells glibc, before
    it allocates a tensor, to give every allocation above 64 KiB its own
    mapping (``mallopt``), so the resident set follows live memory and a run
    cannot reuse what another freed. The timed rounds run with glibc's
    defaults, as a training process does.

Targets: stall in the background at most 10% of the synchronous save's, peak at
most one state above the run without saves.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

import fnloop as fl

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter; setting it also stops the threshold from growing


def direct_mappings() -> bool:
    """From now on, every allocation above 64 KiB its own mapping, which freeing it gives back at once."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(_M_MMAP_THRESHOLD, 64 * 1024))
    except (AttributeError, OSError):
        return False


def status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def add_one(state: fl.TrainState, batch: Any, /) -> fl.TrainState:
    """The pure step: one added to every parameter, out of place."""
    return attrs.evolve(state, params={k: v + 1 for k, v in state.params.items()})


class AddOne:
    """``add_one``, with an in-place ``donating`` variant for the states ``run`` owns."""

    def __call__(self, state: fl.TrainState, batch: Any, /) -> fl.TrainState:
        return add_one(state, batch)

    def donating(self, state: fl.TrainState, batch: Any, /) -> fl.TrainState:
        for v in state.params.values():
            v.add_(1)
        return state


STEPS: dict[str, Callable[[], fl.Step]] = {"out of place": lambda: add_one, "donating": AddOne}
VARIANTS = ["no saves", "synchronous", "background"]


def make_state(mb: int, max_iter: int) -> fl.TrainState:
    per = mb * 1_000_000 // 4 // 100
    params = {f"layer{i}.weight": torch.randn(per) for i in range(100)}
    return fl.TrainState(max_iter=max_iter, params=params)


class Stamps:
    """Two hooks around the checkpoint hook whose effects read the clock: the save's effect lies between."""

    def __init__(self, every: int) -> None:
        self.before: list[float] = []
        self.after: list[float] = []
        self.every = every

    def hook(self, into: list[float]) -> fl.Hook:
        def stamp(state: fl.TrainState, phase: fl.Phase) -> fl.TrainState:
            if phase is not fl.Phase.AFTER_STEP:
                return state
            return fl.request(state, lambda s: into.append(time.perf_counter()), "stamp")

        return fl.every(self.every, fl.on(fl.Phase.AFTER_STEP, stamp))

    def stalls(self) -> list[float]:
        return [b - a for a, b in zip(self.before, self.after, strict=True)]


def one_run(
    kind: str, variant: str, state: fl.TrainState, directory: Path, every: int
) -> tuple[float, list[float], int]:
    """``(wall seconds, stalls, peak bytes above what the process held at the start)``."""
    stamps = Stamps(every)
    hooks: list[fl.Hook] = []
    if variant != "no saves":
        save = fl.hooks.checkpoint(directory, keep=1, background=variant == "background")
        hooks = [stamps.hook(stamps.before), fl.every(every, save), stamps.hook(stamps.after)]
    gc.collect()  # what the run before left in reference cycles goes now, not during this run
    held = status("VmRSS")
    reset_peak()
    start = time.perf_counter()
    fl.run(state, STEPS[kind](), [None] * state.max_iter, hooks)
    wall = time.perf_counter() - start
    return wall, stamps.stalls(), status("VmHWM") - held


Key = tuple[str, str]


def rounds(
    state: fl.TrainState, root: Path, every: int, repeats: int, tag: str
) -> tuple[dict[Key, list[float]], dict[Key, list[float]], dict[Key, list[int]]]:
    """``repeats`` rounds of every kind and variant, in turns; a first round of warm-up, not counted."""
    keys = [(kind, variant) for kind in STEPS for variant in VARIANTS]
    walls: dict[Key, list[float]] = {k: [] for k in keys}
    stalls: dict[Key, list[float]] = {k: [] for k in keys}
    peaks: dict[Key, list[int]] = {k: [] for k in keys}
    for r in range(repeats + 1):
        for kind in STEPS:
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
            for variant in order:
                directory = root / f"{tag}-{r}-{kind}-{variant}".replace(" ", "-")
                wall, stall, peak = one_run(kind, variant, state, directory, every)
                if r:
                    walls[kind, variant].append(wall)
                    stalls[kind, variant] += stall
                    peaks[kind, variant].append(peak)
    return walls, stalls, peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="MB of float32 parameters")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--every", type=int, default=100, help="save every this many steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--peaks", action="store_true", help="(the second process) print the peaks as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.peaks:
        mapped = direct_mappings()  # before the first tensor
        state = make_state(args.mb, args.steps)
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            _, _, peaks = rounds(state, Path(d), args.every, args.repeats, "memory")
        print(json.dumps({"mapped": mapped, "peaks": [[*k, v] for k, v in peaks.items()]}))
        return

    state = make_state(args.mb, args.steps)
    size = sum(t.numel() * t.element_size() for t in state.params.values())
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        walls, stalls, _ = rounds(state, Path(d), args.every, args.repeats, "timed")
    del state
    flags = [
        "--mb",
        args.mb,
        "--steps",
        args.steps,
        "--every",
        args.every,
        "--repeats",
        max(args.repeats // 2, 1),
    ]
    flags += ["--dir", args.dir] if args.dir else []
    second = subprocess.run(
        [sys.executable, __file__, "--peaks", *map(str, flags)], capture_output=True, text=True, check=True
    )
    found = json.loads(second.stdout.splitlines()[-1])
    mapped = found["mapped"]
    peaks = {(kind, variant): values for kind, variant, values in found["peaks"]}

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.1f}"

    print(
        f"{size / 1e6:.0f} MB of state in 100 tensors; {args.steps} steps, a save every {args.every} "
        f"(keep=1); {args.repeats} rounds, interleaved; medians, peaks the largest; {os.cpu_count()} CPUs"
        + ("" if mapped else "; glibc's mallopt unavailable: peaks may miss memory reused between runs")
    )
    print()
    print(
        "| step | saves | stall per save (ms) | stall / synchronous save | run (ms) | run / no saves | peak above start (MB) | peak in states |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind in STEPS:
        sync = statistics.median(stalls[kind, "synchronous"])
        alone = statistics.median(walls[kind, "no saves"])
        for variant in VARIANTS:
            key = (kind, variant)
            stall = statistics.median(stalls[key]) if stalls[key] else None
            wall, peak = statistics.median(walls[key]), max(peaks[key])
            row = [
                kind,
                variant,
                "" if stall is None else ms(stall),
                "" if stall is None else f"{stall / sync:.3f}",
                ms(wall),
                f"{wall / alone:.2f}",
                f"{peak / 1e6:.0f}",
                f"{peak / size:.2f}",
            ]
            print("| " + " | ".join(row) + " |")
    print()
    for kind in STEPS:
        ratio = statistics.median(stalls[kind, "background"]) / statistics.median(stalls[kind, "synchronous"])
        extra = (max(peaks[kind, "background"]) - max(peaks[kind, "no saves"])) / size
        worst = max(stalls[kind, "background"])
        print(
            f"{kind}: background stall / synchronous save {ratio:.4f} (target <= 0.10); peak above the run "
            f"without saves {extra:+.2f} states (target <= 1); worst stall {ms(worst)} ms"
        )


if __name__ == "__main__":
    main()
