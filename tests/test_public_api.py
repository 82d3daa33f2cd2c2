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


@pytest.mark.parametrize(("module", "name", "obj"), list(public_names()), ids=lambda x: str(x)[:40])
def test_public_name_is_documented(module, name, obj):
    if inspect.ismodule(obj) or callable(obj) or isinstance(obj, type):
        assert inspect.getdoc(obj), f"{module}.{name} has no docstring"
    assert re.search(rf"[`.]{re.escape(name)}\b", DOCS), f"{module}.{name} appears nowhere in docs/ as code"


def test_all_is_complete_and_sorted_by_what_it_exports():
    for name in fnloop.__all__:
        assert hasattr(fnloop, name)
    exported = {n for n in dir(fnloop) if not n.startswith("_")}
    assert exported - set(fnloop.__all__) <= {"annotations"} | {
        m for m in exported if inspect.ismodule(getattr(fnloop, m))
    }


def test_py_typed_ships():
    assert (pathlib.Path(fnloop.__file__).parent / "py.typed").exists()
