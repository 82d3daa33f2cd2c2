"""Data parallel and sharded training on this CPU (torchrun, gloo), against 1 process.

Run: python benchmarks/bench_distributed.py [--part speed|sharded|stall|all] [--repeats R] [--steps N]

Part ``speed``: data parallel, 2 ranks against 1 process, same global batches.

Workloads: the tiny MLP (32->64->10, global batch 32, SGD) and the 2048-wide MLP
(2048->2048->2048->10, global batch 64, AdamW). Variants, in alternating fresh
processes (a torchrun job cannot share a process with the others):

* 1 process, 1 thread;
* 1 process, 2 threads (the same two cores, used by intra-op threads instead);
* 2 ranks x 1 thread (torchrun --standalone --nproc_per_node=2, gloo).

Each process compiles its step, warms up, then times ``fl.run`` over N steps;
reported: milliseconds per global step (median of the repeats) and the speed-up
of each variant over 1 process, 1 thread.

Part ``sharded``: a model whose state dominates (8 equal blocks of ``Linear(2048,
2048)`` in a ``ModuleList``, AdamW, global batch 16), on 2 and 4 ranks, unsharded
(data parallel), ``shard="optimizer"``, ``shard="full"`` gathering everything before
the forward (``full-all``, ``blocks=()``), block by block (``full``), block by
block with inductor's compute/communication reordering (``full-prefetch``, which
issues each gather ahead of the compute before it), block by block with glibc's mmap
threshold fixed at 1 MiB (``full-mmap``, ``MALLOC_MMAP_THRESHOLD_=1048576``: each
gathered block is a mapping of its own, handed back when freed), and the reference: torch's FSDP2 (``fully_shard`` on each block and the root,
``torch.optim.AdamW`` with ``foreach=True`` and with ``fused=True``, both measured,
eager). Each launch runs one of them (memory is a process's own); fnloop's workers
move the module to the meta device after ``fl.init`` (the step needs its structure
only), as FSDP2 frees the whole weights. Reported per rank: the bytes of parameters
and optimizer state the state holds between steps (gradients live only inside the
step); the working peak: the peak resident memory over the timed steps above
the memory before them (``VmHWM``, reset through ``/proc/self/clear_refs``),
which counts the step's gradients and gathered parameters; their sum; and
milliseconds per global step. Ratios are against the first of ``--modes`` (data
parallel by default) at the same world size.
With ``--live``, every allocation of 64 KiB or more is its own mapping, returned to the
system when freed (``MALLOC_MMAP_THRESHOLD_``): the working peak then follows the live
tensors instead of the pages glibc keeps for reuse (the steps are slower so; compare
memory only).

Part ``stall``: the training stall of a background checkpoint save against a
synchronous one, on a 200 MB state (``benchmarks/bench_background_save.py``,
run as it is and its table printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

import fnloop as fl

WORKLOADS = {"tiny": (32, 64, 10, 32, "sgd"), "wide": (2048, 2048, 10, 64, "adamw")}


def worker(workload: str, steps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    inputs, width, classes, batch, kind = WORKLOADS[workload]
    torch.manual_seed(0)
    layers = [torch.nn.Linear(inputs, width), torch.nn.ReLU()]
    if workload == "wide":
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, classes))
    opt = fl.optim.sgd(0.01) if kind == "sgd" else fl.optim.adamw(1e-4)

    def loss_fn(forward, b):
        x, y = b
        return torch.nn.functional.cross_entropy(forward(x), y)

    g = torch.Generator().manual_seed(1)
    rows = batch * 8
    data = (torch.randn(rows, inputs, generator=g), torch.randint(0, classes, (rows,), generator=g))
    step = fl.train_step(model, loss_fn, opt)
    stream = fl.data.batches(data, batch_size=batch, seed=0)
    warm = 20
    state = fl.run(fl.init(model, opt, seed=0, max_iter=warm), step, stream)
    state = fl.TrainState(**{**state.__dict__, "max_iter": warm + steps})
    start = time.perf_counter()
    fl.run(state, step, stream)
    took = time.perf_counter() - start
    if fl.distributed.is_main():
        print(f"ms/step {took / steps * 1e3:.4f}")


def _trimmed() -> None:
    """glibc's free pages handed back to the system (``malloc_trim``), so that the peak that follows
    counts what the steps allocate, not pages the warm-up freed and glibc kept for reuse."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def sharded_worker(shard: str, steps: int) -> None:
    """One rank of the sharded part: prints what it holds, its peak over the steps and ms per step."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Blocks()
    opt = fl.optim.adamw(1e-4)

    def loss_fn(forward, b):
        return forward(b).square().mean()

    batch = 16 // fl.distributed.world_size()
    data = torch.randn(16 * 4, WIDTH, generator=torch.Generator().manual_seed(1))
    if shard.startswith("fsdp2"):
        _fsdp2(model, data[:batch], steps, fused=shard.endswith("fused"))
        return
    # full-prefetch: inductor's compute/communication reordering (each gather issued ahead of its use).
    options = {"reorder_for_compute_comm_overlap": True} if shard == "full-prefetch" else None
    step = fl.train_step(model, loss_fn, opt, blocks=() if shard == "full-all" else None, options=options)
    stream = fl.data.batches(data, batch_size=16, seed=0)
    warm = 3
    mode = {"none": None, "full-all": "full", "full-prefetch": "full", "full-mmap": "full"}.get(shard, shard)
    state = fl.init(model, opt, seed=0, max_iter=warm, shard=mode)
    model.to("meta")  # the module's own weights: the step needs its structure only
    # donate_input: the run's first step writes into the state given, not beside it (as FSDP2's in place).
    state = fl.run(state, step, stream, donate_input=True)
    held = sum(t.numel() * t.element_size() for t in (*state.params.values(), *_leaves(state.opt_state)))
    state = fl.TrainState(**{**state.__dict__, "max_iter": warm + steps})
    _trimmed()
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS
    start = time.perf_counter()
    fl.run(state, step, stream, donate_input=True)
    took = time.perf_counter() - start
    peak = _rss_kib("VmHWM") - before
    print(
        f"rank {fl.distributed.rank()} held {held} peak {peak * 1024} ms {took / steps * 1e3:.3f} batch {batch}"
    )


WIDTH, DEPTH = 2048, 8


class Blocks(torch.nn.Module):
    """``DEPTH`` equal blocks (``Linear(WIDTH, WIDTH)``, ReLU) in a ``ModuleList``: the state dominates."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _fsdp2(model: torch.nn.Module, batch: torch.Tensor, steps: int, fused: bool) -> None:
    """The reference: torch's own FSDP2 (``fully_shard`` per layer and at the root) and ``torch.optim.AdamW``, eager.

    ``fused``: ``AdamW(fused=True)``, else ``foreach=True``; both are measured, and the faster is the reference.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (fl.distributed.world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if fused else {"foreach": True}))

    def one() -> None:
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        one()
    local = [p.to_local() for p in model.parameters()]
    local += [t.to_local() for st in opt.state.values() for t in st.values() if t.ndim]
    held = sum(t.numel() * t.element_size() for t in local)
    _trimmed()
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    start = time.perf_counter()
    for _ in range(steps):
        one()
    took = time.perf_counter() - start
    peak = _rss_kib("VmHWM") - before
    print(f"rank {fl.distributed.rank()} held {held} peak {peak * 1024} ms {took / steps * 1e3:.3f} batch 0")


def _leaves(tree: object) -> list[torch.Tensor]:
    from torch.utils import _pytree as pytree

    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


SHARDED_MODES = (
    "none",
    "optimizer",
    "full-all",
    "full",
    "full-mmap",
    "full-prefetch",
    "fsdp2-foreach",
    "fsdp2-fused",
)


def sharded(repeats: int, steps: int, live: bool = False, modes: tuple[str, ...] = SHARDED_MODES) -> None:
    print(
        f"\nsharded: {DEPTH} x Linear({WIDTH}, {WIDTH}), AdamW, global batch 16; per rank, median of", repeats
    )
    print(
        "| ranks | shard | held (params + opt) | ratio | working peak | ratio | held + working | ratio "
        "| ms/step | ratio |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ranks in (2, 4):
        found: dict[str, list[tuple[int, int, float]]] = {m: [] for m in modes}
        for _ in range(repeats):
            for mode in found:
                me = [os.path.abspath(__file__), "--sharded-worker", mode, "--steps", str(steps)]
                command = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc_per_node={ranks}",
                ]
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                if live:  # every allocation of 64 KiB or more its own mapping, returned when freed
                    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
                elif mode == "full-mmap":  # every gathered block its own mapping
                    env["MALLOC_MMAP_THRESHOLD_"] = "1048576"
                done = subprocess.run([*command, *me], capture_output=True, text=True, env=env, timeout=1200)
                if done.returncode:
                    raise RuntimeError(done.stderr[-3000:])
                rows = [line.split() for line in done.stdout.splitlines() if line.startswith("rank ")]
                # The largest rank's figures (they differ by the padding of uneven chunks only).
                held = max(int(r[3]) for r in rows)
                peak = max(int(r[5]) for r in rows)
                ms = max(float(r[7]) for r in rows)
                found[mode].append((held, peak, ms))
        base = [statistics.median(x[i] for x in found[modes[0]]) for i in range(3)]
        for mode, runs in found.items():
            held, peak, ms = (statistics.median(x[i] for x in runs) for i in range(3))
            total, base_total = held + peak, base[0] + base[1]
            print(
                f"| {ranks} | {mode} | {held / 2**20:.0f} MiB | {held / base[0]:.2f} | {peak / 2**20:.0f} MiB | "
                f"{peak / base[1]:.2f} | {total / 2**20:.0f} MiB | {total / base_total:.2f} | {ms:.0f} | "
                f"{ms / base[2]:.2f} |"
            )


def stall() -> None:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_background_save.py")
    print("\nbackground saves (benchmarks/bench_background_save.py):")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    print(done.stdout)


def launch(workload: str, variant: str, steps: int) -> float:
    me = [os.path.abspath(__file__), "--worker", workload, "--steps", str(steps)]
    if variant == "2 ranks x 1 thread":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *me]
    else:
        threads = "2" if variant.startswith("1 process, 2") else "1"
        command = [sys.executable, *me, "--threads", threads]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return float(done.stdout.split("ms/step")[-1])


VARIANTS = ("1 process, 1 thread", "1 process, 2 threads", "2 ranks x 1 thread")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker")
    parser.add_argument("--sharded-worker")
    parser.add_argument("--part", choices=("speed", "sharded", "stall", "all"), default="all")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--modes",
        default=",".join(SHARDED_MODES),
        help="sharded: the variants, comma-separated; the first is the ratios' base",
    )
    parser.add_argument(
        "--live",
        action="store_true",
        help="sharded: glibc maps every large allocation, so RSS follows live memory",
    )
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.threads)
        return
    if args.sharded_worker:
        sharded_worker(args.sharded_worker, args.steps)
        return
    if args.part == "sharded":
        sharded(args.repeats, args.steps or 5, args.live, tuple(args.modes.split(",")))
        return
    if args.part == "stall":
        stall()
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; ms per global step, median of {args.repeats}")
    print(f"| workload | {' | '.join(VARIANTS)} |")
    print(f"|---|{'---|' * len(VARIANTS)}")
    for workload, steps in (("tiny", args.steps or 2000), ("wide", args.steps or 30)):
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                times[variant].append(launch(workload, variant, steps))
        base = statistics.median(times[VARIANTS[0]])
        cells = []
        for variant in VARIANTS:
            ms = statistics.median(times[variant])
            cells.append(f"{ms:.3f} ({base / ms:.2f}x)")
        print(f"| {workload} | {' | '.join(cells)} |")
    if args.part == "all":
        sharded(args.repeats, args.steps or 5)
        stall()


if __name__ == "__main__":
    main()
