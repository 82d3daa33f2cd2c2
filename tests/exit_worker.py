"""A process whose sharded run ends while its signs of life are inside a slow store call (``tests/test_exit.py``).

    python exit_worker.py [WAIT]   # WAIT: fnloop._shared_run.STORE_WAIT for this process

Prints "closed" once the run's end returned; the process must then exit with status 0.
"""

from __future__ import annotations

import datetime
import socket
import sys
import time

import torch.distributed as dist

import fnloop._shared_run as shared
import fnloop.distributed as fd

wait = float(sys.argv[1]) if len(sys.argv) > 1 else None
if wait is not None:
    shared.STORE_WAIT = wait
with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30))


class Slow:
    """A store whose add takes 3 s of C++ calls, as one may on a loaded machine."""

    def add(self, key: str, n: int) -> int:
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            store.add(key, 0)
        return store.add(key, n)


run = fd.SharedRun(Slow(), "p", 0)
time.sleep(0.2)
run.close()
print("closed", flush=True)
