"""Statistics inside the step: equal to the same norms computed by hand around a plain torch loop."""

from __future__ import annotations

import logging

import pytest
import torch

import fnloop as fl

pytestmark = pytest.mark.xdist_group("statistics")

STEPS = 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(2)
        )
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def net() -> Net:
    torch.manual_seed(0)
    model = Net()
    model.out.bias.requires_grad_(False)  # a frozen parameter takes no part
    return model


def loss_fn(forward, batch):
    x, y = batch
    return ((forward(x) - y) ** 2).mean()


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(STEPS)]


def by_hand() -> list[dict[str, dict[str, float]]]:
    """Per step: each trained parameter's squared gradient, parameter and update norms, from torch.optim.AdamW."""
    model = net()
    trained = {k: p for k, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trained.values(), lr=1e-2)
    steps = []
    for batch in data():
        opt.zero_grad()
        loss_fn(model, batch).backward()
        before = {k: p.detach().clone() for k, p in trained.items()}
        opt.step()
        steps.append(
            {
                "grad": {k: float(p.grad.double().square().sum()) for k, p in trained.items()},
                "param": {k: float(v.double().square().sum()) for k, v in before.items()},
                "update": {
                    k: float((p.detach() - before[k]).double().square().sum()) for k, p in trained.items()
                },
            }
        )
    return steps


BLOCKS = {"inp": ["inp.weight", "inp.bias"], "layers.0": ["layers.0.0.weight", "layers.0.0.bias"],
          "layers.1": ["layers.1.0.weight", "layers.1.0.bias"], "out": ["out.weight"]}  # fmt: skip


def expected(step: dict[str, dict[str, float]], groups: dict[str, list[str]]) -> dict[str, float]:
    out = {}
    every = {"": [k for members in groups.values() for k in members] if groups else list(step["grad"])}
    for group, members in {**every, **groups}.items():
        suffix = f"/{group}" if group else ""
        norms = {kind: sum(step[kind][k] for k in members) ** 0.5 for kind in ("grad", "param", "update")}
        out["grad_norm" + suffix] = norms["grad"]
        out["param_norm" + suffix] = norms["param"]
        out["update_norm" + suffix] = norms["update"]
        out["update_ratio" + suffix] = norms["update"] / norms["param"]
    return out


@pytest.fixture(scope="module")
def hand() -> list[dict[str, dict[str, float]]]:
    return by_hand()


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("by", ["model", "blocks", "parameters"])
def test_statistics_equal_the_norms_of_a_plain_loop(by, compile, hand):
    model, opt = net(), fl.optim.adamw(1e-2)
    step = fl.train_step(model, loss_fn, opt, compile=compile, stats=by)
    states = list(fl.scan(fl.init(model, opt, seed=0, max_iter=STEPS), step, data()))
    groups = {"model": {}, "blocks": BLOCKS, "parameters": {k: [k] for k in hand[0]["grad"]}}[by]
    for i in range(STEPS):
        want = expected(hand[i], groups)
        got = {name: float(states[i].metrics.latest(name)[1]) for name in want}
        assert set(states[i].metrics.names) == {"loss", "lr", *want}
        for name, value in want.items():
            assert got[name] == pytest.approx(value, rel=2e-5, abs=1e-7), (i, name)


def test_under_loss_scaling_the_gradient_norm_is_the_losss_own():
    model = net()
    plain, scaled = (
        fl.optim.adamw(1e-2),
        fl.optim.dynamic_loss_scale(fl.optim.adamw(1e-2), init_scale=2.0**10),
    )
    runs = {}
    for name, opt in [("plain", plain), ("scaled", scaled)]:
        step = fl.train_step(model, loss_fn, opt, compile=False, stats="model")
        runs[name] = fl.run(fl.init(model, opt, seed=0, max_iter=STEPS), step, data())
    for figure in ("grad_norm", "param_norm", "update_norm"):
        a, b = (float(runs[k].metrics.latest(figure)[1]) for k in ("plain", "scaled"))
        assert b == pytest.approx(a, rel=1e-5), figure


def test_off_by_default_and_a_wrong_choice_is_refused():
    model, opt = net(), fl.optim.sgd(0.1)
    state = fl.run(
        fl.init(model, opt, seed=0, max_iter=1), fl.train_step(model, loss_fn, opt, compile=False), data()[:1]
    )
    assert state.metrics.names == ("loss", "lr")
    with pytest.raises(
        ValueError, match=r"stats=\.\.\.\) must be None, or one of \('model', 'blocks', 'parameters'\)"
    ):
        fl.train_step(model, loss_fn, opt, stats="layers")


def test_the_console_shows_the_models_figures_and_files_keep_every_groups(tmp_path, caplog):
    model, opt = net(), fl.optim.sgd(0.1)
    step = fl.train_step(model, loss_fn, opt, compile=False, stats="blocks")
    log = fl.hooks.log(fl.writers.console(), fl.writers.jsonl(tmp_path / "m.jsonl"))
    with caplog.at_level(logging.INFO, logger="fnloop"):
        fl.run(fl.init(model, opt, seed=0, max_iter=STEPS), step, data(), [fl.every(STEPS, log)])
    line = caplog.records[-1].getMessage()
    assert "grad_norm: " in line and "update_ratio: " in line and "grad_norm/" not in line
    written = (tmp_path / "m.jsonl").read_text()
    assert '"grad_norm/layers.0"' in written and '"update_ratio/out"' in written
