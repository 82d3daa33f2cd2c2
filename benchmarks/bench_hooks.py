"""What a realistic hook set costs per step, beside the bare compiled step, side by side, one thread.

Run: python benchmarks/bench_hooks.py [--iters N] [--repeats R]
     python benchmarks/bench_hooks.py --gpt2 [--iters N] [--repeats R]

Two runs of the tiny MLP (32->64->10, batch 32, SGD, compiled), taking turns in one
process:

* bare: ``fl.run(state, step, batches)`` with no hook;
* hooks: the same with ``timer()``, ``every(20, log(console(), jsonl(...)))``, ``progress()``
  (on a terminal: stderr is a stand-in tty writing to /dev/null), ``every(100, checkpoint(...))``
  and ``every(100, evaluate(mean_over(eval_step(...), val)))``.

Each hook's share is the set's median less the median of the set without that hook.
Each iteration asks the batch stream for one batch, so the times between two asks
are the iterations' times, measured without adding a hook or touching the fold's clock. "Between writes" is the median iteration: writes (every 20th
step) and checkpoints/evaluations (every 100th) are a few percent of the iterations,
so the median is a step on which no hook wrote. The mean, writes included, is shown too.

Three controls split the cost between writes: a hook that acts after every
step and does nothing (the fold's share), ``timer + progress`` (the hooks that
act after every step) alone, and the same with the writing hooks replaced by
spins as long as their writes (``pauses``): a pause alone slows the steps after
it for a while, whatever runs in it.

With ``--gpt2``, the same hook set (the evaluation: the mean loss over two batches)
against the bare fold on the GPT-2 workload of ``bench_models.py`` (2 layers, 128 wide,
batch 16, 128 positions, AdamW, compiled), the two runs taking turns: the ratio of
their whole wall time, writes, checkpoints and evaluations included.
"""

from __future__ import annotations

import argparse
import io
import itertools
import logging
import statistics
import sys
import tempfile
import time

import torch
from bench_step import cross_entropy
from bench_step import tiny_problem as problem

import fnloop as fl

torch.set_num_threads(1)

WRITE_EVERY = 20
"""The log's period; checkpoints and evaluations (every 100) fall on its writes."""


def accuracy(forward, batch):
    x, y = batch
    return {"accuracy": (forward(x).argmax(1) == y).float().mean()}


class Tty(io.TextIOWrapper):
    """A terminal stand-in, so the progress bar is drawn (into /dev/null)."""

    def isatty(self) -> bool:
        return True


NAMES = ("timer", "log", "progress", "checkpoint", "evaluate")


def hook_set(model, val, folder, leave_out=None):
    evaluate = fl.hooks.evaluate(fl.hooks.mean_over(fl.eval_step(model, accuracy), val, prefix="val_"))
    hooks = [
        fl.hooks.timer(),
        fl.every(
            WRITE_EVERY, fl.hooks.log(fl.writers.console(), fl.writers.jsonl(f"{folder}/metrics.jsonl"))
        ),
        fl.hooks.progress(),
        fl.every(100, fl.hooks.checkpoint(f"{folder}/ckpt", keep=2)),
        fl.every(100, evaluate),
    ]
    return [h for name, h in zip(NAMES, hooks) if name != leave_out]


def runner():
    """``run(n, hooks_for)``: the fold over ``n`` iterations with the hooks ``hooks_for`` builds.

    Every variant drives the same step, model and batches, so they differ in their hooks alone
    (separate steps differ by a few microseconds here, by where their tensors happen to lie).
    """
    model, data = problem()
    opt = fl.optim.sgd(0.01)
    step = fl.train_step(model, cross_entropy, opt)
    state = fl.init(model, opt, seed=0, max_iter=1)
    val = data[:4]

    def run(n, hooks_for):
        # Each iteration asks for one batch: the times between two asks are the iterations'.
        asked = []
        clock = time.perf_counter

        def stream():
            for i in range(n):
                asked.append(clock())
                yield data[i % len(data)]

        with tempfile.TemporaryDirectory() as folder:
            final = fl.run(
                fl.TrainState(**{**state.__dict__, "max_iter": n}),
                step,
                stream(),
                hooks_for(model, val, folder),
            )
        assert final.iteration == n
        return [b - a for a, b in itertools.pairwise(asked)]

    return run


class Nothing:
    """A hook that acts after every step and returns its input unchanged: the fold's share alone."""

    acts_in = frozenset({fl.Phase.AFTER_STEP})

    def __call__(self, state, phase):
        return state


def every_step(model, val, folder):
    """The hooks of the set that act after every step: ``timer()`` and ``progress()``."""
    return [h for name, h in zip(NAMES, hook_set(model, val, folder)) if name in ("timer", "progress")]


def pauses(write: float, save: float):
    """Stand-ins for the writing hooks: spin ``write`` seconds every 20 steps, ``save`` every 100.

    A spin runs no code of any hook and touches almost no memory, so the set
    ``timer(), progress()`` plus these pauses shows what the writes cost the steps
    between them by taking time alone.
    """

    def spin(seconds):
        def wait(state):
            until = time.perf_counter() + seconds
            while time.perf_counter() < until:
                pass

        return fl.on(fl.Phase.AFTER_STEP, lambda state, phase: fl.request(state, wait))

    def hooks_for(model, val, folder):
        return [
            *every_step(model, val, folder),
            fl.every(WRITE_EVERY, spin(write)),
            fl.every(100, spin(save)),
        ]

    return hooks_for


def durations(run, repeats: int = 3) -> tuple[float, float]:
    """The seconds a write (every 20th step) and a checkpoint with an evaluation (every 100th) take."""
    bare, writes, saves = [], [], []
    for _ in range(repeats):
        bare += run(1000, lambda model, val, folder: [])[10:]
        times = run(1000, hook_set)
        # times[i] ends when iteration i + 1 asks for its batch: it holds iteration i's effects.
        writes += [t for i, t in enumerate(times) if (i + 1) % WRITE_EVERY == 0 and (i + 1) % 100]
        saves += [t for i, t in enumerate(times) if i > 0 and (i + 1) % 100 == 0]
    step = statistics.median(bare)
    write = statistics.median(writes) - step
    return write, statistics.median(saves) - step - write


def gpt2(iters: int, repeats: int) -> None:
    """The hook set against the bare fold on GPT-2: medians of the whole run's seconds per step."""
    from bench_models import Settings, _model, workloads

    w = workloads(quick=False)["gpt2"]
    settings = Settings(torch.device("cpu"), None)
    model, data = _model(w, settings), w.batches(settings.device)
    opt = fl.optim.adamw(1e-3, weight_decay=0.01)
    step = fl.train_step(model, w.loss, opt)
    start = fl.init(model, opt, seed=0, max_iter=1)

    def lm_loss(forward, batch):
        return {"loss": forward(input_ids=batch, labels=batch).loss}

    def hooks_for(folder):
        evaluate = fl.hooks.evaluate(
            fl.hooks.mean_over(fl.eval_step(model, lm_loss), data[:2], prefix="val_")
        )
        return [
            fl.hooks.timer(),
            fl.every(WRITE_EVERY, fl.hooks.log(fl.writers.console(), fl.writers.jsonl(f"{folder}/m.jsonl"))),
            fl.hooks.progress(),
            fl.every(100, fl.hooks.checkpoint(f"{folder}/ckpt", keep=2)),
            fl.every(100, evaluate),
        ]

    def run(n, hooked):
        with tempfile.TemporaryDirectory() as folder:
            state = fl.TrainState(**{**start.__dict__, "max_iter": n})
            t = time.perf_counter()
            final = fl.run(
                state, step, (data[i % len(data)] for i in range(n)), hooks_for(folder) if hooked else []
            )
            elapsed = time.perf_counter() - t
        assert final.iteration == n
        return elapsed / n

    run(3, True)  # compile the step and the evaluation
    times = {False: [], True: []}
    for _ in range(repeats):
        for hooked in (False, True):
            times[hooked].append(run(iters, hooked))
    bare, hooked = statistics.median(times[False]), statistics.median(times[True])
    ratios = [h / b for h, b in zip(times[True], times[False])]
    print(f"GPT-2 ({w.label}), compiled, {iters} iterations x {repeats}, one thread")
    print(f"  bare  {bare * 1e3:7.2f} ms/it (each: {', '.join(f'{t * 1e3:.2f}' for t in times[False])})")
    print(f"  hooks {hooked * 1e3:7.2f} ms/it (each: {', '.join(f'{t * 1e3:.2f}' for t in times[True])})")
    print(
        f"  hooks / bare, whole runs: {statistics.median(ratios):.3f} "
        f"(each repeat: {', '.join(f'{r:.3f}' for r in ratios)}; target <= 1.02)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--gpt2", action="store_true", help="the hook set on the GPT-2 workload instead")
    args = parser.parse_args()

    logging.basicConfig(stream=open("/dev/null", "w"), level=logging.INFO)  # noqa: SIM115
    if args.gpt2:
        sys.stderr = Tty(open("/dev/null", "wb"))  # noqa: SIM115
        gpt2(args.iters or 200, args.repeats or 3)
        return
    args.iters, args.repeats = args.iters or 2000, args.repeats or 5

    sys.stderr = Tty(open("/dev/null", "wb"))  # noqa: SIM115
    run = runner()
    runs = {"bare": lambda model, val, folder: [], "hooks": hook_set}
    for name in NAMES:  # each hook's share: the set without it
        runs[f"hooks - {name}"] = lambda model, val, folder, name=name: hook_set(model, val, folder, name)
    for hooks_for in runs.values():
        run(120, hooks_for)  # compile (step and evaluation) and warm up
    write, save = durations(run)
    runs["a hook doing nothing"] = lambda model, val, folder: [Nothing()]
    runs["timer + progress"] = every_step
    runs["  + pauses"] = pauses(write, save)
    medians = {name: [] for name in runs}
    steadies = {name: [] for name in runs}
    means = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, hooks_for in runs.items():
            times = run(args.iters, hooks_for)
            medians[name].append(statistics.median(times[10:]) * 1e6)
            means[name].append(statistics.fmean(times[10:]) * 1e6)
            # Iterations 5 to 18 after each write (every 20th step): what a step costs once the
            # caches the write disturbed have refilled.
            steady = [t for i, t in enumerate(times) if i >= 10 and (i + 1) % WRITE_EVERY >= 5]
            steadies[name].append(statistics.median(steady) * 1e6)
    out = sys.stdout
    print(f"tiny MLP, compiled, {args.iters} iterations x {args.repeats}, one thread", file=out)
    for name in runs:
        print(
            f"  {name:20s} median {statistics.median(medians[name]):7.1f} us/it   "
            f"steady {statistics.median(steadies[name]):7.1f} us/it   "
            f"mean (writes included) {statistics.median(means[name]):7.1f} us/it",
            file=out,
        )
    whole = statistics.median(medians["hooks"])
    for name in NAMES:
        share = whole - statistics.median(medians[f"hooks - {name}"])
        print(f"  {name:12s} costs about {share:5.1f} us/it between writes (the set with it, minus without)")

    def ratio(name: str) -> str:
        each = [h / b for h, b in zip(medians[name], medians["bare"])]
        return f"{statistics.median(each):.3f}"

    print(
        f"  a write takes {write * 1e6:.0f} us, a checkpoint with an evaluation {save * 1e3:.1f} ms; "
        f"between writes, over bare: a hook doing nothing {ratio('a hook doing nothing')}, "
        f"timer + progress {ratio('timer + progress')}, with pauses as long "
        f"as the writes in place of log, checkpoint and evaluate {ratio('  + pauses')}",
        file=out,
    )
    steady = [h / b for h, b in zip(steadies["hooks"], steadies["bare"])]
    print(
        f"  hooks / bare, 5 or more steps after a write: {statistics.median(steady):.3f} "
        f"(each repeat: {', '.join(f'{r:.3f}' for r in steady)})",
        file=out,
    )
    ratios = [h / b for h, b in zip(medians["hooks"], medians["bare"])]
    print(
        f"  hooks / bare between writes: {statistics.median(ratios):.3f} "
        f"(each repeat: {', '.join(f'{r:.3f}' for r in ratios)}; target <= 1.20)",
        file=out,
    )


if __name__ == "__main__":
    main()
