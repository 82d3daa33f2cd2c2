"""Per-iteration cost of the bare fold, beside the seed's mutable TrainerBase/HookBase loop.

Run: python benchmarks/bench_fold.py [--iters N] [--repeats R]

Cases, each with an empty step:
  * 0 hooks;
  * 20 hooks, each wrapped in every(10, ...): the hooks that do not fire must cost next to nothing.

Both loops are measured side by side in one process, interleaved, and the
median of the repeats is reported in microseconds per iteration.
"""

from __future__ import annotations

import argparse
import statistics
import time

import fnloop as fl
from fnloop import Phase


class HookBase:
    """The seed's hook: four methods, a back reference to the trainer."""

    trainer = None

    def before_train(self):
        pass

    def after_train(self):
        pass

    def before_step(self):
        pass

    def after_step(self):
        pass


class PeriodicHook(HookBase):
    """A detectron2-style periodic hook: does its work after every `period`-th step."""

    def __init__(self, period):
        self.period = period
        self.calls = 0

    def after_step(self):
        if (self.trainer.iter + 1) % self.period == 0:
            self.calls += 1


class TrainerBase:
    """The seed's loop, minus logging and EventStorage, with an empty run_step."""

    def __init__(self, hooks):
        self._hooks = list(hooks)
        for h in self._hooks:
            h.trainer = self
        self.iter = 0

    def train(self, start_iter, max_iter):
        self.iter = start_iter
        try:
            for h in self._hooks:
                h.before_train()
            for self.iter in range(start_iter, max_iter):
                for h in self._hooks:
                    h.before_step()
                self.run_step()
                for h in self._hooks:
                    h.after_step()
            self.iter += 1
        finally:
            for h in self._hooks:
                h.after_train()

    def run_step(self):
        pass


def count(state, phase, n):
    return state, n + 1


def empty_step(state, batch):
    return state


def time_fnloop(iters, n_hooks):
    hooks = [fl.every(10, fl.on(Phase.AFTER_STEP, fl.stateful(f"h{k}", 0, count))) for k in range(n_hooks)]
    batches = [None] * iters
    state = fl.TrainState(max_iter=iters)
    t = time.perf_counter()
    final = fl.run(state, empty_step, batches, hooks)
    elapsed = time.perf_counter() - t
    assert final.iteration == iters
    assert all(final.hooks[f"h{k}"] == iters // 10 for k in range(n_hooks))
    return elapsed / iters * 1e6


def time_seed(iters, n_hooks):
    trainer = TrainerBase([PeriodicHook(10) for _ in range(n_hooks)])
    t = time.perf_counter()
    trainer.train(0, iters)
    elapsed = time.perf_counter() - t
    assert all(h.calls == iters // 10 for h in trainer._hooks)
    return elapsed / iters * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    rows = []
    for n_hooks, target in ((0, 5.0), (20, 10.0)):
        ours, seed = [], []
        for _ in range(args.repeats):
            ours.append(time_fnloop(args.iters, n_hooks))
            seed.append(time_seed(args.iters, n_hooks))
        a, b = statistics.median(ours), statistics.median(seed)
        rows.append((n_hooks, a, b, target))
    print(f"{'hooks':>26} | {'fnloop us/it':>12} | {'seed loop us/it':>15} | {'ratio':>6} | target")
    for n_hooks, a, b, target in rows:
        label = "0 hooks" if n_hooks == 0 else f"{n_hooks} x every(10, ...)"
        ok = "ok" if a <= target else "MISSED"
        print(f"{label:>26} | {a:12.2f} | {b:15.2f} | {a / b:6.2f} | <= {target:.0f} us {ok}")


if __name__ == "__main__":
    main()
