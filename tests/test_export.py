"""The trained weights come back to the nn.Module (state_dict) and a state starts from one (load_state_dict)."""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn
from torch.nn import functional as F

import fnloop as fl
from fnloop import testing


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def loss_fn(forward, batch):
    x, y = batch
    return F.cross_entropy(forward(x), y)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def trained(model: nn.Module, steps: int = 30) -> fl.TrainState:
    opt = fl.optim.adamw(0.05)
    state = fl.init(model, opt, seed=0, max_iter=steps)
    step = fl.train_step(model, loss_fn, opt, compile=False)
    return fl.run(state, step, fl.data.batches(data(), batch_size=16, seed=0))


def test_the_model_gets_the_trained_weights_back():
    model = net()
    x, _ = data()
    model.eval()
    before = model(x).detach()
    final = trained(model)
    model.eval()  # the step puts the module in training mode, for dropout and BatchNorm
    # The defect: the run trains the state, never the module.
    assert torch.equal(model(x), before)
    logits = fl.eval_step(model, lambda f, b: f(b), compile=False)(final, x)["value"]
    assert not torch.allclose(logits, before)

    assert str(model.load_state_dict(fl.state_dict(final), strict=True)) == "<All keys matched successfully>"
    torch.testing.assert_close(model(x), logits, rtol=0, atol=0)
    # BatchNorm's running statistics came back too, not only the parameters.
    assert torch.equal(model[1].running_mean, final.buffers["1.running_mean"])
    assert int(model[1].num_batches_tracked) == 30


def test_order_is_the_modules_with_or_without_the_model():
    model = net()
    state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
    sd = fl.state_dict(state)
    assert type(sd) is OrderedDict
    assert list(sd) == list(model.state_dict())
    assert list(fl.state_dict(state, model)) == list(model.state_dict())
    assert all(not t.requires_grad for t in sd.values())


def test_tensors_are_the_states_own_so_the_fold_never_donates_them():
    state = fl.init(net(), fl.optim.sgd(0.1), seed=0, max_iter=1)
    sd = fl.state_dict(state)
    assert all(sd[k] is t for k, t in {**state.params, **state.buffers}.items())


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def test_tied_weights_and_non_persistent_buffers_need_the_model_and_then_match():
    model = Tied()
    state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
    assert "head.weight" not in state.params  # named_parameters() names a tied weight once
    new = fl.load_state_dict(state, {"embed.weight": torch.ones(5, 3)}, strict=False)
    sd = fl.state_dict(new, model)
    assert list(sd) == list(model.state_dict())
    assert sd["head.weight"] is sd["embed.weight"]
    model.load_state_dict(sd, strict=True)
    assert torch.equal(model.head.weight, torch.ones(5, 3))
    # Without the model, the state's own keys: the buffer torch leaves out is there, the alias is not.
    assert list(fl.state_dict(new)) == ["embed.weight", "scratch"]


def test_a_model_the_state_was_not_built_from_is_named():
    state = fl.init(nn.Linear(2, 2), fl.optim.sgd(0.1), seed=0, max_iter=1)
    with pytest.raises(
        KeyError, match=r"the model has '0.weight' but the state has no such parameter.*fnloop.init"
    ):
        fl.state_dict(state, nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(
        TypeError, match=r"'model' must be a torch.nn.Module or None \(got 3 that is an int\)"
    ):
        fl.state_dict(state, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"state_dict\(\) expected a fnloop.TrainState"):
        fl.state_dict(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_a_pretrained_start_equals_init_after_model_load_state_dict():
    pretrained = trained(net(), steps=5)
    opt = fl.optim.adamw(0.05)
    by_function = fl.load_state_dict(fl.init(net(), opt, seed=0, max_iter=10), fl.state_dict(pretrained))
    model = net()
    model.load_state_dict(fl.state_dict(pretrained))
    by_module = fl.init(model, opt, seed=0, max_iter=10)
    testing.assert_identical(by_function.params, by_module.params)
    testing.assert_identical(by_function.buffers, by_module.buffers)
    testing.assert_identical(by_function.opt_state, by_module.opt_state)


def test_load_state_dict_copies_and_changes_nothing_it_was_given():
    model = nn.Linear(2, 1)
    state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
    before = {k: t.clone() for k, t in state.params.items()}
    given = model.state_dict()  # shares the module's memory
    new = fl.load_state_dict(state, given)
    assert new.params["weight"].data_ptr() != model.weight.data_ptr()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(new.params["weight"], model.weight)
    testing.assert_identical(state.params, before)
    assert (new.iteration, new.opt_state, new.rng) == (state.iteration, state.opt_state, state.rng)


def test_load_state_dict_errors_name_the_key_and_the_fix():
    state = fl.init(nn.Linear(2, 1), fl.optim.sgd(0.1), seed=0, max_iter=1)
    good = {"weight": torch.zeros(1, 2), "bias": torch.zeros(1)}
    with pytest.raises(KeyError, match=r"state_dict lacks 'bias' of the state.*strict=False"):
        fl.load_state_dict(state, {"weight": torch.zeros(1, 2)})
    with pytest.raises(
        KeyError, match=r"state_dict has 'extra', which the state has no parameter.*strict=False"
    ):
        fl.load_state_dict(state, {**good, "extra": torch.zeros(1)})
    with pytest.raises(
        ValueError, match=r"state_dict\['weight'\] must be a torch.float32 tensor of shape \(1, 2\)"
    ):
        fl.load_state_dict(state, {**good, "weight": torch.zeros(2, 2)})
    with pytest.raises(
        ValueError, match=r"\(got a torch.float64 tensor of shape \(1, 2\)\).*tensor.to\(torch.float32\)"
    ):
        fl.load_state_dict(state, {**good, "weight": torch.zeros(1, 2, dtype=torch.float64)})
    with pytest.raises(TypeError, match=r"state_dict\['bias'\] must be a tensor \(got 0.0 that is a float\)"):
        fl.load_state_dict(state, {**good, "bias": 0.0})  # type: ignore[dict-item]
    kept = fl.load_state_dict(state, {"weight": torch.ones(1, 2), "extra": torch.zeros(1)}, strict=False)
    assert torch.equal(kept.params["weight"], torch.ones(1, 2))
    assert torch.equal(kept.params["bias"], state.params["bias"])


def test_the_state_dict_shares_through_files_and_exports():
    final = trained(net(), steps=5)
    x, _ = data()
    with tempfile.TemporaryDirectory() as d:
        torch.save(fl.state_dict(final), Path(d) / "model.pt")
        safetensors.torch.save_file(fl.state_dict(final), Path(d) / "model.safetensors")
        from_pt, from_st = net(), net()
        from_pt.load_state_dict(torch.load(Path(d) / "model.pt"))
        from_st.load_state_dict(safetensors.torch.load_file(Path(d) / "model.safetensors"))
    exported = torch.export.export(from_pt.eval(), (x,))
    torch.testing.assert_close(exported.module()(x), from_st.eval()(x), rtol=0, atol=0)


def test_the_exported_state_dict_is_a_round_trip():
    final = trained(net(), steps=5)
    back = fl.load_state_dict(fl.init(net(), fl.optim.adamw(0.05), seed=0, max_iter=5), fl.state_dict(final))
    testing.assert_identical(back.params, final.params)
    testing.assert_identical(back.buffers, final.buffers)


@pytest.mark.parametrize("backend", [None, "graph"], ids=["eager", "traced"])
def test_a_module_moved_to_meta_after_init_trains_the_same_bits(backend: str | None) -> None:
    # After init the step reads the state's tensors, never the module's: model.to("meta") frees the
    # module's copy (docs/concepts.md#memory-the-modules-own-tensors), and names still resolve.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = fl.optim.adamw(1e-2)
    state = fl.init(model, optimizer, seed=0, max_iter=6)
    data = (torch.randn(24, 4), torch.randint(0, 3, (24,)))

    def loss_fn(forward, batch):
        return F.cross_entropy(forward(batch[0]), batch[1])

    def trained() -> fl.TrainState:
        options = {"compile": False} if backend is None else {"backend": backend}
        step = fl.train_step(model, loss_fn, optimizer, **options)
        return fl.run(state, step, fl.data.batches(data, batch_size=8, seed=0))

    before = trained()
    model.to("meta")
    after = trained()
    assert all(torch.equal(after.params[k], before.params[k]) for k in before.params)
    assert all(torch.equal(after.buffers[k], before.buffers[k]) for k in before.buffers)
    assert list(fl.state_dict(after, model)) == list(fl.state_dict(before))


class _Tied(nn.Module):
    """A model with a weight used twice and a buffer ``state_dict`` leaves out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((4,), 0.5), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)) * self.scale)


def _tied() -> _Tied:
    torch.manual_seed(0)
    return _Tied()


def test_donate_model_gives_the_state_the_modules_memory_and_leaves_the_module_on_meta() -> None:
    model = _tied()
    weight, mean, scale = model.embed.weight, model.norm.running_mean, model.scale
    memory = {"embed.weight": weight.data_ptr(), "norm.running_mean": mean.data_ptr()}
    values = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = fl.init(model, fl.optim.adamw(1e-2), seed=0, max_iter=1, donate_model=True)
    # No copy: the state's tensors are the module's memory, with its values.
    assert state.params["embed.weight"].data_ptr() == memory["embed.weight"]
    assert state.buffers["norm.running_mean"].data_ptr() == memory["norm.running_mean"]
    assert "head.weight" not in state.params  # tied: one tensor, under its first name
    assert all(torch.equal(state.params[k], values[k]) for k in state.params)
    # The module keeps its structure, tied as before, on meta; the Parameter objects are new ones.
    assert model.embed.weight.is_meta and model.head.weight is model.embed.weight
    assert not weight.is_meta and weight.data_ptr() == memory["embed.weight"]
    assert model.norm.running_mean.is_meta and model.norm.num_batches_tracked.is_meta
    # A buffer state_dict leaves out stays the module's, and the state holds a copy of it.
    assert model.scale is scale and not scale.is_meta
    assert (
        torch.equal(state.buffers["scale"], scale) and state.buffers["scale"].data_ptr() != scale.data_ptr()
    )


@pytest.mark.parametrize("backend", [None, "graph"], ids=["eager", "traced"])
def test_a_donated_model_trains_the_same_bits_as_a_copied_one(backend: str | None) -> None:
    optimizer = fl.optim.adamw(1e-2)
    tokens = torch.randint(0, 5, (24,))

    def loss_fn(forward, batch):
        return F.cross_entropy(forward(batch), batch)

    def trained(donate_model: bool) -> fl.TrainState:
        model = _tied()
        state = fl.init(model, optimizer, seed=0, max_iter=6, donate_model=donate_model)
        options = {"compile": False} if backend is None else {"backend": backend}
        step = fl.train_step(model, loss_fn, optimizer, **options)
        return fl.run(state, step, fl.data.batches(tokens, batch_size=8, seed=0))

    copied, donated = trained(False), trained(True)
    testing.assert_identical(donated.params, copied.params)
    testing.assert_identical(donated.buffers, copied.buffers)
    testing.assert_identical(donated.opt_state, copied.opt_state)


def test_a_donated_model_is_refused_a_second_init_until_its_weights_are_back() -> None:
    model = _tied()
    optimizer = fl.optim.sgd(0.1)
    state = fl.init(model, optimizer, seed=0, max_iter=1, donate_model=True)
    # Without the refusal the meta model would be made afresh: new random weights, silently.
    with pytest.raises(ValueError, match=r"donate_model=True.*assign=True"):
        fl.init(model, optimizer, seed=0, max_iter=1)
    assert model.embed.weight.is_meta

    model.load_state_dict(fl.state_dict(state, model), assign=True)
    # assign=True gives each name a Parameter of its own: tie them again (transformers: model.tie_weights()).
    assert model.head.weight is not model.embed.weight
    model.head.weight = model.embed.weight
    tokens = torch.arange(5)
    model.eval()
    expected = fl.eval_step(model, lambda f, b: f(b), compile=False)(state, tokens)["value"]
    torch.testing.assert_close(model(tokens), expected, rtol=0, atol=0)
    again = fl.init(model, optimizer, seed=0, max_iter=1)
    testing.assert_identical(again.params, state.params)


def test_a_refused_init_leaves_a_donating_model_as_it_was() -> None:
    model = _tied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="seed"):
        fl.init(model, fl.optim.sgd(0.1), seed=-1, max_iter=1, donate_model=True)
    with pytest.raises(TypeError, match="donate_model"):
        fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1, donate_model="yes")  # type: ignore[arg-type]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_tied_model_moved_to_meta_after_init_is_refused_not_trained_on_nothing() -> None:
    # model.to("meta") makes a meta tensor for each tied name; the state holds the first name's only.
    model = _tied()
    optimizer = fl.optim.sgd(0.1)
    state = fl.init(model, optimizer, seed=0, max_iter=1)
    model.to("meta")
    assert model.head.weight is not model.embed.weight
    step = fl.train_step(model, lambda f, b: F.cross_entropy(f(b), b), optimizer, compile=False)
    with pytest.raises(ValueError, match=r"\['head.weight'\] on the meta device.*donate_model=True"):
        fl.run(state, step, [torch.arange(5)])
    # torch would compute with it all the same: a CPU input times a meta weight is a CPU tensor of
    # whatever the memory held. The evaluation refuses it too.
    assert F.linear(torch.ones(1, 4), torch.empty(5, 4, device="meta")).device.type == "cpu"
    evaluate = fl.eval_step(model, lambda f, b: f(b), compile=False)
    with pytest.raises(ValueError, match=r"eval_step\(\): the model holds \['head.weight'\]"):
        evaluate(state, torch.arange(5))


def test_donate_model_leaves_an_lstm_holding_none_of_its_weights() -> None:
    # An LSTM keeps its own list of its parameters (_flat_weights): replaced in the module's dict
    # alone, the list would go on holding the weights, memory nobody reads.
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.LSTM(4, 8, batch_first=True)

    def loss_fn(forward, batch):
        return forward(batch)[0].square().mean()

    x = torch.randn(3, 5, 4)
    finals = []
    for donate_model in (False, True):
        model, optimizer = make(), fl.optim.adamw(1e-2)
        state = fl.init(model, optimizer, seed=0, max_iter=3, donate_model=donate_model)
        assert all(w.is_meta for w in model._flat_weights) == donate_model
        step = fl.train_step(model, loss_fn, optimizer, compile=False)
        finals.append(fl.run(state, step, [x] * 3))
    testing.assert_identical(finals[1].params, finals[0].params)
