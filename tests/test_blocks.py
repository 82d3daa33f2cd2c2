"""Block by block, in one process: which blocks a model has, and the pass that gathers a block anew.

The sharded runs themselves (2 and 4 ranks) are in tests/test_sharding.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed._functional_collectives
from torch.fx.experimental.proxy_tensor import make_fx

from fnloop._compile.regather import regathered
from fnloop._step.units import units_of
from tests.gathered import live

F = torch.ops._c10d_functional


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Net(torch.nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 4)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(3))
        if tied:
            self.layers[2].fc.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def test_the_blocks_found_are_the_children_of_a_module_list_and_the_rest_is_the_root() -> None:
    units = units_of(Net())
    assert units.blocks == tuple(
        (f"layers.{i}", (f"layers.{i}.fc.weight", f"layers.{i}.fc.bias")) for i in range(3)
    )
    assert "embed.weight" not in units.names


def test_a_transformers_model_s_blocks_are_the_modules_it_names_unsplittable() -> None:
    net = Net()
    net._no_split_modules = ["Linear"]  # as transformers' models name their decoder layers
    assert [name for name, _ in units_of(net).blocks] == [
        "embed",
        "layers.0.fc",
        "layers.1.fc",
        "layers.2.fc",
    ]


def test_blocks_named_by_name_or_class_outermost_only_and_none_when_asked() -> None:
    net = Net()
    assert [n for n, _ in units_of(net, ["layers.1", "layers.1.fc"]).blocks] == ["layers.1"]
    assert [n for n, _ in units_of(net, [Layer]).blocks] == ["layers.0", "layers.1", "layers.2"]
    assert not units_of(net, ())


def test_a_weight_tied_across_a_block_and_the_root_belongs_to_the_root() -> None:
    units = units_of(Net(tied=True))
    assert dict(units.blocks)["layers.2"] == ("layers.2.fc.bias",)
    assert "embed.weight" not in units.names


@pytest.mark.parametrize(
    ("blocks", "error", "says"),
    [
        ("layers.0", TypeError, "a list of module names or module classes"),
        (["layers.9"], ValueError, "no submodule named 'layers.9'"),
        ([torch.nn.Conv2d], ValueError, "no submodule of class Conv2d"),
        ([3], TypeError, "a module name or a module class"),
    ],
)
def test_blocks_named_wrong_are_refused_with_what_was_expected(blocks, error, says) -> None:
    with pytest.raises(error, match=says):
        units_of(Net(), blocks)


def _gather(chunk: torch.Tensor) -> torch.Tensor:
    return F.wait_tensor(F.all_gather_into_tensor(chunk, 2, "g"))


def _scatter(whole: torch.Tensor) -> torch.Tensor:
    return F.wait_tensor(F.reduce_scatter_tensor(whole, "sum", 2, "g"))


def _two_blocks(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
    """Two blocks' forward and backward, written out as a sharded step's trace has them."""
    wa = _gather(a).view(4, 4)
    y = x @ wa.t()
    wb = _gather(b).view(4, 4)
    z = (y @ wb.t()).tanh()
    dz = 1 - z * z
    dy = dz @ wb  # b's backward follows its forward: nothing between
    db = _scatter(dz.t() @ y)
    dx = dy @ wa  # a's backward, after b's reduce-scatter
    da = _scatter(dy.t() @ x)
    return [dx, da, db]


class _OneProcess(torch.fx.Interpreter):
    """The graph run with the collectives of two ranks that hold the same chunks."""

    def call_function(self, target, args, kwargs):
        if target is F.all_gather_into_tensor.default:
            return torch.cat([args[0], args[0]])
        if target is F.reduce_scatter_tensor.default:
            return args[0][: args[0].shape[0] // 2] * 2
        if target is F.wait_tensor.default:
            return args[0]
        return super().call_function(target, args, kwargs)


def test_a_block_read_again_after_another_block_s_collective_is_gathered_anew_and_nothing_else_changes() -> (
    None
):
    inputs = (torch.randn(8), torch.randn(8), torch.randn(3, 4))
    graph = make_fx(_two_blocks, tracing_mode="fake")(*inputs)
    before = copy.deepcopy(graph)
    assert regathered(graph) == 1  # a, for its backward; b's backward reads b's forward gather
    gathers = [n for n in graph.graph.nodes if n.target is F.all_gather_into_tensor.default]
    scatters = [n for n in graph.graph.nodes if n.target is F.reduce_scatter_tensor.default]
    order = list(graph.graph.nodes)
    assert len(gathers) == 3 and gathers[2].args[0] is gathers[0].args[0]  # a's chunk, gathered again
    assert order.index(scatters[0]) < order.index(gathers[2])  # after b's reduce-scatter
    assert live(graph.graph) < live(before.graph)
    for mine, theirs in zip(_OneProcess(graph).run(*inputs), _OneProcess(before).run(*inputs), strict=True):
        assert torch.equal(mine, theirs)


def test_gathering_everything_before_the_forward_is_left_as_it_is() -> None:
    def everything(a, b, x):  # as blocks=() traces: every gather first, every reduce-scatter last
        wa, wb = _gather(a).view(4, 4), _gather(b).view(4, 4)
        y = (x @ wa.t()) @ wb.t()
        dy = y @ wb
        dx = dy @ wa
        return [dx, _scatter(y.t() @ x), _scatter(dy.t() @ x)]

    graph = make_fx(everything, tracing_mode="fake")(torch.randn(8), torch.randn(8), torch.randn(3, 4))
    assert regathered(graph) == 0


def _on_meta(factory):
    with torch.device("meta"):
        return factory()


def test_a_model_on_the_meta_device_is_made_module_by_module_the_same_whole_or_sharded() -> None:
    import fnloop as fl
    from fnloop._core.shards import Shards
    from fnloop._step.sharding import chunk

    model = _on_meta(Net)
    optimizer = fl.optim.adamw(1e-3)
    whole = fl.init(model, optimizer, seed=3, max_iter=1)
    assert all(p.is_meta for p in model.parameters())  # the model is left as it was
    assert all(not t.is_meta for t in whole.params.values())
    assert torch.equal(
        whole.params["layers.0.fc.weight"],
        fl.init(model, optimizer, seed=3, max_iter=1).params["layers.0.fc.weight"],
    )
    assert not torch.equal(
        whole.params["layers.0.fc.weight"],
        fl.init(model, optimizer, seed=4, max_iter=1).params["layers.0.fc.weight"],
    )
    assert not torch.equal(
        whole.params["layers.0.fc.weight"], whole.params["layers.1.fc.weight"]
    )  # a seed per module
    # Filled as the module's reset_parameters fills it: a Linear's kaiming-uniform bound, 1/sqrt(fan_in).
    assert whole.params["layers.0.fc.weight"].abs().max() <= 0.5
    sharded = fl.init(model, optimizer, seed=3, max_iter=1, shard="full")
    layout = Shards("full", 2, 1, sharded.shards.rows)  # what rank 1 of 2 keeps: its rows of the same whole
    assert torch.equal(
        chunk(whole.params["embed.weight"], layout, "embed.weight")[:2], whole.params["embed.weight"][2:]
    )


def test_a_meta_module_without_reset_parameters_needs_init_weights_and_is_filled_by_it() -> None:
    import fnloop as fl

    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = torch.nn.Parameter(torch.zeros(3))

    with pytest.raises(ValueError, match=r"the model itself \(Scale\) has tensors to make \(\['gain'\]\)"):
        fl.init(_on_meta(Scale), fl.optim.sgd(0.1), seed=0, max_iter=1)
    state = fl.init(
        _on_meta(Scale),
        fl.optim.sgd(0.1),
        seed=0,
        max_iter=1,
        init_weights=lambda m: torch.nn.init.ones_(m.gain),
    )
    assert torch.equal(state.params["gain"], torch.ones(3))
    with pytest.raises(TypeError, match="init_weights"):
        fl.init(_on_meta(Scale), fl.optim.sgd(0.1), seed=0, max_iter=1, init_weights="ones")


def test_torch_s_transformer_layers_are_made_on_the_meta_device_attention_included() -> None:
    import fnloop as fl

    layer = _on_meta(lambda: torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True))
    state = fl.init(layer, fl.optim.adamw(1e-3), seed=0, max_iter=1)
    weight = state.params["self_attn.in_proj_weight"]  # MultiheadAttention fills it in _reset_parameters
    assert (
        not weight.is_meta
        and 0 < weight.std() < 1
        and torch.equal(state.params["norm1.weight"], torch.ones(8))
    )


def test_a_transformers_model_on_the_meta_device_is_made_by_its_own_init_weights() -> None:
    import fnloop as fl

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    model = _on_meta(lambda: transformers.LlamaForCausalLM(config))
    state = fl.init(model, fl.optim.adamw(1e-3), seed=0, max_iter=1, init_weights=model._init_weights)
    reference = transformers.LlamaForCausalLM(config)  # built on the CPU, as transformers initializes it
    for name, tensor in reference.state_dict().items():
        mine = {**state.params, **state.buffers}.get(name)
        if mine is None:
            continue  # the head tied to the embeddings: one tensor in the state
        if name.endswith("norm.weight") or "rotary" in name:
            assert torch.equal(mine, tensor), name  # ones, and the rotary frequencies
        else:
            # The same distribution (std 0.02).
            assert abs(mine.std() - tensor.std()) < 0.3 * tensor.std(), name
