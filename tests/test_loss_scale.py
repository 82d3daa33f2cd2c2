"""float16 with dynamic loss scaling: the numbers of a plain loop with ``torch.amp.GradScaler``, and resume.

The reference is the loop PyTorch's AMP recipe writes: autocast to float16,
``scaler.scale(loss).backward()``, ``scaler.step(opt)``, ``scaler.update()``.
Its initial scale (2**20) and growth interval (4) make it overflow often: it
skips steps 0, 1, 5, 14, 16, 24, 32, 40 and 48 of 50.
"""

from __future__ import annotations

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import testing

pytestmark = pytest.mark.xdist_group("loss_scale")

STEPS = 50
SCALER = {"init_scale": 2.0**20, "growth_interval": 4}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 10)
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (256,), generator=torch.Generator().manual_seed(2))
    return [(x[(i % 8) * 32 : (i % 8 + 1) * 32], y[(i % 8) * 32 : (i % 8 + 1) * 32]) for i in range(STEPS)]


def loss_fn(forward, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(forward(x), y)


def optimizer() -> fl.optim.LossScaled:
    return fl.optim.dynamic_loss_scale(fl.optim.adamw(1e-3), **SCALER)


def reference(accumulate: int = 1) -> dict:
    """The plain loop with GradScaler: each step's loss, the scale it used, whether it was skipped."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    losses, scales, skipped = [], [], []
    for x, y in batches():
        opt.zero_grad()
        total = 0.0
        for mx, my in zip(x.chunk(accumulate), y.chunk(accumulate)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(net(mx), my)
            scaler.scale(loss / accumulate).backward()
            total += loss.item() / accumulate
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        losses.append(total)
        scales.append(before)
        skipped.append(int(scaler.get_scale() < before))
    return {"loss": losses, "loss_scale": scales, "overflow": skipped, "params": dict(net.named_parameters())}


def series(states: list[fl.TrainState], name: str) -> list[float]:
    """Every step's value of ``name`` over the states a scan yielded, in order of iteration."""
    found: dict[int, float] = {}
    for state in states:
        for i, value in state.metrics.history(name):
            found[i] = float(value)
    return [found[i] for i in sorted(found)]


@pytest.fixture(scope="module")
def references() -> dict[int, dict]:
    return {1: reference(), 2: reference(accumulate=2)}


@pytest.fixture(scope="module")
def steps() -> dict[str, fl.Step]:
    """Each way of stepping, built once (the compiled ones trace on first use)."""
    opt = optimizer()
    make = lambda **kw: fl.train_step(model(), loss_fn, opt, autocast=torch.float16, **kw)  # noqa: E731
    return {
        "eager": make(compile=False),
        "compiled": make(),
        "eager-accumulate": make(compile=False, accumulate=2),
        "compiled-accumulate": make(accumulate=2),
        "compiled-2-per-call": make(steps_per_call=2),
    }


def trained(
    step: fl.Step, state: fl.TrainState | None = None, data: list | None = None
) -> list[fl.TrainState]:
    state = fl.init(model(), optimizer(), seed=0, max_iter=STEPS) if state is None else state
    return list(fl.scan(state, step, batches()[state.iteration :] if data is None else data))


@pytest.mark.parametrize(
    "how", ["eager", "compiled", "eager-accumulate", "compiled-accumulate", "compiled-2-per-call"]
)
def test_the_step_skips_and_scales_as_a_plain_loop_with_grad_scaler(how, steps, references):
    ref = references[2 if "accumulate" in how else 1]
    states = trained(steps[how])
    assert sum(ref["overflow"]) >= 2  # the comparison means something
    assert series(states, "overflow") == ref["overflow"]
    assert series(states, "loss_scale") == ref["loss_scale"]
    torch.testing.assert_close(series(states, "loss"), ref["loss"], rtol=1e-3, atol=1e-3)
    final = states[-1]
    assert float(final.opt_state.scale) == ref["loss_scale"][-1] * (0.5 if ref["overflow"][-1] else 1.0)
    # AdamW counts only the steps it took, as torch.optim does behind GradScaler.
    assert int(final.opt_state.inner[0].step) == STEPS - sum(ref["overflow"])
    for name, p in ref["params"].items():
        # Eager follows the reference to float rounding; compiled float16 rounds its own way.
        tol = 1e-4 if how.startswith("eager") else 5e-3
        torch.testing.assert_close(final.params[name], p.detach(), rtol=0, atol=tol)


@pytest.mark.parametrize("how", ["eager", "compiled", "compiled-2-per-call"])
def test_a_resume_at_any_iteration_continues_bit_for_bit(how, steps, tmp_path):
    step = steps[how]
    states = trained(step)
    whole = states[-1]
    per = 2 if "per-call" in how else 1
    # Every cut of the run; among them right after each skipped step (1, 2, 6, 15, ...).
    for at in range(per, STEPS, per):
        start = fl.init(model(), optimizer(), seed=0, max_iter=at)
        half = fl.run(start, step, batches()[:at])
        fl.save(half, tmp_path / "half.safetensors")
        loaded = fl.load(tmp_path / "half.safetensors", like=start)
        testing.assert_identical(loaded.opt_state, half.opt_state)
        final = fl.run(attrs.evolve(loaded, max_iter=STEPS), step, batches()[at:])
        testing.assert_identical(final.params, whole.params)
        testing.assert_identical(final.opt_state, whole.opt_state)
        assert series([final], "loss_scale") == series([whole], "loss_scale")
        assert series([final], "loss") == series([whole], "loss")


def test_a_loss_that_is_not_finite_is_not_an_overflow():
    # A smaller scale cannot cure an infinite loss (it multiplies the loss after the forward):
    # the step stops the run as any non-finite loss, the scale untouched.
    opt = optimizer()
    step = fl.train_step(model(), loss_fn, opt, compile=False, autocast=torch.float16)
    data = batches()[:3]
    data[1] = (torch.full_like(data[1][0], float("inf")), data[1][1])
    state = fl.init(model(), opt, seed=0, max_iter=3)
    with pytest.raises(fl.NonFiniteLoss, match="step 1"):
        fl.run(state, step, data)


def test_float16_without_loss_scaling_warns_with_the_fix():
    with pytest.warns(UserWarning, match=r"dynamic_loss_scale\(opt\)"):
        fl.train_step(model(), loss_fn, fl.optim.adamw(1e-3), autocast=torch.float16, compile=False)


def test_a_state_without_the_scale_is_refused_with_the_fix():
    step = fl.train_step(model(), loss_fn, optimizer(), autocast=torch.float16, compile=False)
    state = fl.init(model(), fl.optim.adamw(1e-3), seed=0, max_iter=1)
    with pytest.raises(
        TypeError,
        match=r"\(a tuple\) was not made by this step's optimizer, dynamic_loss_scale.*a LossScaleState",
    ):
        fl.run(state, step, batches()[:1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
    ],
)
def test_settings_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fl.optim.dynamic_loss_scale(fl.optim.sgd(0.1), **kwargs)


def test_the_scale_follows_grad_scalers_rule_to_the_bit():
    # The update of the scale alone, against GradScaler's own kernel, over a run of overflows and growth.
    opt = fl.optim.dynamic_loss_scale(fl.optim.sgd(0.1), init_scale=8.0, growth_interval=3)
    params = {"w": torch.ones(3)}
    state = opt.init(params)
    scale, tracker = torch.full((1,), 8.0), torch.zeros((1,), dtype=torch.int32)
    for i, bad in enumerate([0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]):
        grad = torch.tensor([1.0, float("nan") if bad else 2.0, 3.0])
        params, state = opt.update({"w": grad}, state, params, torch.tensor(i))
        # What GradScaler.update() runs: growth 2, backoff 0.5, interval 3.
        torch._amp_update_scale_(scale, tracker, torch.full((1,), float(bad)), 2.0, 0.5, 3)
        assert torch.equal(state.scale, scale.reshape(())), i
        assert int(state.growth) == int(tracker), i


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_each_member_of_a_population_scales_its_own_loss_as_its_solo_run(compile):
    def member(seed):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 10)
        )
        return fl.init(net, optimizer(), seed=seed, max_iter=20)

    step = fl.train_step(model(), loss_fn, optimizer(), autocast=torch.float16, compile=compile)
    data = batches()[:20]
    together = list(fl.scan(fl.population(member, seeds=[0, 1]), step, data))
    for m in (0, 1):
        alone = list(fl.scan(member(m), step, data))
        assert series(together, f"overflow/{m}") == series(alone, "overflow")
        assert series(together, f"loss_scale/{m}") == series(alone, "loss_scale")
        mine = fl.member(together[-1], m)
        if compile:  # the population's graph is another graph than the solo one
            for name, p in alone[-1].params.items():
                torch.testing.assert_close(mine.params[name], p, rtol=0, atol=5e-3)
        else:
            testing.assert_identical(mine.params, alone[-1].params)
            testing.assert_identical(mine.opt_state, alone[-1].opt_state)
    assert series(together, "overflow/0") != series(together, "overflow/1")  # each its own scale


def test_a_state_of_one_optimizer_stepped_by_another_is_refused_naming_both():
    # init with the loss-scaled optimizer, train_step with the plain one: refused at the first step,
    # not "chain expected its state as a tuple" from inside the update.
    model = torch.nn.Linear(3, 1)
    plain = fl.optim.adamw(1e-3)
    state = fl.init(model, fl.optim.dynamic_loss_scale(plain), seed=0, max_iter=2)
    step = fl.train_step(model, lambda f, b: f(b).square().mean(), plain, compile=False)
    with pytest.raises(
        TypeError, match=r"opt_state \(a LossScaleState\) was not made by this step's optimizer"
    ):
        step(state, torch.ones(2, 3))


@pytest.mark.parametrize("scale", [1e300, float(2**65)])
def test_a_first_scale_no_step_could_use_is_refused(scale):
    with pytest.raises(
        ValueError, match=r"init_scale=...\) must be a finite number above 0.0 and at most 2\*\*64"
    ):
        fl.optim.dynamic_loss_scale(fl.optim.sgd(0.1), init_scale=scale)
