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
