"""Activation checkpointing in the step: torch.utils.checkpoint (non-reentrant), whole or selective.

The recomputed forward runs in the backward on the state's parameters and
draws the dropout masks of the first forward, eager and compiled: losses equal
the run without checkpointing bit for bit (bf16 with a selective policy: to
1e-4, see the step's page). Compiled steps are shared (``_step``).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import fnloop as fl
from fnloop import testing


def _save_matmuls(ctx, op, *args, **kwargs):
    """A selective policy: keep the matrix products, recompute the rest."""
    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class Net(torch.nn.Module):
    """A block that may be checkpointed (``how``: ``None``, ``"full"``, ``"selective"``), then a head."""

    def __init__(self, how: str | None, p: float, reentrant: bool = False) -> None:
        super().__init__()
        self.how, self.reentrant = how, reentrant
        self.embed = torch.nn.Linear(8, 16)
        self.block = torch.nn.Sequential(
            torch.nn.Linear(16, 32),
            torch.nn.Dropout(p),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 16),
            torch.nn.GELU(),
        )
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.how == "full":
            h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        elif self.how == "selective":
            contexts = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            h = checkpoint(self.block, h, use_reentrant=False, context_fn=contexts)
        else:
            h = self.block(h)
        return self.head(h)


def loss_fn(forward, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(forward(x), y)


OPT = fl.optim.adamw(1e-2)
_g = torch.Generator().manual_seed(1)
BATCHES = [(torch.randn(16, 8, generator=_g), torch.randint(0, 3, (16,), generator=_g)) for _ in range(6)]


def _net(how: str | None, p: float, **kwargs) -> Net:
    torch.manual_seed(0)
    return Net(how, p, **kwargs)


@functools.cache
def _step(how: str | None, p: float, **kwargs) -> fl.Step:
    return fl.train_step(_net(how, p), loss_fn, OPT, **kwargs)


def _run(how: str | None, p: float, step: fl.Step, n: int = 4) -> fl.TrainState:
    start = fl.init(_net(how, p), OPT, seed=0, max_iter=n)
    return fl.run(start, step, fl.data.resumable(BATCHES), clock=lambda: 0.0)


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("how", ["full", "selective"])
def test_eager_checkpointing_equals_no_checkpointing_bit_for_bit(how, p):
    # Before, the recomputation ran after functional_call had put the module's own parameters
    # back: from the second step on its gradients were of the initial weights (4e-6 off by step 5).
    plain = _run(None, p, fl.train_step(_net(None, p), loss_fn, OPT, compile=False), 5)
    checkpointed = _run(how, p, fl.train_step(_net(how, p), loss_fn, OPT, compile=False), 5)
    testing.assert_identical(checkpointed, plain)


@pytest.mark.parametrize(("how", "p"), [("full", 0.0), ("full", 0.3), ("selective", 0.3)])
def test_compiled_checkpointing_equals_no_checkpointing_bit_for_bit(how, p):
    # With dropout, the recomputed forward draws the first forward's masks (compiled, the step
    # draws from its seed and a count of draws, which setting torch's generator state back resets).
    testing.assert_identical(_run(how, p, _step(how, p), 4), _run(None, p, _step(None, p), 4))
    assert _step(how, p).compiles == 1


def test_checkpointing_in_several_steps_per_call_equals_single_steps():
    double = _run("full", 0.3, _step("full", 0.3, steps_per_call=2), 4)
    testing.assert_identical(double, _run(None, 0.3, _step(None, 0.3), 4))


def test_bf16_autocast_with_checkpointing():
    plain = _run(None, 0.3, _step(None, 0.3, autocast=torch.bfloat16), 4)
    testing.assert_identical(_run("full", 0.3, _step("full", 0.3, autocast=torch.bfloat16), 4), plain)


def test_a_checkpointed_run_resumed_after_a_crash_ends_bit_exact(tmp_path):
    step = _step("full", 0.3)
    straight = _run("full", 0.3, step, 6)
    start = fl.init(_net("full", 0.3), OPT, seed=0, max_iter=6)
    hooks = [fl.every(2, fl.hooks.checkpoint(tmp_path / "ckpt")), testing.Fail(fl.Phase.AFTER_STEP, 3)]
    with pytest.raises(testing.InjectedFailure):
        fl.run(start, step, fl.data.resumable(BATCHES), hooks, clock=lambda: 0.0)
    resumed = fl.checkpoint.resume(tmp_path / "ckpt", like=start)
    assert resumed.iteration == 2  # the periodic checkpoint before the crash
    final = fl.run(resumed, step, fl.data.resumable(BATCHES), clock=lambda: 0.0)
    testing.assert_identical(final, straight)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_reentrant_checkpointing_is_refused_with_the_fix(compile):
    model = _net("full", 0.0, reentrant=True)
    step = fl.train_step(model, loss_fn, OPT, compile=compile)
    with pytest.raises(
        TypeError, match=r"activation checkpointing: .*use_reentrant=True.*use_reentrant=False"
    ):
        fl.run(fl.init(model, OPT, seed=0, max_iter=1), step, BATCHES)


class Stem(torch.nn.Module):
    """The first layers checkpointed, fed the batch: their input needs no gradient."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:  # use_reentrant left to torch, which then takes the reentrant form
            return self.head(checkpoint(self.stem, x))
        return self.head(checkpoint(self.stem, x, use_reentrant=self.reentrant))


@pytest.mark.filterwarnings("ignore:torch.utils.checkpoint. the use_reentrant parameter")
@pytest.mark.parametrize("reentrant", [True, None], ids=["reentrant", "unsaid"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_reentrant_checkpointing_of_blocks_fed_the_batch_is_refused_not_left_untrained(compile, reentrant):
    # torch gives such a block's parameters no gradient, and says so with a warning only.
    torch.manual_seed(0)
    model = Stem(reentrant)
    step = fl.train_step(model, loss_fn, OPT, compile=compile)
    refused = r"use_reentrant=True .*none of whose inputs needs a gradient.*use_reentrant=False"
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # a user's filters: torch's warning is no error there
        warnings.filterwarnings("ignore", message="torch.utils.checkpoint: the use_reentrant parameter")
        with pytest.raises(TypeError, match=refused):
            fl.run(fl.init(model, OPT, seed=0, max_iter=1), step, BATCHES)
    # Non-reentrant, the same block trains.
    model = Stem(False)
    state = fl.init(model, OPT, seed=0, max_iter=1)
    after = fl.run(state, fl.train_step(model, loss_fn, OPT, compile=False), BATCHES)
    assert not torch.equal(after.params["stem.0.weight"], state.params["stem.0.weight"])


@pytest.mark.inductor("fnloop's inductor options for a graph that recomputes")
def test_a_graph_that_recomputes_is_built_without_inductors_locality_reordering(monkeypatch):
    # Forward and backward are one graph: reordered for locality, the recomputed ops moved up beside
    # the forward ops reading the same inputs, and checkpointing saved 15% of GPT-2's working
    # memory, not 62% (benchmarks/bench_remat.py).
    import fnloop._compile.jit as jit

    seen = []
    real = jit.default_options

    def recording(leaves, loops, ops, recomputes=False, shards=False):
        options = real(leaves, loops, ops, recomputes, shards)
        seen.append(options.get("reorder_for_locality", True))
        return options

    monkeypatch.setattr(jit, "default_options", recording)
    for how in (None, "full"):
        model = _net(how, 0.3)
        step = fl.train_step(model, loss_fn, OPT)
        fl.run(fl.init(model, OPT, seed=0, max_iter=1), step, BATCHES)
    assert seen == [True, False]
