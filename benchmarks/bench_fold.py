"""Per-iteration cost of the fold, beside the seed's mutable TrainerBase/HookBase loop.

Run: python benchmarks/bench_fold.py [--iters N] [--repeats R]

Every case has an empty step, so all that is timed is the loop and its hooks:

  * 0 hooks (the bare loop);
  * 5 and 20 hooks that count every step: fnloop's ``on(AFTER_STEP, stateful(...))``,
    the seed's ``HookBase`` with an ``after_step`` that counts;
  * 5 and 20 of the same hooks made periodic: fnloop's ``every(10, ...)`` around
    them, the seed's hooks testing their period in Python every step, as
    detectron2's periodic hooks do.

And the bare fold beside a real iteration: the tiny MLP (32->64->10, batch 32, SGD) with its
compiled step, run by ``fl.run`` in the same process; the fold's share of that iteration is the
bare fold's time over it.

The seed reference is detectron2's ``TrainerBase.train`` and its hook dispatch
(``before_step``/``run_step``/``after_step`` per iteration, ``storage.iter``
kept equal to ``iter``), minus logging and the EventStorage context, and with a
plain reference to the trainer where the seed has a ``weakref.proxy``: each
of those would only slow it down. The two loops take turns in one process; the
median of the repeats is reported in microseconds per iteration, with the
ratio fnloop / seed, and the targets: the bare fold at most 3% of the tiny MLP's
whole iteration, and 20 x ``every(10, ...)`` no dearer than the seed with the same hooks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_step import cross_entropy, tiny_problem

import fnloop as fl
from fnloop import Phase

torch.set_num_threads(1)


class HookBase:
    """The seed's hook: four methods, a reference to the trainer."""

    trainer = None

    def before_train(self):
        pass

    def after_train(self):
        pass

    def before_step(self):
        pass

    def after_step(self):
        pass


class CountingHook(HookBase):
    """Does its (tiny) work after every step."""

    def __init__(self):
        self.calls = 0

    def after_step(self):
        self.calls += 1


class PeriodicHook(HookBase):
    """Does its work after every ``period``-th step, testing the period every step as detectron2's do."""

    def __init__(self, period):
        self._period = period
        self.calls = 0

    def after_step(self):
        if (self.trainer.iter + 1) % self._period == 0:
            self.calls += 1


class Storage:
    """What the seed's loop keeps in step with its iteration (the EventStorage's counter)."""

    iter = 0


class TrainerBase:
    """The seed's loop (detectron2's ``engine/train_loop.py``) with an empty ``run_step``."""

    def __init__(self, hooks):
        self._hooks = []
        self.register_hooks(hooks)
        self.iter = self.start_iter = 0
        self.storage = Storage()

    def register_hooks(self, hooks):
        hooks = [h for h in hooks if h is not None]
        for h in hooks:
            h.trainer = self
        self._hooks.extend(hooks)

    def train(self, start_iter, max_iter):
        self.iter = self.start_iter = start_iter
        self.max_iter = max_iter
        try:
            self.before_train()
            for self.iter in range(start_iter, max_iter):
                self.before_step()
                self.run_step()
                self.after_step()
            self.iter += 1
        finally:
            self.after_train()

    def before_train(self):
        for h in self._hooks:
            h.before_train()

    def after_train(self):
        self.storage.iter = self.iter
        for h in self._hooks:
            h.after_train()

    def before_step(self):
        self.storage.iter = self.iter
        for h in self._hooks:
            h.before_step()

    def after_step(self):
        for h in self._hooks:
            h.after_step()

    def run_step(self):
        pass


def count(state, phase, n):
    return state, n + 1


def empty_step(state, batch):
    return state


def fnloop_hooks(n_hooks, period):
    hooks = [fl.on(Phase.AFTER_STEP, fl.stateful(f"h{k}", 0, count)) for k in range(n_hooks)]
    return [fl.every(period, h) for h in hooks]


def time_fnloop(iters, n_hooks, period):
    hooks = fnloop_hooks(n_hooks, period)
    batches = [None] * iters
    state = fl.TrainState(max_iter=iters)
    t = time.perf_counter()
    final = fl.run(state, empty_step, batches, hooks)
    elapsed = time.perf_counter() - t
    assert final.iteration == iters
    assert all(final.hooks[f"h{k}"] == iters // period for k in range(n_hooks))
    return elapsed / iters * 1e6


def time_seed(iters, n_hooks, period):
    hooks = [CountingHook() if period == 1 else PeriodicHook(period) for _ in range(n_hooks)]
    trainer = TrainerBase(hooks)
    t = time.perf_counter()
    trainer.train(0, iters)
    elapsed = time.perf_counter() - t
    assert trainer.iter == iters
    assert all(h.calls == iters // period for h in hooks)
    return elapsed / iters * 1e6


CASES = [
    # (label, hooks, period, target ratio fnloop / seed or None)
    ("0 hooks", 0, 1, None),
    ("5 hooks, every step", 5, 1, None),
    ("5 x every(10, ...)", 5, 10, None),
    ("20 hooks, every step", 20, 1, None),
    ("20 x every(10, ...)", 20, 10, 1.0),
]


def mlp_runner():
    """``time(n)``: microseconds per iteration of ``fl.run`` over the tiny MLP's compiled step."""
    model, data = tiny_problem()
    opt = fl.optim.sgd(0.01)
    step = fl.train_step(model, cross_entropy, opt)
    start = fl.init(model, opt, seed=0, max_iter=1)

    def run(n):
        state = fl.TrainState(**{**start.__dict__, "max_iter": n})
        batches = [data[i % len(data)] for i in range(n)]
        t = time.perf_counter()
        final = fl.run(state, step, batches)
        elapsed = time.perf_counter() - t
        assert final.iteration == n
        return elapsed / n * 1e6

    run(200)  # compile and warm up
    return run


def share(iters, repeats):
    """The bare fold's and the tiny MLP's whole iteration, taking turns: medians in us/it."""
    mlp = mlp_runner()
    bare, whole = [], []
    for _ in range(repeats):
        bare.append(time_fnloop(iters, 0, 1))
        whole.append(mlp(max(iters // 10, 500)))
    return statistics.median(bare), statistics.median(whole)


def measure(iters, repeats):
    """``[(label, fnloop us/it, seed us/it, target)]``, medians of interleaved repeats."""
    rows = []
    for label, n_hooks, period, target in CASES:
        ours, seed = [], []
        time_fnloop(min(iters, 1000), n_hooks, period)  # warm-up: imports, first allocations
        for _ in range(repeats):
            ours.append(time_fnloop(iters, n_hooks, period))
            seed.append(time_seed(iters, n_hooks, period))
        rows.append((label, statistics.median(ours), statistics.median(seed), target))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    rows = measure(args.iters, args.repeats)
    print(f"{'case':>22} | {'fnloop us/it':>12} | {'seed us/it':>10} | {'ratio':>6} | target")
    for label, ours, seed, target in rows:
        ratio = ours / seed
        goal = "" if target is None else f"<= {target:g}x {'met' if ratio <= target else 'MISSED'}"
        print(f"{label:>22} | {ours:12.2f} | {seed:10.2f} | {ratio:6.2f} | {goal}")
    bare, whole = share(args.iters, args.repeats)
    fraction = bare / whole
    print(
        f"the bare fold {bare:.2f} us/it, the tiny MLP's whole iteration {whole:.1f} us/it: the fold's share "
        f"{fraction:.1%} (<= 3% {'met' if fraction <= 0.03 else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
