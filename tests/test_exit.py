"""A process ends cleanly after its sharded run, even when the run's last sign of life was slow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

WORKER = str(Path(__file__).with_name("exit_worker.py"))


def ended(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True, timeout=120)


def test_a_runs_end_waits_for_its_signs_of_life_so_the_process_exits_cleanly():
    # The thread giving a sharded run's signs of life is inside a store call (3 s of them) when the
    # run ends. Left running, it is still in C++ when the interpreter finalizes, and the process
    # aborts after all its work ("terminate called without an active exception"): a torchrun
    # launch then fails. Seen in CI as a rank's SIGABRT after "rank 1 done".
    done = ended()
    assert done.returncode == 0 and "closed" in done.stdout, done.stderr[-2000:]
    # The control: the old wait of 2 s gives the thread up inside its call, and the process aborts.
    control = ended("2.0")
    assert "closed" in control.stdout
    assert control.returncode != 0 and "terminate called without an active exception" in control.stderr


OWN_GROUP = """
import atexit, datetime, socket
import torch.distributed as dist
import fnloop as fl
atexit.register(lambda: print("left" if not dist.is_initialized() else "kept", flush=True))
with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
fl.distributed.setup()
"""


def test_a_group_the_script_joined_itself_is_left_at_exit_as_fnloops_own():
    # A gloo group left to the interpreter's teardown can abort the process after its work (its
    # worker threads free tensors without the interpreter): seen in CI as a rank's SIGABRT after
    # "rank 1 done" in the multi-node job whose script calls init_process_group itself.
    done = subprocess.run([sys.executable, "-c", OWN_GROUP], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["left"], done.stdout + done.stderr[-2000:]
