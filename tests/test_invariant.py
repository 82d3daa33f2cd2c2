"""``train_step(..., invariant=G)``: the same run, bit for bit, at 1, 2 and 4 ranks (gloo, CPU).

Three launches of ``tests/invariant_worker.py``, each running several jobs: at 4 ranks first (it
checkpoints the runs the others resume), then 2, then 1 (a plain process). Every job trains a
network with BatchNorm and dropout, AdamW behind a global-norm clip, ``invariant=4``, a global
batch of 16; the GPT-2 jobs a ``transformers`` GPT-2 at its defaults (dropout 0.1). The
``--shard`` jobs shard the state (``"full"``: parameters too; ``"optimizer"``), and train the same
bits as the whole state's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import fnloop as fl
from fnloop._core.shards import Shards
from fnloop._step.invariant import pairwise_sum, slice_tree, tree_sum
from fnloop._step.layout import Layout
from tests.launches import again_after_native_crash

WORKER = str(Path(__file__).with_name("invariant_worker.py"))
ONE_CORE_EACH = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONFAULTHANDLER": "1"}

pytestmark = pytest.mark.xdist_group("invariant")

JOBS = {
    "eager": [],
    "compiled": ["--compile"],
    "several": ["--compile", "--steps-per-call", "2"],
    "gpt2": ["--model", "gpt2", "--max-iter", "12"],
    "full": ["--compile", "--shard", "full"],
    "optimizer": ["--shard", "optimizer"],
    "full-several": ["--compile", "--steps-per-call", "2", "--shard", "full"],
    "gpt2-full": ["--model", "gpt2", "--max-iter", "12", "--shard", "full"],
    "gpt2-full-compiled": ["--model", "gpt2", "--max-iter", "6", "--shard", "full", "--compile"],
}
SHARDED = {"full": "compiled", "optimizer": "eager", "full-several": "several"}
"""Each sharded job, and the whole state's job it equals (block by block, the slices' tree is another)."""


def launch(ranks: int, tmp: Path, jobs: dict[str, list[str]]) -> None:
    runner = [sys.executable]
    if ranks > 1:
        runner += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    argv: list[str] = []
    for name, options in jobs.items():
        argv += [*(["--then"] if argv else []), str(tmp / name), *options]
    env = {**os.environ, **ONE_CORE_EACH}
    again_after_native_crash(
        tmp,
        lambda: subprocess.run(
            [*runner, WORKER, *argv], capture_output=True, text=True, timeout=900, env=env
        ),
        f"{ranks} ranks",
    )


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """At 4 ranks: every job, the run that checkpoints every 10 steps, and a world size that does not divide."""
    tmp = tmp_path_factory.mktemp("four")
    launch(
        4,
        tmp,
        {
            **JOBS,
            "ckpt": ["--checkpoint", str(tmp / "ckpt")],
            "ckpt-full": ["--checkpoint", str(tmp / "ckpt-full"), "--shard", "full"],
            "six": ["--slices", "6"],
        },
    )
    return tmp


@pytest.fixture(scope="module")
def two(four: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """At 2 ranks: every job, and the 4-rank runs resumed from their checkpoints of 30 (the sharded one sharded)."""
    tmp = tmp_path_factory.mktemp("two")
    resumed_full = ["--from", f"{four / 'ckpt-full'}:30", "--shard", "full"]
    launch(2, tmp, {**JOBS, "resumed": ["--from", f"{four / 'ckpt'}:30"], "resumed-full": resumed_full})
    return tmp


@pytest.fixture(scope="module")
def one(four: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """In one process: every job, and the 4-rank runs resumed from their checkpoints of 20 (the sharded one whole)."""
    tmp = tmp_path_factory.mktemp("one")
    resumed_full = ["--from", f"{four / 'ckpt-full'}:20"]
    launch(1, tmp, {**JOBS, "resumed": ["--from", f"{four / 'ckpt'}:20"], "resumed-full": resumed_full})
    return tmp


def result(where: Path, rank: int = 0) -> dict:
    return torch.load(where / f"rank{rank}.pt", weights_only=False)


def assert_same(a: dict, b: dict) -> None:
    """Every parameter, buffer and optimizer state tensor, and every loss, bit for bit."""
    for field in ("params", "buffers"):
        assert a[field].keys() == b[field].keys()
        for k in a[field]:
            assert torch.equal(a[field][k], b[field][k]), (field, k, (a[field][k] - b[field][k]).abs().max())
    assert len(a["opt_state"]) == len(b["opt_state"])
    assert all(torch.equal(x, y) for x, y in zip(a["opt_state"], b["opt_state"]))
    assert [i for i, _ in a["losses"]] == [i for i, _ in b["losses"]]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a["losses"], b["losses"]))


@pytest.mark.parametrize("job", list(JOBS))
def test_the_run_is_the_same_bits_at_1_2_and_4_ranks(one: Path, two: Path, four: Path, job: str) -> None:
    alone = result(one / job)
    assert alone["iteration"] == {"gpt2": 12, "gpt2-full": 12, "gpt2-full-compiled": 6}.get(job, 50)
    for rank in range(2):
        assert_same(alone, result(two / job, rank))
    for rank in range(4):
        assert_same(alone, result(four / job, rank))


def test_several_steps_per_call_are_the_single_steps(one: Path) -> None:
    assert_same(result(one / "compiled"), result(one / "several"))


@pytest.mark.parametrize("job", list(SHARDED))
def test_a_sharded_state_trains_the_same_bits_as_the_whole_one(one: Path, job: str) -> None:
    # With the test above, at 1, 2 and 4 ranks: the gradients' tree and the global norm's sums do
    # not depend on how the state is cut. At one process the chunks are the whole tensors.
    assert_same(result(one / SHARDED[job]), result(one / job))


def test_a_full_state_in_blocks_adds_each_slice_over_the_ranks_block_by_block(
    one: Path, two: Path, four: Path
) -> None:
    # GPT-2's root and 2 layers' 12 parameters each, gathered per slice one by one, each gather's
    # backward adding that slice's gradients over the ranks: 4/W slices a rank, 12 steps, eager;
    # compiled, traced once. In one process nothing is gathered; without blocks nothing block by block.
    assert result(one / "gpt2-full")["trees"] == 0
    per_slice = sum(1 for k in result(one / "gpt2")["params"])
    assert result(two / "gpt2-full")["trees"] == 12 * 2 * per_slice
    assert result(four / "gpt2-full", 3)["trees"] == 12 * 1 * per_slice
    assert result(two / "gpt2-full-compiled")["trees"] == 2 * per_slice
    assert result(two / "full")["trees"] == 0
    assert "block by block" not in result(two / "gpt2-full")["warned"]  # G a power of two: no warning


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
@pytest.mark.parametrize(("where", "began"), [("one", 20), ("two", 30)])
def test_a_run_checkpointed_at_4_ranks_goes_on_at_2_and_at_1_bit_for_bit(
    one: Path, two: Path, four: Path, where: str, began: int, sharded: bool
) -> None:
    # The sharded run's checkpoints, written by 4 ranks' chunks, go on sharded over 2 ranks, and whole at 1.
    suffix = "-full" if sharded else ""
    resumed = result({"one": one, "two": two}[where] / f"resumed{suffix}")
    assert resumed["began"] == began
    assert_same(result(four / f"ckpt{suffix}"), resumed)
    assert_same(result(four / "eager"), resumed)  # checkpointing, and sharding, changed nothing


def test_a_world_size_that_does_not_divide_the_slices_is_refused_with_the_fix(four: Path) -> None:
    said = result(four / "six")["refused"]
    assert "train_step(invariant=6) at 4 ranks" in said
    assert "world sizes [1, 2, 3, 6] only" in said and "here 12" in said


# -- one process: what the mode refuses, and what it is at one rank ----------------------------------


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 3))


def _loss(forward, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(forward(x), y)


def _batch(rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)


def test_one_slice_is_the_ordinary_step_and_more_slices_draw_per_slice() -> None:
    # fused=False: slices always update with the chain's formula, a whole eager step by default
    # with torch's fused kernel (docs/optim.md).
    net, opt = _net(), fl.optim.adamw(1e-2, fused=False)
    state = fl.init(net, opt, seed=0, max_iter=3)
    plain = fl.train_step(net, _loss, opt, compile=False)(state, _batch())
    one = fl.train_step(net, _loss, opt, compile=False, invariant=1)(state, _batch())
    four = fl.train_step(net, _loss, opt, compile=False, invariant=4)(state, _batch())
    leaves = lambda s: pytree.tree_leaves((s.params, s.opt_state))  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(leaves(plain), leaves(one)))
    # Four slices of 4 rows, each with its own dropout masks: another step (the mode's own numbers).
    assert not torch.equal(plain.params["0.weight"], four.params["0.weight"])


def test_what_the_mode_cannot_run_is_refused_with_the_fix() -> None:
    net, opt = _net(), fl.optim.adamw(1e-2)
    with pytest.raises(ValueError, match=r"invariant=4, accumulate=2\).*Leave accumulate out"):
        fl.train_step(net, _loss, opt, compile=False, invariant=4, accumulate=2)
    with pytest.raises(ValueError, match="'invariant' must be a positive int"):
        fl.train_step(net, _loss, opt, compile=False, invariant=0)
    step = fl.train_step(net, _loss, opt, compile=False, invariant=4)
    state = fl.init(net, opt, seed=0, max_iter=3)
    with pytest.raises(ValueError, match=r"batch has a tensor of 6 rows.*divisible by 4"):
        step(state, _batch(6))
    hybrid = Layout(shards=Shards("full", world=2, rank=0, rows={"0.weight": 8}, replicas=2))
    with pytest.raises(ValueError, match=r"replicate=2\).*Leave replicate out"):
        step.plan.check(hybrid)
    population = fl.population(lambda seed: fl.init(net, opt, seed=seed, max_iter=3), seeds=[0, 1])
    with pytest.raises(ValueError, match="on a population"):
        step(population, _batch())


@given(
    log_slices=st.integers(0, 4),
    log_world=st.integers(0, 4),
    scales=st.lists(st.integers(-6, 6), min_size=16, max_size=16),
)
def test_each_tree_splits_where_its_exchange_needs_where_counts_are_powers_of_two(
    log_slices: int, log_world: int, scales: list[int]
) -> None:
    assume(log_world <= log_slices)
    slices, world = 2**log_slices, 2**log_world
    per = slices // world
    g = torch.Generator().manual_seed(sum(scales) + 7 * slices + world)
    rows = [torch.randn(33, generator=g) * 10.0 ** scales[i] for i in range(slices)]
    # tree_sum: a rank's own slices are one subtree, so it adds them before the exchange (invariant.py).
    whole = tree_sum(rows)
    assert torch.equal(whole, tree_sum([tree_sum(rows[r * per : (r + 1) * per]) for r in range(world)]))
    # slice_tree: each rank's j-th slices are one subtree, so the block-by-block step adds each slice
    # over the ranks in its backward (blocks.py, ranks_tree).
    by_slice = [slice_tree([rows[r * per + j] for r in range(world)]) for j in range(per)]
    assert torch.equal(slice_tree(rows), slice_tree(by_slice))


def test_the_slices_tree_pairs_low_bits_first_and_is_the_plain_tree_otherwise() -> None:
    rows = [torch.tensor(10.0**k) for k in range(6)]
    assert torch.equal(slice_tree(rows), tree_sum(rows))
    assert slice_tree(rows[:4]).item() == ((rows[0] + rows[2]) + (rows[1] + rows[3])).item()


@given(values=st.lists(st.floats(-1e6, 1e6, width=32), max_size=70))
def test_the_pairwise_sum_is_a_sum_and_one_fixed_order_whatever_the_layout(values: list[float]) -> None:
    # The global norm's last reduction (RowSquares): the same bits from a contiguous vector and
    # from a strided one holding the same values, as a sharded step's gathered rows are.
    v = torch.tensor(values, dtype=torch.float32)
    strided = torch.stack([v, torch.zeros_like(v)], dim=1)[:, 0]
    assert torch.equal(pairwise_sum(v), pairwise_sum(strided))
    assert abs(pairwise_sum(v).item() - sum(values)) <= 1e-6 * (sum(map(abs, values)) + 1)
