"""The first mistakes in a loss_fn (a metric as a Python number, .item(), print) give GraphBreakError."""

from __future__ import annotations

import pytest
import torch

import fnloop as fl

BATCH = (torch.ones(4, 2), torch.zeros(4, 1))


def mse(forward, batch):
    x, y = batch
    return ((forward(x) - y) ** 2).mean()


def item_metric(forward, batch):
    loss = mse(forward, batch)
    return loss, {"acc": loss.item()}


def float_metric(forward, batch):
    return mse(forward, batch), {"acc": 0.5}


def int_metric(forward, batch):
    return mse(forward, batch), {"rows": batch[0].shape[0]}


def printing(forward, batch):
    loss = mse(forward, batch)
    print(loss.item())
    return loss


def step_once(loss_fn, *, compile: bool) -> fl.TrainState:
    model = torch.nn.Linear(2, 1)
    optimizer = fl.optim.sgd(0.1)
    step = fl.train_step(model, loss_fn, optimizer, compile=compile)
    return fl.run(fl.init(model, optimizer, seed=0, max_iter=1), step, [BATCH])


# Tracing stops before inductor compiles anything, so these cost a trace, not a compile.
compiled = pytest.param(True, marks=pytest.mark.slow, id="compiled")
eager = pytest.param(False, id="eager")


@pytest.mark.parametrize("compile", [compiled, eager])
def test_an_item_metric_names_the_metric_and_the_fix(compile):
    with pytest.raises(fl.GraphBreakError, match=r"metric 'acc' as .*Return the tensor itself.*\.item\(\)"):
        step_once(item_metric, compile=compile)


@pytest.mark.parametrize("compile", [compiled, eager])
def test_a_python_float_metric_is_refused_in_both_modes(compile):
    with pytest.raises(fl.GraphBreakError, match=r"metric 'acc' as a Python float \(0\.5\).*torch\.tensor"):
        step_once(float_metric, compile=compile)


@pytest.mark.parametrize("compile", [compiled, eager])
def test_a_python_int_metric_is_refused_in_both_modes(compile):
    with pytest.raises(fl.GraphBreakError, match=r"metric 'rows' as a Python int \(4\)"):
        step_once(int_metric, compile=compile)


@pytest.mark.slow
def test_printing_an_item_in_a_compiled_step_names_the_cause(capsys):
    with pytest.raises(fl.GraphBreakError, match=r"converts a tensor to a Python number.*print.*metric"):
        step_once(printing, compile=True)
    assert "zuf0" in capsys.readouterr().out  # printed at trace time, before the error explains it


def test_printing_an_item_in_an_eager_step_runs(capsys):
    final = step_once(printing, compile=False)
    assert final.iteration == 1
    assert float(capsys.readouterr().out) == pytest.approx(float(final.metrics.latest("loss")[1]))


def test_tensor_metrics_still_pass():
    def metrics(forward, batch):
        loss = mse(forward, batch)
        return loss, {"double": 2 * loss.detach()}

    final = step_once(metrics, compile=False)
    assert torch.equal(final.metrics.latest("double")[1], 2 * final.metrics.latest("loss")[1])


# Where the trace stopped: the first frame outside torch and fnloop, what it needed, the fix.


class _Branching(torch.nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        if y.sum() > 0:  # the model's line the error names
            return y
        return -y


def _line_of(text: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(_Branching.forward)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_a_branch_on_a_value_in_the_model_names_the_models_line_what_it_is_and_the_fix():
    model = _Branching(2, 1)
    optimizer = fl.optim.sgd(0.1)
    step = fl.train_step(model, mse, optimizer)
    with pytest.raises(fl.GraphBreakError) as caught:
        fl.run(fl.init(model, optimizer, seed=0, max_iter=1), step, [BATCH])
    message = str(caught.value)
    assert f"test_graph_break_errors.py:{_line_of('if y.sum() > 0')} in forward: if y.sum() > 0:" in message
    assert "data-dependent control flow" in message
    assert "torch.where for branches" in message and "compile=False" in message
    assert type(caught.value.__cause__).__name__ == "GuardOnDataDependentSymNode"  # torch's, chained


def test_a_compiled_evaluation_that_branches_on_a_value_is_a_graph_break_naming_the_line():
    evaluate = fl.eval_step(_Branching(2, 1), lambda forward, batch: {"out": forward(batch[0]).sum()})
    state = fl.init(_Branching(2, 1), fl.optim.sgd(0.1), seed=0, max_iter=1)
    with pytest.raises(fl.GraphBreakError, match=r"the evaluation must compile into one graph") as caught:
        evaluate(state, BATCH)
    assert f"test_graph_break_errors.py:{_line_of('if y.sum() > 0')}" in str(caught.value)
    assert "torch.where for branches" in str(caught.value) and "compile=False" in str(caught.value)


class _Grouped(torch.nn.Module):
    """Two groups of rows, each times its own matrix: ``torch._grouped_mm``, whose shape rule takes bfloat16 only."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 4, 4))

    def forward(self, x):
        return torch._grouped_mm(x, self.w, offs=torch.tensor([4, 8], dtype=torch.int32))


def test_an_op_whose_shape_rule_refuses_the_trace_is_a_compile_error_naming_the_op_and_line():
    model, x = _Grouped(), torch.randn(8, 4)
    optimizer = fl.optim.sgd(0.1)

    def loss_fn(forward, batch):
        return forward(batch).square().mean()

    eager = fl.train_step(model, loss_fn, optimizer, compile=False)
    assert fl.run(fl.init(model, optimizer, seed=0, max_iter=1), eager, [x]).iteration == 1  # eager runs it
    compiled = fl.train_step(model, loss_fn, optimizer)
    with pytest.raises(fl.CompileError) as caught:
        fl.run(fl.init(model, optimizer, seed=0, max_iter=1), compiled, [x])
    message = str(caught.value)
    assert "in the op aten._grouped_mm.default" in message
    assert "test_graph_break_errors.py:" in message and "return torch._grouped_mm(x, self.w" in message
    assert "Expected inputs of BF16 type" in message and "compile=False" in message
    assert isinstance(caught.value.__cause__, RuntimeError)  # torch's, chained


def test_an_error_the_users_own_code_raises_while_traced_is_raised_as_it_is():
    def loss_fn(forward, batch):
        raise KeyError("labels")

    with pytest.raises(KeyError, match="labels"):
        step_once(loss_fn, compile=True)
