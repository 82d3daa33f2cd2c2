"""``train_step(..., compile="model")``: the forward and backward compiled, the update outside the graph.

The graph holds the gradient stage and the guard; the update runs after it, in
place, with torch's fused kernel for ``adamw`` (``fnloop/_step/gradients.py``).
These tests run the traced graph op by op (the suite's ``graph`` backend) but
one, which compiles it with inductor.
"""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch

import fnloop as fl
from fnloop._compile.cache import CompileCache
from fnloop._step.errors import NonFiniteLoss, RecompileError
from fnloop._step.layout import Layout
from fnloop._step.seeds import seeded

STEPS = 6


def _model(dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12, bias=False),
        torch.nn.BatchNorm1d(12),
        torch.nn.Tanh(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(12, 3),
    )


def loss_fn(forward, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(forward(x), y)


DATA = [
    (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
    for g in [torch.Generator().manual_seed(1)]
    for _ in range(STEPS)
]
OPT = fl.optim.adamw(1e-2, weight_decay=0.01)


def _run(compile, state=None, steps: int = STEPS, dropout: float = 0.1, **options) -> fl.TrainState:
    model = _model(dropout)
    step = fl.train_step(model, loss_fn, OPT, compile=compile, **options)
    state = fl.init(model, OPT, seed=0, max_iter=steps) if state is None else state
    return fl.run(state, step, fl.data.resumable(DATA))


def _same(a: fl.TrainState, b: fl.TrainState) -> bool:
    tensors = operator.attrgetter("params", "buffers", "opt_state")
    return all(
        torch.equal(x, y)
        for x, y in zip(
            torch.utils._pytree.tree_leaves(tensors(a)),
            torch.utils._pytree.tree_leaves(tensors(b)),
            strict=True,
        )
    )


@pytest.fixture(scope="module")
def outside() -> fl.TrainState:
    return _run("model")


def test_the_update_outside_the_graph_is_torch_optims_fused_adamw() -> None:
    # The graph's gradients, handed to AdamW(fused=True): its parameters are the step's, bit for bit.
    model = _model()
    step = fl.train_step(model, loss_fn, OPT, compile="model")
    state = fl.init(model, OPT, seed=0, max_iter=1)
    with seeded(torch.device("cpu"), state.rng, 0):  # the step's seed, as the step runs it
        found, finite = step.gradient(
            dict(state.params), dict(state.buffers), DATA[0], None, Layout(), torch.tensor(0)
        )
    after = step(state, DATA[0])
    assert bool(finite) and after.metrics.series["loss"][0][1] == found.loss
    reference = _model()
    for name, p in reference.named_parameters():
        p.grad = found.grads[name].clone()
    torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01, fused=True).step()
    for name, p in reference.named_parameters():
        assert torch.equal(after.params[name], p.detach()), name
    for name, b in found.buffers.items():
        assert torch.equal(after.buffers[name], b), name


def test_it_draws_the_whole_compiled_steps_dropout_and_trains_as_it_does(outside) -> None:
    # The same seeds, so the same masks: the two differ by the update's rounding alone.
    whole = _run(True)
    assert outside.metrics.series["loss"][0][1] == whole.metrics.series["loss"][0][1]
    for k in whole.params:
        assert torch.allclose(outside.params[k], whole.params[k], rtol=1e-4, atol=1e-5), k
    for k in whole.buffers:
        assert torch.allclose(outside.buffers[k], whole.buffers[k], rtol=1e-4, atol=1e-5), k
    eager = _run(False)  # the eager step's masks are torch's generator's own
    assert not torch.allclose(eager.params["4.weight"], outside.params["4.weight"], atol=1e-5)


def test_a_resumed_run_is_the_same_bits(outside, tmp_path) -> None:
    half = _run("model", steps=STEPS // 2)
    fl.save(half, tmp_path / "half.pt")
    template = fl.init(_model(), OPT, seed=0, max_iter=STEPS)
    resumed = fl.load(tmp_path / "half.pt", like=template)
    resumed = fl.TrainState(**{**resumed.__dict__, "max_iter": STEPS})
    done = _run("model", state=resumed)
    assert done.iteration == outside.iteration and _same(done, outside)


def test_donation_changes_no_bit(outside) -> None:
    model = _model()
    step = fl.train_step(model, loss_fn, OPT, compile="model")
    given = fl.init(model, OPT, seed=0, max_iter=STEPS)
    before = [t.clone() for t in given.params.values()]
    copied = fl.run(given, step, fl.data.resumable(DATA))
    assert all(torch.equal(a, b) for a, b in zip(before, given.params.values()))  # the state given is kept
    donated = fl.run(
        fl.init(model, OPT, seed=0, max_iter=STEPS), step, fl.data.resumable(DATA), donate_input=True
    )
    assert _same(copied, outside) and _same(donated, outside)


def test_its_graph_holds_no_update_and_writes_nothing() -> None:
    model = _model()
    step = fl.train_step(model, loss_fn, OPT, compile="model")
    fl.run(fl.init(model, OPT, seed=0, max_iter=1), step, DATA[:1])
    assert step.compiled and step.compiles == 1
    graph = step.gradient.jit.last.compiled  # the traced graph itself, on the graph backend
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    inputs = {n for n in graph.graph.nodes if n.op == "placeholder"}
    written = [
        n for n in calls if str(n.target).split(".")[1:2] in (["copy_"], ["add_"]) and n.args[0] in inputs
    ]
    assert not written  # nothing of the state is written in the graph
    assert "aten.sqrt.default" not in {str(n.target) for n in calls}  # Adam's denominator is not there
    (outputs,) = [n.args[0] for n in graph.graph.nodes if n.op == "output"]
    trained, buffers = len(dict(model.named_parameters())), len(dict(model.named_buffers()))
    assert len(outputs) == trained + buffers + 2  # the gradients, the buffers, the loss, the guard


def test_a_non_finite_step_changes_nothing_and_is_counted_or_raised() -> None:
    bad = (torch.full((8, 6), float("nan")), DATA[0][1])
    model = _model()
    step = fl.train_step(model, loss_fn, OPT, compile="model", skip_nonfinite=True)
    first = fl.run(fl.init(model, OPT, seed=0, max_iter=1), step, DATA[:1])
    after = fl.run(fl.TrainState(**{**first.__dict__, "max_iter": 2}), step, [bad])
    assert _same(after, first) and after.metrics.series["skipped"][-1][1] == 1
    strict = fl.train_step(model, loss_fn, OPT, compile="model")
    with pytest.raises(NonFiniteLoss):
        strict(first, bad)


def test_a_batch_of_another_shape_names_itself_in_the_recompile_error() -> None:
    model = _model()
    step = fl.train_step(model, loss_fn, OPT, compile="model")
    state = step(fl.init(model, OPT, seed=0, max_iter=2), DATA[0])
    with pytest.raises(
        RecompileError, match=r"the batch's tensor 0 was shape \(8, 6\).*is now shape \(5, 6\)"
    ):
        step(state, (DATA[1][0][:5], DATA[1][1][:5]))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"compile": "graph"}, "'compile' must be True .*'model'.* or False"),
        ({"compile": 1}, "'compile' must be True"),
        ({"compile": "model", "stats": "model"}, "cannot take stats='model'.*use compile=True"),
        ({"compile": "model", "invariant": 2}, "cannot take invariant=2.*use compile=True"),
    ],
)
def test_what_it_cannot_take_is_refused_when_the_step_is_built(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        fl.train_step(_model(), loss_fn, OPT, **options)


@pytest.mark.inductor("the gradient graph inductor builds, and its start file found again by a restart")
def test_compiled_with_inductor_it_trains_as_its_traced_graph_and_restarts_without_a_trace(
    outside, tmp_path
) -> None:
    def restart() -> tuple[fl.TrainState, Any]:  # a new step sees only the folder, as a new process
        model = _model()
        step = fl.train_step(model, loss_fn, OPT, compile="model", backend="inductor")
        step.gradient.jit.cache = CompileCache(tmp_path)
        return fl.run(
            fl.init(model, OPT, seed=0, max_iter=STEPS), step, fl.data.resumable(DATA)
        ), step.gradient.jit

    compiled, jit = restart()
    assert (jit.traces, jit.started) == (1, 0) and len(list(tmp_path.glob("*.start"))) == 1
    for k in outside.params:
        assert torch.allclose(compiled.params[k], outside.params[k], rtol=1e-4, atol=1e-5), k
    again, jit = restart()
    assert (jit.traces, jit.started, jit.compiles) == (0, 1, 1)
    assert _same(again, compiled)


def test_a_population_member_is_its_solo_run_bit_for_bit() -> None:
    model = _model()
    step = fl.train_step(model, loss_fn, OPT, compile="model")
    pop = fl.population(lambda seed: fl.init(model, OPT, seed=seed, max_iter=3), seeds=[0, 1])
    both = fl.run(pop, step, DATA[:3])
    solo = fl.run(fl.init(model, OPT, seed=1, max_iter=3), step, DATA[:3])
    assert all(torch.equal(both.params[k][1], solo.params[k]) for k in solo.params)


def test_check_step_compares_its_own_graphs_gradients() -> None:
    model = _model()
    step = fl.train_step(model, loss_fn, OPT, compile="model")
    check = fl.check_step(step, fl.init(model, OPT, seed=0, max_iter=1), DATA[0])
    assert check.ok and check.reference == "the graph run op by op"  # it draws dropout masks
    assert [row.name for row in check.parameters] == [k for k, _ in model.named_parameters()]
