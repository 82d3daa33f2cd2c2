"""Pages whose claims are checked beyond running their code: the concepts page, the extras."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _page_blocks(page: str, heading: str) -> list[str]:
    text = (ROOT / "docs" / page).read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


@pytest.mark.parametrize("heading", ["## Catching in-place writes", "## The metrics window"])
def test_the_concepts_page_sections_run(heading, tmp_path):
    blocks = _page_blocks("concepts.md", heading)
    assert blocks
    for block in blocks:  # as a script, so that its functions pickle as a user's would
        done = subprocess.run(
            [sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr


def test_the_examples_extra_installs_what_the_docs_say():
    # Python 3.10 has no tomllib: the extra is one line, read as such.
    found = re.search(r"^examples = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert found is not None
    installed = {re.split(r"[<>=\[]", spec)[0] for spec in re.findall(r'"([^"]+)"', found[1])}
    line = next(
        line for line in (ROOT / "docs" / "example.md").read_text().splitlines() if '".[examples]"' in line
    )
    said = {name.strip() for name in line.split("#", 1)[1].split(",")}
    assert said - {"torch", "attrs", "toolz"} == installed


def _extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^(\w+) = \[", section, flags=re.MULTILINE))


def test_every_install_line_of_the_docs_works_for_a_user_of_the_checkout():
    # fnloop is not on the package index: `pip install "fnloop[wandb]"` fails there. Each install line
    # names an extra of the checkout (pip install -e ".[wandb]"), unless it says it is for an index release.
    extras = _extras()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    messages = [*sorted((ROOT / "fnloop").rglob("*.py"))]
    for path in pages + messages:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}"
            if re.search(r"pip install [^.\n]*fnloop\[", line):
                assert "index" in line, f"{where}: {line.strip()}"
            for named in re.findall(r'-e "\.\[([\w,]+)\]"', line):
                assert set(named.split(",")) <= extras, f"{where}: no extra {named!r} in pyproject.toml"


def test_no_empty_stray_file_is_tracked_at_the_top_of_the_repository():
    # An empty rep.log, left by a run, was committed at the top of the repository.
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = [name for name in listed.splitlines() if "/" not in name]
    assert top, "git ls-files listed nothing: not a checkout?"
    assert [name for name in top if (ROOT / name).stat().st_size == 0] == []
