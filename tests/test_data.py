"""Tests for fnloop.data: order, resume, workers, sharding and errors."""

from __future__ import annotations

import doctest
import itertools
import pickle

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import IterableDataset, TensorDataset

import fnloop.data
from fnloop.data import Batches, batches


class Counting:
    """A map-style dataset that counts its loads; sample i is (x_i, i)."""

    def __init__(self, n: int) -> None:
        self.x = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2)
        self.loads = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.loads += 1
        return self.x[i], i


class Batched(Counting):
    """Loads a whole batch of samples at once, as DataLoader allows."""

    def __getitems__(self, keys: list[int]) -> list[tuple[torch.Tensor, int]]:
        return [(self.x[i], i) for i in keys]


class Endless(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def take(it, m):
    return list(itertools.islice(it, m))


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def same_items(xs, ys) -> bool:
    return len(xs) == len(ys) and all(same(x, y) for x, y in zip(xs, ys, strict=True))


def epoch_indices(stream: Batches, epoch: int) -> list[int]:
    """The indices the stream gives in one epoch, over ``torch.arange`` as dataset."""
    per = stream.batches_per_epoch
    items = take(stream.iter_from(epoch * per), per)
    return torch.cat([b for b, _ in items]).tolist()


def test_doctests():
    import fnloop.data._batches
    import fnloop.data._resumable

    for module in (fnloop.data._batches, fnloop.data._resumable):
        result = doctest.testmod(module)
        assert result.attempted > 0, module
        assert result.failed == 0, module


# ---------------------------------------------------------------- shape of a stream


def test_tuple_of_tensors_gives_tuples_of_rows_and_cursors():
    xs = torch.arange(10.0)
    stream = batches((xs, 2 * xs), batch_size=4, seed=0)
    items = take(stream.iter_from(5), 3)
    assert [c for _, c in items] == [6, 7, 8]
    for (x, y), _ in items:
        assert x.shape == y.shape == (4,)
        assert torch.equal(y, 2 * x)


def test_iter_is_iter_from_zero():
    stream = batches(torch.arange(7), batch_size=2, seed=1)
    assert same_items(take(iter(stream), 9), [b for b, _ in take(stream.iter_from(0), 9)])


def test_map_style_uses_default_collate_or_collate_fn():
    data = Counting(6)
    (x, i), _ = next(batches(data, batch_size=3, seed=0, shuffle=False).iter_from(0))
    assert torch.equal(x, data.x[:3])
    assert torch.equal(i, torch.tensor([0, 1, 2]))
    listed = batches(data, batch_size=3, seed=0, shuffle=False, collate_fn=list)
    assert same(next(iter(listed))[1], (data.x[1], 1))


def test_getitems_is_used_like_dataloader_does():
    plain = batches(Counting(12), batch_size=4, seed=5)
    batched_data = Batched(12)
    fast = batches(batched_data, batch_size=4, seed=5)
    assert same_items(take(iter(plain), 7), take(iter(fast), 7))
    assert batched_data.loads == 0


def test_batches_per_epoch_and_epoch_of():
    assert batches(torch.arange(10), batch_size=3, seed=0).batches_per_epoch == 3
    loose = batches(torch.arange(10), batch_size=3, seed=0, drop_last=False)
    assert loose.batches_per_epoch == 4
    assert [loose.epoch_of(c) for c in (0, 3, 4, 9)] == [0, 0, 1, 2]


def test_last_smaller_batch_with_drop_last_false():
    stream = batches(torch.arange(10), batch_size=4, seed=0, drop_last=False)
    assert [len(b) for b in take(iter(stream), 6)] == [4, 4, 2, 4, 4, 2]


def test_value_semantics_repr_pickle_equality():
    xs = torch.arange(10.0)
    stream = batches((xs, xs), batch_size=2, seed=3)
    assert "tuple of 2 tensors, 10 rows" in repr(stream)
    assert "batch_size=2" in repr(stream)
    back = pickle.loads(pickle.dumps(stream))
    assert back == stream
    assert hash(back) == hash(stream)
    assert same_items(take(iter(back), 8), take(iter(stream), 8))
    assert stream != attrs.evolve(stream, seed=4)
    assert stream != batches((xs, xs + 1), batch_size=2, seed=3)


# ---------------------------------------------------------------- order


def test_same_seed_same_batches_different_seed_different_order():
    def first(seed):
        return take(iter(batches(torch.arange(50), batch_size=50, seed=seed)), 1)[0]

    assert torch.equal(first(0), first(0))
    assert not torch.equal(first(0), first(1))


def test_every_epoch_is_a_permutation_and_epochs_differ():
    stream = batches(torch.arange(23), batch_size=5, seed=7, drop_last=False)
    orders = [epoch_indices(stream, e) for e in range(4)]
    for order in orders:
        assert sorted(order) == list(range(23))
    assert len({tuple(o) for o in orders}) == 4


def test_drop_last_epochs_hold_distinct_indices():
    stream = batches(torch.arange(23), batch_size=5, seed=7)
    for e in range(3):
        order = epoch_indices(stream, e)
        assert len(order) == len(set(order)) == 20


def test_no_shuffle_keeps_dataset_order_every_epoch():
    stream = batches(torch.arange(9), batch_size=3, seed=7, shuffle=False)
    assert [epoch_indices(stream, e) for e in range(3)] == [list(range(9))] * 3


def test_global_rng_is_untouched():
    before = torch.get_rng_state()
    take(iter(batches(torch.arange(20), batch_size=3, seed=0)), 30)
    take(batches(Counting(20), batch_size=3, seed=0).iter_from(11), 10)
    assert torch.equal(torch.get_rng_state(), before)


# ---------------------------------------------------------------- resume


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 20),
    data=st.data(),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(-(2**70), 2**70),
)
def test_iter_from_k_is_the_tail_of_iter_from_zero(n, data, drop_last, shuffle, seed):
    batch_size = data.draw(st.integers(1, n))
    stream = batches(torch.arange(n), batch_size=batch_size, seed=seed, drop_last=drop_last, shuffle=shuffle)
    per = stream.batches_per_epoch
    k = data.draw(st.integers(0, 3 * per + 2), label="k")
    m = 2 * per + 1
    whole = take(stream.iter_from(0), k + m)
    assert same_items(take(stream.iter_from(k), m), whole[k:])
    assert [c for _, c in whole] == list(range(1, k + m + 1))


def test_resume_loads_and_shuffles_only_what_it_yields(monkeypatch):
    data = Counting(100)
    stream = batches(data, batch_size=10, seed=0)
    calls = []
    randperm = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(a) or randperm(*a, **k))
    items = take(stream.iter_from(1000), 3)
    assert [c for _, c in items] == [1001, 1002, 1003]
    assert data.loads == 30
    assert len(calls) == 1  # epoch 100's order alone, not the 100 before it


def test_resume_matches_an_uninterrupted_map_style_stream():
    stream = batches(Counting(13), batch_size=4, seed=2)
    whole = take(stream.iter_from(0), 12)
    assert same_items(take(stream.iter_from(5), 7), whole[5:])


def test_the_fold_resumes_from_state_data():
    step = lambda s, b: attrs.evolve(s, extra=(*s.extra, b.tolist()))  # noqa: E731
    stream = batches(torch.arange(7), batch_size=2, seed=4)
    whole = fnloop.run(fnloop.TrainState(max_iter=8, extra=()), step, stream)
    half = fnloop.run(fnloop.TrainState(max_iter=3, extra=()), step, stream)
    rest = fnloop.run(attrs.evolve(half, max_iter=8), step, stream)
    assert whole.data == rest.data == 8
    assert rest.extra == whole.extra


# ---------------------------------------------------------------- workers


def test_workers_give_the_same_batches_and_leave_the_rng_alone():
    config = {"batch_size": 4, "seed": 3, "drop_last": False}
    expected = take(batches(Counting(14), **config).iter_from(3), 8)
    before = torch.get_rng_state()
    data = Counting(14)
    got = take(batches(data, num_workers=2, **config).iter_from(3), 8)
    assert torch.equal(torch.get_rng_state(), before)
    assert data.loads == 0  # every sample was loaded in a worker process
    assert [c for _, c in got] == [c for _, c in expected] == list(range(4, 12))
    assert same_items([b for b, _ in got], [b for b, _ in expected])


# ---------------------------------------------------------------- distributed


@pytest.mark.parametrize(
    "make",
    [lambda: (torch.arange(26.0), -torch.arange(26)), lambda: Counting(26)],
    ids=["tensors", "map-style"],
)
def test_ranks_split_each_global_batch_contiguously(make):
    data = make()
    whole = batches(data, batch_size=6, seed=9, world_size=1, rank=0)
    ranks = [batches(data, batch_size=6, seed=9, world_size=2, rank=r) for r in (0, 1)]
    for cursor in (0, 1, 3, 4, 9, 13):
        (expected, after), *_ = take(whole.iter_from(cursor), 1)
        shares = [next(r.iter_from(cursor)) for r in ranks]
        assert [c for _, c in shares] == [after, after]
        for k, column in enumerate(expected):
            parts = [share[k] for share, _ in shares]
            assert [len(p) for p in parts] == [3, 3]
            assert torch.equal(torch.cat(parts), column)


def test_ranks_split_a_last_smaller_batch():
    data = torch.arange(10)
    whole = take(batches(data, batch_size=4, seed=1, drop_last=False).iter_from(2), 1)[0][0]
    parts = [
        next(batches(data, batch_size=4, seed=1, drop_last=False, world_size=2, rank=r).iter_from(2))[0]
        for r in (0, 1)
    ]
    assert [len(p) for p in parts] == [1, 1]
    assert torch.equal(torch.cat(parts), whole)


def test_rank_and_world_size_default_to_the_process_group(monkeypatch):
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    stream = batches(torch.arange(16), batch_size=8, seed=0)
    assert (stream.rank, stream.world_size) == (1, 4)
    assert len(next(iter(stream))) == 2
    assert batches(torch.arange(16), batch_size=8, seed=0, rank=3).rank == 3


def test_rank_and_world_size_default_to_one_process():
    stream = batches(torch.arange(4), batch_size=2, seed=0)
    assert (stream.rank, stream.world_size) == (0, 1)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("batch_size", "error"), [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)]
)
def test_batch_size_must_be_a_positive_int(batch_size, error):
    with pytest.raises(error, match=r"'batch_size' must be an int >= 1 \(got"):
        batches(torch.arange(4), batch_size=batch_size, seed=0)


@pytest.mark.parametrize("seed", [1.5, "0", None, True])
def test_seed_must_be_an_int(seed):
    with pytest.raises(TypeError, match=r"'seed' must be an int \(got .* pass the run's seed"):
        batches(torch.arange(4), batch_size=2, seed=seed)


def test_cursor_must_be_a_non_negative_int():
    stream = batches(torch.arange(4), batch_size=2, seed=0)
    with pytest.raises(ValueError, match=r"iter_from: cursor must be >= 0 \(got -1\).*state.data"):
        stream.iter_from(-1)
    with pytest.raises(TypeError, match=r"iter_from: cursor must be an int \(got 1.0 that is a float\)"):
        stream.iter_from(1.0)
    with pytest.raises(ValueError, match=r"epoch_of: cursor must be >= 0"):
        stream.epoch_of(-2)


@pytest.mark.parametrize(
    ("dataset", "error", "match"),
    [
        (42, TypeError, r"indexable with a known length \(got int"),
        ((i for i in range(3)), TypeError, r"\(got generator"),
        (Endless(), TypeError, r"\(got Endless.*IterableDataset"),
        ((torch.arange(3), [1, 2, 3]), TypeError, r"tuple of Tensor, list\)"),
        ((), TypeError, r"tuple of nothing"),
        ((torch.arange(3), torch.arange(4)), ValueError, r"equal lengths \(got lengths \[3, 4\]\)"),
        (torch.tensor(1.0), ValueError, r"0-d"),
        ([], ValueError, r"dataset is empty"),
        (TensorDataset(torch.zeros(0, 2)), ValueError, r"dataset is empty"),
    ],
)
def test_bad_datasets_are_refused(dataset, error, match):
    with pytest.raises(error, match=match):
        batches(dataset, batch_size=1, seed=0)


def test_batch_size_larger_than_the_dataset():
    with pytest.raises(
        ValueError, match=r"batch_size=8 is larger than the dataset \(5 samples\).*drop_last=False"
    ):
        batches(torch.arange(5), batch_size=8, seed=0)
    assert len(next(iter(batches(torch.arange(5), batch_size=8, seed=0, drop_last=False)))) == 5


def test_sharding_errors():
    with pytest.raises(
        ValueError, match=r"batch_size=10 .* world_size=4 .* e.g. batch_size=8 or batch_size=12"
    ):
        batches(torch.arange(40), batch_size=10, seed=0, world_size=4, rank=0)
    with pytest.raises(ValueError, match=r"e.g. batch_size=4\.$"):
        batches(torch.arange(40), batch_size=3, seed=0, world_size=4, rank=0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\) \(got rank=2, world_size=2\)"):
        batches(torch.arange(40), batch_size=10, seed=0, world_size=2, rank=2)
    with pytest.raises(ValueError, match=r"last batch of every epoch has 1 samples, fewer than world_size=2"):
        batches(torch.arange(9), batch_size=4, seed=0, drop_last=False, world_size=2, rank=0)


def test_workers_and_collate_fn_are_for_map_style_datasets():
    with pytest.raises(ValueError, match=r"num_workers and collate_fn apply to map-style.*TensorDataset"):
        batches(torch.arange(4), batch_size=2, seed=0, num_workers=2)
    with pytest.raises(TypeError, match=r"'collate_fn' must be callable or None"):
        batches(Counting(4), batch_size=2, seed=0, collate_fn=3)
    with pytest.raises(TypeError, match=r"'shuffle' must be a bool"):
        batches(Counting(4), batch_size=2, seed=0, shuffle=1)
