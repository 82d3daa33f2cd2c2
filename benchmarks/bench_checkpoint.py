"""Checkpoint throughput: fnloop.checkpoint save/load beside raw torch.save/torch.load of the same tensors.

Run: python benchmarks/bench_checkpoint.py [--mb 200] [--repeats 7] [--dir DIR]

The state holds about ``--mb`` MB of float32 parameters in four large tensors
plus 100 small ones (biases), and a few metrics. Each repeat runs, interleaved,
in the same directory (same disk):

  * ``fnloop save``: ``fnloop.checkpoint.save`` (safetensors + CRC-32, written
    to a temporary file, fsync'd, renamed, directory fsync'd);
  * ``fnloop save, no fsync``: the same with ``os.fsync`` stubbed out, which
    is not atomic any more: for comparison only, to show where the time goes;
  * ``torch.save``: ``torch.save(dict_of_tensors, path)``, no fsync;
  * ``torch.save+fsync``: the same, then flush and ``os.fsync``, which is what
    an atomic save needs;
  * ``fnloop load``: ``fnloop.checkpoint.load(path, like=state)`` (reads, checks
    the CRC, fills the template);
  * ``torch.load``: ``torch.load(path, weights_only=True)``.

Every write goes to a file that does not exist yet. Loads read files that were
just written, so they come from the page cache on both sides: the numbers
measure the libraries, not the disk. Reported: the median seconds per call,
MB/s, and fnloop's throughput as a ratio of torch's (above 1: fnloop faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

import fnloop as fl
import fnloop.checkpoint._transfer
from fnloop import checkpoint


def make_state(mb: int) -> fl.TrainState:
    per_big = mb * 1_000_000 // 4 // 4  # float32 elements in each of the 4 large tensors
    cols = 1024
    params = {f"layer{i}.weight": torch.randn(per_big // cols, cols) for i in range(4)}
    params |= {f"layer{i}.bias": torch.randn(256) for i in range(100)}
    metrics = fl.Metrics().record(0, {"loss": torch.tensor(1.0), "lr": 0.1})
    return fl.TrainState(
        max_iter=1000, iteration=500, params=params, metrics=metrics, clock=fl.Clock(time=12.5)
    )


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def without_fsync(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        real, os.fsync = os.fsync, lambda fd: None
        try:
            return fn()
        finally:
            os.fsync = real

    return run


def torch_save(tensors: dict[str, torch.Tensor], path: Path, fsync: bool) -> None:
    with open(path, "wb") as f:
        torch.save(tensors, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="MB of float32 parameters")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    state = make_state(args.mb)
    tensors = dict(state.params)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    mb = nbytes / 1e6
    print(f"{len(tensors)} tensors, {mb:.1f} MB, {args.repeats} repeats, median seconds per call")

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        root = Path(d)
        times: dict[str, list[float]] = {}
        for r in range(args.repeats):
            fl_path = checkpoint.path_for(root, r)
            raw, synced = root / f"raw-{r}.pt", root / f"synced-{r}.pt"
            unsynced = root / f"unsynced-{r}.safetensors"
            runs = {
                "fnloop save": lambda p=fl_path: checkpoint.save(state, p),
                "fnloop save, no fsync": without_fsync(lambda p=unsynced: checkpoint.save(state, p)),
                "torch.save": lambda p=raw: torch_save(tensors, p, fsync=False),
                "torch.save+fsync": lambda p=synced: torch_save(tensors, p, fsync=True),
                "fnloop load": lambda p=fl_path: checkpoint.load(p, like=state),
                "torch.load": lambda p=raw: torch.load(p, weights_only=True),
            }
            for name, run in runs.items():
                times.setdefault(name, []).append(timed(run))
            for path in (fl_path, unsynced, raw, synced):
                path.unlink()
        crc = statistics.median(
            timed(lambda: [zlib.crc32(checkpoint._transfer._bytes(t)) for t in tensors.values()])
            for _ in range(3)
        )

    median = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"{'':22} {'seconds':>8} {'MB/s':>8}")
    for name, seconds in median.items():
        print(f"{name:22} {seconds:8.3f} {mb / seconds:8.0f}")
    print(f"{'(crc32 alone)':22} {crc:8.3f} {mb / crc:8.0f}")
    print("fnloop / torch throughput (>= 0.9 is the goal):")
    print(f"  save vs torch.save        {median['torch.save'] / median['fnloop save']:.2f}")
    print(f"  save vs torch.save+fsync  {median['torch.save+fsync'] / median['fnloop save']:.2f}")
    print(f"  (save, no fsync, vs torch.save  {median['torch.save'] / median['fnloop save, no fsync']:.2f})")
    print(f"  load vs torch.load        {median['torch.load'] / median['fnloop load']:.2f}")


if __name__ == "__main__":
    main()
