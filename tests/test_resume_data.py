"""Resuming from a checkpoint continues the data, or says once that it restarts."""

from __future__ import annotations

import pickle
import warnings

import attrs
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import fnloop as fl
from fnloop.data import DataRestarts, Resumable, resumable


def seen(state, batch):
    return fl.record(state, x=batch)


def xs(state: fl.TrainState) -> list[float]:
    return [value for _, value in state.metrics.series["x"]]


def through_checkpoint(state: fl.TrainState, path) -> fl.TrainState:
    fl.save(state, path)
    return fl.load(path, like=state)


def test_a_list_resumed_from_a_checkpoint_sees_its_first_batch_again_and_warns_once(tmp_path):
    batches = [1.0, 2.0, 3.0, 4.0]
    half = fl.run(fl.TrainState(max_iter=2), seen, batches)
    resumed = through_checkpoint(attrs.evolve(half, max_iter=4), tmp_path / "c.fnl")
    with pytest.warns(DataRestarts, match=r"resumes at iteration 2.*fnloop\.data\.resumable") as caught:
        rest = fl.run(resumed, seen, batches)
    assert len(caught) == 1
    assert xs(rest)[2:] == [1.0, 2.0]  # the defect the warning is about: the data started over
    assert rest.data == 0


def test_the_remaining_batches_of_a_plain_list_do_not_warn():
    half = fl.run(fl.TrainState(max_iter=2), seen, [1.0, 2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rest = fl.run(attrs.evolve(half, max_iter=4), seen, [3.0, 4.0])
    assert xs(rest) == [1.0, 2.0, 3.0, 4.0]


def test_a_generator_at_a_resume_warns():
    half = fl.run(fl.TrainState(max_iter=1), seen, [1.0])
    with pytest.warns(DataRestarts):
        fl.run(attrs.evolve(half, max_iter=2), seen, (b for b in [1.0, 2.0]))


def test_a_wrapped_list_continues_and_its_cursor_is_saved(tmp_path):
    stream = resumable([1.0, 2.0, 3.0])
    whole = fl.run(fl.TrainState(max_iter=7), seen, stream)
    half = fl.run(fl.TrainState(max_iter=4), seen, stream)
    resumed = through_checkpoint(attrs.evolve(half, max_iter=7), tmp_path / "c.fnl")
    assert resumed.data == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rest = fl.run(resumed, seen, stream)
    assert xs(whole) == [1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0]
    assert xs(rest) == xs(whole) and rest.data == 7


def regression(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]))


def train(loader_stream, stops: list[int], tmp_path) -> fl.TrainState:
    """Train to the last of ``stops``, saving and loading a checkpoint at each earlier one."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
    optimizer = fl.optim.adamw(1e-2)

    def mse(forward, batch):
        x, y = batch
        return ((forward(x) - y) ** 2).mean()

    step = fl.train_step(model, mse, optimizer, compile=False)
    state = fl.init(model, optimizer, seed=0, max_iter=stops[0])
    for k, stop in enumerate(stops):
        state = fl.run(attrs.evolve(state, max_iter=stop), step, loader_stream)
        if stop != stops[-1]:
            state = through_checkpoint(state, tmp_path / f"{k}.fnl")
    return state


def assert_same_params(a: fl.TrainState, b: fl.TrainState) -> None:
    assert a.params.keys() == b.params.keys()
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name


def test_a_wrapped_shuffled_dataloader_resumed_equals_the_uninterrupted_run_bit_for_bit(tmp_path):
    def stream() -> Resumable:
        loader = DataLoader(
            regression(), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(3)
        )
        return resumable(loader)

    whole = train(stream(), [11], tmp_path)  # 4 batches an epoch: the stops cross epochs
    resumed = train(stream(), [2, 6, 9, 11], tmp_path)
    assert resumed.data == whole.data == 11
    assert_same_params(whole, resumed)
    # Each epoch's order is its own: epochs 0 and 1 differ.
    # Each epoch has its own order: epochs 0 and 1 differ.
    it = stream().iter_from(0)
    epochs = [[next(it)[0][0] for _ in range(4)] for _ in range(2)]
    assert not all(torch.equal(a, b) for a, b in zip(*epochs, strict=True))


def test_an_epoch_function_resumes_in_the_middle_of_an_epoch():
    def loader(epoch: int) -> DataLoader:
        return DataLoader(
            regression(), batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(epoch)
        )

    whole = [x for (x, _), _ in zip(resumable(loader), range(10), strict=False)]
    tail = [x for ((x, _), _), _ in zip(resumable(loader).iter_from(6), range(4), strict=False)]
    assert all(torch.equal(a, b) for a, b in zip(whole[6:], tail, strict=True))


def test_a_shuffling_dataloader_without_a_generator_is_refused_with_the_fix():
    loader = DataLoader(regression(), batch_size=4, shuffle=True)
    with pytest.raises(ValueError, match=r"without a generator.*generator=torch\.Generator\(\)\.manual_seed"):
        resumable(loader)


def test_a_one_shot_iterator_or_a_number_is_refused():
    with pytest.raises(TypeError, match=r"one-shot iterator.*function epoch -> iterable"):
        resumable(b for b in [1, 2])
    with pytest.raises(TypeError, match=r"re-iterable .*got 3 that is an int"):
        resumable(3)  # type: ignore[arg-type]


def test_an_empty_epoch_is_an_error_not_a_hang():
    # An empty list is refused when the stream is built; an epoch only iteration finds empty, then.
    with pytest.raises(ValueError, match=r"the source is empty"):
        resumable([])
    with pytest.raises(ValueError, match=r"epoch 0 .* gave no batch"):
        next(resumable(lambda epoch: []).iter_from(0))


def test_the_cursor_is_checked():
    with pytest.raises(ValueError, match=r"Resumable\.iter_from: cursor must be >= 0"):
        resumable([1]).iter_from(-1)


def test_a_wrapped_list_pickles_and_compares():
    stream = resumable([1.0, 2.0])
    assert pickle.loads(pickle.dumps(stream)) == stream
