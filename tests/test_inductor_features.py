"""Each feature of the step compiled once by inductor, against the same trace run op by op.

The suite runs most tests on the traced graph op by op (``backend="graph"``, ``conftest.py``): their
claims are about fnloop's trace, which that backend runs as it is. What inductor makes of each
feature's graph is claimed here, once per feature, on a tiny network with BatchNorm and dropout: the
compiled run equals the op-by-op run of the same trace (the same dropout masks: each random op draws
from the step's seed) to float32's rounding, and where fnloop promises bits across graphs (several
steps per call, donation), bit for bit. Sharding and block-by-block gathering are compiled by
inductor in ``tests/test_sharding.py``'s jobs marked so (``INDUCTOR``); the models suite compiles the
field's models (``tests/test_models.py``).
"""

from __future__ import annotations

import functools

import pytest
import torch

import fnloop as fl
from fnloop import testing

pytestmark = pytest.mark.inductor("what inductor compiles of each feature of the step")

STEPS = 4


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    # No bias before the BatchNorm: its gradient is zero but for rounding, which Adam turns into steps
    # of either sign (docs/population.md), so it would differ by the learning rate between any two runs.
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16, bias=False),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(16, 3),
    )


def loss_fn(forward, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(forward(x), y)


def batches(n: int = STEPS) -> list:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)) for _ in range(n)]


OPT = fl.optim.adamw(1e-2)


def close(a: fl.TrainState, b: fl.TrainState, tol: float = 1e-5) -> None:
    for part in ("params", "buffers"):
        for k in getattr(a, part):
            torch.testing.assert_close(
                getattr(a, part)[k], getattr(b, part)[k], rtol=tol, atol=tol, msg=f"{part}[{k}]"
            )
    assert a.iteration == b.iteration


def zero() -> float:
    return 0.0


def both(state: fl.TrainState, data: list, opt=OPT, **options) -> tuple[fl.TrainState, fl.TrainState]:
    """The run compiled by inductor, and the same run on its trace op by op."""
    compiled = fl.train_step(model(), loss_fn, opt, backend="inductor", **options)
    traced = fl.train_step(model(), loss_fn, opt, backend="graph", **options)
    return fl.run(state, compiled, data, clock=zero), fl.run(state, traced, data, clock=zero)


def start(opt: fl.optim.Optimizer = OPT, n: int = STEPS) -> fl.TrainState:
    return fl.init(model(), opt, seed=0, max_iter=n)


@pytest.mark.parametrize(
    "options",
    [{}, {"accumulate": 2}, {"stats": "blocks"}, {"invariant": 2}],
    ids=["plain", "accumulation", "statistics", "invariant"],
)
def test_inductor_compiles_each_feature_as_its_trace_runs(options):
    compiled, traced = both(start(), batches(), **options)
    close(compiled, traced)
    if "stats" in options:
        for name in ("grad_norm", "update_norm"):
            torch.testing.assert_close(
                torch.tensor(compiled.metrics.floats(name)),
                torch.tensor(traced.metrics.floats(name)),
                rtol=1e-5,
                atol=0,
            )


@functools.cache
def _compiled(**options) -> fl.Step:
    return fl.train_step(model(), loss_fn, OPT, backend="inductor", **options)


def test_several_steps_per_call_are_single_steps_bit_for_bit_and_donation_changes_no_bit():
    single = fl.run(start(), _compiled(), batches(), clock=zero)
    several = fl.run(start(), _compiled(steps_per_call=2), batches(), clock=zero)
    testing.assert_identical(several, single)
    undonated = fl.train_step(model(), loss_fn, OPT, backend="inductor", donate=False)
    undonated = fl.run(start(), undonated, batches(), clock=zero)
    testing.assert_identical(undonated, single)


def test_a_population_compiled_is_its_members_trace():
    def member(seed, lr):
        return fl.init(model(), fl.optim.inject(fl.optim.adamw, lr=lr), seed=seed, max_iter=STEPS)

    population = fl.population(member, seeds=[0, 1], lr=[1e-2, 3e-3])
    opt = fl.optim.inject(fl.optim.adamw, lr=1e-2)
    compiled = fl.run(
        population, fl.train_step(model(), loss_fn, opt, backend="inductor"), batches(), clock=zero
    )
    traced = fl.run(population, fl.train_step(model(), loss_fn, opt, backend="graph"), batches(), clock=zero)
    close(compiled, traced)


def test_loss_scaling_in_float16_compiles_as_its_trace_runs():
    opt = fl.optim.dynamic_loss_scale(OPT, init_scale=2.0**12)
    compiled, traced = both(start(opt), batches(), opt, autocast=torch.float16)
    close(compiled, traced, tol=5e-3)  # float16 kernels round their own way when fused
    assert compiled.opt_state.scale == traced.opt_state.scale


class _Checkpointed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.net, x, use_reentrant=False)


def test_activation_checkpointing_compiles_as_its_trace_runs():
    def step(backend):
        torch.manual_seed(0)
        return fl.train_step(_Checkpointed(), loss_fn, OPT, backend=backend)

    torch.manual_seed(0)
    state = fl.init(_Checkpointed(), OPT, seed=0, max_iter=STEPS)
    close(fl.run(state, step("inductor"), batches()), fl.run(state, step("graph"), batches()))
