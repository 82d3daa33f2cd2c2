"""The step's layout chosen in one place: checked on the source, so that a new feature cannot spread it again.

The placement record (``fnloop/_step/placement.py``) and the transformations
it composes own the layout; everything else in ``_step`` and the compiler room
asks them, and the ground kernel knows no feature at all.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fnloop

STEP = Path(fnloop.__file__).parent / "_step"
COMPILE = Path(fnloop.__file__).parent / "_compile"
OWNERS = {
    "placement.py",
    "sharding.py",
    "blocks.py",
    "invariant.py",
    "replicas.py",
    "collectives.py",
    "units.py",
    "inputs.py",  # the door that reads a call
    "tensor.py",
    "tensor_plans.py",
}
LAYOUT_WORDS = re.compile(r"shard|group|replica|slice|unit|total|tree")
KERNEL_WORDS = re.compile(r"shard|block|slice|unit|member|replica")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fnloop._step."):
            found.add(node.module.rsplit(".", 1)[1])
    return found


def _layout_tests(path: Path, words: re.Pattern[str]) -> list[str]:
    """The ``if``, conditional, ``while`` and ``assert`` tests of ``path`` naming one of ``words``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            names = [n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)]
            names += [n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)]
            if any(words.search(name.lower()) for name in names):
                out.append(f"{path.name}:{node.lineno}")
    return out


def test_no_import_cycle_among_the_steps_modules() -> None:
    graph = {p.stem: _imports(p) for p in STEP.glob("*.py")}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, f"import cycle: {' -> '.join([*path[path.index(module) :], module])}"
        if module in done:
            return
        for dependency in graph.get(module, ()):
            visit(dependency, [*path, module])
        done.add(module)

    for module in graph:
        visit(module, [])


def test_no_transformation_imports_another() -> None:
    transformations = {
        "accumulate",
        "replicas",
        "sharding",
        "blocks",
        "invariant",
        "members",
        "statistics",
        "tensor",
    }
    for name in transformations:
        imported = _imports(STEP / f"{name}.py") & transformations
        assert not imported, f"{name}.py imports {sorted(imported)}: give it what it needs as an argument"


def test_the_layout_is_decided_by_its_owners_alone() -> None:
    found = []
    for path in [*STEP.glob("*.py"), *COMPILE.glob("*.py")]:
        if path.parent == STEP and path.name in OWNERS:
            continue
        found += _layout_tests(path, LAYOUT_WORDS)
    assert len(found) <= 3, f"tests on the layout outside the modules that own it: {found}"
    assert not _layout_tests(STEP / "kernel.py", KERNEL_WORDS)


def test_the_kernel_names_no_feature() -> None:
    code = ast.parse((STEP / "kernel.py").read_text())
    names = {n.id for n in ast.walk(code) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(code) if isinstance(n, ast.Attribute)}
    names |= {a.arg for a in ast.walk(code) if isinstance(a, ast.arg)}
    assert not [n for n in names if KERNEL_WORDS.search(n.lower())]


def test_the_step_is_composed_in_a_few_lines() -> None:
    code = ast.parse((STEP / "composed.py").read_text())
    (transformed,) = [n for n in code.body if isinstance(n, ast.FunctionDef) and n.name == "transformed"]
    assert transformed.end_lineno is not None
    assert transformed.end_lineno - transformed.lineno + 1 < 20


def test_every_module_is_at_most_400_lines() -> None:
    package = Path(fnloop.__file__).parent
    long = {
        str(p.relative_to(package)): n
        for p in package.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, f"split these by idea (docs/architecture.md): {long}"


def _channels(path: Path) -> set[str]:
    """The module-level or class-level stacks of ``path`` that a function pushes onto: values set for a block, not passed."""
    tree = ast.parse(path.read_text())
    declared = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) for t in _targets(n)}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        declared |= {
            f"{cls.name}.{t.id}"
            for n in cls.body
            if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in _targets(n)
        }
    pushed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append":
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else None
            if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name):
                name = f"{owner.value.id}.{owner.attr}"
            if name in declared:
                pushed.add(f"{path.name}:{name}")
    return pushed


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.Name]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [t for t in targets if isinstance(t, ast.Name)]


def test_one_channel_in_the_step_the_seeding_and_the_optimizers() -> None:
    # Everything else reaches the step as an argument or a record. Draws._tracing: torch's tracer,
    # not fnloop, calls the random ops' decompositions. The optimizers have none: an injected
    # setting is told from one given by hand by a walk of the optimizer's records at init.
    step = set().union(*(_channels(p) for p in [*STEP.glob("*.py"), COMPILE / "seeding.py"]))
    optim = set().union(*(_channels(p) for p in (STEP.parent / "optim").glob("*.py")))
    assert step | optim == {"seeding.py:Draws._tracing"}
