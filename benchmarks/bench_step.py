"""fnloop's compiled step against the loops people write today, side by side, one thread.

    python benchmarks/bench_step.py tiny            # 32->64->10 MLP, batch 32, SGD; one process
    python benchmarks/bench_step.py deep            # 50 x Linear(16, 16): many small tensors
    python benchmarks/bench_step.py wide --procs 3  # 2048-wide 3-layer MLP, batch 64, AdamW; fresh processes
    python benchmarks/bench_step.py wide-ref        # 2048->2048->2048->10, AdamW: against the fastest step; one process
    python benchmarks/bench_step.py cnn             # small CNN with BatchNorm and Dropout, AdamW; one process

tiny: the eager loop (zero_grad/backward/step), a hand-written compiled functional
step (forward, backward and an in-place SGD update in one graph), and fnloop end to
end (the fold, the compiled step and a few hooks), interleaved, median of repeats.

wide: each configuration runs in its own fresh process (the eager loop is bimodal
here), several times; we report the median step time and the peak RSS measured over
the timed steps only (the high-water mark is reset after warm-up and compile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from peers import peak_rss_mb, reset_peak_rss
from torch.func import functional_call, grad, grad_and_value

import fnloop as fl
from fnloop import Phase

torch.set_num_threads(1)


# --------------------------------------------------------------------------- tiny


def tiny_problem():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    data = [(torch.randn(32, 32), torch.randint(0, 10, (32,))) for _ in range(16)]
    return model, data


def cross_entropy(forward, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(forward(x), y)


def tiny_eager(iters):
    model, data = tiny_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run(n):
        for i in range(n):
            x, y = data[i % len(data)]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    return run


def handwritten_sgd(model, data, loss_fn, options=None):
    """What people write today: forward, backward and an in-place SGD update in one compiled graph."""
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss(p, batch):
        return loss_fn(lambda *args: functional_call(model, p, args), batch)

    @torch.compile(fullgraph=True, options=options)
    def step(p, batch):
        grads = grad(loss)(p, batch)
        for k, v in p.items():
            v.sub_(0.01 * grads[k])

    def run(n):
        for i in range(n):
            step(params, data[i % len(data)])

    return run


def tiny_handwritten(iters, options=None):
    model, data = tiny_problem()
    return handwritten_sgd(model, data, cross_entropy, options)


def keep_last_loss(state, phase, memory):
    # A writer's bookkeeping: where the newest loss is, without a host sync.
    return state, state.metrics.latest("loss")[0]


def tiny_fnloop(iters, options=None):
    model, data = tiny_problem()
    opt = fl.optim.sgd(0.01)
    step = fl.train_step(model, cross_entropy, opt, options=options)
    hooks = [
        fl.every(100, fl.on(Phase.AFTER_STEP, fl.stateful("last_loss", -1, keep_last_loss))),
        fl.every(1000, fl.on(Phase.AFTER_STEP, fl.stateful("checkpoints", 0, lambda s, p, n: (s, n + 1)))),
        fl.on(Phase.AFTER_TRAIN, fl.identity),
    ]
    state = fl.init(model, opt, seed=0, max_iter=iters)

    def run(n):
        final = fl.run(
            fl.TrainState(**{**state.__dict__, "max_iter": n}),
            step,
            (data[i % len(data)] for i in range(n)),
            hooks,
        )
        assert final.iteration == n

    return run


def interleaved(runs, iters, repeats):
    """Microseconds per iteration of each run, ``repeats`` times, the runs taking turns."""
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t = time.perf_counter()
            run(iters)
            times[name].append((time.perf_counter() - t) / iters * 1e6)
    return times


def bench_tiny(iters, repeats):
    python_wrapper = {"cpp_wrapper": False}
    makers = {
        "eager loop": tiny_eager,
        "hand-written compiled": tiny_handwritten,
        "fnloop (fold + hooks)": tiny_fnloop,
        # The same two with the other inductor wrapper, to separate fnloop's
        # tracer from its default of a C++ wrapper:
        "hand-written, C++ wrapper": lambda n: tiny_handwritten(n, {"cpp_wrapper": True}),
        "fnloop, Python wrapper": lambda n: tiny_fnloop(n, python_wrapper),
    }
    runs = {name: make(iters) for name, make in makers.items()}
    for run in runs.values():
        run(50)  # compile and warm up
    med = {name: statistics.median(v) for name, v in interleaved(runs, iters, repeats).items()}
    print(f"tiny MLP 32->64->10, batch 32, SGD, {iters} iterations x {repeats}, one thread")
    for name, us in med.items():
        print(f"  {name:26s} {us:8.1f} us/it")
    ours, eager, hand = med["fnloop (fold + hooks)"], med["eager loop"], med["hand-written compiled"]
    print(f"  fnloop speed-up over eager: {eager / ours:.2f}x (target >= 2.5x)")
    print(f"  fnloop / hand-written compiled: {ours / hand:.3f} (target <= 1.10)")
    same = med["hand-written, C++ wrapper"]
    print(f"  fnloop / hand-written, both with the C++ wrapper: {ours / same:.3f}")
    print(f"  fnloop with the Python wrapper / hand-written: {med['fnloop, Python wrapper'] / hand:.3f}")


# --------------------------------------------------------------------------- deep

DEPTH = 50


def deep_problem():
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(16, 16), torch.nn.ReLU()]
    data = [(torch.randn(32, 16), torch.randn(32, 16)) for _ in range(8)]
    return torch.nn.Sequential(*layers), data


def deep_handwritten():
    return handwritten_sgd(*deep_problem(), mse)


def deep_fnloop():
    model, data = deep_problem()
    opt = fl.optim.sgd(0.01)
    step = fl.train_step(model, mse, opt)
    state = fl.init(model, opt, seed=0, max_iter=1)

    def run(n):
        fl.run(
            fl.TrainState(**{**state.__dict__, "max_iter": n}), step, (data[i % len(data)] for i in range(n))
        )

    return run


def bench_deep(iters, repeats):
    runs = {"hand-written compiled": deep_handwritten(), "fnloop (fold)": deep_fnloop()}
    first = {}
    for name, run in runs.items():
        t = time.perf_counter()
        run(1)  # trace and compile
        first[name] = time.perf_counter() - t
    times = interleaved(runs, iters, repeats)
    print(f"deep MLP, {DEPTH} x Linear(16, 16) ({2 * DEPTH} parameter tensors), batch 32, SGD, one thread")
    for name, v in times.items():
        print(f"  {name:24s} {statistics.median(v):8.1f} us/it   first call (compile) {first[name]:5.1f} s")
    ratio = statistics.median(times["fnloop (fold)"]) / statistics.median(times["hand-written compiled"])
    print(f"  fnloop / hand-written compiled: {ratio:.3f}")


# --------------------------------------------------------------------------- wide

WIDTH, BATCH, LR = 2048, 64, 1e-3


def wide_problem():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
    )
    data = [(torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)) for _ in range(4)]
    return model, data


def mse(forward, batch):
    x, y = batch
    return ((forward(x) - y) ** 2).mean()


class Clocked:
    """The batches, timing each iteration by when the next batch is asked for.

    After `warm` batches (compile and warm-up) it resets the RSS high-water mark,
    so the peak is measured over the timed steps only.
    """

    def __init__(self, data, warm, timed):
        self.data, self.warm, self.total = data, warm, warm + timed
        self.stamps = []

    def __iter__(self):
        for i in range(self.total):
            if i == self.warm:
                reset_peak_rss()
            self.stamps.append(time.perf_counter())
            yield self.data[i % len(self.data)]
        self.stamps.append(time.perf_counter())

    def step_ms(self):
        return [(b - a) * 1e3 for a, b in zip(self.stamps[self.warm : -1], self.stamps[self.warm + 1 :])]


def wide_child(config, steps):
    model, data = wide_problem()
    batches = Clocked(data, warm=5, timed=steps)
    if config in ("eager", "compile_model"):
        net = torch.compile(model) if config == "compile_model" else model
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
        for x, y in batches:
            opt.zero_grad()
            ((net(x) - y) ** 2).mean().backward()
            opt.step()
    elif config == "handwritten":
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        mu = {k: torch.zeros_like(v) for k, v in params.items()}
        nu = {k: torch.zeros_like(v) for k, v in params.items()}
        count = torch.zeros((), dtype=torch.int64)
        b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01
        model.requires_grad_(False)  # the functional step never reads the module's own tensors

        def loss(p, x, y):
            return ((functional_call(model, p, (x,)) - y) ** 2).mean()

        @torch.compile(fullgraph=True)
        def step(p, m, v, t, x, y):
            grads, value = grad_and_value(loss)(p, x, y)
            t.add_(1)
            bc1 = 1 - b1 ** t.double()
            bc2 = 1 - b2 ** t.double()
            for k, w in p.items():
                g = grads[k]
                m[k].lerp_(g, 1 - b1)
                v[k].mul_(b2).addcmul_(g, g, value=1 - b2)
                w.mul_(1 - LR * wd)
                denom = (v[k] / bc2).sqrt() + eps
                w.sub_((LR * (m[k] / bc1) / denom).to(w.dtype))
            return value

        for x, y in batches:
            step(params, mu, nu, count, x, y)
    elif config == "fnloop":
        opt = fl.optim.adamw(LR)
        step = fl.train_step(model, mse, opt)
        # The initial state is given up to the run: no copy of it is ever made.
        final = fl.run(fl.init(model, opt, seed=0, max_iter=batches.total), step, batches, donate_input=True)
        assert final.iteration == batches.total
    else:
        raise ValueError(config)
    print(json.dumps({"config": config, "ms": statistics.median(batches.step_ms()), "rss_mb": peak_rss_mb()}))


def bench_wide(procs, steps, pinned):
    configs = ["eager", "compile_model", "handwritten", "fnloop"]
    results = {c: [] for c in configs}
    env = dict(os.environ)
    if pinned:
        # glibc raises its mmap threshold after freeing a large block, then keeps
        # freed 16 MB scratch buffers in its heap; a pinned threshold returns them.
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    for _ in range(procs):
        for config in configs:
            out = subprocess.run(
                [sys.executable, __file__, "wide-child", config, "--steps", str(steps)],
                capture_output=True,
                text=True,
                check=True,
                env=env,
            )
            results[config].append(json.loads(out.stdout.strip().splitlines()[-1]))
    allocator = "MALLOC_MMAP_THRESHOLD_=1MiB" if pinned else "default glibc malloc"
    print(
        f"2048-wide 3-layer MLP, batch 64, AdamW, {procs} fresh processes x {steps} steps, one thread, {allocator}"
    )
    med = {}
    for config, rows in results.items():
        ms = [r["ms"] for r in rows]
        rss = statistics.median(r["rss_mb"] for r in rows)
        med[config] = (statistics.median(ms), rss)
        print(
            f"  {config:14s} median {med[config][0]:7.1f} ms/step (runs {', '.join(f'{m:.1f}' for m in ms)}),"
            f" peak RSS {rss:6.0f} MB"
        )
    ours, ours_rss = med["fnloop"]
    print(f"  fnloop / hand-written in-place: {ours / med['handwritten'][0]:.3f} (target <= 1.10)")
    print(f"  speed-up over eager (median): {med['eager'][0] / ours:.2f}x (target >= 1.2x)")
    print(f"  speed-up over compile(model) + AdamW: {med['compile_model'][0] / ours:.2f}x (target >= 1.3x)")
    print(f"  peak RSS / eager: {ours_rss / med['eager'][1]:.3f} (target <= 1.15)")


# ------------------------------------------------- wide-ref and cnn: one process, interleaved


class CpuClocked:
    """``total`` batches cycled from ``data``, stamping this thread's CPU time when each is asked for.

    On a shared machine wall time counts the time other processes hold the core;
    with one torch thread all the step's work runs on this thread, so its CPU time
    is the step's own cost (memory-bandwidth contention still shows).
    """

    def __init__(self, data, total, warm=0):
        self.data, self.total, self.warm = data, total, warm
        self.stamps = []

    def __len__(self):
        return self.total

    def __iter__(self):
        for i in range(self.total):
            self.stamps.append(time.thread_time())
            yield self.data[i % len(self.data)]
        self.stamps.append(time.thread_time())

    def seconds_per_step(self):
        s = self.stamps[self.warm :]
        return (s[-1] - s[0]) / (len(s) - 1)


def _interleaved_workload(workload, makers, steps, repeats):
    """CPU milliseconds per step of each peer on ``workload``: compiled and warmed, then taking turns."""
    from workloads import WORKLOADS

    w = WORKLOADS[workload]
    _, data = w.make()
    runs = {name: make(w) for name, make in makers.items()}
    for run in runs.values():
        run(CpuClocked(data, 3))  # compile and warm up
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            clocked = CpuClocked(data, steps + 1, warm=1)
            run(clocked)
            times[name].append(clocked.seconds_per_step() * 1e3)
    print(f"{w.label}, {steps} steps x {repeats} repeats interleaved, one thread, CPU time of the thread")
    for name, ms in times.items():
        spread = f"{min(ms):.2f}-{max(ms):.2f}"
        print(f"  {name:28s} median {statistics.median(ms):7.2f} ms/step (range {spread})")
    return times


def _ratio(times, a, b):
    """Median of a/b over the repeats (each pair measured back to back) and its range."""
    pairs = [x / y for x, y in zip(times[a], times[b])]
    return statistics.median(pairs), min(pairs), max(pairs)


def bench_wide_ref(steps, repeats):
    import peers

    makers = {
        "eager loop": peers.eager,
        "hand-written compiled step": peers.handwritten,
        "fnloop": peers.fnloop,
    }
    times = _interleaved_workload("wide", makers, steps, repeats)
    r, lo, hi = _ratio(times, "fnloop", "hand-written compiled step")
    print(f"  fnloop / fastest hand-written: {r:.3f} (range {lo:.3f}-{hi:.3f}; target <= 1.05)")
    r, lo, hi = _ratio(times, "eager loop", "fnloop")
    print(f"  fnloop speed-up over eager: {r:.2f}x (range {lo:.2f}-{hi:.2f})")


def bench_cnn(steps, repeats):
    import peers

    makers = {
        "eager loop": peers.eager,
        "fnloop, compile=False": peers.fnloop_eager,
        "fnloop": peers.fnloop,
        "hand-written compiled step": peers.handwritten,
    }
    times = _interleaved_workload("cnn", makers, steps, repeats)
    r, lo, hi = _ratio(times, "eager loop", "fnloop")
    print(f"  fnloop speed-up over eager: {r:.2f}x (range {lo:.2f}-{hi:.2f}; target >= 1.5x)")
    r, lo, hi = _ratio(times, "fnloop, compile=False", "eager loop")
    print(f"  fnloop compile=False / eager: {r:.3f} (range {lo:.3f}-{hi:.3f}; target <= 1.10)")
    r, lo, hi = _ratio(times, "fnloop", "hand-written compiled step")
    print(f"  fnloop / fastest hand-written: {r:.3f} (range {lo:.3f}-{hi:.3f}; target <= 1.05)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["tiny", "deep", "wide", "wide-child", "wide-ref", "cnn"])
    parser.add_argument("config", nargs="?")
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--procs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pinned-malloc", action="store_true", help="pin glibc's mmap threshold (1 MiB)")
    args = parser.parse_args(argv)
    if args.which == "tiny":
        bench_tiny(args.iters, args.repeats)
    elif args.which == "deep":
        bench_deep(args.iters // 6, args.repeats)
    elif args.which == "wide":
        bench_wide(args.procs, args.steps, args.pinned_malloc)
    elif args.which == "wide-ref":
        bench_wide_ref(args.steps, args.repeats)
    elif args.which == "cnn":
        bench_cnn(args.steps * 3, args.repeats)
    else:
        wide_child(args.config, args.steps)


if __name__ == "__main__":
    main()
