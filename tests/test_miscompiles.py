"""Inductor's known miscompiles: the smallest graph each was found in, and fnloop's route around it.

torch 2.13's inductor orders a scatter's writes after a fused reader of the
scattered buffer (``fnloop/_compile/known.py``). It was found in a mixture of
experts whose routers trained on gradients 100% wrong while the loss agreed to
1e-5; torch's graph minifier reduced the step's graph (903 ops) to the one
below: a softmax's backward through a broadcast row (inductor's ``fma``
decomposition), plus a top-k's backward (a scatter into zeros).
"""

from __future__ import annotations

import pytest
import torch

import fnloop as fl
from fnloop._compile import Jit, known

pytestmark = [
    pytest.mark.inductor("what inductor builds from the smallest graph it got wrong, and fnloop's route"),
    pytest.mark.newest_torch,
]


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    index = torch.rand(64, 4, generator=gen).topk(2, -1).indices
    a, b = torch.rand(4, generator=gen), torch.rand(4, generator=gen)
    w, p, n = (
        torch.rand(64, 2, generator=gen),
        torch.rand(64, 4, generator=gen),
        -torch.rand(64, 4, generator=gen),
    )
    return [index, a, b, w, p, n]


def _smallest(index, a, b, w, p, n):
    import torch._inductor.inductor_prims  # registers prims.fma, as inductor's decompositions use it

    row = (a + b).expand(64, 4) * p  # a row computed in the graph, broadcast over the tokens
    softmax_backward = torch.ops.prims.fma(n, row.sum(-1, keepdim=True), row)
    return [softmax_backward + torch.zeros(64, 4).scatter(-1, index, w)]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def test_the_smallest_graph_inductor_gets_wrong_is_wrong_exactly_on_the_torches_known_to():
    # A tripwire for known.affected(): a torch that fixes it (or breaks it again) fails here.
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = _inputs()
    want = _smallest(*inputs)[0]
    graph = make_fx(_smallest, tracing_mode="fake")(*inputs)
    compiled = torch._inductor.standalone_compile(graph, inputs, dynamic_shapes="from_example_inputs")
    wrong = _error(compiled(*inputs)[0], want) > 0.1
    assert wrong == known.affected(), (
        f"torch {torch.__version__}: wrong={wrong}, known.affected()={not wrong}"
    )


def test_fnloop_compiles_the_smallest_graph_right_on_every_torch():
    inputs = _inputs()
    jit = Jit(lambda structure: lambda draws, *tensors: (_smallest(*tensors), None), cache=None)
    out, _ = jit("smallest", inputs)
    assert _error(out[0], _smallest(*inputs)[0]) < 1e-6
    assert jit.compiles == 1


class _Experts(torch.nn.Module):
    """Top-2 of 4 experts, routed on the router's logits (as GraniteMoE routes), every expert on every token."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(8, 4, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(4, 8, 8) * 0.3)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.router(h)
        top, index = logits.topk(2, dim=-1)
        every = torch.einsum("td,edf->tef", h, self.experts)
        picked = every.gather(1, index.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        return h + (torch.softmax(top, dim=-1).unsqueeze(-1) * picked).sum(1), logits


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Experts(), _Experts()])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits = []
        for layer in self.layers:
            x, found = layer(x)
            logits.append(found)
        return x, logits


def _balance(logits: list[torch.Tensor]) -> torch.Tensor:
    """The load-balancing loss over every layer's choices, as transformers' ``load_balancing_loss_func`` on a CPU."""
    counts, probs = torch.zeros(4), torch.zeros(4)
    for found in logits:
        p = torch.softmax(found, dim=-1)
        chosen = p.topk(2, dim=-1).indices
        counts = counts + torch.histc(chosen.reshape(-1).float(), bins=4, min=0, max=4)
        probs = probs + p.sum(0)
    rows = sum(found.shape[0] for found in logits)
    return (counts / rows * (probs / rows)).sum() * 4


def _moe_loss(forward, batch):
    x, y = batch
    out, logits = forward(x)
    return ((out - y) ** 2).mean() + 0.01 * _balance(logits)


@pytest.fixture(scope="module")
def moe():
    torch.manual_seed(0)
    model = _TwoLayers()
    opt = fl.optim.sgd(1.0)
    batch = (torch.randn(64, 8), torch.randn(64, 8))
    return model, opt, fl.init(model, opt, seed=0, max_iter=1), batch


def test_two_moe_layers_with_their_router_loss_train_on_eager_gradients_by_default(moe):
    model, opt, state, batch = moe
    check = fl.check_step(fl.train_step(model, _moe_loss, opt), state, batch)
    assert check.ok and check.reference == "eager", str(check)
    assert max(p.gradient for p in check.parameters) < 1e-5


def test_without_the_route_the_check_names_the_routers_on_the_torches_known_to_miscompile(moe, monkeypatch):
    import fnloop._compile.jit as jit

    monkeypatch.setattr(jit, "routed", lambda nodes: False)
    model, opt, state, batch = moe
    check = fl.check_step(fl.train_step(model, _moe_loss, opt), state, batch)
    routers = {"layers.0.router.weight", "layers.1.router.weight"}
    if known.affected():
        assert routers <= set(check.off), str(check)
        assert "the compiler's (inductor" in str(check)
    else:
        assert check.ok, str(check)
