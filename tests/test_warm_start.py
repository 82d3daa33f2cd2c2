"""A restarted run loads its compiled step without tracing it, by a key of what the trace would read.

The start key (``fnloop/_compile/identity.py``, ``cache.start_key``) must be the same in every
process for the same program, and must change with anything that could change the graph: the
model's code, its attributes and config, the loss function's code and closure, the optimizer's
settings, the options, torch's settings.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import fnloop as fl
from fnloop._compile.cache import CompileCache, start_key
from fnloop._compile.identity import fingerprint
from fnloop._step.kernel import Kernel

ROOT = Path(__file__).resolve().parent.parent
_g = torch.Generator().manual_seed(0)
BATCH = (torch.randn(8, 4, generator=_g), torch.randint(0, 3, (8,), generator=_g))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(8, 3)
    )


def loss(f: Any, batch: Any) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(f(batch[0]), batch[1])


def smoothed(f: Any, batch: Any) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(f(batch[0]), batch[1], label_smoothing=0.1)


def run(loss_fn: Any, cache: CompileCache) -> tuple[fl.TrainState, Any]:
    """Three compiled steps of AdamW from the same start; the step's cache is ``cache``."""
    module, optimizer = model(), fl.optim.adamw(1e-2)
    step = fl.train_step(module, loss_fn, optimizer)
    step.jit.cache = cache
    state = fl.init(module, optimizer, seed=0, max_iter=3)
    return fl.run(state, step, [BATCH] * 3), step.jit


def leaves(state: fl.TrainState) -> list[torch.Tensor]:
    return pytree.tree_leaves((state.params, state.buffers, state.opt_state))


@pytest.mark.inductor("a graph inductor built, found again by its start key")
def test_a_restart_loads_its_graph_without_tracing_and_trains_the_same_bits(tmp_path: Path) -> None:
    first, jit = run(loss, CompileCache(tmp_path))
    assert (jit.traces, jit.started) == (1, 0)
    assert len(list(tmp_path.glob("*.start"))) == 1

    again, jit = run(loss, CompileCache(tmp_path))  # a new step sees only the folder, as a new process
    assert (jit.traces, jit.started, jit.compiles) == (0, 1, 1)
    assert all(torch.equal(a, b) for a, b in zip(leaves(first), leaves(again)))
    assert first.metrics.series["loss"] == again.metrics.series["loss"]

    # Another loss function: traced, and compiled, again; its own start file beside the first.
    other, jit = run(smoothed, CompileCache(tmp_path))
    assert (jit.traces, jit.started) == (1, 0)
    assert len(list(tmp_path.glob("*.start"))) == 2
    assert not torch.equal(other.params["0.weight"], first.params["0.weight"])

    # An evaluation step the same way.
    outputs = []
    for traces_started in [(1, 0), (0, 1)]:
        evaluate = fl.eval_step(model(), lambda f, b: {"logits": f(b[0])})
        evaluate.jit.cache = CompileCache(tmp_path)
        outputs.append(evaluate(first, BATCH)["logits"])
        assert (evaluate.jit.traces, evaluate.jit.started) == traces_started
    assert torch.equal(*outputs)


_RESTART = """
import json, sys
from fnloop._compile.cache import CompileCache
from tests.test_warm_start import loss, run
final, jit = run(loss, CompileCache(sys.argv[1]))
print(json.dumps([jit.traces, jit.started, final.params["0.weight"].tolist()]))
"""


@pytest.mark.inductor("a restarted process loads the C++ inductor built, and builds none again")
def test_a_restarted_process_builds_no_cpp_again(tmp_path: Path) -> None:
    # In one process the loaded code stays in memory, so only a new process shows a build that a
    # changed build flag (a key of its own) would start again: a C++ wrapper's takes 25 s.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "FNLOOP_CACHE_DIR": "off"}

    def process() -> list[Any]:
        done = subprocess.run(
            [sys.executable, "-c", _RESTART, str(tmp_path / "fnloop")],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def libraries() -> set[Path]:
        return set((tmp_path / "inductor").rglob("*.so"))

    first = process()
    built = libraries()
    assert first[:2] == [1, 0] and built
    again = process()
    assert again[:2] == [0, 1] and again[2] == first[2]
    assert libraries() == built


_FIELD = """
import json, threading, torch, transformers, fnloop as fl
from fnloop._compile.identity import fingerprint
from fnloop._step.kernel import Kernel
transformers.logging.set_verbosity_error()
tiny = dict(vocab_size=64, max_position_embeddings=32)
models = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, **tiny)),
    "vit": lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=16, patch_size=8, num_labels=3)),
    "lstm": lambda: torch.nn.LSTM(4, 8, batch_first=True),
    "encoder": lambda: torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1, enable_nested_tensor=False),
}
loss = lambda model, batch: model(**batch).loss
print(json.dumps({k: fingerprint(Kernel(make(), loss, fl.optim.adamw(1e-3))) for k, make in models.items()}))
"""


def test_the_key_of_the_fields_models_is_the_same_in_every_process() -> None:
    # Python's hashes of strings, ids and addresses differ per process: none may enter the key.
    found = [
        json.loads(
            subprocess.run([sys.executable, "-c", _FIELD], capture_output=True, text=True, check=True).stdout
        )
        for _ in range(2)
    ]
    assert found[0] == found[1]
    assert None not in found[0].values()
    assert len(set(found[0].values())) == len(found[0])


_USER_MODEL = """
import torch

SCALE = 1.0


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x) * SCALE
"""


def _kernel(module: torch.nn.Module, loss_fn: Any = loss, lr: float = 1e-2) -> Kernel:
    return Kernel(module, loss_fn, fl.optim.adamw(lr))


def test_what_the_trace_would_read_changes_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = fingerprint(_kernel(model()))
    assert base is not None
    assert fingerprint(_kernel(model())) == base  # the same program, built again
    changed = {
        "the loss function's code": fingerprint(_kernel(model(), smoothed)),
        "the optimizer's learning rate": fingerprint(_kernel(model(), lr=2e-2)),
        "a layer's setting (dropout's p)": fingerprint(_kernel(_with(model(), "2", p=0.3))),
        "eval mode": fingerprint(_kernel(model().eval())),
        "a parameter's shape": fingerprint(_kernel(torch.nn.Sequential(torch.nn.Linear(4, 3)))),
        "a closure's number": fingerprint(_kernel(model(), _weighted(2.0))),
        "a closure's tensor": fingerprint(_kernel(model(), _weighted(torch.tensor(2.0)))),
    }
    assert fingerprint(_kernel(model(), _weighted(1.0))) != changed["a closure's number"]
    assert fingerprint(_kernel(model(), _weighted(torch.tensor(1.0)))) != changed["a closure's tensor"]
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: out)
    try:
        changed["a hook on every module"] = fingerprint(_kernel(model()))
    finally:
        handle.remove()
    for what, key in changed.items():
        assert key not in (None, base), what
    assert fingerprint(_kernel(model())) == base

    # The user's own code, edited between runs: its forward, and a global it reads.
    source = tmp_path / "user_net.py"
    source.write_text(_USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("user_net")
    before = fingerprint(_kernel(module.Net()))
    monkeypatch.setattr(module, "SCALE", 2.0)
    assert fingerprint(_kernel(module.Net())) not in (None, before), "a global the forward reads"
    source.write_text(_USER_MODEL.replace("* SCALE", "* SCALE + 1"))
    module = importlib.reload(module)
    monkeypatch.setattr(module, "SCALE", 1.0)
    assert fingerprint(_kernel(module.Net())) not in (None, before), "an edited forward"


def test_the_options_the_settings_and_the_code_change_the_start_key(tmp_path: Path) -> None:
    identity, leaves = fingerprint(_kernel(model())), [torch.ones(3), torch.zeros(2, dtype=torch.int64)]
    assert identity is not None
    base = start_key(identity, "form", leaves, {}, None)
    assert start_key(identity, "form", leaves, {}, None) == base
    assert start_key(identity, "form", leaves, {"epilogue_fusion": False}, None) != base
    assert start_key(identity, "another form", leaves, {}, None) != base
    assert start_key(identity, "form", [torch.ones(4), leaves[1]], {}, None) != base
    assert start_key(identity, "form", [leaves[0], leaves[0]], {}, None) != start_key(
        identity, "form", [leaves[0], leaves[0].clone()], {}, None
    )  # which inputs share storage
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium" if previous != "medium" else "high")
    try:
        assert start_key(identity, "form", leaves, {}, None) != base
    finally:
        torch.set_float32_matmul_precision(previous)
    # A file of one's own code, edited (its size or time): another key.
    helper = tmp_path / "user_helper.py"
    helper.write_text("X = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module("user_helper")
        loaded = start_key(identity, "form", leaves, {}, None)
        helper.write_text("X = 22\n")
        assert start_key(identity, "form", leaves, {}, None) != loaded
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("user_helper", None)


@pytest.mark.inductor("the graph of a step without a start key, compiled and found by its traced graph")
def test_what_only_an_address_describes_has_no_key_and_the_step_is_traced(tmp_path: Path) -> None:
    assert fingerprint(object()) is None
    for _ in range(2):
        locked = model()
        locked.guard = threading.Lock()  # type: ignore[assignment]
        assert fingerprint(_kernel(locked)) is None
        optimizer = fl.optim.sgd(0.1)
        step = fl.train_step(locked, loss, optimizer)
        step.jit.cache = CompileCache(tmp_path)
        step(fl.init(locked, optimizer, seed=0, max_iter=1), BATCH)
        assert (step.jit.traces, step.jit.started) == (1, 0)
    assert list(tmp_path.glob("*.start")) == []
    assert len(list(tmp_path.glob("*.graph"))) == 1  # the second found the first's graph by its trace


def _with(module: torch.nn.Sequential, index: str, **settings: Any) -> torch.nn.Module:
    for name, value in settings.items():
        setattr(module._modules[index], name, value)
    return module


def _weighted(weight: Any) -> Any:
    def weighted(f: Any, batch: Any) -> torch.Tensor:
        return loss(f, batch) * weight

    return weighted


def test_a_transformers_models_private_settings_change_the_key() -> None:
    # transformers keeps its implementation choices in a config's private attributes, beside the
    # dataclass's fields (set_experts_implementation("eager") made a Python loop over experts).
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    gpt2 = transformers.GPT2LMHeadModel(config)
    before = fingerprint(_kernel(gpt2))
    gpt2.set_attn_implementation("eager" if gpt2.config._attn_implementation != "eager" else "sdpa")
    assert fingerprint(_kernel(gpt2)) not in (None, before)


def test_a_start_file_round_trips_and_a_partial_or_damaged_one_is_ignored(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path)
    record = {"graph": "a" * 64, "draws": False, "context": ["loss"], "accumulates": [], "random": True}
    assert cache.keep_start("k", record) and cache.start("k") == record
    assert cache.keep_start("partial", {"graph": "a" * 64}) and cache.start("partial") is None
    path = tmp_path / "k.start"
    path.write_bytes(path.read_bytes()[:-3])  # truncated: its checksum no longer holds
    assert cache.start("k") is None
    assert cache.start("missing") is None
    assert not cache.keep_start("tuple", {**record, "context": ("loss",)})  # would come back a list


def test_which_files_are_installed_is_the_same_read_as_written_or_with_links_resolved(tmp_path: Path) -> None:
    import os

    from fnloop._compile import loaded

    def resolved(path: str | None) -> bool:  # the plain answer: every link resolved
        return bool(path) and os.path.realpath(path).startswith(loaded._installed_roots())

    paths = [getattr(m, "__file__", None) for m in list(sys.modules.values())]
    assert [loaded.is_installed(p) for p in paths] == [resolved(p) for p in paths]
    site = os.path.dirname(os.path.dirname(torch.__file__))
    link = tmp_path / "linked"
    link.symlink_to(site)
    escaped = os.path.join(site, "..", "..", "..", "..", "not_installed.py")  # written under it, outside it
    for path in (str(link / "torch" / "__init__.py"), escaped, str(tmp_path / "mine.py")):
        assert loaded.is_installed(path) == resolved(path), path
    assert loaded.is_installed(str(link / "torch" / "__init__.py"))
    assert not loaded.is_installed(str(tmp_path / "mine.py"))
