"""What a run keeps in memory: the state it was given goes once the first step has made the next.

``fl.run(fl.init(...), ...)`` leaves nobody else holding the given state, so its tensors are
freed after the first step (the step made the next state beside it); the fold then hands the
pages glibc keeps back to the system, once per run (``fnloop/_core/memory.py``).
"""

from __future__ import annotations

import weakref

import attrs
import pytest
import torch

import fnloop as fl
from fnloop._core import fold, memory


def _step(state: fl.TrainState, batch: object) -> fl.TrainState:
    return attrs.evolve(state, params={"w": state.params["w"] + 1})  # a new tensor, as a copying step's


def test_the_given_state_is_freed_after_the_first_step_when_its_caller_keeps_none() -> None:
    given = torch.zeros(1000)
    alive = weakref.ref(given)
    seen: list[bool] = []

    def watch(state: fl.TrainState, phase: fl.Phase) -> fl.TrainState:
        if phase is fl.Phase.AFTER_STEP:
            seen.append(alive() is not None)
        return state

    given_up = [fl.TrainState(max_iter=3, params={"w": given})]
    del given
    final = fl.run(given_up.pop(), _step, [0, 0, 0], [watch])  # the run holds the only reference
    assert final.iteration == 3 and torch.equal(final.params["w"], torch.full((1000,), 3.0))
    # Held while the first iteration's hooks run (the fold can still fall back to it), gone after.
    assert seen == [True, False, False]


def test_a_state_its_caller_keeps_stays_as_it_was() -> None:
    state = fl.TrainState(max_iter=3, params={"w": torch.zeros(4)})
    fl.run(state, _step, [0, 0, 0])
    assert torch.equal(state.params["w"], torch.zeros(4))


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(fold, "hand_back_freed", lambda: calls.append(1))
    return calls


@pytest.fixture(scope="module")
def eager() -> tuple[torch.nn.Module, fl.optim.Optimizer, fl.TrainStep]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = fl.optim.sgd(0.1)
    loss = lambda forward, batch: forward(batch).square().mean()  # noqa: E731
    return model, opt, fl.train_step(model, loss, opt, compile=False)


def test_the_pages_are_handed_back_once_per_run_after_the_copying_first_step(monkeypatch, eager) -> None:
    model, opt, step = eager
    calls = _counted(monkeypatch)
    fl.run(fl.init(model, opt, seed=0, max_iter=4), step, [torch.ones(3, 4)] * 4)
    assert calls == [1]


def test_a_donated_first_step_copies_nothing_and_nothing_is_handed_back(monkeypatch, eager) -> None:
    model, opt, step = eager
    calls = _counted(monkeypatch)
    fl.run(fl.init(model, opt, seed=0, max_iter=4), step, [torch.ones(3, 4)] * 4, donate_input=True)
    assert calls == []


def test_handing_back_runs_where_there_is_glibc() -> None:
    memory.hand_back_freed()  # never fails; on glibc it calls malloc_trim(0)
    import platform

    if platform.libc_ver()[0] == "glibc":
        assert memory._trim() is not None
