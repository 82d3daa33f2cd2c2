"""Native deaths of compiled gloo launches, counted: the same 2-rank sharded job launched N times.

    python benchmarks/gloo_crashes.py --launches 15        # on the torch of this environment

Each launch is ``tests/shard_worker.py``'s sharded job (``--shard full --compile --backend inductor``)
under torchrun, two ranks on the CPU with gloo, one thread each, the faulthandler on; the first
launch compiles (fnloop's and inductor's caches under ``--cache``), the others load. A launch that
fails is counted as a native death when a rank's faulthandler reports SIGABRT or SIGSEGV
(``tests/launches.py``), else as a failure, and its output kept under ``--cache``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.launches import native_crash  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=15)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.mkdtemp(prefix="gloo-crashes-")))
    args = parser.parse_args()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",
        "FNLOOP_CACHE_DIR": str(args.cache / "fnloop"),
        "TORCHINDUCTOR_CACHE_DIR": str(args.cache / "inductor"),
    }
    worker = ROOT / "tests" / "shard_worker.py"
    deaths = failures = 0
    times = []
    for i in range(args.launches):
        results = args.cache / f"run{i}"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        command += [str(worker), str(results), "--shard", "full", "--compile", "--backend", "inductor"]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
        times.append(time.perf_counter() - start)
        if done.returncode:
            (args.cache / f"failed{i}.txt").write_text(done.stdout + "\n--- stderr\n" + done.stderr)
            deaths += native_crash(done)
            failures += not native_crash(done)
        said = "ok" if not done.returncode else ("native death" if native_crash(done) else "failed")
        print(f"launch {i + 1}/{args.launches}: {said} in {times[-1]:.1f} s", flush=True)
    print(
        f"torch {torch.__version__}: {args.launches} launches, {deaths} native deaths, {failures} other "
        f"failures; first {times[0]:.0f} s (compiles), then median {statistics.median(times[1:] or times):.0f} s"
    )


if __name__ == "__main__":
    main()
