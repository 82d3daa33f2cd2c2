"""Bit for bit at any thread count: ``train_step(..., deterministic=True)``, and the warning without it.

A compiled graph that adds into a tensor at indices known only when it runs
(an embedding's gradient) varies from run to run with several CPU threads;
measured on the models suite at two threads, GPT-2, Llama, BERT and
Qwen2-MoE differed run to run compiled (up to 7e-8 after 6 steps), every
model was identical eager, and every one was identical compiled under
torch's deterministic algorithms (see docs/replay.md).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fnloop as fl
from fnloop import testing

VOCAB, STEPS = 32, 6


class Bag(torch.nn.Module):
    """Token embeddings, averaged, then a linear head: its gradient adds rows at the tokens' indices."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


def loss_fn(forward, ids):
    return torch.nn.functional.cross_entropy(forward(ids), ids[:, 0])


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (64, 8), generator=gen) for _ in range(STEPS)]


def model() -> Bag:
    torch.manual_seed(0)
    return Bag()


OPT = fl.optim.adamw(1e-2)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def start(n: int = STEPS) -> fl.TrainState:
    return fl.init(model(), OPT, seed=0, max_iter=n)


@pytest.mark.xdist_group("determinism")
def test_a_compiled_step_whose_additions_vary_warns_once_naming_the_op_and_the_fix(two_threads):
    step = fl.train_step(model(), loss_fn, OPT)
    with pytest.warns(
        UserWarning, match=r"index_put.*with 2 CPU threads.*deterministic=True.*set_num_threads\(1\)"
    ):
        fl.run(start(), step, batches())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl.run(start(), step, batches())  # once a step
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl.run(start(), fl.train_step(model(), loss_fn, OPT), batches())  # one thread: the order is fixed


@pytest.mark.xdist_group("determinism")
def test_deterministic_runs_are_identical_at_two_threads_and_a_resume_equals_the_whole_run(
    two_threads, tmp_path
):
    step = fl.train_step(model(), loss_fn, OPT, deterministic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = fl.run(start(), step, batches())
    assert not torch.are_deterministic_algorithms_enabled()  # the step's setting ends with it
    for _ in range(3):
        testing.assert_identical(fl.run(start(), step, batches()).params, first.params)
    half = fl.run(start(3), step, batches()[:3])
    fl.save(half, tmp_path / "half.safetensors")
    resumed = fl.load(tmp_path / "half.safetensors", like=start())
    resumed = fl.run(fl.TrainState(**{**resumed.__dict__, "max_iter": STEPS}), step, batches()[3:])
    for field in ("params", "opt_state", "metrics", "rng"):
        testing.assert_identical(getattr(resumed, field), getattr(first, field))


def test_deterministic_must_be_a_bool():
    with pytest.raises(TypeError, match=r"'deterministic' must be a bool"):
        fl.train_step(model(), loss_fn, OPT, deterministic=1)


@pytest.mark.xdist_group("determinism")
def test_a_deterministic_run_replays_bit_for_bit_at_two_threads(two_threads, tmp_path):
    step = fl.train_step(model(), loss_fn, OPT, deterministic=True)
    log = tmp_path / "fingerprints.jsonl"
    fl.run(start(), step, batches(), [fl.replay.fingerprints(log)])
    report = fl.replay.replay(start(), step, batches(), [], fl.replay.read_log(log))
    assert report.divergence is None
    assert report.compared == STEPS
