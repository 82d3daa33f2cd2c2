"""Bad input, explained: what was expected, what was got, and the fix (a new user's mistakes among them)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import attrs
import pytest
import torch

import fnloop as fl
import fnloop.checkpoint._transfer
from fnloop import Phase, TrainState, checkpoint, testing


def _torch_optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: torch.optim.lr_scheduler.CosineAnnealingLR(_torch_optimizer(), T_max=100), "cosine"),
        (lambda: torch.optim.lr_scheduler.StepLR(_torch_optimizer(), step_size=10), "multistep"),
        (lambda: torch.optim.lr_scheduler.LinearLR(_torch_optimizer()), "linear_warmup"),
        (lambda: torch.optim.lr_scheduler.LambdaLR(_torch_optimizer(), lambda i: 1.0), "cosine"),
    ],
)
def test_a_torch_scheduler_as_lr_names_fnloop_schedules(make, named):
    scheduler = make()
    with pytest.raises(TypeError, match=r"fnloop\.optim\.cosine") as info:
        fl.optim.adamw(lr=scheduler)
    message = str(info.value)
    assert f"torch.optim.lr_scheduler.{type(scheduler).__name__}" in message
    assert f"fnloop.optim.{named}(" in message
    assert "warmup(" in message
    with pytest.raises(TypeError, match=r"not a torch\.optim\.lr_scheduler"):
        fl.optim.sgd(scheduler)


def test_a_torch_optimizer_as_lr_is_refused_with_the_fix():
    with pytest.raises(
        TypeError, match=r"'lr' must be a float or a fnloop schedule, not a torch\.optim\.SGD"
    ):
        fl.optim.adamw(lr=_torch_optimizer())


def test_fnloop_schedules_and_plain_functions_still_pass_as_lr():
    fl.optim.adamw(lr=fl.optim.cosine(1e-3, 100))
    fl.optim.sgd(lambda i: 0.1 * torch.ones(()))


def _loss(forward, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(forward(x), y)


def _train(model: torch.nn.Module, compiled_wrapper: torch.nn.Module) -> fl.TrainState:
    optimizer = fl.optim.adamw(1e-2)
    state = fl.init(compiled_wrapper, optimizer, seed=0, max_iter=5)
    step = fl.train_step(compiled_wrapper, _loss, optimizer, compile=False)
    torch.manual_seed(1)
    batches = [(torch.randn(8, 3), torch.randn(8, 1)) for _ in range(5)]
    return fl.run(state, step, batches)


def test_a_torch_compiled_module_is_unwrapped_and_trains_like_the_plain_one():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    wrapped = torch.compile(model)
    assert isinstance(wrapped, torch._dynamo.eval_frame.OptimizedModule)
    plain_state = _train(model, model)
    wrapped_state = _train(model, wrapped)
    assert sorted(wrapped_state.params) == sorted(dict(model.named_parameters()))  # no "_orig_mod." prefix
    testing.assert_identical(testing.without_clock(plain_state), testing.without_clock(wrapped_state))
    evaluate = fl.eval_step(wrapped, lambda f, b: {"out": f(b).sum()}, compile=False)
    plain = fl.eval_step(model, lambda f, b: {"out": f(b).sum()}, compile=False)
    x = torch.randn(4, 3)
    assert torch.equal(evaluate(wrapped_state, x)["out"], plain(plain_state, x)["out"])


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: fl.init("model", fl.optim.sgd(0.1), seed=0, max_iter=1), "init"),
        (lambda: fl.train_step("model", _loss, fl.optim.sgd(0.1)), "train_step"),
        (lambda: fl.eval_step("model", _loss), "eval_step"),
    ],
)
def test_a_model_that_is_no_module_is_refused(call, name):
    with pytest.raises(TypeError, match=rf"{name}\(\) expected a torch\.nn\.Module, got 'model' \(a str\)"):
        call()


def test_a_metrics_window_of_1000_keeps_1000():
    state = attrs.evolve(fl.TrainState(max_iter=2000), metrics=fl.Metrics(window=1000))
    metrics = state.metrics
    for i in range(1500):
        metrics = metrics.record(i, {"loss": float(i)})
    assert len(metrics.series["loss"]) == 1000
    assert metrics.series["loss"][0] == (500, 500.0)


def test_train_step_names_a_torch_optimizer_whole():
    with pytest.raises(
        TypeError, match=r"train_step\(\) expected a fnloop\.optim\.Optimizer, got a torch\.optim\.SGD; build"
    ):
        fl.train_step(torch.nn.Linear(2, 1), _loss, _torch_optimizer())


def test_a_metric_never_recorded_is_named_at_the_end_of_the_run(tmp_path):
    step = lambda s, b: fl.record(s, loss=1.0)  # noqa: E731
    with pytest.warns(fl.hooks.MetricNeverRecorded, match=r"'losss' was never recorded.*\['loss'\]"):
        fl.run(TrainState(max_iter=2), step, [None] * 2, [fl.hooks.best_checkpoint(tmp_path, "losss")])
    assert issubclass(fl.hooks.MetricNeverRecorded, UserWarning)


def test_init_explains_a_torch_optimizer():
    model = torch.nn.Linear(2, 1)
    with pytest.raises(
        TypeError, match=r"init\(\) expected a fnloop\.optim\.Optimizer.*torch\.optim\.SGD"
    ) as exc:
        fl.init(model, torch.optim.SGD(model.parameters(), lr=0.1), seed=0, max_iter=1)
    assert "fnloop.optim.sgd" in str(exc.value)


def test_init_names_a_bad_seed():
    with pytest.raises(ValueError, match=r"'seed' must be a non-negative int \(got -1 that is an int\)"):
        fl.init(torch.nn.Linear(2, 1), fl.optim.sgd(0.1), seed=-1, max_iter=1)


@pytest.mark.parametrize("make", [lambda: fl.optim.cosine(-1e-3, 100), lambda: fl.optim.constant(-0.1)])
def test_a_negative_schedule_is_refused_as_sgd_refuses_a_negative_lr(make):
    with pytest.raises(ValueError, match=r"must be at least 0"):
        make()


def test_a_schedule_of_the_wrong_shape_is_named():
    model = torch.nn.Linear(2, 1)
    opt = fl.optim.sgd(lambda t: torch.ones(3))
    # train_step reads the optimizer's learning rates once when it is built: the error comes at once.
    with pytest.raises(TypeError, match=r"schedule .* must return a 0-d tensor.*shape \(3,\)"):
        fl.train_step(model, lambda f, b: f(b).pow(2).mean(), opt, compile=False)
    with pytest.raises(TypeError, match=r"schedule .* must return a 0-d tensor.*shape \(3,\)"):
        opt.update(
            {"w": torch.ones(1)}, opt.init({"w": torch.ones(1)}), {"w": torch.ones(1)}, torch.tensor(0)
        )


def test_run_explains_a_missing_step():
    with pytest.raises(TypeError, match=r"step must be a callable \(state, batch\) -> state.*None"):
        fl.run(TrainState(max_iter=1), None, [None])


def test_train_state_names_a_param_that_is_not_a_tensor():
    with pytest.raises(TypeError, match=r"'params'\['w'\] must be a tensor \(got 3 that is an int\)"):
        TrainState(max_iter=1, params={"w": 3})


def test_train_state_explains_bad_metrics():
    with pytest.raises(TypeError, match=r"'metrics' must be a fnloop\.Metrics \(got \{\} that is a dict\)"):
        TrainState(max_iter=1, metrics={})


def test_non_scalar_metrics_from_the_loss_are_named():
    model = torch.nn.Linear(2, 1)
    opt = fl.optim.sgd(0.1)

    def loss_fn(forward, batch):
        out = forward(batch)
        return out.pow(2).mean(), {"acc": out.squeeze(1)}

    step = fl.train_step(model, loss_fn, opt, compile=False)
    with pytest.raises(TypeError, match=r"metric 'acc'.*shape \(4,\)"):
        fl.run(fl.init(model, opt, seed=0, max_iter=1), step, [torch.ones(4, 2)])


@pytest.mark.parametrize(
    ("phase", "lowered", "at"),
    [(Phase.BEFORE_STEP, 2, 3), (Phase.AFTER_STEP, 3, 3), (Phase.BEFORE_TRAIN, 1, 2)],
)
def test_a_hook_lowering_max_iter_below_the_steps_done_is_refused(phase, lowered, at):
    # Lowering max_iter ends a run early; below what the run will have completed, it would end it with
    # max_iter < iteration.
    def lower(state, p):
        hit = p is phase and (phase is Phase.BEFORE_TRAIN or state.iteration == at)
        return attrs.evolve(state, max_iter=lowered) if hit else state

    start = 2 if phase is Phase.BEFORE_TRAIN else 0
    with pytest.raises(ValueError, match=rf"max_iter was lowered to {lowered} in {phase.name}") as info:
        fl.run(fl.TrainState(max_iter=10, iteration=start), lambda s, b: s, [None] * 10, [lower])
    assert info.value.state.max_iter == 10  # the last consistent state, as before the hook


def test_lowering_max_iter_to_the_steps_done_ends_the_run_as_a_success():
    def stop_after_three(state, phase):
        return (
            attrs.evolve(state, max_iter=3) if phase is Phase.AFTER_STEP and state.iteration == 2 else state
        )

    final = fl.run(fl.TrainState(max_iter=10), lambda s, b: s, [None] * 10, [stop_after_three])
    assert (final.iteration, final.max_iter) == (3, 3)


def test_saving_a_hook_state_nested_too_deep_names_where():
    deep: object = 0
    for _ in range(2000):
        deep = [deep]
    state = fl.TrainState(max_iter=1, hooks={"deep": deep})
    with pytest.raises(
        TypeError, match=r"state.hooks\['deep'\]\[0\]\[0\].*nested deeper than a checkpoint can hold"
    ):
        checkpoint.save(state, Path(tempfile.mkdtemp()) / "c")


def test_a_profile_directory_that_cannot_be_made_is_refused_when_the_hook_is_built(tmp_path):
    # It stopped the run mid-way with a bare pathlib OSError that never named the hook.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(
        ValueError, match=r"profile\(\): cannot write into .*a-file/traces: .*a-file is a file"
    ):
        fl.hooks.profile(blocker / "traces", start=1, steps=1)


# -- writers -------------------------------------------------------------------------------------------


def _log_run(writer: object, step, start: int = 0, end: int = 3) -> fl.TrainState:
    batches = fl.data.resumable([None])
    return fl.run(fl.TrainState(max_iter=end, iteration=start), step, batches, [fl.hooks.log(writer)])


@pytest.mark.parametrize(("make", "what"), [(fl.writers.csv, "column"), (fl.writers.jsonl, "key")])
def test_a_metric_named_iteration_is_refused_by_the_file_writers(tmp_path, make, what):
    # It overwrote the iteration of each row, and a resume then cut every earlier row away.
    path = tmp_path / "metrics"
    step = lambda s, b: fl.record(s, loss=1.0, iteration=10.0 * s.iteration)  # noqa: E731
    with pytest.raises(
        ValueError,
        match=rf"{make.__name__}\('.*metrics'\): a metric is named 'iteration', .* {what} .*another name",
    ):
        _log_run(make(path), step)


def test_a_resume_over_a_csv_file_it_did_not_write_is_refused_and_leaves_the_file(tmp_path):
    # It appended rows without an iteration under the file's own columns.
    path = tmp_path / "data.csv"
    path.write_text("a,b\n1,2\n3,4\n")
    step = lambda s, b: fl.record(s, loss=1.0)  # noqa: E731
    with pytest.raises(
        ValueError, match=r"csv\('.*data.csv'\): .*first column is 'a', not 'iteration'.*another path"
    ):
        _log_run(fl.writers.csv(path), step, start=2, end=4)
    assert path.read_text() == "a,b\n1,2\n3,4\n"


@pytest.mark.parametrize("make", [fl.writers.csv, fl.writers.jsonl])
def test_a_file_writer_refuses_a_path_no_run_could_write_when_it_is_built(tmp_path, make):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"'path' holds a NUL byte at position 3 .*give the path without it"):
        make("run\0/metrics")
    with pytest.raises(
        ValueError, match=rf"{make.__name__}\('.*a-file/m'\): cannot write a file there: .*a-file is a file"
    ):
        make(blocker / "m")
    with pytest.raises(ValueError, match=r"cannot write a file there: .* is a directory, not a file"):
        make(tmp_path)


def test_tensorboard_refuses_a_log_directory_no_run_could_write_when_it_is_built(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"tensorboard\(\): 'logdir' holds a NUL byte"):
        fl.writers.tensorboard("runs\0")
    with pytest.raises(
        ValueError, match=r"tensorboard\('.*a-file'\): cannot write a directory there: .*a-file is a file"
    ):
        fl.writers.tensorboard(blocker)


# -- data ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("abc", r"gives its characters"),
        (b"abc", r"gives its characters"),
        ({"x": torch.ones(2)}, r"iterating a dict gives its keys.*list\(source.values\(\)\)"),
        ({1, 2}, r"a set has no order.*sorted\(source\)"),
    ],
    ids=["str", "bytes", "dict", "set"],
)
def test_resumable_refuses_a_source_whose_iteration_is_no_batches(source, why):
    # A str gave its characters and a dict its keys, one "batch" each.
    with pytest.raises(TypeError, match=rf"resumable: the source must be a re-iterable of batches .*{why}"):
        fl.data.resumable(source)


def test_resumable_refuses_an_empty_source_when_built():
    with pytest.raises(ValueError, match=r"resumable: the source is empty \(got \[\] that is a list\)"):
        fl.data.resumable([])


def _stateful_loader(workers: int):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    return stateful.StatefulDataLoader(torch.arange(16.0), batch_size=2, num_workers=workers)


def test_a_loader_position_resumed_with_another_number_of_workers_names_both():
    # torchdata refused it with a bare AssertionError, at the first batch of the resumed run.
    seen = lambda s, b: fl.record(s, x=b.sum())  # noqa: E731
    half = fl.run(fl.TrainState(max_iter=3), seen, fl.data.resumable(_stateful_loader(2)))
    assert type(half.data) is dict
    with pytest.raises(
        ValueError,
        match=r"resumable: the StatefulDataLoader refused the position saved in state.data \(epoch 0\).*"
        r"saved by a loader with num_workers=2, and this one has num_workers=0\. Build the loader with "
        r"num_workers=2 to resume",
    ):
        fl.run(attrs.evolve(half, max_iter=5), seen, fl.data.resumable(_stateful_loader(0)))


def _stream(seed: int) -> fl.data.Batches:
    return fl.data.batches(torch.arange(8.0).reshape(8, 1), batch_size=2, seed=seed)


@pytest.mark.parametrize(
    ("streams", "error", "match"),
    [
        (5, TypeError, r"per_member\(streams\) expects a non-empty list .*\(got 5 that is an int\)"),
        ([], ValueError, r"per_member\(streams\) expects a non-empty list .*\(got an empty tuple\)"),
        ({"a": None}, TypeError, r"per_member\(streams\) expects .*that is a dict\)"),
        ([[1.0], [2.0]], TypeError, r"streams\[0\] is not a resumable stream.*fnloop\.data\.resumable"),
    ],
    ids=["int", "empty", "dict", "lists"],
)
def test_per_member_names_what_is_not_a_list_of_streams(streams, error, match):
    with pytest.raises(error, match=match):
        fl.data.per_member(streams)


def _member(seed: int) -> fl.TrainState:
    torch.manual_seed(seed)
    return fl.init(torch.nn.Linear(1, 1), fl.optim.sgd(0.1), seed=seed, max_iter=2)


def _member_step():
    return fl.train_step(
        torch.nn.Linear(1, 1), lambda f, b: f(b).pow(2).mean(), fl.optim.sgd(0.1), compile=False
    )


@pytest.mark.parametrize("count", [1, 3])
def test_per_member_with_another_number_of_streams_than_members_is_refused_at_the_first_batch(count):
    # Three streams for two members were ignored silently; one gave an IndexError from inside the step.
    population = fl.population(_member, seeds=[0, 1])
    streams = fl.data.per_member([_stream(s) for s in range(count)])
    with pytest.raises(
        ValueError,
        match=rf"train_step at iteration 0: .*the population has 2 members, but .* shape \({count}, 2, 1\) "
        rf"has rows for {count} members?\. Give fnloop\.data\.per_member one stream per member, 2 in all",
    ):
        fl.run(population, _member_step(), streams)


def test_per_member_batches_given_to_a_single_run_are_refused():
    with pytest.raises(ValueError, match=r"train_step: a PerMember batch .* this state is a single run's"):
        fl.run(_member(0), _member_step(), fl.data.per_member([_stream(0), _stream(1)]))


# -- populations -----------------------------------------------------------------------------------------


def _injected_member(seed: int, lr: float = 0.1) -> fl.TrainState:
    torch.manual_seed(seed)
    return fl.init(torch.nn.Linear(1, 1), fl.optim.inject(fl.optim.sgd, lr=lr), seed=seed, max_iter=4)


@pytest.mark.parametrize(
    ("seeds", "error", "match"),
    [
        (5, TypeError, r"expects one seed per member, a list .*seeds=range\(8\) \(got 5 that is an int\)"),
        ("01", TypeError, r"expects one seed per member.*\(got '01' that is a str\)"),
        ({0, 1}, TypeError, r"expects one seed per member.*\(got \{0, 1\} that is a set\)"),
        (["a"], ValueError, r"'seeds\[0\]' must be a non-negative int \(got 'a' that is a str\)"),
        ([0, -1], ValueError, r"'seeds\[1\]' must be a non-negative int \(got -1 that is an int\)"),
        ([], ValueError, r"it needs at least one \(got an empty list\)"),
    ],
    ids=["int", "str", "set", "str-seed", "negative", "empty"],
)
def test_population_names_seeds_that_are_not_one_per_member(seeds, error, match):
    # seeds=5 gave "'int' object is not iterable"; ['a'] was accepted by an init that ignores it.
    with pytest.raises(error, match=match):
        fl.population(lambda seed: _injected_member(0 if seed == "a" else seed), seeds=seeds)


def test_population_names_an_init_that_is_no_function():
    with pytest.raises(TypeError, match=r"population\(init, \.\.\.\) expects init to be a function .*got 5"):
        fl.population(5, seeds=[0])


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda pop: fl.member(42, 0),
            TypeError,
            r"member\(state, i\) expects a population's fnloop\.TrainState \(got 42",
        ),
        (
            lambda pop: fl.members(None),
            TypeError,
            r"members\(state\) expects a population's fnloop\.TrainState \(got None",
        ),
        (
            lambda pop: fl.member(pop, "1"),
            TypeError,
            r"i must be an int, a member's index from 0 to 1 \(got '1'",
        ),
        (
            lambda pop: fl.member(pop, 2),
            IndexError,
            r"the population has members 0 to 1 \(got 2 that is an int\)",
        ),
    ],
    ids=["int-state", "none-state", "str-index", "past-the-end"],
)
def test_member_names_what_is_not_a_population_or_a_member(call, error, match):
    # member(42, 0) gave "'int' object has no attribute 'population'".
    with pytest.raises(error, match=match):
        call(fl.population(_injected_member, seeds=[0, 1]))


def test_ema_params_names_what_is_not_a_state_or_a_name():
    # ema_params(42) gave "'int' object has no attribute 'hooks'".
    with pytest.raises(TypeError, match=r"ema_params\(state, name\) expects a fnloop\.TrainState \(got 42"):
        fl.hooks.ema_params(42)
    with pytest.raises(TypeError, match=r"name must be the name= of an ema hook, a non-empty str \(got 5"):
        fl.hooks.ema_params(fl.TrainState(max_iter=1), 5)


# -- checkpoints -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "where", "name"),
    [
        (lambda p: checkpoint.resume(p, like=TrainState(max_iter=1)), "resume", "directory"),
        (lambda p: checkpoint.latest(p, like=TrainState(max_iter=1)), "latest", "directory"),
        (lambda p: checkpoint.checkpoints(p), "checkpoints", "directory"),
        (lambda p: checkpoint.path_for(p, 1), "path_for", "directory"),
        (lambda p: checkpoint.save(TrainState(max_iter=1), p), "save", "path"),
        (lambda p: checkpoint.load(p, like=TrainState(max_iter=1)), "load", "path"),
        (lambda p: checkpoint.read_raw(p), "read_raw", "path"),
    ],
    ids=["resume", "latest", "checkpoints", "path_for", "save", "load", "read_raw"],
)
def test_the_checkpoint_functions_name_a_path_that_is_none_or_empty(call, where, name):
    # resume(None, ...) read the checkpoints of the current directory (os.listdir(None)); resume("", ...)
    # never found one; 123 gave "expected str, bytes or os.PathLike object, not int".
    with pytest.raises(TypeError, match=rf"{where}\(\): '{name}' must be a str or os.PathLike \(got None"):
        call(None)
    with pytest.raises(TypeError, match=rf"{where}\(\): '{name}' must be a str or os.PathLike \(got 123"):
        call(123)
    with pytest.raises(ValueError, match=rf"{where}\(\): '{name}' is empty; give the path"):
        call("")


def test_save_names_a_nul_byte_in_its_path(tmp_path):
    with pytest.raises(ValueError, match=r"save\(\): 'path' holds a NUL byte at position"):
        checkpoint.save(TrainState(max_iter=1), f"{tmp_path}/a\0b")


@pytest.mark.parametrize(
    "make", [fl.hooks.checkpoint, lambda d: fl.hooks.best_checkpoint(d, "loss")], ids=["checkpoint", "best"]
)
def test_a_checkpoint_hook_refuses_a_directory_under_a_file_when_it_is_built(tmp_path, make):
    # Accepted when built, the first save failed with a bare FileExistsError.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(
        ValueError, match=r"checkpoint\(\) cannot write into the directory .*a-file/ckpt'.*a-file is a file"
    ):
        make(blocker / "ckpt")
    with pytest.raises(ValueError, match=r"checkpoint\(\): 'directory' holds a NUL byte"):
        make("ckpt\0")
    with pytest.raises(
        TypeError, match=r"checkpoint\(\): 'directory' must be a str or os.PathLike \(got 123"
    ):
        make(123)


@pytest.mark.parametrize(
    ("dataset", "match"),
    [
        (
            {"x": torch.ones(4), "y": torch.ones(4)},
            r"a dict dataset is read as dataset\[i\] .*keys are 'x', 'y'",
        ),
        ("abcd", r"the dataset is a str, whose samples would be its characters"),
    ],
    ids=["dict-of-columns", "str"],
)
def test_batches_refuses_a_dataset_not_indexed_by_sample_when_built(dataset, match):
    # A dict of columns was accepted and failed with KeyError: 0 at the first batch; a str gave characters.
    with pytest.raises(TypeError, match=rf"fnloop\.data\.batches: {match}"):
        fl.data.batches(dataset, batch_size=2, seed=0)
