"""The data loaders users already have, resumed exactly through ``fnloop.data.resumable``.

torchdata's ``StatefulDataLoader`` and a Hugging Face ``IterableDataset`` keep
their own position: its ``state_dict()`` is the cursor in ``state.data``, saved
in checkpoints. A Hugging Face map-style ``Dataset`` is a dataset like any
other (``fl.data.batches``, or a ``DataLoader`` through ``resumable``). Each
test crashes a run, resumes it from its checkpoint with a fresh loader, and
compares the final state with an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import attrs
import datasets
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import fnloop as fl
from fnloop import testing

ROWS = 22  # not a multiple of the batch size: the last batch of an epoch is smaller


def _seen(state, batch):
    """A step recording which rows it saw (their sum, and the first one), as the batch holds them."""
    ids = batch["y"] if isinstance(batch, dict) else batch[1]
    return fl.record(state, rows=float(ids.sum()) + 1000.0 * float(ids[0]))


def _crash_and_resume(tmp_path, make, steps: int = 14, crash: int = 8) -> tuple[fl.TrainState, fl.TrainState]:
    """An uninterrupted run over ``make()``, and one crashed at ``crash`` then resumed with a fresh ``make()``."""
    straight = fl.run(fl.TrainState(max_iter=steps), _seen, fl.data.resumable(make()), clock=lambda: 0.0)
    hooks = [fl.every(3, fl.hooks.checkpoint(tmp_path / "ckpt")), testing.Fail(fl.Phase.AFTER_STEP, crash)]
    with pytest.raises(testing.InjectedFailure):
        fl.run(fl.TrainState(max_iter=steps), _seen, fl.data.resumable(make()), hooks, clock=lambda: 0.0)
    resumed = fl.checkpoint.resume(tmp_path / "ckpt", like=fl.TrainState(max_iter=steps))
    assert 0 < resumed.iteration < steps
    return fl.run(resumed, _seen, fl.data.resumable(make()), clock=lambda: 0.0), straight


def _tensors() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(ROWS, 3, generator=g), torch.arange(ROWS))


@pytest.mark.parametrize("crash", [4, 9, 15], ids=["epoch-0", "epoch-1", "epoch-2"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataloader_resumes_bit_exact_with_shuffling_across_epochs(tmp_path, workers, crash):
    # Resumed in its second epoch without workers, the loader's own restore gave every later epoch
    # another order (torchdata 0.11); fnloop begins each epoch itself, and the loader's state
    # restores the position within it.
    def make():
        generator = torch.Generator().manual_seed(5)
        return StatefulDataLoader(
            _tensors(), batch_size=4, shuffle=True, generator=generator, num_workers=workers
        )

    final, straight = _crash_and_resume(tmp_path, make, steps=20, crash=crash)
    testing.assert_identical(final, straight)
    assert set(final.data) == {"epoch", "position"}  # the position is the loader's own state_dict()
    assert final.data["epoch"] == 3  # 20 batches, 6 an epoch
    seen = [v for _, v in straight.metrics.history("rows")]
    assert len(set(seen)) == len(seen), "each epoch reshuffled"


def _hf_rows() -> datasets.Dataset:
    return datasets.Dataset.from_dict({"x": [[float(i)] * 2 for i in range(ROWS)], "y": list(range(ROWS))})


def test_a_hugging_face_map_style_dataset_through_batches_and_through_a_dataloader(tmp_path):
    table = _hf_rows().with_format("torch")
    final, straight = _crash_and_resume(
        tmp_path / "batches", lambda: fl.data.batches(table, batch_size=4, seed=0)
    )
    testing.assert_identical(final, straight)

    def loader():
        generator = torch.Generator().manual_seed(2)
        return torch.utils.data.DataLoader(table, batch_size=4, shuffle=True, generator=generator)

    final, straight = _crash_and_resume(tmp_path / "loader", loader)
    testing.assert_identical(final, straight)


@pytest.mark.parametrize("crash", [4, 11, 13], ids=["in-epoch-0", "before-a-last-partial-batch", "epoch-2"])
def test_a_hugging_face_iterable_dataset_resumes_from_its_own_state(tmp_path, crash):
    # Its state_dict() holds where each shard is. Not with .shuffle(buffer_size=...): Hugging Face
    # saves no buffer content, so a resumed run sees other examples (docs/data.md).
    def make():
        return _hf_rows().to_iterable_dataset(num_shards=2).with_format("torch").batch(batch_size=4)

    final, straight = _crash_and_resume(tmp_path, make, steps=16, crash=crash)
    # Everything but the dataset's own record of its position is bit for bit the same; that record
    # can be spelled another way after a resume (Hugging Face's chain of previous states) while
    # saying the same position: both go on with the same batches.
    testing.assert_identical(attrs.evolve(final, data=None), attrs.evolve(straight, data=None))
    assert final.data["epoch"] == straight.data["epoch"] == 2  # 16 batches, 6 an epoch: the third
    after = [fl.data.resumable(make()).iter_from(state.data) for state in (final, straight)]
    for _ in range(8):
        (mine, _), (theirs, _) = (next(stream) for stream in after)
        assert torch.equal(mine["y"], theirs["y"])


def test_a_record_in_a_saved_cursor_is_refused_as_a_mismatch(tmp_path):
    @attrs.frozen
    class Position:
        at: int = 0

    path = fl.checkpoint.save(fl.TrainState(max_iter=2, data=Position(1)), tmp_path / "c")
    with pytest.raises(fl.checkpoint.CheckpointMismatch, match=r"state\.data: a saved .*Position record"):
        fl.checkpoint.load(path, like=fl.TrainState(max_iter=2))
