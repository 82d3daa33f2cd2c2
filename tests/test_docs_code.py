"""Every fenced Python block of the documentation runs, so the docs cannot drift from the code.

Each page runs as one script in a fresh process, its blocks in order, as ``__main__`` (so a hook
a block defines pickles, as ``check_hook`` needs), in a scratch directory, with warnings as errors
as the test suite has them. Blocks fenced as ```` ```text ```` or ```` ```bash ```` are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
README = DOCS.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)

RUNNER = """
import builtins, sys, warnings
warnings.simplefilter("error")
# torch's own modules warn about their own deprecated internals when inductor imports them.
warnings.filterwarnings("ignore", message="`torch.jit.", category=DeprecationWarning)
# torchdata's StatefulDataLoader calls a torch function torch has deprecated, at every iter().
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
import torch
torch.set_num_threads(1)
for index, block in enumerate(BLOCKS):
    try:
        # The builtins themselves: a page may well name something `compile`.
        builtins.exec(builtins.compile(block, f"{PAGE} block {index + 1}", "exec"), globals())
    except BaseException:
        print(f"--- {PAGE}, block {index + 1} ---", file=sys.stderr)
        print(block, file=sys.stderr)
        raise
"""


def pages() -> list[Path]:
    """The README and every docs page with at least one python block."""
    return [p for p in [README, *sorted(DOCS.glob("*.md"))] if BLOCK.search(p.read_text())]


@pytest.mark.slow
@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_python_block_of_the_page_runs(page: Path, tmp_path: Path) -> None:
    blocks = BLOCK.findall(page.read_text())
    source = f"BLOCKS = {blocks!r}\nPAGE = {page.name!r}\n{RUNNER}"
    env = {**os.environ, "PYTHONPATH": str(DOCS.parent)}
    done = subprocess.run(
        [sys.executable, "-c", source], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{page.name}: a block failed\n{done.stderr[-4000:]}"
