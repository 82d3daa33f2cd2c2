"""Test-wide settings: hypothesis profiles and the inductor cache.

`ci` (the default) is bounded and derandomized, so the property suite is fast
and the same on every run. Hunt for bugs locally with
`HYPOTHESIS_PROFILE=hunt pytest property_tests`.
"""

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# Compiled graphs are shared by the whole run (every worker, and every process a test starts), in the
# checkout's ignored build area: inductor's cache and fnloop's own. A fresh clone starts them empty. A
# test's result never depends on them: a graph found there is the graph a compile would build, and
# the tests of the caches themselves point them at folders of their own.
_CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))
os.environ.setdefault("FNLOOP_CACHE_DIR", os.path.join(_CACHE, "fnloop"))
# One compiling process each: the suite runs on every core already (pytest-xdist), and inductor's pool
# of compile workers would start a few interpreters in every process that compiles.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
torch.set_num_threads(1)

# A test compiles only what it tests. Its compiled steps run fnloop's traced graph op by op
# (backend="graph": the trace, in seconds, no inductor) unless it is marked
# @pytest.mark.inductor("<its claim>"): a claim about what inductor builds (bits of compiled runs,
# fused kernels, the compile cache, the models suite, compiled speed) runs on inductor. The variable
# reaches every process a test starts (torchrun's workers, the docs' pages). FNLOOP_BACKEND=inductor
# in the environment runs every test on inductor.
SUITE_BACKEND = os.environ.setdefault("FNLOOP_BACKEND", "graph")

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=2000,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("hunt", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The torchrun workers are scripts launched by path (their own folder first on sys.path), not modules:
# `--doctest-modules` would import them as `tests.<name>`, where their sibling imports do not resolve.
collect_ignore_glob = ["tests/*_worker.py"]


TIMES = Path(__file__).parent / "tests" / "suite-times.json"
"""Each test's time in a recorded cold run, setup included, and its setup's: what ``slow`` and the
order of the groups are derived from. ``python benchmarks/suite_table.py REPORT --write-times
tests/suite-times.json`` writes it from a run's ``--suite-report``."""

SLOW = 2.0
"""Seconds from which a test is ``slow``: ``pytest -m "not slow"`` is the inner loop's tier."""


def _recorded() -> dict[str, list[float]]:
    try:
        return json.loads(TIMES.read_text())["tests"]
    except (OSError, ValueError, KeyError):
        return {}


def _shared(item: pytest.Item) -> set[str]:
    """The module- and session-scoped fixtures ``item`` uses: what a test before it may have built."""
    defs = item._fixtureinfo.name2fixturedefs  # type: ignore[attr-defined]
    return {
        name for name, found in defs.items() if found and found[-1].scope in ("module", "session", "package")
    }


def _slow(items: list[pytest.Item]) -> None:
    """Mark ``slow`` each test that took ``SLOW`` seconds, and each test sharing a fixture that took as long to build.

    A module's shared fixture (a compiled step, a launch) is built by its first test, whose setup the
    record charges; any other test of the module using it may be the one to build it, so it is slow too.
    """
    times = _recorded()
    costly: dict[str, set[str]] = {}  # module -> fixtures whose building took SLOW
    for item in items:
        total, setup = times.get(item.nodeid.split("@")[0], (0.0, 0.0))
        if setup >= SLOW:
            costly.setdefault(item.nodeid.split("::")[0], set()).update(_shared(item))
    for item in items:
        total, _ = times.get(item.nodeid.split("@")[0], (0.0, 0.0))
        if total >= SLOW or costly.get(item.nodeid.split("::")[0], set()) & _shared(item):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the tests' ids
def pytest_collection_modifyitems(config, items):
    """Each test in its file's group unless it names one (``xdist_group``); ``slow`` from the record.

    The suite runs on every core with ``pytest-xdist --dist loadgroup``: a group's tests run in one
    worker, in order, so a module's shared compiled steps are built once. A large file splits its tests
    into groups of their own where they share nothing (``tests/test_models.py``, by architecture).
    """
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    _slow(items)
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        # The longest groups first, by the record: the workers hand out groups in this order, and a
        # long group handed out last would leave one core working alone at the end.
        times = _recorded()
        marks = {item: item.get_closest_marker("xdist_group") for item in items}
        group = {item: mark.args[0] if mark.args else mark.kwargs.get("name") for item, mark in marks.items()}
        length: Counter = Counter()
        for item in items:
            length[group[item]] += times.get(item.nodeid.split("@")[0], (0.0, 0.0))[0]
        items.sort(key=lambda item: -length[group[item]])


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures are set up: a module's shared steps too
def pytest_runtest_setup(item):
    """The test's steps on inductor if it is marked ``inductor``, else on the suite's backend."""
    marked = item.get_closest_marker("inductor")
    if marked is not None and not (marked.args and isinstance(marked.args[0], str) and marked.args[0]):
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.inductor needs its claim, as a string")
    os.environ["FNLOOP_BACKEND"] = "inductor" if marked is not None else SUITE_BACKEND


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Under ``--dist loadgroup``, every test's id a worker collected must carry its group (``@name``)."""
    if node.config.getoption("dist") == "loadgroup" and any("@" not in i for i in ids):
        pytest.exit(
            f"pytest-xdist's --dist loadgroup left the tests without their groups (pytest {pytest.__version__} "
            "ignores the group xdist writes into a test's id: pytest-xdist issue 1386), so a file's tests "
            "would run on several workers, each building the file's shared compiled steps and launches "
            "again. Install the pytest the dev extra names (pip install -c constraints.txt -e '.[dev]'), "
            "or run with -n0.",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


# -- the suite's own time: a report, not a timed test ----------------------------------------------------

NATIVE_CRASHES = Path(_CACHE) / "native-crashes.log"
"""Where a launch that a rank's native crash made run again writes the crash's report
(``tests/launches.py``); the suite's summary counts those of this run. The previous run's is kept
beside it as ``native-crashes.earlier.log`` (a later pytest run, as the device check's, would
otherwise lose the suite's)."""

BUDGET = 60.0
"""Seconds a test may take, setup included, on a cold run (empty caches) of an ordinary day on a 2-core
machine; one that takes longer is named at the end of the run. Nothing fails for it: it is a report."""


def pytest_addoption(parser):
    parser.addoption(
        "--suite-report",
        metavar="FILE",
        help="write each test's and each file's time, the processes launched and the graphs built, as JSON",
    )


def _launched(event, args):
    # Every Python process a test starts (the compiler's gcc aside), and the workers of each torchrun
    # launch, which its agent starts.
    if event == "subprocess.Popen":
        argv = [str(a) for a in (args[1] if isinstance(args[1], (list, tuple)) else [args[1]])]
        if not argv or "python" not in os.path.basename(argv[0]):
            _LAUNCHED["other processes"] += 1
            return
        _LAUNCHED["processes"] += 1
        if "torch.distributed.run" in argv:
            n = next((a.split("=", 1)[1] for a in argv if a.startswith("--nproc_per_node=")), "1")
            nodes = next((a.split("=", 1)[1] for a in argv if a.startswith("--nnodes=")), "1")
            _LAUNCHED["torchrun workers"] += int(n) if n.isdigit() else 1
            _LAUNCHED["torchrun launches"] += 1 if nodes == "1" else 0


_LAUNCHED: Counter = Counter()
_TIMES: dict[str, float] = {}
_SETUPS: dict[str, float] = {}


def pytest_configure(config):
    config.stash[_STARTED] = time.time()
    # The run's own process, before any worker starts.
    if getattr(config, "workerinput", None) is None and NATIVE_CRASHES.exists():
        NATIVE_CRASHES.replace(NATIVE_CRASHES.with_name("native-crashes.earlier.log"))
    sys.addaudithook(_launched)


_STARTED = pytest.StashKey[float]()


def pytest_runtest_logreport(report):
    nodeid = report.nodeid.split("@")[0]
    _TIMES[nodeid] = _TIMES.get(nodeid, 0.0) + report.duration
    if report.when == "setup":
        _SETUPS[nodeid] = report.duration


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its launches go to the controller
        workeroutput["launched"] = json.dumps(dict(_LAUNCHED))


@pytest.hookimpl(optionalhook=True)  # xdist's: the run may go without it (-p no:xdist)
def pytest_testnodedown(node, error):
    _LAUNCHED.update(json.loads(getattr(node, "workeroutput", {}).get("launched", "{}")))


def _graphs_built(since: float) -> dict[str, int]:
    """The graphs compiled this run, as the shared caches hold them (every process, every worker)."""
    fnloop = Path(os.environ["FNLOOP_CACHE_DIR"]) / "compile"
    inductor = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "fxgraph"
    return {
        "fnloop": sum(1 for p in fnloop.glob("*.graph") if p.stat().st_mtime >= since),
        "inductor": sum(1 for p in inductor.glob("*/*/*") if p.stat().st_mtime >= since),
    }


def pytest_terminal_summary(terminalreporter, config):
    if getattr(config, "workerinput", None) is not None or not _TIMES:
        return
    started = config.stash[_STARTED]
    wall = time.time() - started
    files: Counter = Counter()
    for nodeid, seconds in _TIMES.items():
        files[nodeid.split("::")[0]] += seconds
    graphs = _graphs_built(started)
    write = terminalreporter.write_line
    terminalreporter.section("the suite's time")
    write(
        f"{len(_TIMES)} tests in {wall / 60:.1f} min of wall time ({sum(_TIMES.values()) / 60:.1f} min of tests); "
        f"Python processes launched: {_LAUNCHED['processes']} (torchrun: {_LAUNCHED['torchrun launches']} "
        f"launches on one machine, {_LAUNCHED['torchrun workers']} workers; others: "
        f"{_LAUNCHED['other processes']}, the compiler's); graphs built this run: "
        f"{graphs['fnloop']} in fnloop's cache, {graphs['inductor']} in inductor's"
    )
    write("the ten slowest tests (setup and teardown included):")
    for nodeid, seconds in sorted(_TIMES.items(), key=lambda kv: -kv[1])[:10]:
        write(f"  {seconds:7.1f} s  {nodeid}")
    over = [(n, s) for n, s in _TIMES.items() if s > BUDGET]
    write(
        f"over the budget of {BUDGET:.0f} s a test: "
        + (", ".join(f"{n} ({s:.0f} s)" for n, s in sorted(over, key=lambda kv: -kv[1])) or "none")
    )
    crashes = NATIVE_CRASHES.read_text().count("\n--- ") if NATIVE_CRASHES.exists() else 0
    write(
        "launches run again after a rank's native crash: "
        + (f"{crashes}, their reports in {NATIVE_CRASHES}" if crashes else "none")
    )
    path = config.getoption("--suite-report")
    if path:
        report = {
            "wall_s": wall,
            "launched": dict(_LAUNCHED),
            "graphs": graphs,
            "files": dict(files.most_common()),
            "tests": dict(sorted(_TIMES.items(), key=lambda kv: -kv[1])),
            "setups": {k: _SETUPS.get(k, 0.0) for k in _TIMES},
        }
        Path(path).write_text(json.dumps(report, indent=1))
