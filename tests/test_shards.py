"""Sharded states in one process: the layout, the step at one rank, and sharded checkpoints.

A checkpoint of several ranks is written here by threads, one per rank,
meeting through an in-process store, as the ranks of a job meet through
theirs; ``tests/test_sharding.py`` runs the same under torchrun.
"""

from __future__ import annotations

import threading
from pathlib import Path

import attrs
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import fnloop as fl
from fnloop._core.shards import sharded_tensors
from fnloop._step.sharding import chunk
from fnloop.checkpoint import _sharded


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def optimizer() -> fl.optim.Optimizer:
    return fl.optim.chain(fl.optim.clip_by_global_norm(0.1), fl.optim.adamw(1e-2))


def loss_fn(forward, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(forward(x), y)


BATCH = (torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 3)


def trained(shard: str | None, steps: int = 3) -> fl.TrainState:
    net = model()
    state = fl.init(net, optimizer(), seed=0, max_iter=steps, shard=shard)
    return fl.run(state, fl.train_step(net, loss_fn, optimizer(), compile=False), [BATCH] * steps, [])


def leaves(state: fl.TrainState) -> list[torch.Tensor]:
    return list(pytree.tree_leaves((state.params, state.buffers, state.opt_state)))


def same(a: fl.TrainState, b: fl.TrainState) -> bool:
    return all(torch.equal(x, y) for x, y in zip(leaves(a), leaves(b), strict=True))


@given(rows=st.integers(0, 40), world=st.integers(1, 9))
def test_the_chunks_of_every_rank_cover_each_row_once(rows: int, world: int) -> None:
    layouts = [fl.Shards("full", world, r, {"w": rows}) for r in range(world)]
    spans = [layout.span("w") for layout in layouts]
    covered = [i for a, b in spans for i in range(a, b)]
    assert covered == list(range(rows))
    assert all(b - a <= layouts[0].rows_per_rank("w") for a, b in spans)
    whole = torch.arange(rows * 2.0).reshape(rows, 2)
    parts = [chunk(whole, layout, "w") for layout in layouts]
    assert all(p.shape == (layouts[0].rows_per_rank("w"), 2) for p in parts)
    assert torch.equal(torch.cat(parts)[:rows], whole) and not torch.cat(parts)[rows:].any()


@pytest.mark.parametrize("shard", ["full", "optimizer"])
def test_a_state_sharded_over_one_rank_trains_bit_for_bit_as_the_whole_one(shard: str) -> None:
    whole, sharded = trained(None), trained(shard)
    assert sharded.shards is not None and sharded.shards.world == 1 and sharded.shards.mode == shard
    assert same(whole, sharded)
    assert same(whole, fl.unshard(sharded)) and fl.unshard(sharded).shards is None
    assert all(
        torch.equal(a, b) for a, b in zip(fl.state_dict(whole).values(), fl.state_dict(sharded).values())
    )


def test_init_names_the_modes_of_sharding() -> None:
    with pytest.raises(ValueError, match=r"shard=\.\.\.\) must be None, or one of \('full', 'optimizer'\)"):
        fl.init(model(), optimizer(), seed=0, max_iter=1, shard="zero3")


@pytest.mark.parametrize(
    ("shard", "replicate", "said"),
    [
        (None, 2, r"replicate=2\) keeps copies of a sharded state, but shard is None: pass shard='full'"),
        ("full", 2, r"the 1 rank\(s\) of this run do not split into 2 equal blocks"),
        ("full", 0, r"replicate=\.\.\.\) must be a positive int"),
        ("full", "2", r"replicate=\.\.\.\) must be a positive int"),
    ],
)
def test_init_refuses_copies_of_a_state_it_cannot_lay_out_with_the_fix(
    shard: str | None, replicate: object, said: str
) -> None:
    with pytest.raises(ValueError, match=said):
        fl.init(model(), optimizer(), seed=0, max_iter=1, shard=shard, replicate=replicate)


def test_a_state_of_another_mesh_is_refused_by_the_step_with_the_fix() -> None:
    net = model()
    state = fl.init(net, optimizer(), seed=0, max_iter=1, shard="full")
    copy = attrs.evolve(state, shards=attrs.evolve(state.shards, world=2, rank=0, replicas=2, replica=1))
    step = fl.train_step(net, loss_fn, optimizer(), compile=False)
    with pytest.raises(
        ValueError, match=r"rank 2's part of a state sharded over 4 rank\(s\) in 2 copies.*rank 0 of 1"
    ):
        fl.run(copy, step, [BATCH], [])


def test_a_state_sharded_for_other_ranks_is_refused_by_the_step_with_the_fix() -> None:
    net = model()
    state = fl.init(net, optimizer(), seed=0, max_iter=1, shard="full")
    elsewhere = attrs.evolve(state, shards=state.shards.at(world=2, rank=1))
    step = fl.train_step(net, loss_fn, optimizer(), compile=False)
    with pytest.raises(ValueError, match=r"rank 1's part of a state sharded over 2 rank\(s\).*rank 0 of 1"):
        fl.run(elsewhere, step, [BATCH], [])


def split(state: fl.TrainState, world: int, rank: int) -> fl.TrainState:
    """Rank ``rank``'s part of a state sharded over one rank, as ``world`` ranks would hold it."""
    assert state.shards is not None and state.shards.world == 1
    layout = state.shards.at(world, rank)
    names = sharded_tensors(state.params, state.opt_state, state.shards)

    def cut(t: torch.Tensor) -> torch.Tensor:
        name = names.get(id(t))
        return t if name is None else chunk(t, layout, name)

    params = {k: cut(v) for k, v in state.params.items()}
    return attrs.evolve(state, params=params, opt_state=pytree.tree_map(cut, state.opt_state), shards=layout)


def save_by_ranks(parts: list[fl.TrainState], path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every part saved at once, one thread per rank, meeting through one store."""
    store = dist.HashStore()
    monkeypatch.setattr(_sharded, "_store", lambda: store)
    errors: list[BaseException] = []

    def save(part: fl.TrainState) -> None:
        try:
            fl.save(part, path)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(p,)) for p in parts[1:]]
    for thread in threads:
        thread.start()
    save(parts[0])
    for thread in threads:
        thread.join()
    assert not errors, errors


@pytest.fixture
def checkpoint_of_three(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, fl.TrainState]:
    state = trained("full")
    path = fl.checkpoint.path_for(tmp_path, state.iteration)
    save_by_ranks([split(state, 3, r) for r in range(3)], path, monkeypatch)
    return path, state


def test_a_checkpoint_of_three_ranks_is_an_index_and_two_parts(checkpoint_of_three) -> None:
    path, _ = checkpoint_of_three
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "ckpt-00000003.part-00001-of-00003.safetensors",
        "ckpt-00000003.part-00002-of-00003.safetensors",
        "ckpt-00000003.safetensors",
    ]
    assert [p.name for p in fl.checkpoint.checkpoints(path.parent)] == [path.name]
    assert sorted(p.name for p in _sharded.parts_of(path)) == [
        "ckpt-00000003.part-00001-of-00003.safetensors",
        "ckpt-00000003.part-00002-of-00003.safetensors",
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_a_checkpoint_of_three_ranks_loads_at_any_world_size(checkpoint_of_three, world: int) -> None:
    path, state = checkpoint_of_three
    for rank in range(world):
        like = split(fl.init(model(), optimizer(), seed=0, max_iter=3, shard="full"), world, rank)
        loaded = fl.load(path, like=like)
        assert loaded.shards == like.shards and loaded.iteration == 3 and loaded.data == state.data
        assert same(loaded, split(state, world, rank))


@pytest.mark.parametrize("shard", [None, "optimizer"])
def test_a_checkpoint_of_three_ranks_loads_whole_or_sharded_otherwise(checkpoint_of_three, shard) -> None:
    path, state = checkpoint_of_three
    loaded = fl.load(path, like=fl.init(model(), optimizer(), seed=0, max_iter=3, shard=shard))
    assert same(fl.unshard(loaded), fl.unshard(state))
    assert loaded.metrics == state.metrics


def test_a_whole_checkpoint_loads_into_a_sharded_run(tmp_path: Path) -> None:
    whole = trained(None)
    path = fl.save(whole, fl.checkpoint.path_for(tmp_path, 3))
    like = split(fl.init(model(), optimizer(), seed=0, max_iter=3, shard="full"), 2, 1)
    expected = split(attrs.evolve(whole, shards=like.shards.at(1, 0)), 2, 1)
    assert same(fl.load(path, like=like), expected)


def test_inspect_and_read_raw_show_a_sharded_checkpoint_whole(checkpoint_of_three, capsys) -> None:
    path, state = checkpoint_of_three
    metadata, tree = fl.checkpoint.read_raw(path)
    assert '"world":3' in metadata["fnloop.shards"]
    assert torch.equal(tree["params"]["0.weight"], state.params["0.weight"])
    from fnloop.cli import main

    main(["inspect", str(path)])
    out = capsys.readouterr().out
    assert "3 parts (full), shown whole" in out and "(7, 4)" in out


def test_a_part_of_another_save_makes_the_checkpoint_damaged_and_latest_goes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = trained("full")
    older = fl.checkpoint.path_for(tmp_path, 2)
    newer = fl.checkpoint.path_for(tmp_path, 3)
    save_by_ranks([split(attrs.evolve(state, iteration=2), 2, r) for r in range(2)], older, monkeypatch)
    save_by_ranks([split(state, 2, r) for r in range(2)], newer, monkeypatch)
    # A part of the save of iteration 2 where iteration 3's should be.
    stale = _sharded.part_path(older, 1, 2).read_bytes()
    _sharded.part_path(newer, 1, 2).write_bytes(stale)
    like = fl.init(model(), optimizer(), seed=0, max_iter=3)
    with pytest.raises(fl.checkpoint.DamagedCheckpoint, match=r"part-00001-of-00002.*not the one its index"):
        fl.load(newer, like=like)
    with pytest.warns(fl.checkpoint.CheckpointWarning, match="not the one its index names"):
        assert fl.checkpoint.latest(tmp_path, like=like).iteration == 2
    # A part gone: the same.
    _sharded.part_path(older, 1, 2).unlink()
    with pytest.warns(fl.checkpoint.CheckpointWarning):
        assert fl.checkpoint.latest(tmp_path, like=like) is None


def test_a_flipped_bit_in_the_index_is_damage(checkpoint_of_three) -> None:
    path, _ = checkpoint_of_three
    data = bytearray(path.read_bytes())
    at = data.index(b'world\\":3')
    data[at + 8] = ord("4")  # world 3 -> 4: still an index, but not the one written
    path.write_bytes(bytes(data))
    with pytest.raises(fl.checkpoint.DamagedCheckpoint, match="checksum"):
        fl.load(path, like=fl.init(model(), optimizer(), seed=0, max_iter=3))


def test_a_module_wrapped_by_fully_shard_is_refused_with_the_fix(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        net = fully_shard(model(), mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(TypeError, match=r"is a DTensor.*shard='full'"):
            fl.init(net, optimizer(), seed=0, max_iter=1)
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_of_four_ranks_loads_at_two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = trained("full")
    path = fl.checkpoint.path_for(tmp_path, state.iteration)
    save_by_ranks([split(state, 4, r) for r in range(4)], path, monkeypatch)
    assert len(_sharded.parts_of(path)) == 3
    for rank in range(2):
        like = split(fl.init(model(), optimizer(), seed=0, max_iter=3, shard="full"), 2, rank)
        assert same(fl.load(path, like=like), split(state, 2, rank))


def test_diff_compares_sharded_checkpoints_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from fnloop.cli import main

    state = trained("full")
    two = fl.checkpoint.path_for(tmp_path / "two", state.iteration)
    three = fl.checkpoint.path_for(tmp_path / "three", state.iteration)
    save_by_ranks([split(state, 2, r) for r in range(2)], two, monkeypatch)
    save_by_ranks([split(state, 3, r) for r in range(3)], three, monkeypatch)
    assert main(["diff", str(two), str(three)]) == 0  # the same state, split two ways
    nudged = attrs.evolve(state, params={**state.params, "2.bias": state.params["2.bias"] + 1})
    save_by_ranks([split(nudged, 3, r) for r in range(3)], three, monkeypatch)
    assert main(["diff", str(two), str(three)]) != 0
    assert "state.params['2.bias']" in capsys.readouterr().out


def test_an_index_naming_a_part_elsewhere_is_damage(checkpoint_of_three) -> None:
    path, _ = checkpoint_of_three
    index = _sharded.Index
    data = {"mode": "full", "world": 2, "rows": [["w", 2]], "chunks": {}, "parts": []}
    for file in ("../ckpt-00000003.part-00001-of-00002.safetensors", "/etc/passwd", "x.safetensors"):
        with pytest.raises(fl.checkpoint.DamagedCheckpoint, match="malformed"):
            index({**data, "parts": [{"file": file, "checksum": "crc32:0"}]}, str(path))
    index(
        {**data, "parts": [{"file": "ckpt-00000003.part-00001-of-00002.safetensors", "checksum": "c"}]}, "x"
    )


def with_ema(state: fl.TrainState, world: int, rank: int) -> fl.TrainState:
    """Rank ``rank``'s part of ``state`` (sharded over one rank) with its EMA's chunks, as ``split`` cuts."""
    part = split(state, world, rank)
    average = state.hooks["ema"]
    names = part.shards.names
    params = {k: chunk(v, part.shards, k) if k in names else v for k, v in average.params.items()}
    return attrs.evolve(part, hooks={**state.hooks, "ema": fl.hooks.EmaState(params, average.updates)})


@pytest.mark.parametrize(("saved", "loaded"), [(2, 3), (2, 2), (1, 2), (2, 1)])
def test_the_ema_of_a_full_state_resumes_at_the_world_size_that_saved_it_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved: int, loaded: int
) -> None:
    # Rows of 4 split in chunks of 2 over 2 ranks as over 3: read at 3 ranks, every rank silently got
    # rank 0's chunk of the average; at other sizes the shapes differed, and the error never said why.
    def square() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(4, 4)

    def start() -> fl.TrainState:
        return fl.init(square(), optimizer(), seed=0, max_iter=2, shard="full")

    net = square()
    step = fl.train_step(net, lambda f, b: f(b).pow(2).mean(), optimizer(), compile=False)
    state = fl.run(start(), step, [torch.ones(2, 4)] * 2, [fl.hooks.ema(0.9)])
    path = fl.checkpoint.path_for(tmp_path, state.iteration)
    save_by_ranks([with_ema(state, saved, r) for r in range(saved)], path, monkeypatch)
    for rank in range(loaded):
        resumed = fl.load(path, like=split(start(), loaded, rank))
        if saved == loaded:
            kept = fl.hooks.ema_params(resumed)
            assert all(
                torch.equal(kept[k], v) for k, v in with_ema(state, loaded, rank).hooks["ema"].params.items()
            )
            continue
        was = f"a shard='full' run over {saved} ranks" if saved > 1 else "a run whose parameters were whole"
        now = f"splits the parameters over {loaded} ranks" if loaded > 1 else "holds the parameters whole"
        with pytest.raises(
            fl.checkpoint.CheckpointMismatch,
            match=rf"ema 'ema': the average in .*state.hooks\['ema'\] was saved by {was}, and the state it is "
            rf"read into {now}\. .*resumes only at the world size that saved it.*start the average afresh",
        ):
            fl.hooks.ema(0.9)(resumed, fl.Phase.BEFORE_TRAIN)


def test_a_save_waiting_on_a_late_rank_looks_in_the_store_without_a_line_of_c10d_each_slice(capfd, tmp_path):
    """A survivor of a killed rank waits here until it gives up: c10d warns each timed-out ``wait``
    (``[c10d] waitForInput ... timed out after 200ms``, ten lines a second), so the save only looks."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    late = threading.Timer(1.0, lambda: store.set("meeting/1", "1"))
    late.start()
    try:
        _sharded._wait(store, "meeting", {1: "meeting/1"}, tmp_path / "ckpt", 3, "rank 1's part")
    finally:
        late.join()
    assert store.check(["meeting/1"])
    assert "waitForInput" not in capfd.readouterr().err
