"""Resume equals no resume: a run cut at any step and resumed from its checkpoint ends bit-identical.

The runs are generated: a tiny model with dropout, AdamW with a warmup-cosine
schedule, the resumable data stream, several stateful hooks in random order and
the checkpoint hook at a random position among them. The step is compiled once
for the module.
"""

from __future__ import annotations

import functools
import tempfile

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fnloop as fl
from fnloop import Phase, testing

MAX_ITER = 14


@functools.cache
def job():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(16, 3)
    )
    optimizer = fl.optim.adamw(fl.optim.warmup(fl.optim.cosine(0.02, MAX_ITER), 3), weight_decay=0.05)

    def loss_fn(forward, batch):
        x, y = batch
        logits = forward(x)
        return torch.nn.functional.cross_entropy(logits, y), {"acc": (logits.argmax(1) == y).float().mean()}

    data = (
        torch.randn(40, 4, generator=torch.Generator().manual_seed(1)),
        torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(2)),
    )
    step = fl.train_step(model, loss_fn, optimizer)
    # Compile once here, outside any example's deadline.
    fl.run(fl.init(model, optimizer, seed=0, max_iter=1), step, [(data[0][:8], data[1][:8])])
    return model, optimizer, step, data


@pytest.fixture(autouse=True, scope="module")
def _compiled():
    job()


def fresh_template():
    model, optimizer, _, _ = job()
    return fl.init(model, optimizer, seed=11, max_iter=MAX_ITER)


def stream():
    return fl.data.batches(job()[3], batch_size=8, seed=5)  # 5 batches an epoch: resumes cross epochs


def sum_of_losses(state, phase, total):
    # A hook whose memory holds a tensor derived from the step's output.
    if phase is Phase.AFTER_STEP:
        return state, total + state.metrics.latest("loss")[1]
    return state, total


def record_norm(state, phase):
    if phase is Phase.AFTER_STEP:
        return fl.record(state, norm=torch.linalg.vector_norm(state.params["0.weight"]))
    return state


def step_log(state, phase, log):
    return state, (*log, (phase.name, state.iteration))


HOOKS = {
    "counter": lambda: testing.counter("steps"),
    "every3": lambda: fl.every(3, testing.counter("every3")),
    "losses": lambda: fl.stateful("losses", torch.zeros(()), sum_of_losses),
    "norm": lambda: record_norm,
    "log": lambda: fl.on({Phase.BEFORE_STEP, Phase.AFTER_STEP}, fl.stateful("log", (), step_log)),
    "best": lambda: None,  # replaced by best_checkpoint in the test, it needs a directory
}


@given(
    hooks=st.permutations(sorted(HOOKS)),
    position=st.integers(0, len(HOOKS)),
    k=st.integers(1, MAX_ITER - 1),
)
def test_resume_from_any_step_equals_the_uninterrupted_run(hooks, position, k):
    _model, _optimizer, step, _ = job()
    with tempfile.TemporaryDirectory() as tmp:

        def chain(directory):
            made = [
                HOOKS[h]() if h != "best" else fl.hooks.best_checkpoint(directory, "norm", "max")
                for h in hooks
            ]
            made.insert(position, fl.hooks.checkpoint(f"{directory}/ckpt", keep=None))
            return made

        zero = lambda: 0.0  # noqa: E731
        whole = fl.run(fresh_template(), step, stream(), chain(f"{tmp}/whole"), clock=zero)

        saved = fl.load(fl.checkpoint.path_for(f"{tmp}/whole/ckpt", k), like=fresh_template())
        assert saved.iteration == k and saved.data == k
        resumed = fl.run(saved, step, stream(), chain(f"{tmp}/resumed"), clock=zero)
        testing.assert_identical(resumed, whole)


def test_latest_resumes_exactly_after_the_run_was_cut(tmp_path):
    _, _, step, _ = job()

    def hooks(directory):
        return [testing.counter("steps"), fl.every(4, fl.hooks.checkpoint(directory, keep=2))]

    zero = lambda: 0.0  # noqa: E731
    whole = fl.run(fresh_template(), step, stream(), hooks(tmp_path / "whole"), clock=zero)

    cut = fl.run(
        attrs.evolve(fresh_template(), max_iter=9), step, stream(), hooks(tmp_path / "cut"), clock=zero
    )
    assert cut.iteration == 9
    resumed_from = fl.checkpoint.latest(tmp_path / "cut", like=fresh_template())
    assert resumed_from.iteration == 9  # every(4) saved at 4 and 8, AFTER_TRAIN saved 9
    final = fl.run(
        attrs.evolve(resumed_from, max_iter=MAX_ITER), step, stream(), hooks(tmp_path / "cut"), clock=zero
    )
    testing.assert_identical(final, whole)
