"""The pure compiled step: one graph, donation, purity, numbers equal to torch, randomness."""

from __future__ import annotations

import copy

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import Phase, TrainState, testing

torch.manual_seed(0)
X = torch.randn(96, 8)
Y = torch.randint(0, 3, (96,))
BATCHES = [(X[i : i + 16], Y[i : i + 16]) for i in range(0, 96, 16)]


def zero() -> float:
    return 0.0


def batches(n: int) -> list:
    return [BATCHES[i % len(BATCHES)] for i in range(n)]


def classify(forward, batch):
    x, y = batch
    logits = forward(x)
    return torch.nn.functional.cross_entropy(logits, y), {"acc": (logits.argmax(1) == y).float().mean()}


def mlp(dropout: float) -> torch.nn.Module:
    torch.manual_seed(1)
    layers = [torch.nn.Linear(8, 16, bias=False), torch.nn.BatchNorm1d(16), torch.nn.ReLU()]
    if dropout:
        layers.append(torch.nn.Dropout(dropout))
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 3))


SCHEDULE = fl.optim.warmup(fl.optim.cosine(0.05, 200), 10)


@pytest.fixture(scope="module")
def noisy():
    """A compiled step on a model with BatchNorm and dropout, AdamW with warmup and cosine."""
    model = mlp(0.3)
    optimizer = fl.optim.adamw(SCHEDULE, weight_decay=0.05)
    step = fl.train_step(model, classify, optimizer)
    return model, optimizer, step, fl.init(model, optimizer, seed=7, max_iter=30)


def test_one_graph_no_recompile_over_a_long_run_with_a_schedule(noisy):
    _model, _optimizer, step, state = noisy
    fl.run(attrs.evolve(state, max_iter=2), step, batches(2), clock=zero)  # compiles, once for the module
    assert step.compiles == 1
    final = fl.run(attrs.evolve(state, max_iter=2000), step, batches(2000), clock=zero)
    assert step.compiles == 1  # and the budget (0 recompiles) would have raised at the first
    assert final.iteration == 2000
    assert final.metrics.latest("loss")[0] == 1999


def test_donation_changes_no_bit(noisy):
    model, optimizer, step, state = noisy
    undonated = fl.train_step(model, classify, optimizer, donate=False)
    assert not hasattr(undonated, "donating")
    donated = fl.run(state, step, batches(30), clock=zero)
    plain = fl.run(state, undonated, batches(30), clock=zero)
    lazily = list(fl.scan(state, step, batches(30), clock=zero))[-1]
    testing.assert_identical(donated, plain)
    testing.assert_identical(donated, lazily)


def test_the_callers_state_and_the_module_are_untouched(noisy):
    model, _optimizer, step, state = noisy
    module_before = copy.deepcopy(model.state_dict())
    snapshot = [
        (p, t.clone(), t._version) for p, t in fl._core.tree.leaves(state) if isinstance(t, torch.Tensor)
    ]
    yielded = []
    final = None
    for final in fl.scan(state, step, batches(30), clock=zero):
        yielded.append(
            (final, [(p, t.clone()) for p, t in fl._core.tree.leaves(final) if isinstance(t, torch.Tensor)])
        )
    fl.run(state, step, batches(30), clock=zero)
    for path, value, version in snapshot:
        tensor = dict(fl._core.tree.leaves(state))[path]
        assert tensor._version == version, path
        assert torch.equal(tensor, value), path
    for s, copies in yielded:  # every state scan gave out is still what it was
        current = dict(fl._core.tree.leaves(s))
        for path, value in copies:
            assert torch.equal(current[path], value), path
    for name, value in model.state_dict().items():
        assert torch.equal(value, module_before[name]), name
    assert final is not None and model.training


def test_dropout_replays_identically_and_resume_equals_no_resume(noisy):
    _model, _optimizer, step, state = noisy
    rng_before = torch.get_rng_state()
    whole = fl.run(state, step, batches(30), clock=zero)
    again = fl.run(state, step, batches(30), clock=zero)
    testing.assert_identical(whole, again)
    assert torch.equal(torch.get_rng_state(), rng_before), "the step must not move the global generator"
    # Dropout draws from the seed the graph takes as an input, not from torch's generator.
    assert [entry.draws for entry in step.jit._cache.values()] == [False]
    midway = list(fl.scan(state, step, batches(30), clock=zero))[12 - 1]
    assert midway.iteration == 12
    resumed = fl.run(midway, step, batches(30)[12:], clock=zero)
    testing.assert_identical(whole, resumed)
    other_seed = fl.run(attrs.evolve(state, rng=8), step, batches(30), clock=zero)
    assert fl._core.tree.first_difference(whole.params, other_seed.params) is not None, (
        "dropout must follow the seed"
    )


def test_metrics_are_tensors_at_the_steps_index(noisy):
    _model, _optimizer, step, state = noisy
    final = fl.run(attrs.evolve(state, max_iter=3), step, batches(3), clock=zero)
    assert [i for i, _ in final.metrics.history("loss")] == [0, 1, 2]
    assert all(isinstance(v, torch.Tensor) for _, v in final.metrics.history("acc"))


@pytest.fixture(scope="module")
def plain():
    model = mlp(0.0)
    return model


def torch_loop(model, optimizer, scheduler, n):
    for x, y in batches(n):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return model


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (
            lambda: fl.optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
            lambda p: (torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3), None),
        ),
        (
            lambda: fl.optim.adamw(fl.optim.cosine(0.01, 100)),
            lambda p: (
                o := torch.optim.AdamW(p, lr=0.01),
                torch.optim.lr_scheduler.CosineAnnealingLR(o, 100),
            ),
        ),
    ],
    ids=["sgd-nesterov", "adamw-cosine"],
)
def test_the_compiled_step_matches_the_torch_loop_including_batchnorm_buffers(plain, ours, theirs):
    reference = copy.deepcopy(plain)
    optimizer = ours()
    step = fl.train_step(plain, classify, optimizer)
    final = fl.run(fl.init(plain, optimizer, seed=0, max_iter=100), step, batches(100), clock=zero)
    # No random op in the graph draws from torch's generator, so the step never touches it.
    assert [entry.draws for entry in step.jit._cache.values()] == [False]
    torch_optimizer, scheduler = theirs(reference.parameters())
    torch_loop(reference, torch_optimizer, scheduler, 100)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(final.params[name], p.detach(), rtol=1e-4, atol=1e-5)
    for name, b in reference.named_buffers():
        torch.testing.assert_close(final.buffers[name], b, rtol=1e-4, atol=1e-5)


def test_a_recompile_beyond_the_budget_is_an_error_not_a_silent_fallback():
    model = torch.nn.Linear(4, 1)

    def mse(forward, batch):
        x, y = batch
        return ((forward(x) - y) ** 2).mean()

    step = fl.train_step(model, mse, fl.optim.sgd(0.1))
    data = [(torch.ones(8, 4), torch.zeros(8, 1))] * 3 + [(torch.ones(5, 4), torch.zeros(5, 1))]
    state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=4)
    with pytest.raises(
        fl.RecompileError,
        match=r"compiled again at iteration 3 \(1 recompiles, budget 0\): the batch's tensor 0 was "
        r"shape \(8, 4\), strides \(4, 1\), torch.float32, on cpu, is now shape \(5, 4\).*"
        r"drop_last=True.*Nothing of this iteration ran",
    ) as info:
        fl.run(state, step, data)
    # Refused before anything ran: the state after three steps is intact, and a
    # step with a budget takes the odd batch.
    last = info.value.state
    assert last.iteration == 3 and step.compiles == 1
    testing.assert_identical(last.params, fl.run(attrs.evolve(state, max_iter=3), step, data).params)
    lenient = fl.train_step(model, mse, fl.optim.sgd(0.1), recompiles=1)
    assert fl.run(state, lenient, data).iteration == 4 and lenient.compiles == 2
    with pytest.raises(ValueError, match=r"'recompiles' must be an int >= 0 \(got -1"):
        fl.train_step(model, mse, fl.optim.sgd(0.1), recompiles=-1)


def test_a_graph_break_is_a_clear_error():
    model = torch.nn.Linear(4, 1)

    def chatty(forward, batch):
        loss = forward(batch).mean()
        if loss.item() > 0:  # a host sync and a Python branch: cannot be one graph
            return loss * 2
        return loss

    step = fl.train_step(model, chatty, fl.optim.sgd(0.1))
    # The message names the line on a line of its own, so the pattern spans lines.
    with pytest.raises(fl.GraphBreakError, match=r"(?s)must compile into one graph.*\.item\(\)") as caught:
        fl.run(fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1), step, [torch.ones(2, 4)])
    assert "in chatty: if loss.item() > 0:" in str(caught.value)  # loss_fn's own line


# The eager step runs the same kernel; these tests need no compile.


def linear_problem():
    model = torch.nn.Linear(4, 2)

    def mse(forward, batch):
        x, y = batch
        return ((forward(x) - y) ** 2).mean()

    torch.manual_seed(3)
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(5)]
    return model, mse, data


def test_gradient_accumulation_equals_the_whole_batch():
    model, mse, data = linear_problem()
    opt = fl.optim.sgd(0.1)
    state = fl.init(model, opt, seed=0, max_iter=5)
    whole = fl.run(state, fl.train_step(model, mse, opt, compile=False), data)
    halves = fl.run(state, fl.train_step(model, mse, opt, compile=False, accumulate=2), data)
    for k in whole.params:
        torch.testing.assert_close(whole.params[k], halves.params[k], rtol=1e-6, atol=1e-7)
    assert abs(whole.metrics.latest_float("loss")[1] - halves.metrics.latest_float("loss")[1]) < 1e-5


def test_accumulate_needs_a_divisible_batch():
    model, mse, data = linear_problem()
    step = fl.train_step(model, mse, fl.optim.sgd(0.1), compile=False, accumulate=3)
    with pytest.raises(
        ValueError, match=r"cannot split a batch of 8 rows into accumulate=3 equal micro-batches"
    ):
        step(fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1), data[0])


@pytest.mark.parametrize("bad", ["bf16", True, 5, torch.int32, torch.float32])
def test_an_autocast_that_is_no_autocast_dtype_is_refused_when_the_step_is_built(bad):
    model, mse, _ = linear_problem()
    with pytest.raises(TypeError, match=r"autocast=\.\.\.\) must be None, torch.bfloat16 or torch.float16"):
        fl.train_step(model, mse, fl.optim.sgd(0.1), compile=False, autocast=bad)


def test_bf16_autocast_trains_float32_params():
    model, mse, data = linear_problem()
    opt = fl.optim.sgd(0.1)
    final = fl.run(
        fl.init(model, opt, seed=0, max_iter=5),
        fl.train_step(model, mse, opt, compile=False, autocast=torch.bfloat16),
        data,
    )
    assert final.params["weight"].dtype == torch.float32
    assert final.metrics.latest("loss")[1].dtype == torch.float32
    plain = fl.run(
        fl.init(model, opt, seed=0, max_iter=5), fl.train_step(model, mse, opt, compile=False), data
    )
    assert fl._core.tree.first_difference(final.params, plain.params) is not None  # bf16 really ran


@attrs.frozen
class Kept:
    params: object


@pytest.mark.parametrize(
    "how", [dict, lambda params: params, lambda params: (0, {"deep": params}), Kept, lambda p: Kept((p,))]
)
def test_a_hook_keeping_parameters_never_sees_them_change(how):
    model, mse, data = linear_problem()
    opt = fl.optim.sgd(0.1)

    def keep(state, phase):
        if phase is Phase.AFTER_STEP and state.iteration == 1:
            return fl.with_hook_state(state, "kept", how(state.params))
        return state

    # Hook states that stay the same objects from step to step: the step's check skips them.
    steady = [
        fl.stateful("steady", Kept(0), lambda s, p, m: (s, m)),
        fl.stateful("n", 0, lambda s, p, m: (s, m)),
    ]
    state = fl.init(model, opt, seed=0, max_iter=5)
    at_two = list(fl.scan(state, fl.train_step(model, mse, opt, compile=False), data))[1]
    final = fl.run(state, fl.train_step(model, mse, opt, compile=False), data, [*steady, keep])
    testing.assert_identical(final.hooks["kept"], how(at_two.params))
    assert fl._core.tree.first_difference(final.params, at_two.params) is not None


def test_debug_names_a_hook_that_writes_into_the_state():
    model, mse, data = linear_problem()
    opt = fl.optim.sgd(0.1)

    def sneaky(state, phase):
        if phase is Phase.AFTER_STEP:
            state.params["weight"].mul_(0.5)
        return state

    state = fl.init(model, opt, seed=0, max_iter=5)
    with pytest.raises(
        RuntimeError,
        match=r"hook .*sneaky wrote into state.params\['weight'\] in place in "
        r"Phase.AFTER_STEP",
    ):
        fl.run(
            state,
            fl.train_step(model, mse, opt, compile=False),
            data,
            [fl.every(2, testing.Tag("x")), sneaky],
            debug=True,
        )


def test_init_copies_and_names_like_the_module():
    model = mlp(0.1)
    state = fl.init(model, fl.optim.sgd(0.1), seed=3, max_iter=9)
    assert list(state.params) == [n for n, _ in model.named_parameters()]
    assert list(state.buffers) == [n for n, _ in model.named_buffers()]
    assert (state.rng, state.max_iter, state.iteration) == (3, 9, 0)
    for name, p in model.named_parameters():
        assert torch.equal(state.params[name], p) and state.params[name].data_ptr() != p.data_ptr()


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: fl.train_step("model", classify, fl.optim.sgd(0.1)), r"expected a torch.nn.Module"),
        (lambda: fl.train_step(mlp(0), classify, torch.optim.SGD), r"expected a fnloop.optim.Optimizer"),
        (
            lambda: fl.train_step(mlp(0), classify, fl.optim.sgd(0.1), accumulate=0),
            r"'accumulate' must be a positive int",
        ),
        (lambda: fl.init(3, fl.optim.sgd(0.1), seed=0, max_iter=1), r"init\(\) expected a torch.nn.Module"),
        (
            lambda: fl.train_step(mlp(0), classify, fl.optim.sgd(0.1), options={"cpp_wraper": True}),
            r"options: 'cpp_wraper' is not a setting of torch._inductor.config",
        ),
        (
            lambda: fl.eval_step(mlp(0), classify, options={"nope": 1}),
            r"options: 'nope' is not a setting",
        ),
    ],
)
def test_step_errors(build, match):
    with pytest.raises((TypeError, ValueError), match=match):
        build()


def test_a_loss_that_is_not_a_scalar_is_refused():
    model, _, data = linear_problem()
    step = fl.train_step(model, lambda f, b: f(b[0]), fl.optim.sgd(0.1), compile=False)
    with pytest.raises(
        TypeError,
        match=r"loss_fn must return a scalar loss tensor or \(loss, metrics\), got Tensor "
        r"\(8, 2\); reduce the loss",
    ):
        step(fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1), data[0])


def test_eval_step_reads_the_state_and_changes_nothing():
    model = mlp(0.5)
    evaluate = fl.eval_step(
        model, lambda f, b: {"acc": (f(b[0]).argmax(1) == b[1]).float().mean()}, compile=False
    )
    state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
    snapshot = copy.deepcopy(dict(state.buffers))
    first, second = evaluate(state, BATCHES[0]), evaluate(state, BATCHES[0])
    assert torch.equal(first["acc"], second["acc"])  # eval mode: no dropout
    testing.assert_identical(dict(state.buffers), snapshot)
    assert model.training


def test_compiled_eval_step_equals_eager_and_compiles_once_per_batch_shape():
    model = mlp(0.5)

    def accuracy(forward, batch):
        x, y = batch
        logits = forward(x)
        return {"acc": (logits.argmax(1) == y).float().mean(), "logit_sum": logits.sum()}

    compiled, eager = fl.eval_step(model, accuracy), fl.eval_step(model, accuracy, compile=False)
    state = fl.run(
        fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=3),
        fl.train_step(model, classify, fl.optim.sgd(0.1), compile=False),
        batches(3),
    )
    for batch in [*BATCHES, (X[:5], Y[:5])]:  # the last, smaller batch compiles a second graph
        ours, theirs = compiled(state, batch), eager(state, batch)
        assert ours.keys() == theirs.keys() == {"acc", "logit_sum"}
        torch.testing.assert_close(ours, theirs)
    assert compiled.compiles == 2 and model.training


def test_static_values_in_a_batch_are_part_of_the_signature():
    model, _, data = linear_problem()

    def scaled(forward, batch):
        x, y, how = batch["x"], batch["y"], batch["how"]
        err = (forward(x) - y) ** 2
        return err.sum() if how == "sum" else err.mean()

    opt = fl.optim.sgd(0.01)
    state = fl.init(model, opt, seed=0, max_iter=4)
    stream = [{"x": x, "y": y, "how": how} for (x, y), how in zip(data, ["mean", "mean", "sum", "mean"])]
    step = fl.train_step(model, scaled, opt, recompiles=1, options={"cpp_wrapper": False})
    ours = fl.run(state, step, stream)
    theirs = fl.run(state, fl.train_step(model, scaled, opt, compile=False), stream)
    assert step.compiles == 2  # "mean" and "sum" are two graphs; the fourth step reuses the first
    for name in ours.params:
        torch.testing.assert_close(ours.params[name], theirs.params[name])
    with pytest.raises(TypeError, match=r"this batch holds \{1, 2\} \(a set\), which is neither"):
        step(state, {"x": data[0][0], "y": data[0][1], "how": {1, 2}})


def test_tensors_the_loss_closes_over_are_constants_of_the_graph():
    model = torch.nn.Linear(8, 3)
    weight = torch.tensor([1.0, 2.0, 0.5])  # class weights, read from the closure

    def weighted(forward, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(forward(x), y, weight=weight)

    opt = fl.optim.sgd(0.1)
    state = fl.init(model, opt, seed=0, max_iter=6)
    ours = fl.run(state, fl.train_step(model, weighted, opt, options={"cpp_wrapper": False}), batches(6))
    theirs = fl.run(state, fl.train_step(model, weighted, opt, compile=False), batches(6))
    for name in ours.params:
        torch.testing.assert_close(ours.params[name], theirs.params[name])


def test_without_standalone_compile_the_traced_graph_goes_through_torch_compile(monkeypatch):
    # torch before 2.8 has no torch._inductor.standalone_compile: the same traced graph, compiled by dynamo.
    import torch._inductor

    model, mse, data = linear_problem()
    opt = fl.optim.adam(0.01)
    state = fl.init(model, opt, seed=0, max_iter=5)
    monkeypatch.delattr(torch._inductor, "standalone_compile")
    step = fl.train_step(model, mse, opt, options={"cpp_wrapper": False})
    ours = fl.run(state, step, data)
    theirs = fl.run(state, fl.train_step(model, mse, opt, compile=False), data)
    assert step.compiles == 1
    for name in ours.params:
        torch.testing.assert_close(ours.params[name], theirs.params[name])


def test_step_is_a_good_step_for_the_fold_without_compile():
    model, mse, data = linear_problem()
    opt = fl.optim.adam(0.01)
    state = fl.init(model, opt, seed=0, max_iter=5)
    step = fl.train_step(model, mse, opt, compile=False)
    testing.assert_identical(
        fl.run(state, step, data, clock=zero), list(fl.scan(state, step, data, clock=zero))[-1]
    )
    assert isinstance(step, fl.TrainStep) and "train_step(Linear" in repr(step)
    assert TrainState is type(state)


def storage_of_weight(state, phase, seen):
    if phase is Phase.AFTER_STEP:
        return state, (*seen, state.params["weight"].data_ptr())
    return state, seen


def test_run_updates_in_place_once_it_owns_the_state_and_scan_never_does(noisy):
    # `noisy` has compiled a step: dynamo's frame hook is installed, which once changed reference counts.
    model, mse, data = linear_problem()
    opt = fl.optim.adam(0.01)
    state = fl.init(model, opt, seed=0, max_iter=5)
    step = fl.train_step(model, mse, opt, compile=False)
    hook = fl.stateful("ptrs", (), storage_of_weight)
    ran = fl.run(state, step, data, [hook]).hooks["ptrs"]
    assert ran[0] != state.params["weight"].data_ptr()
    assert len(set(ran)) == 1, "after the first step, run must write into the same storage"
    scanned = list(fl.scan(state, step, data, [hook]))[-1].hooks["ptrs"]
    assert len(set(scanned)) == len(scanned), "scan must give every state its own storage"


def test_a_metric_holding_a_parameter_keeps_its_value():
    model, mse, data = linear_problem()
    opt = fl.optim.sgd(0.1)

    def log_bias(state, phase):
        return fl.record(state, bias=state.params["bias"]) if phase is Phase.AFTER_STEP else state

    state = fl.init(model, opt, seed=0, max_iter=5)
    final = fl.run(state, fl.train_step(model, mse, opt, compile=False), data, [log_bias])
    states = list(fl.scan(state, fl.train_step(model, mse, opt, compile=False), data, [log_bias]))
    for (i, logged), s in zip(final.metrics.history("bias"), states):
        assert torch.equal(logged, s.params["bias"]), i


def test_a_step_cut_while_writing_in_place_leaves_no_torn_state_anywhere(tmp_path):
    model, mse, data = linear_problem()
    opt = fl.optim.sgd(0.1)
    step = fl.train_step(model, mse, opt, compile=False)
    real = step.function
    calls = []

    def cut_midway(params, buffers, opt_state, iteration, batch, shards):
        calls.append(int(iteration))
        if len(calls) == 3:  # the third step: write one tensor, then stop, as a kernel boundary would
            params["weight"].add_(1.0)
            raise KeyboardInterrupt
        return real(params, buffers, opt_state, iteration, batch, shards)

    object.__setattr__(step, "function", cut_midway)
    state = fl.init(model, opt, seed=0, max_iter=5)
    with pytest.raises(KeyboardInterrupt) as info:
        fl.run(state, step, data, [fl.every(100, fl.hooks.checkpoint(tmp_path))])
    assert info.value.state is None
    assert "no consistent state is left in memory" in info.value.__notes__[0]
    assert fl.checkpoint.checkpoints(tmp_path) == []  # AFTER_TRAIN wrote no half-updated state


def test_a_step_that_fails_before_writing_keeps_the_last_consistent_state():
    model, mse, data = linear_problem()
    opt = fl.optim.sgd(0.1)
    step = fl.train_step(model, mse, opt, compile=False)
    real = step.function

    def fail_early(params, buffers, opt_state, iteration, batch, shards):
        if int(iteration) == 2:
            raise ValueError("bad batch")
        return real(params, buffers, opt_state, iteration, batch, shards)

    object.__setattr__(step, "function", fail_early)
    state = fl.init(model, opt, seed=0, max_iter=5)
    with pytest.raises(ValueError, match="bad batch") as info:
        fl.run(state, step, data)
    reference = list(fl.scan(state, fl.train_step(model, mse, opt, compile=False), data))[1]
    testing.assert_identical(info.value.state.params, reference.params)


def test_recorded_metrics_never_change_though_their_storage_is_reused(noisy):
    # `noisy` has compiled a step: dynamo's frame hook is installed, which once changed reference counts.
    model, mse, data = linear_problem()
    opt = fl.optim.adam(0.01)
    step = fl.train_step(model, mse, opt, compile=False)
    state = attrs.evolve(fl.init(model, opt, seed=0, max_iter=60), metrics=fl.Metrics(window=3))
    stream = [data[i % len(data)] for i in range(60)]
    seen = []
    for s in fl.scan(state, step, stream):  # every state is kept: nothing may be reused under it
        seen.append((s, [float(v) for _, v in s.metrics.history("loss")]))
    for s, values in seen:
        assert [float(v) for _, v in s.metrics.history("loss")] == values
    kept = seen[-1][0]
    del seen
    final = fl.run(attrs.evolve(kept, max_iter=200), step, [data[i % len(data)] for i in range(140)])
    homes = len(step._memo.pool._homes)
    # One pooled scalar per step (the loss; a fixed lr is a float); the states of the scan were let
    # go: their homes came back.
    assert homes <= 60 + 3 + 8, homes
    assert [i for i, _ in final.metrics.history("loss")] == [197, 198, 199]


def fail_after_step_three(state, phase):
    if phase is Phase.AFTER_STEP and state.iteration == 3:
        raise OSError("writer failed")
    return state


@pytest.mark.parametrize("donate", [True, False])
def test_a_hook_failing_after_an_in_place_step_never_passes_off_a_mixed_state(tmp_path, donate):
    """After a donating step, the previous state's tensors hold the new values: it is no longer consistent."""
    model, mse, data = linear_problem()
    opt = fl.optim.sgd(0.1)
    step = fl.train_step(model, mse, opt, compile=False, donate=donate)
    state = fl.init(model, opt, seed=0, max_iter=5)
    with pytest.raises(OSError, match="writer failed") as info:
        fl.run(state, step, data, [fail_after_step_three, fl.every(100, fl.hooks.checkpoint(tmp_path))])
    reference = list(fl.scan(state, fl.train_step(model, mse, opt, compile=False), data))[2]  # iteration 3
    if donate:
        assert info.value.state is None
        assert fl.checkpoint.checkpoints(tmp_path) == []
    else:
        testing.assert_identical(info.value.state.params, reference.params)
        saved = fl.load(fl.checkpoint.path_for(tmp_path, 3), like=state)
        testing.assert_identical(saved.params, reference.params)


class _FailingWriter:
    """A log writer whose write at ``iteration`` fails, once (a full disk that is then freed)."""

    def __init__(self, iteration: int) -> None:
        self.iteration, self.lines = iteration, []

    def start(self, iteration: int) -> None:
        pass

    def write(self, line) -> None:
        if line.iteration == self.iteration and self.iteration not in self.lines:
            self.lines.append(line.iteration)
            raise OSError(28, "No space left on device")
        self.lines.append(line.iteration)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("effect", ["save", "log"])
def test_an_effect_failing_after_a_donating_step_keeps_the_state_it_was_given(tmp_path, monkeypatch, effect):
    """An effect only reads the state of a finished iteration: its failure leaves that state whole."""
    from fnloop.checkpoint import _writing

    model, mse, data = linear_problem()
    opt = fl.optim.sgd(0.1)
    step = fl.train_step(
        model, mse, opt, compile=False
    )  # donating: the fold owns every state after the first
    state = fl.init(model, opt, seed=0, max_iter=5)
    hooks = [fl.every(2, fl.hooks.checkpoint(tmp_path))]
    if effect == "save":
        real, tries = _writing.write_atomically, []

        def full_disk_once(path, write):
            tries.append(path.name)
            if len(tries) == 2:  # the save of iteration 4; the one of 2 went through
                raise OSError(28, "No space left on device")
            return real(path, write)

        monkeypatch.setattr(_writing, "write_atomically", full_disk_once)
    else:
        hooks.insert(0, fl.every(2, fl.hooks.log(_FailingWriter(4))))
    with pytest.raises(OSError, match="No space left") as info:
        fl.run(state, step, data, hooks)
    reference = list(fl.scan(state, fl.train_step(model, mse, opt, compile=False), data))[3]  # iteration 4
    assert info.value.state is not None and info.value.state.iteration == 4
    testing.assert_identical(info.value.state.params, reference.params)
    testing.assert_identical(info.value.state.opt_state, reference.opt_state)
    # AFTER_TRAIN saved it: nothing since the last checkpoint is lost.
    saved = fl.load(fl.checkpoint.path_for(tmp_path, 4), like=state)
    testing.assert_identical(saved.params, reference.params)
    assert not any("no consistent state" in note for note in getattr(info.value, "__notes__", []))


def test_the_learning_rate_applied_is_recorded_from_the_graph(noisy):
    _model, _optimizer, step, state = noisy
    final = fl.run(attrs.evolve(state, max_iter=12), step, batches(12), clock=zero)
    history = final.metrics.history("lr", 12)
    assert [i for i, _ in history] == list(range(12))
    assert all(isinstance(v, torch.Tensor) for _, v in history)  # recorded without a host sync
    assert [float(v) for _, v in history] == [float(SCHEDULE(torch.tensor(i))) for i in range(12)]


def poisoned(n: int, at: int) -> list:
    x, y = BATCHES[0]
    bad = (torch.full_like(x, float("nan")), y)
    return [bad if i == at else BATCHES[i % len(BATCHES)] for i in range(n)]


def test_a_non_finite_step_changes_no_bit_and_stops_the_compiled_run(noisy, tmp_path):
    _model, _optimizer, step, state = noisy
    state = attrs.evolve(state, max_iter=6)
    hooks = [fl.every(100, fl.hooks.checkpoint(tmp_path))]
    with pytest.raises(fl.NonFiniteLoss, match=r"step 3: the loss was nan .*skip_nonfinite=True") as info:
        fl.run(state, step, poisoned(6, 3), hooks, clock=zero)
    assert isinstance(info.value, FloatingPointError) and info.value.iteration == 3
    reference = list(fl.scan(state, step, batches(6), clock=zero))[2]  # after steps 0, 1, 2
    testing.assert_identical(info.value.state.params, reference.params)
    testing.assert_identical(info.value.state.opt_state, reference.opt_state)
    testing.assert_identical(info.value.state.buffers, reference.buffers)
    saved = fl.checkpoint.latest(tmp_path, like=state)  # the end-of-run save holds the clean state
    assert saved is not None and saved.iteration == 3
    testing.assert_identical(saved.params, reference.params)


@pytest.mark.inductor("inductor's own build failure becomes fnloop's CompileError")
def test_a_graph_torch_cannot_compile_is_fnloops_compile_error_naming_the_fix():
    model, mse, data = linear_problem()
    opt = fl.optim.sgd(0.1)
    # A C++ compiler that always fails: inductor traces and lowers the graph, then cannot build it.
    step = fl.train_step(model, mse, opt, options={"cpp.cxx": (None, "/bin/false")})
    with pytest.raises(
        fl.CompileError, match=r"^compiling the training step failed in torch's compiler"
    ) as info:
        fl.run(fl.init(model, opt, seed=0, max_iter=2), step, data)
    assert "train_step(..., compile=False) runs the same step eagerly" in str(info.value)
    assert info.value.__cause__ is not None, "torch's own error is chained"


class _Scaled(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 3.0  # the line the error points to


def test_a_compile_failure_names_the_op_and_the_models_lines_that_made_it():
    from torch.func import functional_call

    from fnloop._compile import trace
    from fnloop._compile.trace import located

    model = _Scaled()

    def scaled(draws, x: torch.Tensor) -> tuple[list[torch.Tensor], None]:
        return [functional_call(model, {}, (x,))], None

    x = torch.ones(3)
    node = next(n for n in trace(scaled, [x]).graph.graph.nodes if n.target is torch.ops.aten.sin.default)
    error = RuntimeError(f"some inductor failure\nWhile executing %{node.name} : ...")
    failed = located(scaled, [x], True, error)
    assert failed.op == "aten.sin.default"
    assert failed.where is not None and "test_step.py" in failed.where, failed.where
    assert "torch.sin(x) * 3.0" in failed.where


def test_library_code_sees_that_it_is_compiled_while_the_step_is_traced_and_only_then():
    # As under torch.compile: a library (transformers' mixture of experts) picks its compiled path so.
    from fnloop._compile import trace

    seen: list[bool] = []

    def asks(draws, x: torch.Tensor) -> tuple[list[torch.Tensor], None]:
        seen.append(torch.compiler.is_compiling())
        return [x * 2.0 if torch.compiler.is_compiling() else x * 3.0], None

    graph = trace(asks, [torch.ones(3)]).graph
    assert seen == [True]
    assert torch.equal(graph(torch.ones(3))[0], torch.full((3,), 2.0))
    assert not torch.compiler.is_compiling()  # back as it was once the trace is over
    with pytest.raises(RuntimeError, match="raised inside"):
        trace(_raising, [torch.ones(3)])
    assert not torch.compiler.is_compiling()  # and after a trace that failed


def _raising(draws, x: torch.Tensor) -> tuple[list[torch.Tensor], None]:
    raise RuntimeError("raised inside the traced function")


def test_the_step_keeps_nothing_of_a_runs_states_once_it_is_over():
    # A step is often held in a reference cycle, so what it kept would live on (an extra copy of the
    # model, or tensors of a process group freed only by the interpreter's teardown).
    import gc
    import weakref

    model, mse, data = linear_problem()
    opt = fl.optim.sgd(0.1)
    step = fl.train_step(model, mse, opt, compile=False)
    final = fl.run(fl.init(model, opt, seed=0, max_iter=5), step, data)
    weight = weakref.ref(final.params["weight"])
    del final
    gc.collect()
    assert weight() is None
