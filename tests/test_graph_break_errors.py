"""The first mistakes in a loss_fn (a metric as a Python number, .item(), print) give GraphBreakError."""

from __future__ import annotations

import inspect

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
compiled = pytest.param(True, id="compiled")
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


@torch.library.custom_op("fnloop_test::grouped", mutates_args=())
def _grouped_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[:4] @ w[0], x[4:] @ w[1]])


@_grouped_op.register_fake
def _grouped_rule(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # A shape rule stricter than the op's eager kernel, checked as torch's own rules check (torch._check):
    # torch 2.13's aten._grouped_mm took bfloat16 only when traced and float32 eagerly, which is how a
    # mixture of experts met it. An op of the test's own, so that no torch release changes the premise.
    torch._check(x.dtype == torch.bfloat16, lambda: "Expected inputs of BF16 type")
    return x.new_empty(x.shape[0], w.shape[2])


_grouped_op.register_autograd(lambda ctx, grad: (None, None), setup_context=lambda ctx, inputs, output: None)


class _Grouped(torch.nn.Module):
    """Two groups of rows, each times its own matrix, through an op whose shape rule takes bfloat16 only."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 4, 4))

    def forward(self, x):
        return torch.ops.fnloop_test.grouped(x, self.w)


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
    assert "in the op fnloop_test.grouped.default" in message, message
    # The rule is the test's own code here, so its line is where the refusal came from.
    lines, start = inspect.getsourcelines(_grouped_rule)
    line = start + next(i for i, text in enumerate(lines) if "torch._check(x.dtype" in text)
    assert f"test_graph_break_errors.py:{line}" in message
    assert "Expected inputs of BF16 type" in message and "compile=False" in message
    assert isinstance(caught.value.__cause__, RuntimeError)  # torch's, chained


class _TorchGrouped(torch.nn.Module):
    """The same through ``torch._grouped_mm``, whose shape rule took bfloat16 only on torch 2.13 (not on 2.15)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 4, 4))

    def forward(self, x):
        return torch._grouped_mm(x, self.w, offs=torch.tensor([4, 8], dtype=torch.int32))


def _refused_when_traced() -> bool:
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        make_fx(lambda x, w, offs: torch._grouped_mm(x, w, offs=offs), tracing_mode="fake")(
            torch.randn(8, 4), torch.randn(2, 4, 4), torch.tensor([4, 8], dtype=torch.int32)
        )
    except RuntimeError:
        return True
    return False


def test_torchs_own_op_whose_rule_refuses_the_trace_names_the_models_line_and_where_it_does_not_it_trains():
    model, x = _TorchGrouped(), torch.randn(8, 4)
    optimizer = fl.optim.sgd(0.1)

    def loss_fn(forward, batch):
        return forward(batch).square().mean()

    state = fl.init(model, optimizer, seed=0, max_iter=1)
    compiled = fl.train_step(model, loss_fn, optimizer)
    if _refused_when_traced():  # torch 2.13: float32 refused by the rule, run eagerly
        with pytest.raises(fl.CompileError) as caught:
            fl.run(state, compiled, [x])
        message = str(caught.value)
        assert "in the op aten._grouped_mm.default" in message
        assert "return torch._grouped_mm(x, self.w" in message
        assert caught.value.__cause__ is not None  # torch's own words (they change between releases)
    else:  # a torch whose rule takes float32 (2.15): it compiles and trains as eagerly
        eager = fl.train_step(model, loss_fn, optimizer, compile=False)
        torch.testing.assert_close(
            fl.run(state, compiled, [x]).params["w"], fl.run(state, eager, [x]).params["w"]
        )


def test_an_error_the_users_own_code_raises_while_traced_is_raised_as_it_is():
    def loss_fn(forward, batch):
        raise KeyError("labels")

    with pytest.raises(KeyError, match="labels"):
        step_once(loss_fn, compile=True)


class _Reading(torch.nn.Module):
    """A model that reads a tensor's value in its forward, as some libraries' mixtures of experts do."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.layer = torch.nn.Linear(2, 1)

    def forward(self, x):
        h = self.layer(x)
        if self.how == "item":
            scale = h.abs().max().item()  # an .item() read
            return h * scale
        counts = h.sum(0).long().tolist()  # a .tolist() read
        return h * len(counts)


@pytest.mark.parametrize("how", ["item", "tolist"])
def test_a_host_read_in_the_models_forward_names_the_models_line(how):
    # JetMoe at its defaults reads .tolist() in its forward (modeling_jetmoe.py:195); the error named no line.
    model = _Reading(how)
    optimizer = fl.optim.sgd(0.1)
    step = fl.train_step(model, mse, optimizer)
    with pytest.raises(fl.GraphBreakError, match="a tensor converted to a Python number, at") as caught:
        fl.run(fl.init(model, optimizer, seed=0, max_iter=1), step, [BATCH])
    lines, start = inspect.getsourcelines(_Reading.forward)
    line = start + next(
        i for i, text in enumerate(lines) if f"an .{how}() read" in text or f"a .{how}() read" in text
    )
    assert f"test_graph_break_errors.py:{line} in forward" in str(caught.value)
