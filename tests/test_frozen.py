"""Frozen parameters: ``requires_grad=False`` on the module means not trained, as under torch.optim.

A frozen parameter stays bit for bit what it was, gets no gradient (its backward is not computed)
and no optimizer state; the others train as a torch.optim loop over the trainable ones trains them.
The compiled steps are shared by a module fixture: each graph costs seconds to build.
"""

from __future__ import annotations

import pytest
import torch

import fnloop as fl
from fnloop._compile import trace
from fnloop._step.composed import transformed
from fnloop._step.kernel import Kernel
from fnloop._step.layout import Layout
from fnloop._step.placement import Placement, Plan

STEPS = 5
FROZEN = ("0.weight", "0.bias")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    for name in FROZEN:
        model.get_parameter(name).requires_grad_(False)
    return model


def loss_fn(forward, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(forward(x), y)


OPT = fl.optim.adamw(1e-2, weight_decay=0.1)
DATA = [
    (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
    for g in [torch.Generator().manual_seed(1)]
    for _ in range(STEPS)
]


def _run(step) -> fl.TrainState:
    return fl.run(fl.init(_model(), OPT, seed=0, max_iter=STEPS), step, fl.data.resumable(DATA))


@pytest.fixture(scope="module")
def steps() -> dict[str, fl.TrainStep]:
    model = _model()
    return {
        "compiled": fl.train_step(model, loss_fn, OPT),
        "eager": fl.train_step(model, loss_fn, OPT, compile=False),
        "five per call": fl.train_step(model, loss_fn, OPT, steps_per_call=STEPS),
    }


def _torch_reference() -> dict[str, torch.Tensor]:
    model = _model()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.1)
    for batch in DATA:
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in model.named_parameters()}


def test_the_optimizer_state_covers_only_the_trained_parameters() -> None:
    state = fl.init(_model(), OPT, seed=0, max_iter=STEPS)
    assert sorted(state.params) == ["0.bias", "0.weight", "2.bias", "2.weight"]  # still in the state
    adam = state.opt_state[0]  # adamw's state: Adam's moments, then the stateless transforms'
    assert sorted(adam.mu) == sorted(adam.nu) == ["2.bias", "2.weight"]


@pytest.mark.parametrize("kind", ["compiled", "eager", "five per call"])
def test_frozen_parameters_stay_bit_for_bit_and_the_rest_train_as_torch_optim(steps, kind) -> None:
    start = fl.init(_model(), OPT, seed=0, max_iter=STEPS)
    final = _run(steps[kind])
    reference = _torch_reference()
    for name in FROZEN:
        assert torch.equal(final.params[name], start.params[name]), name
    for name in ("2.weight", "2.bias"):
        assert not torch.equal(final.params[name], start.params[name]), name
        torch.testing.assert_close(final.params[name], reference[name], rtol=1e-5, atol=1e-6)


def test_compiled_eager_and_several_per_call_agree(steps) -> None:
    runs = {kind: _run(step) for kind, step in steps.items()}
    for name in runs["compiled"].params:
        assert torch.equal(runs["compiled"].params[name], runs["five per call"].params[name]), name
        torch.testing.assert_close(runs["compiled"].params[name], runs["eager"].params[name])


def _products(model: torch.nn.Module) -> list[str]:
    """The matrix products in the traced step of ``model``: forward, backward and update."""
    state = fl.init(model, OPT, seed=0, max_iter=1)
    update = transformed(Kernel(model, loss_fn, OPT), Placement.of(Plan(), Layout(), None))

    def flat(draws, *leaves):
        params = dict(zip(state.params, leaves))
        new = update(params, {}, state.opt_state, torch.tensor(0), DATA[0])
        return [*new.params.values(), new.loss], None

    graph = trace(flat, list(state.params.values())).graph
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return [str(n.target) for n in graph.graph.nodes if n.target in matmuls]


def test_no_gradient_is_computed_for_a_frozen_parameter() -> None:
    # Both layers trained: two products forward, three backward (the second layer's weight and
    # input gradients, the first layer's weight gradient). The first layer frozen: its weight
    # gradient goes, and so does the second layer's input gradient, which only it needed.
    trained = _model().requires_grad_(True)
    assert len(_products(trained)) == 5, _products(trained)
    assert len(_products(_model())) == 3, _products(_model())


def test_a_model_with_nothing_to_train_is_refused_with_the_fix() -> None:
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        fl.train_step(model, loss_fn, OPT)
    with pytest.raises(ValueError, match="requires_grad"):
        fl.init(model, OPT, seed=0, max_iter=1)


@pytest.mark.parametrize("compile", [False, True])
def test_flags_changed_between_init_and_train_step_are_named(compile: bool) -> None:
    model = _model().requires_grad_(True)
    state = fl.init(model, OPT, seed=0, max_iter=1)  # every parameter trained
    model[0].requires_grad_(False)  # then frozen for the step
    step = fl.train_step(model, loss_fn, OPT, compile=compile)
    with pytest.raises(KeyError, match=r"freezes \['0.bias', '0.weight'\].*requires_grad flags before both"):
        step(state, DATA[0])
