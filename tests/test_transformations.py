"""A transformation of the step's kernel, written as a contributor would, composes with the others.

The worked example of ``docs/architecture.md#adding-a-transformation``:
``with_update_size`` wraps the update stage to record the size of each
update. Given to the kernel, it holds in a single run, eager and compiled,
in every member of a population as in that member's solo run, and in several
steps per call as in single steps, with no change to the step itself.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fnloop as fl
from fnloop._step.build import step_of
from fnloop._step.kernel import Kernel, Updated

STEPS = 4
DATA = (torch.randn(32, 4, generator=torch.Generator().manual_seed(0)), torch.randint(0, 2, (32,)))


def with_update_size(update):
    """The update stage, also recording the L2 norm of the change it makes to the parameters."""

    def measured(grads, opt_state, params, iteration, total=None) -> Updated:
        found = update(grads, opt_state, params, iteration, total)
        squares = sum((found.trained[k] - params[k]).float().square().sum() for k in found.trained)
        if total is not None:  # a sharded step: each rank changed its own chunks
            squares = total(squares)
        return found._replace(metrics={**found.metrics, "update_size": squares.sqrt()})

    return measured


def model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2)
    )


def loss_fn(forward, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(forward(x), y)


def optimizer(lr: float = 1e-2) -> fl.optim.Optimizer:
    return fl.optim.inject(fl.optim.adam, lr=lr)


def init(seed: int, lr: float = 1e-2) -> fl.TrainState:
    torch.manual_seed(seed)
    return fl.init(model(), optimizer(lr), seed=seed, max_iter=STEPS)


@functools.cache
def step(compile: bool, steps_per_call: int = 1) -> fl.Step:
    kernel = Kernel(model(), loss_fn, optimizer(), transforms=(with_update_size,), eager=not compile)
    return step_of(kernel, compile=compile, steps_per_call=steps_per_call)


def stream() -> fl.data.Batches:
    return fl.data.batches(DATA, batch_size=8, seed=0)


def sizes(state: fl.TrainState, name: str = "update_size") -> list[torch.Tensor]:
    return [v for _, v in state.metrics.series[name]]


@pytest.mark.parametrize("compile", [False, True])
def test_the_update_size_is_the_norm_of_the_change_each_step_makes(compile: bool) -> None:
    states = list(fl.scan(init(0), step(compile), stream()))[:STEPS]  # then the final state, again
    before = [init(0), *states[:-1]]
    for old, new in zip(before, states):
        change = torch.cat([(new.params[k] - old.params[k]).flatten() for k in new.params]).norm()
        recorded = new.metrics.series["update_size"][-1]
        assert recorded[0] == old.iteration  # recorded at the step's own index; the fold then advances
        torch.testing.assert_close(recorded[1], change, rtol=1e-5, atol=1e-7)
    assert all(float(s) > 0 for s in sizes(states[-1]))


@pytest.mark.parametrize("compile", [False, True])
def test_every_member_of_a_population_records_the_update_size_of_its_solo_run(compile: bool) -> None:
    seeds, lrs = [0, 1], [1e-2, 3e-2]
    final = fl.run(fl.population(init, seeds=seeds, lr=lrs), step(compile), stream())
    for m, (seed, lr) in enumerate(zip(seeds, lrs)):
        alone = fl.run(init(seed, lr), step(compile), stream())
        mine = fl.member(final, m)
        assert mine.metrics.names == alone.metrics.names == ("loss", "lr", "update_size")
        if compile:  # vmapped kernels round otherwise than the solo ones, in the last bits
            torch.testing.assert_close(
                torch.stack(sizes(mine)), torch.stack(sizes(alone)), rtol=1e-5, atol=1e-7
            )
        else:  # eager, each member's own step: bit for bit
            assert [float(v) for v in sizes(mine)] == [float(v) for v in sizes(alone)]
    assert sizes(fl.member(final, 0)) != sizes(fl.member(final, 1))


def test_two_steps_per_call_record_the_update_sizes_of_single_steps_bit_for_bit() -> None:
    single = fl.run(init(0), step(True), stream())
    several = fl.run(init(0), step(True, 2), stream())
    assert [i for i, _ in single.metrics.series["update_size"]] == list(range(STEPS))
    assert [(i, float(v)) for i, v in several.metrics.series["update_size"]] == [
        (i, float(v)) for i, v in single.metrics.series["update_size"]
    ]
    for name in single.params:
        assert torch.equal(several.params[name], single.params[name]), name
