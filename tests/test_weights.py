"""``fl.save_weights``, ``fl.state_dict(rank0_only=True)`` and ``fl.unshard(rank0_only=True)``: in one
process, and on 4 ranks of every layout.

The memory they take under a limit, on a model twice what a rank may hold, is
``tests/test_memory_cap.py``'s; transformers' models written by a sharded run and read back by
``from_pretrained`` are ``tests/test_sharding.py``'s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import fnloop as fl
import fnloop._weights
from tests.launches import ok

WORKER = str(Path(__file__).with_name("weights_worker.py"))


def _state() -> tuple[torch.nn.Module, fl.TrainState]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3))
    return model, fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)


def test_the_file_holds_the_state_dict_in_its_dtype_or_the_one_asked_with_the_metadata(
    tmp_path: Path,
) -> None:
    _, state = _state()
    path = fl.save_weights(state, tmp_path / "a" / "model.safetensors", metadata={"run": "x"})
    assert path == tmp_path / "a" / "model.safetensors"
    written, expected = safetensors.torch.load_file(path), fl.state_dict(state)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], v) for k, v in expected.items())
    with safe_open(str(path), "pt") as file:
        assert file.metadata() == {"format": "pt", "run": "x"}
    half = safetensors.torch.load_file(
        fl.save_weights(state, tmp_path / "half.safetensors", dtype=torch.bfloat16)
    )
    assert half["1.num_batches_tracked"].dtype == torch.int64
    assert all(
        torch.equal(half[k], v.to(torch.bfloat16)) for k, v in expected.items() if v.is_floating_point()
    )


def test_with_the_model_the_keys_are_its_state_dicts_each_tensor_once(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight  # tied: save_pretrained writes it once
    model.register_buffer("scratch", torch.zeros(2), persistent=False)
    state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
    written = safetensors.torch.load_file(fl.save_weights(state, tmp_path / "m.safetensors", model))
    assert sorted(written) == ["0.weight"]
    again = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
    again[1].weight = again[0].weight
    again.load_state_dict(written, strict=False)
    assert torch.equal(again[1].weight, state.params["0.weight"])


def test_a_failed_write_leaves_the_file_that_was_there_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, state = _state()
    path = fl.save_weights(state, tmp_path / "model.safetensors")
    before = path.read_bytes()

    def full(fd: int, view: memoryview, at: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fnloop._weights, "written_out", full)
    changed = attrs.evolve(state, params={k: v + 1 for k, v in state.params.items()})
    with pytest.raises(OSError, match="No space left on device"):
        fl.save_weights(changed, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temporary file left


def test_bad_arguments_are_refused_with_what_was_expected(tmp_path: Path) -> None:
    model, state = _state()
    with pytest.raises(TypeError, match=r"save_weights\(\) expected a fnloop.TrainState"):
        fl.save_weights(model, tmp_path / "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"floating torch\.dtype"):
        fl.save_weights(state, tmp_path / "x", dtype=torch.int8)
    with pytest.raises(TypeError, match="must map str to str"):
        fl.save_weights(state, tmp_path / "x", metadata={"step": 3})  # type: ignore[dict-item]
    with pytest.raises(KeyError, match="the model has 'weight' but the state has no such"):
        fl.save_weights(state, tmp_path / "x", torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="rank0_only"):
        fl.state_dict(state, rank0_only=1)  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()


def test_rank_0_alone_in_one_process_is_the_states_own_tensors() -> None:
    model, state = _state()
    alone, every = fl.state_dict(state, model, rank0_only=True), fl.state_dict(state, model)
    assert list(alone) == list(every) and all(alone[k] is every[k] for k in every)
    sharded = fl.init(model, fl.optim.adamw(0.1), seed=0, max_iter=1, shard="full")
    whole = fl.unshard(sharded, rank0_only=True)
    assert whole is not None and whole.shards is None
    assert all(whole.params[k] is sharded.params[k] for k in sharded.params)  # one rank: the chunks are whole


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("weights")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", WORKER]
    ok(subprocess.run([*runner, str(out)], capture_output=True, text=True, timeout=600, env=env))
    return out


@pytest.mark.parametrize("layout", ["dp", "optimizer", "full", "mesh"])
def test_every_layout_writes_one_file_and_gives_rank_0_alone_the_gathered_weights(
    four: Path, layout: str
) -> None:
    ranks = [torch.load(four / layout / f"rank{r}.pt") for r in range(4)]
    whole = ranks[0]["whole"]
    assert all(r["whole"].keys() == whole.keys() for r in ranks)
    assert all(torch.equal(r["whole"][k], whole[k]) for r in ranks for k in whole)  # the same everywhere
    assert ranks[0]["alone"].keys() == whole.keys()
    assert all(torch.equal(ranks[0]["alone"][k], whole[k]) for k in whole)
    assert all(r["alone"] == {} for r in ranks[1:])
    # unshard(rank0_only=True): rank 0 alone gets the whole state, the parameters and the optimizer's
    unsharded, alone = ranks[0]["unshard"], ranks[0]["unshard_alone"]
    assert alone["shards"] is None and unsharded["shards"] is None
    assert alone["params"].keys() == unsharded["params"].keys()
    assert all(torch.equal(alone["params"][k], v) for k, v in unsharded["params"].items())
    assert alone["opt_state"].keys() == unsharded["opt_state"].keys() and len(alone["opt_state"]) > 2
    assert all(torch.equal(alone["opt_state"][k], v) for k, v in unsharded["opt_state"].items())
    assert all(r["unshard_alone"] is None for r in ranks[1:])
    written = safetensors.torch.load_file(four / layout / "model.safetensors")
    assert written.keys() == whole.keys()
    for key, value in whole.items():
        assert torch.equal(written[key], value.to(torch.bfloat16) if value.is_floating_point() else value)
    with safe_open(str(four / layout / "model.safetensors"), "pt") as file:
        assert file.metadata() == {"format": "pt", "run": layout}


def test_a_write_rank_0_cannot_make_fails_on_every_rank(four: Path) -> None:
    said = [torch.load(four / "failed" / f"rank{r}.pt")["said"] for r in range(4)]
    assert said[0].startswith(("NotADirectoryError", "FileExistsError"))
    assert all(
        s
        == "OSError: save_weights: rank 0 could not write "
        + repr(str(four / "failed" / "file" / "model.safetensors"))
        + "; see its error."
        for s in said[1:]
    )
