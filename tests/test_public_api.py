"""Every public name has a docstring and appears in the docs."""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest

import fnloop

DOCS = "\n".join(p.read_text() for p in (pathlib.Path(__file__).parent.parent / "docs").glob("*.md"))
MODULES = [
    "fnloop",
    "fnloop.data",
    "fnloop.testing",
    "fnloop.optim",
    "fnloop.checkpoint",
    "fnloop.distributed",
    "fnloop.hooks",
    "fnloop.replay",
    "fnloop.writers",
]


def public_names():
    import importlib

    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue
        for name in module.__all__:
            yield module_name, name, getattr(module, name)


def _id(value: object) -> str:
    # The module and the name; the object's repr holds its address, which differs between processes.
    return value if isinstance(value, str) else "-"


@pytest.mark.parametrize(("module", "name", "obj"), list(public_names()), ids=_id)
def test_public_name_is_documented(module, name, obj):
    if inspect.ismodule(obj) or callable(obj) or isinstance(obj, type):
        assert inspect.getdoc(obj), f"{module}.{name} has no docstring"
    assert re.search(rf"[`.]{re.escape(name)}\b", DOCS), f"{module}.{name} appears nowhere in docs/ as code"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The heading ids of the built API reference page, and the warnings its build gave."""
    import subprocess
    import sys

    site = tmp_path_factory.mktemp("site")
    # Not --strict: a broken link on another page is the strict docs build's to report, not this test's.
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--no-strict", "--site-dir", str(site)],
        cwd=pathlib.Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    log = built.stdout + built.stderr
    assert built.returncode == 0, log
    warnings = [
        line
        for line in log.splitlines()
        if "WARNING" in line and re.search(r"griffe|mkdocstrings|autorefs|api\.md", line)
    ]
    ids = set(re.findall(r'id="([^"]+)"', (site / "api" / "index.html").read_text()))
    return ids, warnings


@pytest.mark.parametrize(("module", "name", "obj"), list(public_names()), ids=_id)
def test_public_name_is_in_the_api_reference(reference, module, name, obj):
    ids, _ = reference
    directive = f"{module}.{name}" if inspect.ismodule(obj) else module
    assert f"{module}.{name}" in ids, (
        f"{module}.{name} has no entry in the API reference (docs/api.md renders each public module "
        f"with '::: <module>'); add '::: {directive}' there."
    )


@pytest.mark.parametrize(("module", "name", "obj"), list(public_names()), ids=_id)
def test_doctests_sit_in_an_examples_section(module, name, obj):
    # The reference renders an Examples: section as code; elsewhere a doctest is prose.
    if inspect.ismodule(obj) or callable(obj) or isinstance(obj, type):
        before_examples = (inspect.getdoc(obj) or "").split("\nExamples:\n")[0]
        assert ">>>" not in before_examples, (
            f"{module}.{name}'s docstring has a doctest outside an Examples: section; put it, "
            f"indented, under an 'Examples:' line after Args/Returns/Raises."
        )


def test_api_reference_builds_without_warnings(reference):
    # A doctest outside an Examples: section renders as prose, and its output ([1, 2]) as a broken link.
    _, warnings = reference
    assert not warnings, "\n".join(warnings)


def test_all_is_complete_and_sorted_by_what_it_exports():
    for name in fnloop.__all__:
        assert hasattr(fnloop, name)
    exported = {n for n in dir(fnloop) if not n.startswith("_")}
    assert exported - set(fnloop.__all__) <= {"annotations"} | {
        m for m in exported if inspect.ismodule(getattr(fnloop, m))
    }


def test_py_typed_ships():
    assert (pathlib.Path(fnloop.__file__).parent / "py.typed").exists()
