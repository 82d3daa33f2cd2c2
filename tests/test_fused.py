"""The eager step's fused Adam and AdamW: torch's own kernels, torch.optim's bits, resumed exactly.

``train_step(..., compile=False)`` updates ``adam`` and ``adamw`` with ``torch._fused_adam(w)_``
(``fnloop/optim/_fused.py``). Its numbers are then ``torch.optim.AdamW(fused=True)``'s, bit for
bit; ``fused=False`` gives the chain's own formula, ``Optimizer.update``'s bits. No compiles here.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fnloop as fl
from fnloop import testing
from fnloop.optim import Optimizer
from fnloop.optim._fused import fused_update_

STEPS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.LayerNorm(12), torch.nn.Tanh(), torch.nn.Linear(12, 3)
    )


def loss_fn(forward, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(forward(x), y)


DATA = [
    (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
    for g in [torch.Generator().manual_seed(1)]
    for _ in range(STEPS)
]


def _fnloop(opt: Optimizer, steps: int = STEPS) -> fl.TrainState:
    model = _model()
    step = fl.train_step(model, loss_fn, opt, compile=False)
    return fl.run(fl.init(model, opt, seed=0, max_iter=steps), step, fl.data.resumable(DATA[:steps]))


def _torch(make: type[torch.optim.Optimizer], groups, schedule=None, clip=None, **settings) -> dict:
    model = _model()
    opt = make(groups(model), **settings)
    scheduler = None if schedule is None else schedule(opt)
    for batch in DATA:
        loss_fn(model, batch).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _all(model):
    return model.parameters()


def _decayed_and_not(model):
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.ndim >= 2]},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]


CASES = {
    "adamw": (
        lambda fused: fl.optim.adamw(1e-2, weight_decay=0.1, fused=fused),
        lambda: _torch(torch.optim.AdamW, _all, lr=1e-2, weight_decay=0.1, fused=True),
    ),
    "adamw, cosine, no decay for biases and norms": (
        lambda fused: fl.optim.adamw(
            fl.optim.cosine(1e-2, max_iter=STEPS),
            betas=(0.8, 0.95),
            weight_decay=0.1,
            decay_mask=fl.optim.exclude_bias_and_norm,
            fused=fused,
        ),
        lambda: _torch(
            torch.optim.AdamW,
            _decayed_and_not,
            lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS),
            lr=1e-2,
            betas=(0.8, 0.95),
            weight_decay=0.1,
            fused=True,
        ),
    ),
    "clipped, then adamw": (
        lambda fused: fl.optim.chain(
            fl.optim.clip_by_global_norm(0.5), fl.optim.adamw(1e-2, weight_decay=0.1, fused=fused)
        ),
        lambda: _torch(torch.optim.AdamW, _all, clip=0.5, lr=1e-2, weight_decay=0.1, fused=True),
    ),
    "adam with L2 decay": (
        lambda fused: fl.optim.adam(1e-2, weight_decay=0.1, eps=1e-6, fused=fused),
        lambda: _torch(torch.optim.Adam, _all, lr=1e-2, weight_decay=0.1, eps=1e-6, fused=True),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_eager_step_updates_with_the_bits_of_torch_optim_fused(case) -> None:
    make, reference = CASES[case]
    ours, theirs = _fnloop(make(True)).params, reference()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


@pytest.mark.parametrize("case", list(CASES))
def test_fused_false_updates_with_the_chains_formula_and_fused_differs(case) -> None:
    make, _ = CASES[case]
    model = _model()
    opt = make(False)
    # The pure update, step by step: Optimizer.update's bits.
    state = fl.init(model, opt, seed=0, max_iter=STEPS)
    params, opt_state = dict(state.params), state.opt_state
    for i, batch in enumerate(DATA):
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        loss = loss_fn(functools.partial(torch.func.functional_call, model, leaves), batch)
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        params, opt_state = opt.update(grads, opt_state, params, torch.tensor(i))
    pure = _fnloop(opt).params
    fused = _fnloop(make(True)).params
    for name, value in params.items():
        assert torch.equal(pure[name], value), name
    assert any(not torch.equal(fused[k], pure[k]) for k in pure), "the fused kernel's rounding differs"


def test_a_fused_eager_run_resumed_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path) -> None:
    opt = fl.optim.adamw(fl.optim.cosine(1e-2, max_iter=STEPS), weight_decay=0.1)
    straight = _fnloop(opt)
    half = _fnloop(opt, steps=STEPS // 2)
    path = fl.checkpoint.save(half, tmp_path / "half.safetensors")
    model = _model()
    template = fl.init(model, opt, seed=0, max_iter=STEPS)
    resumed = fl.checkpoint.load(path, like=template)
    resumed = fl.TrainState(**{**resumed.__dict__, "max_iter": STEPS})
    step = fl.train_step(model, loss_fn, opt, compile=False)
    done = fl.run(resumed, step, fl.data.resumable(DATA))
    assert done.iteration == STEPS
    for a, b in zip(
        torch.utils._pytree.tree_leaves((straight.params, straight.opt_state)),
        torch.utils._pytree.tree_leaves((done.params, done.opt_state)),
    ):
        assert torch.equal(a, b)


def test_what_the_kernels_cannot_take_runs_the_chain_in_place() -> None:
    params = {"w": torch.ones(3), "n": torch.ones(2, dtype=torch.int64)}
    grads = {"w": torch.ones(3), "n": torch.ones(2, dtype=torch.int64)}
    for opt in (
        fl.optim.adamw(1e-2, fused=False),  # asked not to
        fl.optim.adamw(1e-2),  # an integer tensor
        fl.optim.inject(fl.optim.adamw, lr=1e-2),  # settings held as tensors
        fl.optim.sgd(0.1, momentum=0.9),  # not Adam
    ):
        state = opt.init({"w": params["w"]})
        kept = [t.clone() for t in torch.utils._pytree.tree_leaves(state)]
        assert not fused_update_(opt, grads, state, params, torch.tensor(0)), repr(opt)
        for a, b in zip(kept, torch.utils._pytree.tree_leaves(state)):
            assert torch.equal(a, b)


def test_statistics_record_the_fused_steps_numbers_and_change_no_bit() -> None:
    # The step that records statistics runs the pure layout, fused as the step in place is.
    opt = fl.optim.adamw(fl.optim.cosine(1e-2, max_iter=STEPS), weight_decay=0.1)
    plain = _fnloop(opt)
    model = _model()
    step = fl.train_step(model, loss_fn, opt, compile=False, stats="model")
    watched = fl.run(fl.init(model, opt, seed=0, max_iter=STEPS), step, fl.data.resumable(DATA))
    assert "grad_norm" in " ".join(watched.metrics.names)
    for name, value in plain.params.items():
        assert torch.equal(watched.params[name], value), name


def test_a_state_sharded_at_one_rank_updates_with_the_fused_kernel_as_the_whole_one() -> None:
    # At one rank the chunks are the whole tensors. Across ranks a sharded step runs the chain's
    # formula (the kernel rounds its vectorized body and its scalar tail differently, so chunks cut
    # elsewhere would part the bits); tests/test_sharding.py compares those runs.
    model = _model()
    opt = fl.optim.adamw(1e-2, weight_decay=0.1)
    step = fl.train_step(model, loss_fn, opt, compile=False)
    sharded = fl.run(fl.init(model, opt, seed=0, max_iter=STEPS, shard="full"), step, fl.data.resumable(DATA))
    whole = _fnloop(opt).params
    formula = _fnloop(fl.optim.adamw(1e-2, weight_decay=0.1, fused=False)).params
    for name, value in fl.unshard(sharded).params.items():
        assert torch.equal(whole[name], value), name
    assert any(not torch.equal(formula[k], v) for k, v in fl.unshard(sharded).params.items())


class _Downsampling(torch.nn.Module):
    """A 2x2, stride-2 convolution on channels-last activations, as ConvNeXt downsamples after its LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 16, kernel_size=2, stride=2)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # NCHW, laid out channels-last
        return self.head(self.conv(x).mean((2, 3)))


def test_a_gradient_in_another_memory_layout_than_its_parameter_updates_the_right_elements() -> None:
    # The fused kernels pair elements by memory offset. torch.autograd.grad returns this convolution's
    # weight gradient channels-last beside a contiguous weight, and the kernel updated each weight with
    # another element's gradient: the eager step moved against the gradient (found by fl.check_step).
    gen = torch.Generator().manual_seed(3)
    data = [
        (torch.randn(4, 8, 8, 8, generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(3)
    ]
    probe = _Downsampling()
    (grad,) = torch.autograd.grad(loss_fn(probe, data[0]), [probe.conv.weight])
    assert grad.stride() != probe.conv.weight.stride(), (
        "the premise: the gradient comes back in another layout"
    )

    opt = fl.optim.adamw(1e-2)
    torch.manual_seed(0)
    model = _Downsampling()
    step = fl.train_step(model, loss_fn, opt, compile=False)
    ours = fl.run(fl.init(model, opt, seed=0, max_iter=3), step, fl.data.resumable(data))
    torch.manual_seed(0)
    theirs = _Downsampling()
    reference = torch.optim.AdamW(theirs.parameters(), lr=1e-2, fused=True)
    for batch in data:
        loss_fn(theirs, batch).backward()
        reference.step()
        reference.zero_grad(set_to_none=True)
    testing.assert_identical(ours.params, {k: v.detach() for k, v in theirs.named_parameters()})
