"""One battery over every shipped hook: a good hook in every phase, pure, deterministic, pickled, composed, resumable.

Each hook of ``fnloop.hooks`` is built here by a factory taking a scratch folder, and
run through the same checks:

* ``fnloop.testing.check_hook`` on a realistic state, in every phase: it returns a
  state, leaves its input untouched, is deterministic and behaves the same pickled;
* composed with ``chain`` and ``every`` in a real run;
* the same run twice with the same injected clock gives the same state, bit for bit;
* resume-safe: a run saved to disk halfway, loaded and continued ends in the state an
  uninterrupted run ends in (the fold's clock excepted, which a timer records).

A test also checks that every hook ``fnloop.hooks`` exports is in the battery.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import Phase, testing


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def mse(forward, batch):
    x, y = batch
    return ((forward(x) - y) ** 2).mean()


def val_loss(forward, batch):
    x, y = batch
    return {"val_loss": ((forward(x) - y) ** 2).mean()}


torch.manual_seed(1)
DATA = [(torch.randn(6, 3), torch.randn(6, 2)) for _ in range(4)]
MODEL = model()
OPT = fl.optim.skip_spikes(
    fl.optim.adamw(fl.optim.cosine(0.05, 12)), window=4, warmup=2
)  # stop_on_spikes reads it
STEP = fl.train_step(MODEL, mse, OPT, compile=False)
EVAL = fl.eval_step(MODEL, val_loss, compile=False)


def template(max_iter: int = 12) -> fl.TrainState:
    return fl.init(MODEL, OPT, seed=3, max_iter=max_iter)


Factory = Callable[[Path], fl.Hook]

# Every shipped hook, configured as a user would; `every` where users wrap it.
HOOKS: dict[str, Factory] = {
    "checkpoint": lambda d: fl.every(4, fl.hooks.checkpoint(d / "ckpt")),
    "checkpoint_background": lambda d: fl.every(4, fl.hooks.checkpoint(d / "ckpt_bg", background=True)),
    "best_checkpoint": lambda d: fl.hooks.best_checkpoint(d / "best", "val_loss"),
    "timer": lambda d: fl.hooks.timer(warmup=1),
    "log": lambda d: fl.every(
        3,
        fl.hooks.log(fl.writers.console(), fl.writers.jsonl(d / "m.jsonl"), fl.writers.tensorboard(d / "tb")),
    ),
    "progress": lambda d: fl.hooks.progress(),
    "memory": lambda d: fl.every(2, fl.hooks.memory()),
    "profile": lambda d: fl.hooks.profile(d / "prof", start=2, steps=2),
    "evaluate": lambda d: fl.every(3, fl.hooks.evaluate(fl.hooks.mean_over(EVAL, DATA[:2]))),
    "evaluate_ema": lambda d: fl.every(3, fl.hooks.evaluate(fl.hooks.mean_over(EVAL, DATA[:2]), ema="ema")),
    "early_stop": lambda d: fl.hooks.early_stop("loss", patience=100),
    "ema": lambda d: fl.hooks.ema(0.9),
    "precise_bn": lambda d: fl.every(5, fl.hooks.precise_bn(MODEL, DATA, num_iter=2)),
    "check_replicas": lambda d: fl.every(2, fl.hooks.check_replicas()),
    "throughput": lambda d: fl.every(
        3, fl.hooks.throughput(samples=8, tokens=8 * 16, flops_per_token=1e3, peak=1e9)
    ),
    "stop_on_spikes": lambda d: fl.hooks.stop_on_spikes(3),
}

# Hooks whose checks need another hook beside them (its state, or its metric).
NEEDS: dict[str, list[Factory]] = {
    "evaluate_ema": [HOOKS["ema"]],
    "best_checkpoint": [lambda d: fl.every(3, fl.hooks.evaluate(fl.hooks.mean_over(EVAL, DATA[:2])))],
}

CLOCKED = {"timer"}
"""Hooks that record the fold's clock: a resumed run reads the clock at other moments."""


def hooks_for(name: str, folder: Path) -> list[fl.Hook]:
    return [make(folder) for make in NEEDS.get(name, [])] + [HOOKS[name](folder)]


def ticking() -> Callable[[], float]:
    ticks = iter(range(10_000))
    return lambda: float(next(ticks))


@pytest.fixture(autouse=True)
def quiet_console(caplog):
    caplog.set_level(logging.INFO, logger="fnloop")


def realistic_state() -> fl.TrainState:
    """Half a run in: params, optimizer state, metrics with tensors, hook states."""
    state = fl.run(template(), STEP, DATA * 3, hooks_for("evaluate_ema", Path("/nonexistent")), effects=False)
    return attrs.evolve(state, iteration=6, max_iter=12)


def test_every_exported_hook_is_in_the_battery():
    factories = {
        name
        for name, obj in vars(fl.hooks).items()
        if inspect.isfunction(obj)
        and name in fl.hooks.__all__
        and "hook" in str(inspect.signature(obj).return_annotation).lower()
    }
    covered = {name.removesuffix("_ema") for name in HOOKS}
    assert factories <= covered | {"ema_params", "mean_over", "trace_path", "peak_mib"}, factories - covered


@pytest.mark.parametrize("name", list(HOOKS))
def test_a_good_hook_in_every_phase(name, tmp_path):
    state = realistic_state()
    for hook in hooks_for(name, tmp_path):
        testing.check_hook(hook, state)


@pytest.mark.parametrize("name", list(HOOKS))
def test_composes_with_chain_and_every_in_a_real_run(name, tmp_path):
    hooks = hooks_for(name, tmp_path)
    composed = fl.chain(fl.every(1, fl.chain(*hooks)), fl.identity)
    final = fl.run(template(), STEP, DATA * 3, [composed], clock=ticking())
    assert final.iteration == 12


@pytest.mark.parametrize("name", list(HOOKS))
def test_deterministic_given_the_state_and_the_clock(name, tmp_path):
    a = fl.run(template(), STEP, DATA * 3, hooks_for(name, tmp_path / "a"), clock=ticking(), effects=False)
    b = fl.run(template(), STEP, DATA * 3, hooks_for(name, tmp_path / "b"), clock=ticking(), effects=False)
    if name == "memory":
        # The process's peak RSS may rise between the two runs (it did after the property tests):
        # the same iterations are recorded, not the same peaks.
        assert [i for i, _ in a.metrics.history("max_mem")] == [i for i, _ in b.metrics.history("max_mem")]
        a, b = (attrs.evolve(s, metrics=_without(s.metrics, "max_mem")) for s in (a, b))
    testing.assert_identical(a, b)


def _without(metrics: fl.Metrics, name: str) -> fl.Metrics:
    return fl.Metrics(window=metrics.window, series={k: v for k, v in metrics.series.items() if k != name})


def without_clock(state: fl.TrainState) -> fl.TrainState:
    metrics = {k: v for k, v in state.metrics.series.items() if k not in ("time", "data_time")}
    hooks = {k: v for k, v in state.hooks.items() if k != "timer"}
    return attrs.evolve(
        state, clock=fl.Clock(), hooks=hooks, metrics=fl.Metrics(window=state.metrics.window, series=metrics)
    )


def saver(folder: Path) -> fl.Hook:
    return fl.every(5, fl.hooks.checkpoint(folder / "resume", keep=None))


@pytest.mark.parametrize("name", list(HOOKS))
def test_resume_equals_no_resume(name, tmp_path):
    # The uninterrupted run saves at iteration 5 as it goes; a run resumed from that file, as after a
    # crash, must end where the uninterrupted one ended.
    first, again = tmp_path / "whole", tmp_path / "again"
    whole = fl.run(template(), STEP, DATA * 3, [*hooks_for(name, first), saver(first)], clock=ticking())
    saved = fl.load(fl.checkpoint.path_for(first / "resume", 5), like=template())
    assert saved.iteration == 5
    resumed = fl.run(saved, STEP, (DATA * 3)[5:], [*hooks_for(name, again), saver(again)], clock=ticking())
    if name in CLOCKED:
        whole, resumed = without_clock(whole), without_clock(resumed)
    if name == "throughput":
        # Rates off the clock, which a resumed run reads at other moments: the same iterations are
        # measured, not the same rates (fnloop.testing.without_clock leaves them out).
        assert [i for i, _ in resumed.metrics.history("mfu")] == [i for i, _ in whole.metrics.history("mfu")]
        whole, resumed = testing.without_clock(whole), testing.without_clock(resumed)
    if name == "memory":
        # The process's peak RSS may rise between the two runs (after tests that left it at its
        # peak): the same iterations are recorded, not the same peaks.
        assert [i for i, _ in resumed.metrics.history("max_mem")] == [
            i for i, _ in whole.metrics.history("max_mem")
        ]
        whole, resumed = (attrs.evolve(s, metrics=_without(s.metrics, "max_mem")) for s in (whole, resumed))
    testing.assert_identical(without_time(resumed), without_time(whole))


def without_time(state: fl.TrainState) -> fl.TrainState:
    return attrs.evolve(state, clock=fl.Clock())


def test_the_fold_with_every_hook_at_once(tmp_path):
    hooks = [
        make(tmp_path) for name, make in HOOKS.items() if name not in ("evaluate_ema", "best_checkpoint")
    ]
    hooks += [fl.hooks.best_checkpoint(tmp_path / "best", "val_loss")]
    final = fl.run(template(), STEP, DATA * 3, hooks, clock=ticking())
    assert final.iteration == 12
    assert {"loss", "lr", "time", "val_loss", "max_mem"} <= set(final.metrics.names)
    assert (tmp_path / "m.jsonl").exists() and (tmp_path / "best" / "best.safetensors").exists()


def test_no_hook_syncs_with_the_device_on_a_step_where_it_does_not_write(tmp_path, monkeypatch):
    # A skipping step reads no flag, so every read of a tensor's value here is a hook's.
    step = fl.train_step(MODEL, mse, OPT, compile=False, skip_nonfinite=True)
    reads: list[int] = []
    current = [0]

    def counting(method):
        def read(self, *args, **kwargs):
            reads.append(current[0])
            return method(self, *args, **kwargs)

        return read

    def where(state, phase):
        current[0] = state.iteration
        return state

    for method in ("item", "tolist", "__float__"):
        monkeypatch.setattr(torch.Tensor, method, counting(getattr(torch.Tensor, method)))
    hooks = [
        fl.on(Phase.BEFORE_STEP, where),
        fl.hooks.timer(),
        fl.every(5, fl.hooks.log(fl.writers.console(), fl.writers.jsonl(tmp_path / "m.jsonl"))),
        fl.hooks.progress(),
        fl.every(10, fl.hooks.checkpoint(tmp_path / "ckpt")),
        fl.every(10, fl.hooks.evaluate(fl.hooks.mean_over(EVAL, DATA[:2]))),
        fl.hooks.early_stop("val_loss", patience=100),
        fl.hooks.best_checkpoint(tmp_path / "best", "val_loss"),
        fl.hooks.ema(0.9),
        fl.every(5, fl.hooks.memory()),
    ]
    fl.run(template(20), step, DATA * 5, hooks)
    # Writes at steps 4, 9, 14, 19; evaluations (read by early_stop and best_checkpoint) at 9, 19.
    assert set(reads) <= {4, 9, 14, 19, 20}, sorted(set(reads))
