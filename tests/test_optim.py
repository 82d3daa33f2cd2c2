"""fnloop.optim: one conformance battery over every optimizer, schedules, errors, and one compile test."""

from __future__ import annotations

import inspect
import math
import pathlib
import pickle
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.utils._pytree as pytree
from torch.func import grad, grad_and_value

import fnloop.optim as O
from fnloop.optim import (
    Optimizer,
    adam,
    adamw,
    chain,
    clip_by_global_norm,
    constant,
    cosine,
    exclude_bias_and_norm,
    join,
    linear_warmup,
    multistep,
    partition,
    sgd,
    warmup,
    warmup_multistep,
)

STEPS = 100
ROOT = pathlib.Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------
# The problem: a tiny two-layer MLP with a norm-like scale, on fixed data.


def make_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fc1.weight": torch.randn(6, 3, generator=g) * 0.5,
        "fc1.bias": torch.randn(6, generator=g) * 0.1,
        "norm.weight": 1 + torch.randn(6, generator=g) * 0.1,
        "fc2.weight": torch.randn(2, 6, generator=g) * 0.5,
        "fc2.bias": torch.zeros(2),
    }


_G = torch.Generator().manual_seed(1)
X = torch.randn(16, 3, generator=_G)
Y = torch.randn(16, 2, generator=_G)


def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor = X, y: torch.Tensor = Y) -> torch.Tensor:
    h = torch.tanh(x @ p["fc1.weight"].T + p["fc1.bias"]) * p["norm.weight"]
    return ((h @ p["fc2.weight"].T + p["fc2.bias"] - y) ** 2).mean()


def by_ndim(name: str, tensor: torch.Tensor) -> str:
    return "decay" if tensor.ndim >= 2 else "no_decay"


def detectron2_warmup_multistep(
    it: int, milestones=(40, 70), gamma=0.5, warmup_iters=20, factor=0.01
) -> float:
    """detectron2's legacy WarmupMultiStepLR factor, written out as it is there."""
    if it >= warmup_iters:
        warm = 1.0
    else:
        alpha = it / warmup_iters
        warm = factor * (1 - alpha) + alpha
    return warm * gamma ** sum(m <= it for m in milestones)


# ---------------------------------------------------------------------------
# The battery's cases: fnloop's optimizer and the torch.optim recipe it must equal.


class Case(NamedTuple):
    make: Callable[[], Optimizer]
    torch_opt: Callable[[dict[str, torch.nn.Parameter]], torch.optim.Optimizer]
    torch_sched: Callable[[torch.optim.Optimizer], Any] | None = None
    clip: float | None = None


def groups(params, decay: dict[str, Any], no_decay: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"params": [p for p in params.values() if p.ndim >= 2], **decay},
        {"params": [p for p in params.values() if p.ndim < 2], **no_decay},
    ]


def seq_warmup_cosine(o):
    return torch.optim.lr_scheduler.SequentialLR(
        o,
        [
            torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=10),
            torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=90),
        ],
        milestones=[10],
    )


CASES = {
    "sgd": Case(lambda: sgd(0.1), lambda p: torch.optim.SGD(p.values(), lr=0.1)),
    "sgd_momentum": Case(
        lambda: sgd(0.05, momentum=0.9), lambda p: torch.optim.SGD(p.values(), lr=0.05, momentum=0.9)
    ),
    "sgd_dampening": Case(
        lambda: sgd(0.05, momentum=0.9, dampening=0.3),
        lambda p: torch.optim.SGD(p.values(), lr=0.05, momentum=0.9, dampening=0.3),
    ),
    "sgd_nesterov_wd": Case(
        lambda: sgd(0.05, momentum=0.9, weight_decay=1e-2, nesterov=True),
        lambda p: torch.optim.SGD(p.values(), lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=True),
    ),
    "sgd_wd": Case(
        lambda: sgd(0.1, weight_decay=0.1), lambda p: torch.optim.SGD(p.values(), lr=0.1, weight_decay=0.1)
    ),
    "adam": Case(lambda: adam(1e-2), lambda p: torch.optim.Adam(p.values(), lr=1e-2)),
    "adam_wd": Case(
        lambda: adam(1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        lambda p: torch.optim.Adam(p.values(), lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    ),
    "adamw": Case(lambda: adamw(1e-2), lambda p: torch.optim.AdamW(p.values(), lr=1e-2)),
    "adamw_wd": Case(
        lambda: adamw(1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p.values(), lr=1e-2, weight_decay=0.1),
    ),
    "sgd_momentum_linear_warmup": Case(
        lambda: sgd(linear_warmup(0.05, 10, start_factor=0.1), momentum=0.9),
        lambda p: torch.optim.SGD(p.values(), lr=0.05, momentum=0.9),
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=10),
    ),
    "adam_cosine": Case(
        lambda: adam(cosine(1e-2, STEPS, final=1e-4)),
        lambda p: torch.optim.Adam(p.values(), lr=1e-2),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS, eta_min=1e-4),
    ),
    "adamw_multistep": Case(
        lambda: adamw(multistep(1e-2, [30, 60], gamma=0.5), weight_decay=0.1),
        lambda p: torch.optim.AdamW(p.values(), lr=1e-2, weight_decay=0.1),
        lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[30, 60], gamma=0.5),
    ),
    "sgd_warmup_multistep": Case(
        lambda: sgd(warmup_multistep(0.1, [40, 70], 0.5, warmup_iters=20, warmup_factor=0.01), momentum=0.9),
        lambda p: torch.optim.SGD(p.values(), lr=0.1, momentum=0.9),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, detectron2_warmup_multistep),
    ),
    "adamw_constant": Case(lambda: adamw(constant(1e-2)), lambda p: torch.optim.AdamW(p.values(), lr=1e-2)),
    "adamw_warmup_cosine": Case(
        lambda: adamw(join([linear_warmup(1e-2, 10, start_factor=0.1), cosine(1e-2, 90)], [10])),
        lambda p: torch.optim.AdamW(p.values(), lr=1e-2),
        seq_warmup_cosine,
    ),
    "clip_adamw": Case(
        lambda: chain(clip_by_global_norm(0.2), adamw(1e-2)),
        lambda p: torch.optim.AdamW(p.values(), lr=1e-2),
        clip=0.2,
    ),
    "clip_sgd_momentum": Case(
        lambda: chain(clip_by_global_norm(0.2), sgd(0.1, momentum=0.9)),
        lambda p: torch.optim.SGD(p.values(), lr=0.1, momentum=0.9),
        clip=0.2,
    ),
    "adamw_decay_mask": Case(
        lambda: adamw(1e-2, weight_decay=0.1, decay_mask=exclude_bias_and_norm),
        lambda p: torch.optim.AdamW(groups(p, {"weight_decay": 0.1}, {"weight_decay": 0.0}), lr=1e-2),
    ),
    "partition_adamw": Case(
        lambda: partition(
            by_ndim, {"decay": adamw(1e-2, weight_decay=0.1), "no_decay": adamw(1e-2, weight_decay=0.0)}
        ),
        lambda p: torch.optim.AdamW(groups(p, {"weight_decay": 0.1}, {"weight_decay": 0.0}), lr=1e-2),
    ),
    "partition_sgd_two_lrs": Case(
        lambda: chain(
            clip_by_global_norm(0.5),
            partition(
                by_ndim,
                {
                    "decay": sgd(cosine(0.05, STEPS), momentum=0.9, weight_decay=0.1),
                    "no_decay": sgd(cosine(0.1, STEPS), momentum=0.5),
                },
            ),
        ),
        lambda p: torch.optim.SGD(
            groups(p, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}, {"lr": 0.1, "momentum": 0.5}),
            lr=0.1,
        ),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS),
        clip=0.5,
    ),
}


def run_fnloop(opt: Optimizer, steps: int = STEPS) -> tuple[dict[str, torch.Tensor], Any]:
    params = make_params()
    state = opt.init(params)
    for i in range(steps):
        grads = grad(loss_fn)(params)
        params, state = opt.update(grads, state, params, torch.tensor(i))
    return params, state


def run_torch(case: Case, steps: int = STEPS) -> dict[str, torch.Tensor]:
    params = {k: torch.nn.Parameter(v.clone()) for k, v in make_params().items()}
    opt = case.torch_opt(params)
    sched = case.torch_sched(opt) if case.torch_sched else None
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(params).backward()
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), case.clip)
        opt.step()
        if sched is not None:
            sched.step()
    return {k: v.detach() for k, v in params.items()}


def metas(tree: Any) -> tuple[Any, list[tuple[Any, ...]]]:
    leaves, spec = pytree.tree_flatten(tree)
    return spec, [(t.shape, t.dtype, t.device) for t in leaves]


@pytest.fixture(params=sorted(CASES), scope="module")
def case_name(request: pytest.FixtureRequest) -> str:
    return request.param


# ---------------------------------------------------------------------------
# The conformance battery.


@pytest.mark.filterwarnings("ignore:The epoch parameter:UserWarning")
def test_matches_torch_optim(case_name: str) -> None:
    case = CASES[case_name]
    ours, _ = run_fnloop(case.make())
    theirs = run_torch(case)
    assert ours.keys() == theirs.keys()
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    moved = max((ours[k] - v).abs().max().item() for k, v in make_params().items())
    assert moved > 1e-2, "the test problem should move the parameters"


def test_returns_same_structure_and_is_stable(case_name: str) -> None:
    opt = CASES[case_name].make()
    params = make_params()
    state = opt.init(params)
    spec = metas(state)
    for i in range(3):
        new_params, state = opt.update(grad(loss_fn)(params), state, params, torch.tensor(i))
        assert list(new_params) == list(params)
        assert metas(new_params) == metas(params)
        assert metas(state) == spec
        params = new_params


def test_does_not_mutate_inputs(case_name: str) -> None:
    opt = CASES[case_name].make()
    params = make_params()
    state = opt.init(params)
    params, state = opt.update(grad(loss_fn)(params), state, params, torch.tensor(0))
    grads = grad(loss_fn)(params)
    iteration = torch.tensor(1)
    inputs = (grads, state, params, iteration)
    leaves = pytree.tree_leaves(inputs)
    before = [(t._version, t.clone()) for t in leaves]
    new_params, _ = opt.update(*inputs)
    for (version, value), t in zip(before, leaves):
        assert t._version == version
        assert torch.equal(t, value)
    new_ids = {id(t) for t in pytree.tree_leaves(new_params)}
    assert not new_ids & {id(t) for t in pytree.tree_leaves(params)}


def test_the_in_place_update_is_the_update_bit_for_bit(case_name: str) -> None:
    # update_ writes into the state it is given; what it leaves is what update returns.
    opt = CASES[case_name].make()
    params = make_params()
    state = opt.init(params)
    mine = {k: v.clone() for k, v in params.items()}
    mine_state = pytree.tree_map(torch.clone, state)
    for i in range(12):
        grads = grad(loss_fn)(params)
        params, state = opt.update(grads, state, params, torch.tensor(i))
        opt.update_({k: g.clone() for k, g in grads.items()}, mine_state, mine, torch.tensor(i))
        for x, y in zip(pytree.tree_leaves((params, state)), pytree.tree_leaves((mine, mine_state))):
            assert torch.equal(x, y), f"step {i}"


@pytest.mark.parametrize(
    "transform", [O.trace(0.9), O.trace(0.9, nesterov=True), O.scale_by_adam()], ids=repr
)
def test_the_in_place_update_of_no_parameters_counts_the_step_as_update_does(transform) -> None:
    # A group of a partition can be empty (every parameter of its label frozen, say).
    state = transform.init({})
    _, new = transform.update({}, state, {}, torch.tensor(0))
    transform.update_({}, state, {}, torch.tensor(0))
    for x, y in zip(pytree.tree_leaves(new), pytree.tree_leaves(state)):
        assert torch.equal(x, y)


def test_a_transformation_whose_state_changes_shape_is_refused_in_place() -> None:
    class Growing(NamedTuple):  # a user's own whose state is not the same tree from step to step
        def init(self, params):
            return ()

        def update(self, updates, state, params, iteration):
            return updates, (torch.zeros(()),)

    opt = O.chain(Growing(), sgd(0.1))
    params = make_params()
    with pytest.raises(ValueError, match="same structure"):
        opt.update_(grad(loss_fn)(params), opt.init(params), params, torch.tensor(0))


def test_a_transformation_without_an_in_place_update_is_copied_into_its_state() -> None:
    class Counting(NamedTuple):  # a user's own, pure only: its state counts the steps
        def init(self, params):
            return torch.zeros((), dtype=torch.int64)

        def update(self, updates, state, params, iteration):
            return {k: u * 2.0 for k, u in updates.items()}, state + 1

    opt = O.chain(Counting(), sgd(0.1))
    params = make_params()
    state = opt.init(params)
    mine, mine_state = {k: v.clone() for k, v in params.items()}, pytree.tree_map(torch.clone, state)
    for i in range(3):
        grads = grad(loss_fn)(params)
        params, state = opt.update(grads, state, params, torch.tensor(i))
        opt.update_(dict(grads), mine_state, mine, torch.tensor(i))
    assert int(mine_state[0]) == 3
    for x, y in zip(pytree.tree_leaves((params, state)), pytree.tree_leaves((mine, mine_state))):
        assert torch.equal(x, y)


def test_init_does_not_alias_params(case_name: str) -> None:
    params = make_params()
    state = CASES[case_name].make().init(params)
    storages = {t.untyped_storage().data_ptr() for t in params.values()}
    assert not any(t.untyped_storage().data_ptr() in storages for t in pytree.tree_leaves(state))


def test_deterministic(case_name: str) -> None:
    a, sa = run_fnloop(CASES[case_name].make(), steps=5)
    b, sb = run_fnloop(CASES[case_name].make(), steps=5)
    for x, y in zip(pytree.tree_leaves((a, sa)), pytree.tree_leaves((b, sb))):
        assert torch.equal(x, y)


def test_equal_pickles_and_repr_rebuilds(case_name: str) -> None:
    opt = CASES[case_name].make()
    assert opt == CASES[case_name].make()
    assert pickle.loads(pickle.dumps(opt)) == opt
    namespace = {**vars(O), "by_ndim": by_ndim}
    assert eval(repr(opt), namespace) == opt


# ---------------------------------------------------------------------------
# Composition.


def test_chain_laws() -> None:
    clip, opt = clip_by_global_norm(1.0), adamw(1e-3)
    assert repr(chain()) == "chain()"
    assert chain(clip) is clip and chain(opt) is opt
    a, b = clip_by_global_norm(2.0), O.trace(0.9)
    assert chain(chain(clip, a), b) == chain(clip, chain(a, b)) == chain(clip, a, b)
    assert chain(chain(clip, a), opt) == chain(clip, chain(a, opt))
    assert isinstance(chain(clip, opt), Optimizer)
    assert not isinstance(chain(clip, a), Optimizer)
    params = {"w": torch.ones(2)}
    identity = chain()
    updates, state = identity.update(params, identity.init(params), params, torch.tensor(0))
    assert updates == params and state == ()


def test_hand_built_optimizer_equals_sgd_momentum() -> None:
    hand = Optimizer(chain(O.trace(0.9), O.scale_by_learning_rate(0.05)))
    assert hand == sgd(0.05, momentum=0.9)


class Scale(NamedTuple):
    """A user's own transformation, optax style: a NamedTuple of two functions."""

    init: Callable[..., Any]
    update: Callable[..., Any]


def test_user_transformations_and_partitioned_transformations_compose() -> None:
    double = Scale(lambda params: (), lambda u, s, p, i: ({k: v * 2 for k, v in u.items()}, s))
    assert isinstance(double, O.GradientTransformation)
    params = make_params()
    grads = grad(loss_fn)(params)
    new, _ = chain(double, sgd(0.1)).update(grads, ((), O.EmptyState()), params, torch.tensor(0))
    ref, _ = sgd(0.2).update(grads, O.EmptyState(), params, torch.tensor(0))
    for k in params:
        torch.testing.assert_close(new[k], ref[k])
    per_group = chain(
        partition(by_ndim, {"decay": clip_by_global_norm(1e-3), "no_decay": clip_by_global_norm(1e3)}),
        sgd(1.0),
    )
    new, state = per_group.update(grads, per_group.init(params), params, torch.tensor(0))
    assert set(state[0]) == {"decay", "no_decay"}
    for k, p in params.items():
        if p.ndim < 2:
            torch.testing.assert_close(new[k], p - grads[k])


def test_clip_records_norm_and_matches_torch() -> None:
    g = make_params()
    clip = clip_by_global_norm(0.5)
    clipped, state = clip.update(g, clip.init(g), g, torch.tensor(0))
    ref = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in g.items()}
    for k, p in ref.items():
        p.grad = g[k].clone()
    norm = torch.nn.utils.clip_grad_norm_(list(ref.values()), 0.5)
    assert norm > 1.0
    torch.testing.assert_close(state.global_norm, norm, rtol=0, atol=0)
    for k in g:
        torch.testing.assert_close(clipped[k], ref[k].grad, rtol=0, atol=0)
    small = {k: v * 1e-3 for k, v in g.items()}
    unclipped, _ = clip.update(small, state, small, torch.tensor(1))
    assert all(torch.equal(unclipped[k], small[k]) for k in g)


@pytest.mark.parametrize(
    "build",
    [
        lambda: chain(clip_by_global_norm(0.5), sgd(1.0)),
        lambda: partition(lambda name, t: "all", {"all": chain(clip_by_global_norm(0.5), sgd(1.0))}),
        lambda: O.inject(lambda lr: chain(clip_by_global_norm(0.5), sgd(lr)), lr=1.0),
    ],
    ids=["chain", "partition", "inject"],
)
def test_over_shards_reaches_a_global_norm_inside_each_combinator(build: Callable[[], Optimizer]) -> None:
    # A sharded step's sum over ranks; here, two ranks holding the same chunks: the norm is sqrt(2) times.
    g = make_params()
    opt = build()
    sharded = opt.over_shards(lambda value: 2 * value)
    assert isinstance(sharded, Optimizer) and sharded == opt  # the sum is not part of what it is
    local, _ = opt.update(g, opt.init(g), g, torch.tensor(0))
    whole, _ = sharded.update(g, sharded.init(g), g, torch.tensor(0))
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(v) for v in g.values()]))
    for k in g:  # sgd(1.0): the parameters move by the clipped gradient
        torch.testing.assert_close(g[k] - local[k], g[k] * (0.5 / (norm + 1e-6)), rtol=1e-6, atol=0)
        torch.testing.assert_close(g[k] - whole[k], g[k] * (0.5 / (norm * 2**0.5 + 1e-6)), rtol=1e-6, atol=0)
    assert isinstance(clip_by_global_norm(1.0), O.OverShards) and not isinstance(
        sgd(1.0).transform, O.OverShards
    )


def test_decay_mask_spares_biases_and_norms() -> None:
    opt = adamw(0.1, weight_decay=0.5, decay_mask=exclude_bias_and_norm)
    params = make_params()
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    new, _ = opt.update(zeros, opt.init(params), params, torch.tensor(0))
    for k, v in params.items():
        expected = v * (1 - 0.1 * 0.5) if v.ndim >= 2 else v
        torch.testing.assert_close(new[k], expected)


# ---------------------------------------------------------------------------
# Schedules against torch.optim.lr_scheduler.


def torch_lrs(make_sched: Callable[[torch.optim.Optimizer], Any], base: float, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = make_sched(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


SCHEDULES = {
    "constant": (constant(0.1), lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=1.0), 0.1),
    "linear_warmup": (
        linear_warmup(0.1, 7, start_factor=0.01),
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.01, total_iters=7),
        0.1,
    ),
    "linear_warmup_torch_default": (
        linear_warmup(0.1, 5, start_factor=1 / 3),
        lambda o: torch.optim.lr_scheduler.LinearLR(o),
        0.1,
    ),
    "cosine": (cosine(0.1, 30), lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=30), 0.1),
    "cosine_final": (
        cosine(0.1, 30, final=0.01),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=30, eta_min=0.01),
        0.1,
    ),
    "multistep": (
        multistep(0.1, [5, 12, 20], gamma=0.3),
        lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[5, 12, 20], gamma=0.3),
        0.1,
    ),
    "warmup_multistep": (
        warmup_multistep(0.1, [40, 70], 0.5, warmup_iters=20, warmup_factor=0.01),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, detectron2_warmup_multistep),
        0.1,
    ),
    "warmup_multistep_constant": (
        warmup_multistep(0.1, [15], warmup_iters=10, warmup_factor=0.1, warmup_method="constant"),
        lambda o: torch.optim.lr_scheduler.LambdaLR(
            o, lambda it: (0.1 if it < 10 else 1.0) * 0.1 ** (it >= 15)
        ),
        0.1,
    ),
    "join": (
        join([linear_warmup(0.1, 10, start_factor=0.1), cosine(0.1, 20)], [10]),
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [
                torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=10),
                torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20),
            ],
            milestones=[10],
        ),
        0.1,
    ),
}


@pytest.mark.filterwarnings("ignore:The epoch parameter:UserWarning")
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_matches_lr_scheduler(name: str) -> None:
    schedule, make_sched, base = SCHEDULES[name]
    steps = 30 if name != "warmup_multistep" else 100
    ours = [schedule(torch.tensor(i)) for i in range(steps)]
    assert all(v.shape == () and v.dtype == torch.float64 for v in ours)
    theirs = torch_lrs(make_sched, base, steps)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert math.isclose(float(a), b, rel_tol=1e-9, abs_tol=1e-12), (i, float(a), b)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_is_a_value(name: str) -> None:
    schedule = SCHEDULES[name][0]
    assert pickle.loads(pickle.dumps(schedule)) == schedule
    assert eval(repr(schedule), vars(O)) == schedule
    assert float(schedule(3)) == float(schedule(torch.tensor(3)))


def test_cosine_stays_at_final_after_max_iter() -> None:
    s = cosine(1.0, 10, final=0.1)
    assert float(s(10)) == pytest.approx(0.1) and float(s(25)) == pytest.approx(0.1)


def test_warmup_composes_with_any_schedule() -> None:
    s = warmup(cosine(1.0, 100), 10, factor=0.0)
    assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5 * float(cosine(1.0, 100)(5)))
    assert float(s(50)) == float(cosine(1.0, 100)(50))


# ---------------------------------------------------------------------------
# Errors.


def test_negative_lr() -> None:
    with pytest.raises(ValueError, match=r"'lr' must be at least 0.0 \(got -0.1\)"):
        sgd(-0.1)
    with pytest.raises(TypeError, match="'lr' must be a float or a schedule, not a tensor"):
        adamw(torch.ones(2))
    with pytest.raises(TypeError, match="'lr' must be a finite float"):
        adam("0.001")  # type: ignore[arg-type]


def test_bad_betas() -> None:
    with pytest.raises(ValueError, match=r"'betas\[1\]' must be at least 0.0 and below 1.0 \(got 1.0\)"):
        adam(1e-3, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"'betas' must be a pair"):
        adamw(1e-3, betas=(0.9,))  # type: ignore[arg-type]


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="Nesterov momentum needs momentum > 0"):
        sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match=r"'weight_decay' must be at least 0\.0"):
        adamw(1e-3, weight_decay=-0.1)
    with pytest.raises(ValueError, match="'max_norm' must be positive"):
        clip_by_global_norm(0)
    with pytest.raises(ValueError, match="'milestones' must be increasing positive ints"):
        multistep(0.1, [20, 10])
    with pytest.raises(ValueError, match="warmup method must be 'linear' or 'constant'"):
        warmup_multistep(0.1, [10], warmup_method="exp")
    with pytest.raises(ValueError, match="one boundary fewer than schedules"):
        join([constant(0.1), constant(0.2)], [])


def test_unknown_group_label() -> None:
    opt = partition(lambda name, p: "other", {"decay": sgd(0.1), "no_decay": sgd(0.1)})
    with pytest.raises(
        ValueError, match=r"gave 'other' for parameter 'fc1.weight'.*Add an entry for 'other'"
    ):
        opt.init(make_params())


def test_mismatched_param_and_grad_keys() -> None:
    opt = adamw(1e-3)
    params = make_params()
    state = opt.init(params)
    grads = {k: v for k, v in grad(loss_fn)(params).items() if k != "fc2.bias"}
    grads["extra"] = torch.zeros(1)
    with pytest.raises(
        KeyError,
        match=r"grads must have the same keys as params; missing: \['fc2.bias'\], "
        r"unexpected: \['extra'\]",
    ):
        opt.update(grads, state, params, torch.tensor(0))


def test_iteration_must_be_a_tensor() -> None:
    opt = sgd(0.1)
    params = make_params()
    with pytest.raises(TypeError, match="update expected iteration as a 0-d int64 tensor"):
        opt.update(params, opt.init(params), params, 3)  # type: ignore[arg-type]


def test_state_of_other_params_or_optimizer() -> None:
    params = make_params()
    g = grad(loss_fn)(params)
    state = adam(1e-3).init({k: v for k, v in params.items() if k != "fc2.bias"})
    with pytest.raises(KeyError, match=r"opt_state\.mu must have the same keys.*missing: \['fc2\.bias'\]"):
        adam(1e-3).update(g, state, params, torch.tensor(0))
    with pytest.raises(
        ValueError, match="chain expected its state as a tuple with one entry per transformation"
    ):
        sgd(0.1, momentum=0.9, weight_decay=0.1).update(g, adam(1e-3).init(params), params, torch.tensor(0))


def test_bad_composition() -> None:
    with pytest.raises(TypeError, match="takes an Optimizer only as its last entry"):
        chain(adamw(1e-3), clip_by_global_norm(1.0))
    with pytest.raises(TypeError, match="chain\\(\\) entry 0 expected a gradient transformation"):
        chain(lambda g: g, adamw(1e-3))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="either all Optimizers or no Optimizer"):
        partition(by_ndim, {"decay": adamw(1e-3), "no_decay": clip_by_global_norm(1.0)})
    opt = adamw(1e-3, decay_mask=lambda n, p: p.sum() > 0)  # type: ignore[arg-type,return-value]
    params = make_params()
    with pytest.raises(TypeError, match="decay_mask must return a bool"):
        opt.update(params, opt.init(params), params, torch.tensor(0))


# ---------------------------------------------------------------------------
# The API and its documentation.


def test_public_names_documented() -> None:
    docs = (ROOT / "docs" / "optim.md").read_text()
    for name in O.__all__:
        obj = getattr(O, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert inspect.getdoc(obj), f"{name} has no docstring"
        assert f"`{name}" in docs, f"{name} is not in docs/optim.md"


# ---------------------------------------------------------------------------
# One graph, no recompiles: forward, backward, clipping and AdamW with a schedule.


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiles_to_one_graph_without_recompiles() -> None:
    opt = chain(
        clip_by_global_norm(0.5),
        adamw(
            join([linear_warmup(1e-2, 2, start_factor=0.1), cosine(1e-2, 3)], [2]),
            weight_decay=0.1,
            decay_mask=exclude_bias_and_norm,
        ),
    )

    def step(params, state, iteration, x, y):
        grads, loss = grad_and_value(loss_fn)(params, x, y)
        params, state = opt.update(grads, state, params, iteration)
        return params, state, loss

    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = torch.compile(step, fullgraph=True)
    params = make_params()
    state = opt.init(params)
    eager_params, eager_state = params, state
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(5):
            iteration = torch.tensor(i)
            params, state, _ = compiled(params, state, iteration, X, Y)
            eager_params, eager_state, _ = step(eager_params, eager_state, iteration, X, Y)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before + 1
    for a, b in zip(pytree.tree_leaves((params, state)), pytree.tree_leaves((eager_params, eager_state))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_every_optimizer_compiles_to_what_it_computes_eagerly() -> None:
    """All cases in one compiled graph, against eager: catches miscompiles of the update arithmetic.

    On torch 2.13, ``torch.add(g, x, alpha=c)`` on a ``grad_and_value`` output
    lost ``alpha`` when compiled; weight decay was silently wrong.
    """
    optimizers = {name: CASES[name].make() for name in sorted(CASES)}

    def steps(params, states, iterations):
        out = {}
        for name, opt in optimizers.items():
            p, s = params, states[name]
            for iteration in iterations:
                grads, _ = grad_and_value(loss_fn)(p)
                p, s = opt.update(grads, s, p, iteration)
            out[name] = (p, s)
        return out

    params = make_params()
    states = {name: opt.init(params) for name, opt in optimizers.items()}
    iterations = [torch.tensor(i) for i in range(2)]
    compiled = torch.compile(steps, fullgraph=True)(params, states, iterations)
    eager = steps(params, states, iterations)
    for name in optimizers:
        for a, b in zip(pytree.tree_leaves(compiled[name]), pytree.tree_leaves(eager[name])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_partition_with_its_arguments_swapped_says_so() -> None:
    with pytest.raises(TypeError, match="look swapped"):
        O.partition({"all": sgd(0.1)}, lambda name, p: "all")


@pytest.mark.parametrize(
    ("make", "path"),
    [
        (lambda t: adamw(t), "lr"),
        (lambda t: adamw(1e-3, weight_decay=t), "weight_decay"),
        (lambda t: adam(1e-3, betas=(t, 0.999)), "b1"),
        (lambda t: sgd(0.1, momentum=t), "momentum"),
        (lambda t: adamw(O.cosine(t, 10)), "lr.base"),
        (lambda t: O.Optimizer(O.chain(O.clip_by_global_norm(t), O.scale_by_learning_rate(0.1))), "max_norm"),
    ],
    ids=["lr", "weight_decay", "betas", "momentum", "schedule", "chain"],
)
def test_a_tensor_setting_given_by_hand_is_refused_where_the_optimizer_meets_a_model(
    make: Callable[[torch.Tensor], Any], path: str
) -> None:
    # Built by hand, the optimizer takes a 0-d tensor as torch.optim does, and steps with it;
    # init and train_step refuse it, naming where it sits, since a compiled graph would bake it in.
    import fnloop as fl

    opt = make(torch.tensor(0.5))
    params = {"w": torch.ones(2)}
    new, _ = opt.update({"w": torch.ones(2)}, opt.init(params), params, torch.tensor(0))
    assert new["w"].shape == (2,)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(
        TypeError,
        match=rf"init: the optimizer holds a tensor as a setting, at optimizer\..*{path} \(got tensor",
    ):
        fl.init(model, opt, seed=0, max_iter=1)
    with pytest.raises(TypeError, match=r"train_step: .*fnloop\.optim\.inject"):
        fl.train_step(model, lambda out, batch: out.sum(), opt, compile=False)


def test_tensors_that_are_the_states_or_the_users_own_are_not_refused() -> None:
    import fnloop as fl

    class Preconditioned(NamedTuple):  # a transformation of the user's, holding a tensor of its own
        scale: torch.Tensor

        def init(self, params: Any) -> Any:
            return O.EmptyState()

        def update(self, updates: Any, state: Any, params: Any = None, iteration: Any = None) -> Any:
            return {k: -self.scale * u for k, u in updates.items()}, state

    model = torch.nn.Linear(2, 1)
    for opt in (
        O.inject(adamw, lr=1e-3, weight_decay=0.1),
        O.inject(lambda lr: adamw(O.cosine(lr, 10)), lr=1e-3),
        O.Optimizer(Preconditioned(torch.tensor(0.1))),
    ):
        assert list(O._inject.tensor_settings(opt)) == []
        fl.init(model, opt, seed=0, max_iter=1)
