"""Populations: members stacked in one state, stepped by one vmapped graph, each an ordinary run.

The compiled steps are shared by the module (one graph for solo runs, one for
the population of ``P`` members, one for per-member batches), so most tests
cost a few eager or compiled steps.
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fnloop as fl
from fnloop import Phase

P = 3
STEPS = 8


def model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3)
    )


def loss_fn(forward, batch):
    x, y = batch
    logits = forward(x)
    return torch.nn.functional.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def optimizer(lr: float = 1e-3, wd: float = 0.0) -> fl.optim.Optimizer:
    return fl.optim.inject(
        lambda lr, wd: fl.optim.adamw(fl.optim.cosine(lr, 20), weight_decay=wd), lr=lr, wd=wd
    )


def init(seed: int, lr: float, wd: float, max_iter: int = STEPS) -> fl.TrainState:
    torch.manual_seed(seed)
    return fl.init(model(), optimizer(lr, wd), seed=seed, max_iter=max_iter)


DATA = (torch.randn(64, 5, generator=torch.Generator().manual_seed(0)), torch.randint(0, 3, (64,)))
LRS, WDS, SEEDS = [1e-2, 3e-3, 3e-2], [0.0, 0.1, 0.01], [0, 1, 2]


def stream(seed: int = 0) -> fl.data.Batches:
    return fl.data.batches(DATA, batch_size=16, seed=seed)


@functools.cache
def step(compile: bool) -> fl.Step:
    return fl.train_step(model(), loss_fn, optimizer(), compile=compile)


def furthest(a: fl.TrainState, b: fl.TrainState) -> float:
    return max((a.params[k] - b.params[k]).abs().max().item() for k in a.params)


def losses(state: fl.TrainState, name: str = "loss") -> list[float]:
    return [float(v) for _, v in state.metrics.series[name]]


def population(max_iter: int = STEPS, seeds=SEEDS, lrs=LRS, wds=WDS) -> fl.TrainState:
    return fl.population(functools.partial(init, max_iter=max_iter), seeds=seeds, lr=lrs, wd=wds)


@pytest.fixture(scope="module")
def trained() -> fl.TrainState:
    """The compiled population, STEPS steps."""
    return fl.run(population(), step(True), stream(), [])


def test_a_population_state_stacks_its_members_and_names_them() -> None:
    pop = population()
    assert pop.population == fl.Population(
        seeds=(0, 1, 2),
        labels=tuple(f"lr={lr:g}, wd={wd:g}" for lr, wd in zip(LRS, WDS)),
        stopped=(-1, -1, -1),
    )
    assert pop.params["0.weight"].shape == (P, 16, 5)
    hyper = pop.opt_state.hyperparams
    assert hyper["lr"].tolist() == LRS and hyper["wd"].tolist() == WDS
    for m in range(P):
        alone = init(SEEDS[m], LRS[m], WDS[m])
        assert all(torch.equal(fl.member(pop, m).params[k], alone.params[k]) for k in alone.params)


@pytest.mark.parametrize("compile", [True, False])
def test_each_member_of_a_population_run_equals_the_member_trained_alone(trained, compile: bool) -> None:
    final = trained if compile else fl.run(population(), step(False), stream(), [])
    for m in range(P):
        alone = fl.run(init(SEEDS[m], LRS[m], WDS[m]), step(compile), stream(), [])
        mine = fl.member(final, m)
        assert mine.iteration == alone.iteration == STEPS and mine.population is None and mine.rng == SEEDS[m]
        assert mine.metrics.names == alone.metrics.names == ("loss", "lr", "acc")
        if compile:  # vmapped kernels round otherwise than the solo ones, in the last bits
            assert furthest(mine, alone) < 1e-6
            assert max(abs(a - b) for a, b in zip(losses(mine), losses(alone))) < 1e-6
        else:  # eager, each member's own step: bit for bit
            assert furthest(mine, alone) == 0 and losses(mine) == losses(alone)
        assert losses(mine, "lr") == pytest.approx(losses(alone, "lr"), rel=1e-12)
    assert step(compile).compiles == (2 if compile else 0)  # one graph for the population, one for solo runs


@settings(max_examples=6, deadline=None)
@given(
    seeds=st.lists(st.integers(0, 2**31), min_size=P, max_size=P, unique=True),  # twins are refused
    lrs=st.lists(st.floats(1e-4, 0.1), min_size=P, max_size=P),
    wds=st.lists(st.floats(0.0, 0.2), min_size=P, max_size=P),
)
def test_property_a_member_equals_its_solo_run_for_any_seeds_and_hyperparameters(seeds, lrs, wds) -> None:
    final = fl.run(population(4, seeds, lrs, wds), step(True), stream(), [])
    for m in range(P):
        alone = fl.run(init(seeds[m], lrs[m], wds[m], 4), step(True), stream(), [])
        assert furthest(fl.member(final, m), alone) < 1e-6
        assert max(abs(a - b) for a, b in zip(losses(fl.member(final, m)), losses(alone))) < 1e-6


def test_members_draw_their_own_dropout_and_differ_from_one_another(trained) -> None:
    # Same seed, same dropout masks: members differing only by their weight decay, which does not act
    # before the first update, take the same first step; then they part.
    alike = fl.run(population(1, [5, 5, 5], [1e-2] * 3, [0.0, 0.1, 0.2]), step(True), stream(), [])
    assert all(losses(fl.member(alike, m)) == losses(fl.member(alike, 0)) for m in range(P))
    assert len({tuple(losses(fl.member(trained, m))) for m in range(P)}) == P
    # Same seed and same hyperparameters: one run twice, refused.
    with pytest.raises(
        ValueError, match=r"members 0 and 1 are alike \(seed 5, lr=0.01, wd=0.0\).*seeds=range"
    ):
        population(4, [5, 5, 5], [1e-2] * 3, [0.0] * 3)


@pytest.mark.parametrize("compile", [True, False])
def test_each_member_trains_on_its_own_data_order_with_per_member_batches(compile: bool) -> None:
    streams = [stream(seed=10 + m) for m in range(P)]
    own = fl.train_step(model(), loss_fn, optimizer(), compile=compile)  # its batches make another graph
    final = fl.run(population(4), own, fl.data.per_member(streams), [])
    assert final.data == 4
    for m in range(P):
        alone = fl.run(init(SEEDS[m], LRS[m], WDS[m], 4), own, streams[m], [])
        assert furthest(fl.member(final, m), alone) <= (1e-6 if compile else 0)


def test_a_member_is_an_ordinary_run_that_goes_on_alone_exports_and_saves(trained, tmp_path: Path) -> None:
    half = fl.run(population(4), step(True), stream(), [])
    mine = fl.member(half, 1)
    longer = fl.run(
        attrs_evolve(mine, max_iter=STEPS), step(True), stream(), []
    )  # goes on from 4 to 8, alone
    assert furthest(longer, fl.member(trained, 1)) < 1e-6
    net = model()
    net.load_state_dict(fl.state_dict(longer))
    fl.save(longer, tmp_path / "one.safetensors")
    back = fl.load(tmp_path / "one.safetensors", like=init(1, LRS[1], WDS[1]))
    assert furthest(back, longer) == 0 and back.opt_state.hyperparams["lr"].item() == LRS[1]


def attrs_evolve(state, **changes):
    import attrs

    return attrs.evolve(state, **changes)


@pytest.fixture(scope="module")
def every_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled population's run, checkpointed after every step."""
    directory = tmp_path_factory.mktemp("every") / "ckpt"
    fl.run(population(), step(True), stream(), [fl.every(1, fl.hooks.checkpoint(directory, keep=None))])
    return directory


@settings(max_examples=5, deadline=None)
@given(at=st.integers(1, STEPS - 1))
def test_property_a_population_checkpoint_resumes_bit_exact_at_any_iteration(
    trained, every_step, at: int
) -> None:
    resumed_from = fl.load(every_step / f"ckpt-{at:08d}.safetensors", like=population())
    assert resumed_from.iteration == at and resumed_from.population == population().population
    final = fl.run(resumed_from, step(True), stream(), [])
    assert all(torch.equal(final.params[k], trained.params[k]) for k in trained.params)
    assert all(losses(final, f"loss/{m}") == losses(trained, f"loss/{m}") for m in range(P))


@pytest.mark.parametrize("compile", [True, False])
def test_evaluate_evaluates_every_member_in_one_call(trained, compile: bool) -> None:
    evaluation = fl.eval_step(model(), lambda f, b: {"loss": loss_fn(f, b)[0]}, compile=compile)
    val = [(DATA[0][:32], DATA[1][:32]), (DATA[0][32:], DATA[1][32:])]
    fn = fl.hooks.mean_over(evaluation, val, prefix="val_")
    values = fn(trained)
    assert sorted(values) == [f"val_loss/{m}" for m in range(P)]
    for m in range(P):
        alone = fn(fl.member(trained, m))["val_loss"]
        assert abs(float(values[f"val_loss/{m}"]) - float(alone)) < 1e-6
    final = fl.run(population(4), step(True), stream(), [fl.every(2, fl.hooks.evaluate(fn))])
    assert [i for i, _ in final.metrics.series["val_loss/2"]] == [1, 3]
    assert [i for i, _ in fl.member(final, 2).metrics.series["val_loss"]] == [1, 3]


def _scores(table: dict[int, list[float]]):
    """A hook recording ``score/m`` from ``table[m]`` at each step: a made-up validation curve per member."""

    def hook(state, phase, /):
        if phase is not Phase.AFTER_STEP:
            return state
        return fl.record(state, **{f"score/{m}": v[state.iteration] for m, v in table.items()})

    return hook


def test_early_stop_stops_each_member_on_its_own_and_the_stopped_ones_stop_changing(tmp_path: Path) -> None:
    # Member 0 stops improving after step 1 and member 1 after step 3 (patience 2); member 2 improves throughout.
    table = {0: [3, 2, 5, 5, 5, 5, 5, 5], 1: [3, 2, 1, 0.5, 4, 4, 4, 4], 2: [8, 7, 6, 5, 4, 3, 2, 1]}
    hooks = [_scores(table), fl.hooks.early_stop("score", patience=2)]
    final = fl.run(population(), step(True), stream(), hooks)
    assert final.population.stopped == (4, 6, -1) and final.iteration == STEPS
    assert [m.best_iteration for m in final.hooks["early_stop:score"]] == [1, 3, 7]
    for m, stop in [(0, 4), (1, 6)]:
        # A stopped member is the run that stopped there: its tensors are those after `stop` steps.
        alone = fl.run(init(SEEDS[m], LRS[m], WDS[m], stop), step(True), stream(), [])
        mine = fl.member(final, m)
        assert mine.iteration == stop and furthest(mine, alone) < 1e-6
        assert [i for i, _ in mine.metrics.series["loss"]] == list(range(stop))
    assert furthest(fl.member(final, 2), fl.run(init(2, LRS[2], WDS[2]), step(True), stream(), [])) < 1e-6


def test_a_population_ends_once_every_member_has_stopped_and_stays_stopped_on_resume(tmp_path: Path) -> None:
    table = {m: [3, 2, 5, 5, 5, 5, 5, 5] for m in range(P)}
    directory = tmp_path / "ckpt"
    hooks = [_scores(table), fl.hooks.early_stop("score", patience=2), fl.hooks.checkpoint(directory)]
    final = fl.run(population(), step(False), stream(), hooks)
    assert final.population.stopped == (4, 4, 4) and final.iteration == 4
    with pytest.warns(fl.checkpoint.RunChanged):  # the template's max_iter is the run's 8
        again = fl.checkpoint.resume(directory, like=population())
    assert fl.run(again, step(False), stream(), hooks).iteration == 4


def test_best_checkpoint_keeps_each_members_best_as_its_own_run(tmp_path: Path) -> None:
    table = {0: [3, 1, 2, 2, 2, 2, 2, 2], 1: [3, 2, 1, 0, 4, 4, 4, 4], 2: [1, 2, 3, 4, 5, 6, 7, 8]}
    hooks = [_scores(table), fl.hooks.best_checkpoint(tmp_path / "best", "score")]
    final = fl.run(population(), step(False), stream(), hooks)
    assert [b.iteration for b in final.hooks["best:score"]] == [1, 3, 0]
    for m, best in [(0, 1), (1, 3), (2, 0)]:
        saved = fl.load(tmp_path / "best" / f"member-{m}" / "best.safetensors", like=init(0, 1.0, 0.0))
        alone = fl.run(init(SEEDS[m], LRS[m], WDS[m], best + 1), step(False), stream(), [])
        assert saved.iteration == best + 1 and saved.population is None and furthest(saved, alone) == 0


def test_tensorboard_writes_one_curve_per_member(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = fl.every(2, fl.hooks.log(fl.writers.tensorboard(tmp_path / "tb")))
    final = fl.run(population(4), step(False), stream(), [log])
    runs = sorted(p.name for p in (tmp_path / "tb").iterdir() if p.is_dir())
    assert runs == [f"member-{m} {label}" for m, label in enumerate(final.population.labels)]
    for m, run in enumerate(runs):
        events = EventAccumulator(str(tmp_path / "tb" / run))
        events.Reload()
        assert set(events.Tags()["scalars"]) == {"loss", "lr", "acc"}
        written = [e.value for e in events.Scalars("loss")]
        assert written == pytest.approx([losses(final, f"loss/{m}")[i] for i in (1, 3)])


def test_a_setting_that_does_not_reach_the_state_is_refused() -> None:
    def plain(seed: int, lr: float) -> fl.TrainState:  # lr is a number of the optimizer, not of the state
        torch.manual_seed(seed)
        return fl.init(model(), fl.optim.adamw(lr), seed=seed, max_iter=4)

    with pytest.raises(ValueError, match=r"does not reach the state.*fnloop\.optim\.inject"):
        fl.population(plain, seeds=[0, 1], lr=[1e-3, 1e-2])


def test_members_that_do_not_fit_one_graph_or_an_init_that_is_not_a_function_of_its_seed_are_refused() -> (
    None
):
    def wide(seed: int, width: int) -> fl.TrainState:
        torch.manual_seed(seed)
        return fl.init(torch.nn.Linear(5, width), optimizer(), seed=seed, max_iter=4)

    with pytest.raises(ValueError, match="member 1 differs from member 0 in the names, shapes"):
        fl.population(wide, seeds=[0, 1], width=[3, 4])

    def unseeded(seed: int) -> fl.TrainState:
        return fl.init(model(), optimizer(), seed=seed, max_iter=4)

    with pytest.raises(ValueError, match="two different states from the same arguments"):
        fl.population(unseeded, seeds=[0, 1])
    with pytest.raises(ValueError, match="one value per member, 3 in all"):
        fl.population(init, seeds=[0, 1, 2], lr=[1e-3], wd=[0.0] * 3)
    with pytest.raises(TypeError, match="not a population"):
        fl.member(init(0, 1e-3, 0.0), 0)
    with pytest.raises(IndexError, match="members 0 to 2"):
        fl.member(population(), 3)


def test_a_non_finite_member_is_named_or_skipped_alone() -> None:
    huge = population(3, lrs=[1e-2, 1e30, 1e-3])
    with pytest.raises(fl.NonFiniteLoss, match=r"member 1 \(lr=1e") as raised:
        fl.run(huge, step(True), stream(), [])
    # Compiled, the step left every member as it was: the run's last state is whole, at iteration 1.
    last = raised.value.state
    assert last.iteration == 1
    assert furthest(fl.member(last, 0), fl.run(init(0, 1e-2, 0.0, 1), step(True), stream(), [])) < 1e-6
    with pytest.raises(fl.NonFiniteLoss, match=r"member 1 \(lr=1e"):
        fl.run(huge, step(False), stream(), [])
    skipping = fl.train_step(model(), loss_fn, optimizer(), compile=False, skip_nonfinite=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        final = fl.run(population(4, lrs=[1e-2, 1e30, 1e-3]), skipping, stream(), [])
    skipped = {m: int(final.metrics.latest(f"skipped/{m}")[1]) for m in range(P)}
    assert skipped[0] == skipped[2] == 0 and skipped[1] > 0
    assert all(math.isfinite(v) for v in losses(final, "loss/0"))


def test_inject_gives_the_numbers_of_the_optimizer_it_builds() -> None:
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    grads = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    plain, injected = fl.optim.adamw(fl.optim.cosine(0.1, 20), weight_decay=0.05), optimizer(0.1, 0.05)
    p1, s1, p2, s2 = params, plain.init(params), params, injected.init(params)
    for i in range(5):
        p1, s1 = plain.update(grads, s1, p1, torch.tensor(i))
        p2, s2 = injected.update(grads, s2, p2, torch.tensor(i))
    assert all(torch.equal(p1[k], p2[k]) for k in params)
    with pytest.raises(TypeError, match="expects a number"):
        fl.optim.inject(fl.optim.sgd, lr=fl.optim.cosine(0.1, 10))


def test_a_model_vmap_cannot_batch_or_activation_checkpointing_is_refused_with_the_fix() -> None:
    class Recurrent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm, self.head = torch.nn.LSTM(5, 8, batch_first=True), torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.lstm(x)[0][:, -1])

    class Checkpointed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = (
                torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU()),
                torch.nn.Linear(16, 3),
            )

        def forward(self, x):
            return self.head(torch.utils.checkpoint.checkpoint(self.body, x[:, 0], use_reentrant=False))

    batch = (torch.randn(8, 4, 5), torch.randint(0, 3, (8,)))
    for build, match in [
        (Recurrent, "vmap cannot batch aten::lstm"),
        (Checkpointed, "cannot checkpoint activations"),
    ]:

        def init(seed: int, build=build) -> fl.TrainState:
            torch.manual_seed(seed)
            return fl.init(build(), optimizer(), seed=seed, max_iter=1)

        pop = fl.population(init, seeds=[0, 1])
        with pytest.raises(TypeError, match=match) as raised:
            fl.train_step(build(), loss_fn, optimizer())(pop, batch)
        assert "compile=False" in str(raised.value)
        eager = fl.train_step(build(), loss_fn, optimizer(), compile=False)(pop, batch)  # the fix works
        assert eager.metrics.names == ("loss/0", "lr/0", "acc/0", "loss/1", "lr/1", "acc/1")


def test_fnloop_inspect_shows_a_population_checkpoint_s_members(tmp_path: Path, capsys) -> None:
    from fnloop.cli import main

    fl.save(population(), tmp_path / "pop.safetensors")
    assert main(["inspect", str(tmp_path / "pop.safetensors")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "population  3 members, 0 stopped: lr=0.01, wd=0; lr=0.003, wd=0.1; lr=0.03, wd=0.01"
    assert "params: 4 tensors, 441 elements, 1.8 kB" in lines


def test_the_step_never_writes_into_the_population_it_is_given_and_donation_changes_no_bit(trained) -> None:
    pop = population()
    before = {k: v.clone() for k, v in pop.params.items()}
    after = step(True)(pop, next(iter(stream())))  # a call from outside the fold: out of place
    assert all(torch.equal(pop.params[k], before[k]) for k in before)
    assert not all(torch.equal(after.params[k], before[k]) for k in before)
    kept = fl.train_step(model(), loss_fn, optimizer(), donate=False)
    undonated = fl.run(population(), kept, stream(), [])  # the fold's own states, never written into
    assert all(torch.equal(undonated.params[k], trained.params[k]) for k in trained.params)
    assert all(losses(undonated, f"loss/{m}") == losses(trained, f"loss/{m}") for m in range(P))


def test_best_checkpoint_keeps_each_members_k_best_as_their_own_runs(tmp_path: Path) -> None:
    table = {0: [3, 1, 2, 2, 2, 2, 2, 2], 1: [3, 2, 1, 0, 4, 4, 4, 4], 2: [1, 2, 3, 4, 5, 6, 7, 8]}
    hooks = [_scores(table), fl.hooks.best_checkpoint(tmp_path / "best", "score", k=2)]
    final = fl.run(population(), step(False), stream(), hooks)
    tops = final.hooks["best:score"]
    assert [top.iterations for top in tops] == [(1, 2), (3, 2), (0, 1)]
    for m, top in enumerate(tops):
        folder = tmp_path / "best" / f"member-{m}"
        assert sorted(p.name for p in folder.glob("*.safetensors")) == sorted(
            ["best.safetensors", *(f"top-{i + 1:08d}.safetensors" for i in top.iterations)]
        )
        for i in top.iterations:
            saved = fl.load(folder / f"top-{i + 1:08d}.safetensors", like=init(0, 1.0, 0.0))
            alone = fl.run(init(SEEDS[m], LRS[m], WDS[m], i + 1), step(False), stream(), [])
            assert saved.population is None and furthest(saved, alone) == 0
