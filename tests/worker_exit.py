"""How the torchrun test workers take their jobs (``jobs()``) and end (``leave()``, once their results
are written, then as users' scripts do).

A worker ends as any script does: its ``main`` returns and the interpreter exits, with fnloop's own
handler leaving the process group at exit (``fnloop.distributed``). Nothing here shortcuts that (no
``os._exit``): an abort at exit would fail the launch, and the test with it, as it would fail a
user's job. The marker on stderr tells whether such an abort came after the results (at teardown)
or before.
"""

from __future__ import annotations

import os
import sys


def jobs(argv: list[str]) -> list[list[str]]:
    """The jobs of one launch: ``argv`` cut at each ``--then`` (``A --then B`` runs ``A``, then ``B``)."""
    found = [[]]
    for arg in argv:
        if arg == "--then":
            found.append([])
        else:
            found[-1].append(arg)
    return found


def leave(rank: int) -> None:
    """Say that this worker (rank ``rank``) is done, on stderr; the process then exits as a script does."""
    print(f"{os.path.basename(sys.argv[0])}: rank {rank} done", file=sys.stderr, flush=True)
    sys.stdout.flush()
