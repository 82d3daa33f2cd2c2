"""The device check: the models suite on a CUDA GPU, and the models benchmark in bf16, as one table.

    python benchmarks/device_check.py          # on a machine with a CUDA GPU (about 6 minutes)
    python benchmarks/device_check.py --cpu    # the same on the CPU, small: a smoke test (CI runs it)

It runs ``tests/test_models.py`` with ``FNLOOP_TEST_DEVICE`` set to the device
(every architecture compiled at its defaults, losses against ``torch.optim``,
several steps per call with dropout, bf16 autocast, SIGKILL and resume,
``save_pretrained``), then ``benchmarks/bench_models.py`` on the device under
bf16 autocast (the speed rows; ``--cpu`` at its quick sizes), and prints one
table: each test's outcome, then each workload's milliseconds per step. It
exits non-zero if a test failed or the benchmark did not run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tests(device: str, quick: bool) -> tuple[list[tuple[str, str]], bool]:
    """Each test of the models suite and its outcome on ``device``."""
    selection = ["-k", "gpt2 or resnet"] if quick else []
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rA",
        "-p",
        "no:randomly",
        "tests/test_models.py",
        *selection,
    ]
    # Its own selection alone: options meant for the suite's own run (PYTEST_ADDOPTS) stay there.
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, "FNLOOP_TEST_DEVICE": device}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200, check=False
    )
    outcomes = re.findall(r"^(PASSED|FAILED|ERROR) tests/test_models\.py::(\S+)", done.stdout, re.MULTILINE)
    rows = [(name.split("@")[0], outcome.lower()) for outcome, name in outcomes]  # without xdist's @group
    if not rows:
        rows = [("(the suite did not run)", done.stdout[-300:] + done.stderr[-300:])]
    return rows, done.returncode == 0


def benchmark(device: str, quick: bool) -> tuple[list[str], bool]:
    """The speed rows of ``bench_models.py`` on ``device`` in bf16."""
    command = [
        sys.executable,
        "benchmarks/bench_models.py",
        "--device",
        device,
        "--dtype",
        "bf16",
        "--skip-processes",
    ]
    command += ["--quick"] if quick else ["--steps", "10", "--repeats", "3"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        return [f"the benchmark failed: {done.stderr[-800:]}"], False
    return [
        line for line in done.stdout.splitlines() if line.startswith(("####", "|", "`steps_per_call"))
    ], True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU, small (a smoke test)")
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("no CUDA GPU here: run with --cpu for the smoke test")
        where = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    else:
        import torch

        where = f"CPU, torch {torch.__version__}"
    start = time.perf_counter()
    rows, passed = tests(device, quick=args.cpu)
    lines, ran = benchmark(device, quick=args.cpu)
    print(f"## Device check on {where} ({time.perf_counter() - start:.0f} s)\n")
    print("| test of tests/test_models.py | outcome |\n|---|---|")
    for name, outcome in rows:
        print(f"| {name} | {outcome} |")
    print("\nbenchmarks/bench_models.py, bf16 autocast, ms per step:\n")
    print("\n".join(lines))
    if not (passed and ran):
        sys.exit(1)


if __name__ == "__main__":
    main()
