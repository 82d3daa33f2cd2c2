"""Every fenced Python block of the documentation runs, so the docs cannot drift from the code.

Each page runs as one script in a process of its own, its blocks in order, as ``__main__`` (so a
hook a block defines pickles, as ``check_hook`` needs), in a scratch directory, with warnings as
errors as the test suite has them (``tests/page_worker.py``). The processes are forked from a server
that has imported torch and fnloop once. Blocks fenced as ```` ```text ```` or ```` ```bash ```` are
not run.
"""

from __future__ import annotations

import multiprocessing
import re
import time
from pathlib import Path

import pytest

from tests.page_worker import run_page

DOCS = Path(__file__).resolve().parent.parent / "docs"
README = DOCS.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
LIMIT = 600
"""Seconds a page may take."""


def pages() -> list[Path]:
    """The README and every docs page with at least one python block."""
    return [p for p in [README, *sorted(DOCS.glob("*.md"))] if BLOCK.search(p.read_text())]


@pytest.fixture(scope="module")
def server() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "fnloop"])
    return context


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_python_block_of_the_page_runs(server, page: Path, tmp_path: Path) -> None:
    blocks = BLOCK.findall(page.read_text())
    mine, theirs = server.Pipe(duplex=False)
    process = server.Process(target=run_page, args=(blocks, page.name, str(tmp_path), theirs))
    process.start()
    theirs.close()
    deadline = time.monotonic() + LIMIT
    while not mine.poll(0.2) and process.is_alive() and time.monotonic() < deadline:
        pass
    failed = mine.recv() if mine.poll() else f"no answer (the process: {process.exitcode}; limit {LIMIT} s)"
    process.join(10)
    if process.is_alive():
        process.kill()
    assert failed is None, f"{page.name}: a block failed\n{failed[-4000:]}"
    assert process.exitcode == 0, f"{page.name}: the page's process ended with {process.exitcode}"
