"""How ``tests/test_docs_code.py`` runs one page: its python blocks in order, in a process of its own.

A page's process is forked from a server that has imported torch and fnloop once (multiprocessing's
``forkserver``), so each page still runs alone, as ``__main__``, in a scratch directory, with warnings
as errors, without paying an interpreter's start and torch's import again.
"""

from __future__ import annotations

import builtins
import os
import sys
import traceback
import types
import warnings
from multiprocessing.connection import Connection


def run_page(blocks: list[str], page: str, cwd: str, answer: Connection) -> None:
    """Run ``blocks`` as the script of ``page`` in ``cwd``; send ``None``, or what failed, on ``answer``."""
    os.chdir(cwd)
    main = types.ModuleType("__main__")  # a hook a block defines pickles, as check_hook needs
    sys.modules["__main__"] = main
    warnings.simplefilter("error")
    # torch's own modules warn about their own deprecated internals when inductor imports them.
    warnings.filterwarnings("ignore", message="`torch.jit.", category=DeprecationWarning)
    # torchdata's StatefulDataLoader calls a torch function torch has deprecated, at every iter().
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
    import torch

    torch.set_num_threads(1)
    for index, block in enumerate(blocks):
        try:
            # The builtins themselves: a page may well name something `compile`.
            builtins.exec(builtins.compile(block, f"{page} block {index + 1}", "exec"), main.__dict__)
        except BaseException:  # noqa: BLE001 - sent to the test, which fails with it
            answer.send(f"--- {page}, block {index + 1} ---\n{block}\n{traceback.format_exc()}")
            return
    answer.send(None)
