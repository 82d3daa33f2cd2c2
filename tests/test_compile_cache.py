"""fnloop's compile cache: a changed graph compiles afresh, the same one loads, a damaged file is rebuilt."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._inductor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn import functional as F

import fnloop as fl
from fnloop._compile import cache as cache_module
from fnloop._compile.cache import CompileCache, default_cache, graph_key
from fnloop._compile.keys import start_key
from fnloop._compile.probes import remembered_probes

pytestmark = pytest.mark.inductor("the compile cache keeps and loads what inductor builds")

X = torch.linspace(-1, 1, 24).reshape(6, 4)
Y = torch.tensor([0, 1, 2, 0, 1, 2])
BATCH = (X, Y)


def model(hidden: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))


def smoothed(forward: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(forward(x), y, label_smoothing=0.1)


def weighted(weight: float | torch.Tensor) -> Callable[[Any, Any], torch.Tensor]:
    def loss_fn(forward: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return weight * F.cross_entropy(forward(x), y)  # the same code for every weight

    return loss_fn


BASE = weighted(1.0)
"""The base run's loss: a closure's number, baked into the graph."""


class Counted:
    """``standalone_compile``, counting its calls: each one is a real inductor compile (or inductor's own cache)."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.original(*args, **kwargs)


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fnloop-cache")


@pytest.fixture(scope="module")
def inductor() -> Iterator[Counted]:
    counted = Counted(torch._inductor.standalone_compile)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch._inductor, "standalone_compile", counted)
        yield counted


def run(module: torch.nn.Module, loss_fn: Any, cache: CompileCache | None, *, compile: bool = True) -> Any:
    """Two steps of SGD from the same start; the step's cache is ``cache``."""
    optimizer = fl.optim.sgd(0.1, momentum=0.9)
    step = fl.train_step(module, loss_fn, optimizer, compile=compile)
    if compile:
        step.jit.cache = cache
    state = fl.init(module, optimizer, seed=0, max_iter=2)
    return fl.run(state, step, [BATCH, BATCH])


def assert_as_eager(final: Any, module: torch.nn.Module, loss_fn: Any) -> None:
    eager = run(module, loss_fn, None, compile=False)
    for name, value in eager.params.items():
        torch.testing.assert_close(final.params[name], value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        final.metrics.latest("loss")[1], eager.metrics.latest("loss")[1], rtol=1e-5, atol=1e-6
    )


@pytest.fixture(scope="module")
def first(directory: Path, inductor: Counted) -> tuple[CompileCache, Any]:
    """The base run, compiled into an empty cache."""
    cache = CompileCache(directory)
    final = run(model(), BASE, cache)
    assert (cache.hits, cache.misses, inductor.calls) == (0, 1, 1)
    return cache, final


def test_a_changed_graph_compiles_afresh_and_the_same_one_loads(
    first: tuple[CompileCache, Any], directory: Path, inductor: Counted
) -> None:
    _, base = first
    assert_as_eager(base, model(), BASE)

    cache = CompileCache(directory)  # a new process would see only the folder
    calls = inductor.calls
    again = run(model(), BASE, cache)
    assert (cache.hits, cache.misses, inductor.calls) == (1, 0, calls)
    for name, value in base.params.items():
        assert torch.equal(again.params[name], value)

    changes = [
        ("the loss function's code", model(), smoothed),
        ("a closure constant", model(), weighted(3.0)),
        ("a parameter's shape", model(hidden=6), BASE),
    ]
    for what, module, loss_fn in changes:
        misses = cache.misses
        final = run(module, loss_fn, cache)
        assert (cache.misses, inductor.calls) == (misses + 1, calls + 1), what
        calls += 1
        assert_as_eager(final, module, loss_fn)
    assert len(list(directory.glob("*.graph"))) == 4


def test_a_graph_with_a_tensor_constant_compiles_without_the_cache(
    first: tuple[CompileCache, Any], directory: Path, inductor: Counted
) -> None:
    # torch 2.13 cannot reload such a graph (it expects the constant as an input): never reuse it.
    cache = CompileCache(directory)
    calls, files = inductor.calls, set(directory.glob("*.graph"))
    for value in (1.0, 3.0):
        loss_fn = weighted(torch.tensor(value))
        final = run(model(), loss_fn, cache)
        assert_as_eager(final, model(), loss_fn)
    assert (cache.hits, cache.misses, inductor.calls) == (0, 0, calls + 2)
    assert set(directory.glob("*.graph")) == files


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "empty", "not ours", "checksummed garbage"])
def test_a_damaged_file_is_rebuilt_never_loaded(
    first: tuple[CompileCache, Any], directory: Path, inductor: Counted, damage: str
) -> None:
    _, base = first
    files = list(directory.glob("*.graph"))
    cache = CompileCache(directory)
    key = _key_of_base(cache)
    path = cache.path(key)
    assert path in files
    data = path.read_bytes()
    damaged = {
        "truncated": data[: len(data) // 2],
        "flipped byte": data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:],
        "empty": b"",
        "not ours": data[len(cache_module._FORMAT) :],
        # Passes fnloop's checksum, so torch's own loading must refuse it.
        "checksummed garbage": cache_module._FORMAT
        + hashlib.sha256(b"junk").hexdigest().encode()
        + b"\njunk",
    }[damage]
    path.write_bytes(damaged)
    calls = inductor.calls
    final = run(model(), BASE, cache)
    assert (cache.rejected, cache.hits, inductor.calls) == (1, 0, calls + 1)
    for name, value in base.params.items():
        assert torch.equal(final.params[name], value)
    assert path.read_bytes() != damaged  # rewritten, whole
    assert cache_module._checked(path.read_bytes()) is not None


def _key_of_base(cache: CompileCache) -> str:
    """The key of the base run's graph, found by tracing it as the step does (no compile)."""
    module = model()
    optimizer = fl.optim.sgd(0.1, momentum=0.9)
    step = fl.train_step(module, BASE, optimizer)
    seen: list[str] = []

    def keyed(graph: Any, leaves: Any, options: Any) -> str:
        seen.append(graph_key(graph, leaves, options))
        raise _Stop

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("fnloop._compile.jit.graph_key", keyed)
        step.jit.cache = cache
        with pytest.raises(_Stop):
            step(fl.init(module, optimizer, seed=0, max_iter=2), BATCH)
    return seen[0]


class _Stop(Exception):
    pass


# --------------------------------------------------------------------------- the key, without compiling


def traced(function: Callable[..., Any], *inputs: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(function, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)


def test_the_key_is_the_same_for_the_same_graph_traced_twice() -> None:
    x = torch.ones(3, 2)

    def f(t: torch.Tensor) -> list[torch.Tensor]:
        return [t.sin() * torch.tensor([1.0, 2.0])]

    assert graph_key(traced(f, x), [x], {}) == graph_key(traced(f, x), [x.clone()], {})


def test_the_key_changes_under_torchs_deterministic_algorithms() -> None:
    # Inductor lowers an accumulating index_put otherwise under them: a graph built one way is not the other's.
    x = torch.ones(3, 2)
    graph = traced(lambda t: [t.sin()], x)
    plain = graph_key(graph, [x], {})
    torch.use_deterministic_algorithms(True)
    try:
        deterministic = graph_key(graph, [x], {})
    finally:
        torch.use_deterministic_algorithms(False)
    assert plain != deterministic
    assert plain == graph_key(graph, [x], {})


def test_the_key_changes_with_a_closure_tensor_an_input_an_option_and_aliasing() -> None:
    x = torch.ones(3, 2)

    def scaled(c: torch.Tensor) -> Callable[[torch.Tensor], list[torch.Tensor]]:
        return lambda t: [t * c]

    base = graph_key(traced(scaled(torch.tensor([1.0, 2.0])), x), [x], {})
    assert base != graph_key(traced(scaled(torch.tensor([1.0, 3.0])), x), [x], {})
    assert base != graph_key(traced(scaled(torch.tensor([1.0, 2.0])), x), [x.t().contiguous().t()], {})
    assert base != graph_key(traced(scaled(torch.tensor([1.0, 2.0])), x), [x], {"cpp_wrapper": True})

    def pair(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        return [a + b]

    y = torch.ones(3, 2)
    assert graph_key(traced(pair, x, y), [x, y], {}) != graph_key(traced(pair, x, x), [x, x], {})


def test_the_ranks_rows_of_one_batch_find_one_graph_where_they_start_aligned() -> None:
    """A rank's rows of a batch are a view at its own offset: the key does not hold the offset, only whether
    the view starts aligned (inductor's assumption) and where it lies against a leaf sharing its storage."""
    batch = torch.ones(8, 4)
    first, second = batch.chunk(2)  # offsets 0 and 16 floats
    graph = traced(lambda t: [t.sin()], first)
    assert graph_key(graph, [first], {}) == graph_key(graph, [second], {})
    assert start_key("f", "s", [first], {}, None) == start_key("f", "s", [second], {}, None)
    odd = torch.ones(33)[1:].view(8, 4)  # 4 bytes in: not aligned
    assert graph_key(graph, [first], {}) != graph_key(graph, [odd], {})

    def pair(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        return [a + b]

    rows = torch.ones(12, 4)
    near, far = (rows[:4], rows[4:8]), (rows[:4], rows[8:])  # two views of one storage, 16 or 32 floats apart
    aliased = traced(pair, *near)
    assert graph_key(aliased, list(near), {}) != graph_key(aliased, list(far), {})


def test_the_environment_relocates_or_turns_off_the_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FNLOOP_CACHE_DIR", str(tmp_path))
    step = fl.train_step(model(), BASE, fl.optim.sgd(0.1))
    assert step.jit.cache is not None and step.jit.cache.directory == tmp_path / "compile"
    monkeypatch.setenv("FNLOOP_CACHE_DIR", "off")
    assert default_cache() is None
    assert fl.train_step(model(), BASE, fl.optim.sgd(0.1)).jit.cache is None
    monkeypatch.delenv("FNLOOP_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache = default_cache()
    assert cache is not None and cache.directory == tmp_path / "xdg" / "fnloop" / "compile"


def test_a_cache_directory_must_be_a_path() -> None:
    with pytest.raises(TypeError, match=r"'directory' must be a str or a path \(got 3 that is an int\)"):
        CompileCache(3)  # type: ignore[arg-type]


def test_a_missing_file_is_a_miss(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path)
    assert cache.load("f" * 64) is None
    assert (cache.hits, cache.misses, cache.rejected) == (0, 1, 0)


def test_a_probe_answer_is_remembered_for_the_same_library_only(tmp_path: Path) -> None:
    from torch._inductor.cpu_vec_isa import VecAVX2

    library = tmp_path / "not-a-library.so"
    library.write_bytes(b"no ELF here")
    isa = VecAVX2()
    with remembered_probes(tmp_path):
        assert isa._probe_load(str(library)) is False  # a real probe: the child cannot dlopen it
    record = json.loads((tmp_path / "cpu-probes.json").read_text())
    assert list(record.values()) == [False]
    (key,) = record
    (tmp_path / "cpu-probes.json").write_text(json.dumps({key: True}))
    with remembered_probes(tmp_path):
        assert isa._probe_load(str(library)) is True  # answered from the record
        library.write_bytes(b"another file now")
        assert isa._probe_load(str(library)) is False  # a changed library is probed again
    assert isa._probe_load.__func__ is VecAVX2._probe_load  # type: ignore[attr-defined]


# -- one compile per machine -------------------------------------------------------------------------

_RACE = """
import sys, time, json, torch, fnloop as fl
from fnloop._compile.cache import CompileCache
import torch._inductor
calls = []
real = torch._inductor.standalone_compile
torch._inductor.standalone_compile = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
directory, start = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
opt = fl.optim.sgd(0.1)
step = fl.train_step(model, lambda f, b: f(b[0]).square().mean(), opt, backend="inductor")
step.jit.cache = CompileCache(directory)
state = fl.init(model, opt, seed=0, max_iter=1)
while time.time() < start:
    time.sleep(0.01)
new = step(state, (torch.ones(6, 4), torch.zeros(6)))
print(json.dumps({"compiles": len(calls), "hits": step.jit.cache.hits, "w": new.params["0.weight"].sum().item()}))
"""


@pytest.mark.inductor("what inductor builds is what one process saves and the others load")
def test_processes_that_need_one_graph_at_once_compile_it_once_and_the_others_load_it(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    start = str(time.time() + 8)  # every process past its imports and trace before the first compiles
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACE, str(tmp_path / "fnloop"), start],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(3)
    ]
    results = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(r["compiles"] for r in results) == [0, 0, 1], results
    assert sorted(r["hits"] for r in results) == [0, 1, 1], results
    assert len({r["w"] for r in results}) == 1


def test_a_process_killed_holding_a_graphs_lock_leaves_it_free(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    holder = (
        "import sys, time\n"
        "from fnloop._compile.cache import CompileCache\n"
        "with CompileCache(sys.argv[1]).claimed('k' * 64):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    import fcntl
    import os

    fd = os.open(tmp_path / ("k" * 64 + ".lock"), os.O_RDWR)
    with pytest.raises(BlockingIOError):  # the holder has it: a second process would wait
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free the moment its holder died
    os.close(fd)
    with CompileCache(tmp_path).claimed("k" * 64):  # and the next run takes it
        pass


def test_a_tensor_made_and_never_read_leaves_no_constant_and_the_graph_is_kept() -> None:
    # transformers' GPT-2 makes torch.tensor([]) in its masks and never reads it: traced, a constant
    # that would keep the whole graph out of the cache (torch 2.13 cannot reload constants).
    from fnloop._compile.trace import dead_constants_dropped, has_constants

    def f(x: torch.Tensor) -> list[torch.Tensor]:
        torch.tensor([])
        return [x * torch.tensor([2.0, 3.0])]

    graph = make_fx(f, tracing_mode="fake")(torch.ones(2))
    assert dead_constants_dropped(graph)
    assert has_constants(graph)  # the one read stays, with its value
    assert torch.equal(graph(torch.ones(2))[0], torch.tensor([2.0, 3.0]))
    unread = make_fx(lambda x: (torch.tensor([]), [x + 1])[1], tracing_mode="fake")(torch.ones(2))
    assert dead_constants_dropped(unread) and not has_constants(unread)
    assert not dead_constants_dropped(unread)  # nothing left to drop
