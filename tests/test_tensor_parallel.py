"""Tensor parallelism: plans, the split state, and the step under torchrun against the same jobs in one process.

The launches (``tests/tensor_worker.py``) are shared by the tests: one process (the reference, whole),
2 ranks (T=2), 4 ranks (T=2 x 2 copies, data parallel across them), 4 ranks again with the copies
sharding the state (T=2 x 2 shards, torchtitan's 2-D mesh), 8 ranks (T=2 x 2 shards x 2 copies, 3-D),
and 2 ranks that continue the 2-D run's checkpoint sharded without tensor parallelism; each runs its
jobs in one launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

import fnloop as fl
from conftest import SUITE_BACKEND
from fnloop._core.tensor_parallel import TensorParallel, joined, local_slice
from fnloop._step.layout import Layout
from fnloop._step.placement import Plan
from fnloop._step.tensor import tensor_slices
from fnloop._step.tensor_functions import SplitSequence
from fnloop._step.tensor_plans import TensorPlan, builtin_plan, layout_of
from tests import tensor_worker
from tests.launches import again_after_native_crash

WORKER = str(Path(__file__).with_name("tensor_worker.py"))
ONE_CORE_EACH = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
TOLERANCE = 1e-5


def _launched(tmp: Path, ranks: int, *jobs: str) -> Path:
    runner = [sys.executable]
    if ranks > 1:
        runner += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    out = tmp / "results"
    out.mkdir()
    # fnloop's cache off: the graph is traced (its collectives counted) however warm the caches are.
    # A job's backend is its own (JOBS), whichever test starts the launch.
    env = {**os.environ, **ONE_CORE_EACH, "FNLOOP_CACHE_DIR": "off", "FNLOOP_BACKEND": SUITE_BACKEND}

    def run() -> subprocess.CompletedProcess[str]:
        argv = [*runner, WORKER, str(out), *jobs]
        return subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)

    again_after_native_crash(tmp, run, f"{ranks} ranks")
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return _launched(tmp_path_factory.mktemp("one"), 1, *JOBS)


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    return _launched(tmp_path_factory.mktemp("two"), 2, *JOBS, "sequence")


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> Path:
    return _launched(tmp_path_factory.mktemp("four"), 4, "llama", "eager", "resume", "slices")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    jobs = ("llama", "quiet", "eager", "resume", "compose", "llama@optimizer", "sequence")
    jobs += ("slices", "slices@optimizer")  # the invariant mode: gathered at once, and on whole slices
    return _launched(tmp_path_factory.mktemp("sharded"), 4, "--shard", "full", *jobs)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Path:
    return _launched(tmp_path_factory.mktemp("hybrid"), 8, "--shard", "full", "--replicate", "2", "llama")


@pytest.fixture(scope="module")
def continued(tmp_path_factory, sharded) -> Path:
    return _launched(
        tmp_path_factory.mktemp("continued"), 2, "--shard", "full", "--from", str(sharded), "continue"
    )


# The Llama's 30 compiled steps are inductor's (the claim is what it builds); the others run the traced
# graph op by op, as the suite's compiled steps do (the same graph, its collectives counted alike).
JOBS = ("llama:inductor", "gpt2", "slices", "quiet", "eager", "resume", "compose")
RANKS = {"two": 2, "four": 4, "sharded": 4, "hybrid": 8}
SHARDS = {"two": 1, "four": 1, "sharded": 2, "hybrid": 2}
"""How many ranks shard each place's slices: the copies of the 2-D and 3-D launches shard them."""


def _result(out: Path, job: str, rank: int = 0) -> dict:
    return torch.load(out / job / f"rank{rank}.pt")


RUNS = [
    ("two", "llama"),
    ("two", "gpt2"),
    ("two", "slices"),
    ("two", "eager"),
    ("two", "sequence"),
    ("four", "llama"),
    ("four", "eager"),
    ("four", "slices"),
    ("sharded", "llama"),
    ("sharded", "quiet"),
    ("sharded", "slices"),
    ("sharded", "slices@optimizer"),
    ("sharded", "eager"),
    ("sharded", "llama@optimizer"),
    ("sharded", "sequence"),
    ("hybrid", "llama"),
]


def _reference_job(job: str) -> str:
    """The single process's job a job is compared with: itself, or the Llama's for its variants."""
    name = job.partition("@")[0]
    return "llama" if name == "sequence" else name


@pytest.mark.slow
@pytest.mark.inductor("the Llama's compiled steps at T=2 equal one process's, as inductor builds them")
@pytest.mark.parametrize(("world", "job"), RUNS)
def test_every_loss_parameter_and_moment_is_the_single_process_runs(request, reference, world, job) -> None:
    """30 compiled steps (6 eager, two micro-batches each) at T=2, T=2 x 2 copies, T=2 x 2 shards (the Llama's
    gathered block by block, GPT-2's all at once, and the Llama's with only its optimizer state sharded) and
    T=2 x 2 shards x 2 copies, and the Llama under sequence parallelism at T=2 and T=2 x 2 shards, end
    within 1e-5 of one process.

    GPT-2 trains at its default dropout (0.1): the residual and embedding dropout run on whole tensors,
    where the ranks of a copy draw one mask, the single process's; the attention's on each rank's heads,
    whose mask is drawn for every head and sliced (measured without that: losses 2.4e-3 apart). With
    copies or shards, each copy draws the masks of its rows only where the run is world-size-invariant
    (``slices``: GPT-2 at its default dropout under ``invariant=4``, against one process's run of it),
    where each slice of the batch draws its own, whichever copy runs it.
    """
    out = request.getfixturevalue(world)
    mine, whole = _result(out, job), _result(reference, _reference_job(job))
    assert mine["split"] and whole["split"] is None
    assert mine["sharded"] == (SHARDS[world] > 1)
    assert len(mine["losses"]) == len(whole["losses"])
    for a, b in zip(mine["losses"], whole["losses"]):
        assert abs(a - b) <= TOLERANCE
    for a, b in zip(mine["grad_norms"], whole["grad_norms"]):
        assert abs(a - b) <= TOLERANCE
    assert mine["params"].keys() == whole["params"].keys()
    for name, value in whole["params"].items():
        torch.testing.assert_close(mine["params"][name], value, rtol=0, atol=TOLERANCE, msg=name)
    assert mine["opt_state"].keys() == whole["opt_state"].keys()
    for name, value in whole["opt_state"].items():
        torch.testing.assert_close(mine["opt_state"][name], value, rtol=0, atol=TOLERANCE, msg=name)
    for rank in range(1, RANKS[world]):  # every rank's whole model (fl.unshard) is the same
        other = _result(out, job, rank)
        for name, value in mine["params"].items():
            assert torch.equal(other["params"][name], value), (rank, name)


@pytest.mark.slow
def test_an_invariant_run_is_the_same_bits_at_any_number_of_copies(two, four) -> None:
    """GPT-2 at its default dropout under ``invariant=4``: T=2 alone and T=2 x 2 copies, every loss and every
    parameter the same bits (each slice the same masks and the same sums, in the same order)."""
    alone, copies = _result(two, "slices"), _result(four, "slices")
    assert alone["losses"] == copies["losses"]
    for name, value in alone["params"].items():
        assert torch.equal(copies["params"][name], value), name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "job"),
    [
        ("two", "llama"),
        ("two", "gpt2"),
        ("four", "llama"),
        ("sharded", "llama"),
        ("hybrid", "llama"),
        ("two", "sequence"),
        ("sharded", "sequence"),
    ],
)
def test_the_graph_holds_one_all_reduce_per_block_each_way(request, world, job) -> None:
    """Per layer, attention and MLP: one all-reduce in the forward (the row-wise output) and one in the
    backward (the column-wise input's gradient, shared by query, key and value, and by the MLP's two
    input projections). Beside them: the embedding's forward, the head's input in the backward and
    its output gathered once; the clip's and the statistics' sums and the finiteness check; and with
    copies, data parallel's one all-reduce (one dtype).

    Sharded (2-D): the root's chunks and each block's gathered in one all-gather and their gradients
    reduce-scattered in one collective each; the clip's and the statistics' sums added over the shards
    too, the loss averaged over them; and with copies of that (3-D), the chunks' gradients all-reduced
    across the copies once.

    Under sequence parallelism each of those all-reduces is an all-gather and a reduce-scatter: the
    attention's and the MLP's input gathered on the sequence (reduce-scattered in the backward), their
    output reduce-scattered on it (gathered in the backward); the head's input gathered, the first
    layer's input cut (gathered in the backward); and each norm's weight gradient summed over the
    ranks that held a slice of the sequence each."""
    graphs = _result(request.getfixturevalue(world), job)["graphs"]
    assert len(graphs) == 1
    layers = 2
    blocks = 2 * 2 * layers  # (attention, MLP) x (forward, backward)
    sums = 3  # clip_by_global_norm, stats="model", the finiteness of the slices
    if job == "sequence":  # the embedding's forward, each norm; the head's gathers and the cut's
        collectives = {
            "all_reduce": 1 + 2 * layers + 1,
            "all_gather": blocks + 3,
            "reduce_scatter": blocks + 1,
        }
    else:  # the embedding's forward, the head's input in the backward; its output gathered
        collectives = {"all_reduce": blocks + 1 + 1, "all_gather": 1, "reduce_scatter": 0}
    collectives["all_reduce"] += sums + (world == "four")  # with copies, data parallel's one all-reduce
    if SHARDS[world] > 1:
        units = 1 + layers  # the root (embedding, norm, head), each decoder layer
        collectives["all_gather"] += units
        collectives["reduce_scatter"] += units
        # the clip's and statistics' sums over the shards; the loss and metrics averaged over them; the
        # chunks' gradients across the copies (3-D)
        collectives["all_reduce"] += 2 + 1 + (world == "hybrid")
    assert graphs[0] == collectives


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "job"),
    [
        ("two", "llama"),
        ("two", "gpt2"),
        ("four", "llama"),
        ("sharded", "llama"),
        ("sharded", "quiet"),
        ("sharded", "sequence"),
    ],
)
def test_each_rank_holds_its_part_of_each_split_layer_and_its_optimizer_state(
    request, reference, world, job
) -> None:
    """Half of each split layer's parameters and optimizer state at T=2; a quarter at T=2 x 2 shards, where
    the tensors kept whole by tensor parallelism (norms) are halved by the shards."""
    out = request.getfixturevalue(world)
    mine, whole = _result(out, job), _result(reference, _reference_job(job))
    split, shards = set(mine["split"]), SHARDS[world]
    for name, size in whole["held"].items():
        assert mine["held"][name] == size // (2 * shards if name in split else shards), name
    linear = [n for n in whole["held"] if n.endswith(("proj.weight", "c_attn.weight", "c_fc.weight"))]
    assert linear and set(linear) <= split


@pytest.mark.slow
@pytest.mark.parametrize("world", ["two", "sharded"])
def test_the_weights_written_are_the_whole_model_on_rank0_alone(request, world) -> None:
    from safetensors.torch import load_file

    out = request.getfixturevalue(world)
    whole = _result(out, "llama")
    model = tensor_worker.llama()
    model.load_state_dict(load_file(out / "llama" / "model.safetensors"))
    for name, value in model.named_parameters():
        assert torch.equal(value, whole["params"][name]), name
    assert set(whole["alone"]) == {*whole["params"], *dict(model.named_buffers())}
    for name, value in whole["alone"].items():
        assert torch.equal(value, whole["params"].get(name, value)), name
    for rank in range(1, RANKS[world]):
        assert _result(out, "llama", rank)["alone"] == {}


@pytest.mark.slow
@pytest.mark.parametrize("world", ["two", "four", "sharded"])
def test_a_checkpoint_resumes_bit_for_bit_at_its_layout(request, world) -> None:
    """``fl.save`` at step 10 of 20, ``fl.load`` with the run's template, 10 more steps: the same bits as the
    run that went on, on every rank; and a run checkpointing every 2 steps in the background resumes at 4 with its
    final state's bits. A save that rank 0 cannot write raises on every rank, and the run goes on."""
    out = request.getfixturevalue(world)
    for rank in range(RANKS[world]):
        found = torch.load(out / "resume" / f"rank{rank}.pt")
        assert found["same_at10"] and found["resumed_same"], rank
        assert found["refused"] != "nothing", rank  # a save rank 0 could not write raised on every rank
        assert found["hooked_iteration"] == 4 and found["hooked_same"], rank


@pytest.mark.slow
@pytest.mark.parametrize("world", ["two", "four", "sharded"])
def test_a_split_runs_checkpoint_goes_on_in_one_process_and_a_whole_runs_goes_on_split(
    request, reference, world, tmp_path
) -> None:
    """The file of a run at T=2 (and T=2 x 2 copies, T=2 x 2 shards) is the whole state: one process loads it and its 10 more
    steps end within 1e-5 of the single process's own run; the single process's file, loaded with a T=2 template,
    is this rank's slices of it."""
    out = request.getfixturevalue(world)
    mine = torch.load(reference / "resume" / "rank0.pt")
    model = tensor_worker.llama()
    optimizer = fl.optim.chain(fl.optim.clip_by_global_norm(0.5), fl.optim.adamw(1e-3))
    template = fl.init(model, optimizer, seed=3, max_iter=20)
    state = fl.load(out / "resume" / "at10.safetensors", like=template)
    assert state.iteration == 10 and state.tensor is None
    step = fl.train_step(model, tensor_worker.lm_loss, optimizer)
    for batch in mine["batches"][10:]:
        state = attrs.evolve(step(state, batch), iteration=state.iteration + 1)
    for name, value in mine["params"].items():
        torch.testing.assert_close(state.params[name], value, rtol=0, atol=TOLERANCE, msg=name)
    # The whole run's file as rank 1's slices of a T=2 layout.
    split = layout_of(model, builtin_plan(model, 2), 2, 1)
    whole = fl.load(reference / "resume" / "at10.safetensors", like=template)
    sliced = fl.load(
        reference / "resume" / "at10.safetensors",
        like=attrs.evolve(
            template,
            params=tensor_slices(template.params, split),
            tensor=split,
            opt_state=optimizer.init(tensor_slices(template.params, split)),
        ),
    )
    assert sliced.tensor == split
    for name, dim, parts in split.params:
        assert torch.equal(sliced.params[name], local_slice(whole.params[name], dim, parts, 2, 1)), name


@pytest.mark.slow
def test_a_2d_runs_checkpoint_goes_on_sharded_without_tensor_parallelism(reference, continued) -> None:
    """The T=2 x 2 shards run's file of step 10, loaded at 2 ranks with shard="full" alone (each rank its chunks
    of the whole tensors) and run to step 20: within 1e-5 of the single process's run, on both ranks."""
    mine = torch.load(reference / "resume" / "rank0.pt")["params"]
    for rank in range(2):
        found = torch.load(continued / "continue" / f"rank{rank}.pt")
        assert found["world"] == 2
        for name, value in mine.items():
            torch.testing.assert_close(found["params"][name], value, rtol=0, atol=TOLERANCE, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["two", "sharded"])
@pytest.mark.parametrize("variant", ["k2", "remat", "bf16", "fp16"])
def test_it_composes_with_several_steps_per_call_remat_autocast_and_loss_scaling(
    request, reference, world, variant
) -> None:
    """Several steps per call and activation checkpointing give the single process's numbers within 1e-5,
    at T=2 and at T=2 x 2 shards (each layer's chunks gathered anew for its recomputation); under bf16 and
    fp16 autocast, within their rounding (measured: losses 1e-4 and 1e-5 apart, parameters 2e-3 after 6
    steps), the sums over the ranks being made in another order."""
    mine, whole = (
        torch.load(request.getfixturevalue(world) / "compose" / "rank0.pt")[variant],
        torch.load(reference / "compose" / "rank0.pt")[variant],
    )
    loss, param = (1e-5, 1e-5) if variant in ("k2", "remat") else (1e-3, 1e-2)
    assert len(mine["losses"]) == len(whole["losses"]) == 6
    for a, b in zip(mine["losses"], whole["losses"]):
        assert abs(a - b) <= loss
    for name, value in whole["params"].items():
        torch.testing.assert_close(mine["params"][name], value, rtol=0, atol=param, msg=name)


# ------------------------------------------------------------------ in one process: plans and records


def _llama(**config) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    defaults = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    defaults["num_attention_heads"] = 4
    return LlamaForCausalLM(LlamaConfig(**{**defaults, **config}))


def test_a_slice_and_the_slices_joined_are_each_others_inverse() -> None:
    whole = torch.arange(2 * 24).view(2, 24)
    for parts in (1, 3):
        for degree in (1, 2, 4):
            slices = [local_slice(whole, 1, parts, degree, r) for r in range(degree)]
            assert all(s.shape == (2, 24 // degree) for s in slices)
            assert torch.equal(joined(slices, 1, parts), whole)
    # GPT-2's fused query-key-value: each rank holds its slice of each of the three.
    assert local_slice(torch.arange(12), 0, 3, 2, 1).tolist() == [2, 3, 6, 7, 10, 11]


def test_the_llama_plan_splits_the_projections_and_the_vocabulary() -> None:
    model = _llama(num_key_value_heads=2)
    split = layout_of(model, builtin_plan(model, 2), 2, 1)
    dims = {name: dim for name, dim, _ in split.params}
    assert dims == {
        "model.embed_tokens.weight": 0,
        **{f"model.layers.0.self_attn.{p}_proj.weight": 0 for p in "qkv"},
        "model.layers.0.self_attn.o_proj.weight": 1,
        "model.layers.0.mlp.gate_proj.weight": 0,
        "model.layers.0.mlp.up_proj.weight": 0,
        "model.layers.0.mlp.down_proj.weight": 1,
        "lm_head.weight": 0,
    }
    assert split.degree == 2 and split.rank == 1 and split.divided == ()


def test_the_llama_plan_with_sequence_parallelism_cuts_the_sequence_where_the_layers_begin() -> None:
    """The norms run on slices of the sequence, the attention and the MLP gather their input's, the first
    layer's input is cut; what is split of the parameters is the plan's without it."""
    model = _llama(num_key_value_heads=2, num_hidden_layers=2)
    plain, plan = fl.TensorPlan.builtin(model, 2), fl.TensorPlan.builtin(model, 2, sequence=True)
    split = layout_of(model, plan, 2, 0)
    styles = {name: style for name, style, _ in split.layers}
    assert styles["model.layers.0"] == "split" and "model.layers.1" not in styles
    for layer in ("model.layers.0.", "model.layers.1."):
        assert styles[f"{layer}input_layernorm"] == styles[f"{layer}post_attention_layernorm"] == "sequence"
        assert styles[f"{layer}self_attn"] == styles[f"{layer}mlp"] == "gather"
    assert styles["model.norm"] == "sequence" and styles["lm_head"] == "gathered"
    assert split.sequence and not layout_of(model, plain, 2, 0).sequence
    assert split.params == layout_of(model, plain, 2, 0).params


def test_sequence_parallelism_is_refused_where_it_would_not_be_the_same_run() -> None:
    from torch.distributed.tensor.parallel import SequenceParallel
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16))
    with pytest.raises(ValueError, match=r"GPT-2 drops out on its residual stream"):
        fl.TensorPlan.builtin(gpt2, 2, sequence=True)
    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 8))
    split = layout_of(model, TensorPlan({"0": SequenceParallel(), "1": "colwise"}), 2, 0)
    assert split.layers[0][:2] == ("0", "sequence") and split.params == (("1.weight", 0, 1), ("1.bias", 0, 1))
    with pytest.raises(
        ValueError, match=r"cuts the sequence \(dimension 1.*shape \(2, 5, 4\).*length 2 divides"
    ):
        SplitSequence.apply(torch.zeros(2, 5, 4), None, 2, 0)


def test_attention_dropout_on_a_ranks_heads_is_its_part_of_the_whole_runs() -> None:
    """Inside an attention holding a rank's heads, scaled_dot_product_attention with dropout is torch's own
    (the same bits at T=1), its mask drawn for every head: each rank's output is its heads of the whole."""
    from fnloop._step.tensor_functions import whole_masks

    q, k, v = (torch.randn(2, 4, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)

    module = Attention()
    torch.manual_seed(0)
    whole = module(q, k, v)
    for rank, heads in enumerate((slice(0, 2), slice(2, 4))):
        torch.manual_seed(0)
        with whole_masks([module], 2, rank):
            mine = module(q[:, heads], k[:, heads], v[:, heads])
        assert torch.equal(mine, whole[:, heads]), rank
    torch.manual_seed(0)
    with whole_masks([module], 1, 0):
        assert torch.equal(module(q, k, v), whole)
    torch.manual_seed(0)
    assert not torch.equal(module(q[:, 2:], k[:, 2:], v[:, 2:]), whole[:, 2:])  # without it: another mask


def test_the_gpt2_plan_splits_conv1d_on_its_own_dimensions_and_divides_the_split_size() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16))
    split = layout_of(model, builtin_plan(model, 2), 2, 0)
    params = {name: (dim, parts) for name, dim, parts in split.params}
    assert params == {
        "transformer.wte.weight": (0, 1),  # tied with lm_head: split on the same rows
        "transformer.h.0.attn.c_attn.weight": (1, 3),  # Conv1D: [in, out]
        "transformer.h.0.attn.c_attn.bias": (0, 3),
        "transformer.h.0.attn.c_proj.weight": (0, 1),
        "transformer.h.0.mlp.c_fc.weight": (1, 1),
        "transformer.h.0.mlp.c_fc.bias": (0, 1),
        "transformer.h.0.mlp.c_proj.weight": (0, 1),
    }
    assert set(split.divided) == {
        ("transformer.h.0.attn", "split_size"),
        ("transformer.h.0.attn.c_attn", "nf"),
        ("transformer.h.0.mlp.c_fc", "nf"),
    }


def test_torch_styles_are_taken_as_the_plans_words() -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    model.append(torch.nn.Linear(4, 8))
    plan = {
        "0": RowwiseParallel(input_layouts=Replicate()),
        "1": ColwiseParallel(),
        "2": RowwiseParallel(),
        "3": ColwiseParallel(output_layouts=Replicate()),
    }
    split = layout_of(model, TensorPlan(plan), 2, 0)
    assert [(n, s) for n, s, _ in split.layers] == [
        ("0", "vocab"),
        ("1", "colwise"),
        ("2", "rowwise"),
        ("3", "gathered"),
    ]


def test_a_plan_that_does_not_fit_the_model_says_where_and_the_fix() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    with pytest.raises(ValueError, match=r"'9' matches no module .*named_modules"):
        layout_of(model, TensorPlan({"9": "colwise"}), 2, 0)
    with pytest.raises(ValueError, match=r"'colwise' applies to an nn.Linear .* ReLU"):
        layout_of(model, TensorPlan({"1": "colwise"}), 2, 0)
    with pytest.raises(ValueError, match=r"must be one of .*'sideways'"):
        layout_of(model, TensorPlan({"0": "sideways"}), 2, 0)
    with pytest.raises(ValueError, match=r"0.weight .* has 6 along the dimension split, which 4 ranks"):
        layout_of(model, TensorPlan({"0": "colwise"}), 4, 0)
    with pytest.raises(ValueError, match=r"'0' is matched by '\?' and by an earlier pattern"):
        layout_of(model, TensorPlan({"0": "colwise", "?": "colwise"}), 2, 0)
    with pytest.raises(ValueError, match=r"divide\['0'\] names 0.width"):
        layout_of(model, TensorPlan({"0": "colwise"}, divide={"0": ("width",)}), 2, 0)
    tied = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match=r"0.weight is tied between '0' and '1'"):
        layout_of(tied, TensorPlan({"0": "vocab", "1": "rowwise"}), 2, 0)
    assert layout_of(tied, TensorPlan({"0": "vocab", "1": "gathered"}), 2, 0).params == (("0.weight", 0, 1),)


def test_the_built_in_plans_check_the_heads_and_name_the_way_out() -> None:
    with pytest.raises(ValueError, match=r"config.num_key_value_heads is 1, which 2 ranks"):
        builtin_plan(_llama(num_key_value_heads=1), 2)
    with pytest.raises(
        ValueError, match=r"built-in .* this model is a Sequential.*tensor_plan=fnloop.TensorPlan"
    ):
        builtin_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2)


def test_init_refuses_what_tensor_parallelism_does_not_do_yet() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    optimizer = fl.optim.sgd(0.1)
    with pytest.raises(ValueError, match=r"tensor=2\) at 1 rank\(s\).*multiple of 2"):
        fl.init(model, optimizer, seed=0, max_iter=1, tensor=2, tensor_plan={"0": "colwise"})
    with pytest.raises(ValueError, match=r"tensor_plan=\.\.\.\) is given, but tensor is 1"):
        fl.init(model, optimizer, seed=0, max_iter=1, tensor_plan={"0": "colwise"})
    with pytest.raises(ValueError, match=r"init\(tensor=\.\.\.\) must be a positive int"):
        fl.init(model, optimizer, seed=0, max_iter=1, tensor=0)
    with pytest.raises(TypeError, match=r"'tensor' must be a fnloop.TensorParallel"):
        fl.TrainState(max_iter=1, tensor="2")


def test_the_invariant_mode_shares_the_slices_over_the_copies_of_a_split_model(monkeypatch) -> None:
    """Under tensor parallelism the slices of the batch go to the copies of the model, not to the ranks."""
    import fnloop._step.placement as placement

    split = TensorParallel(2, 0, (("0", "colwise", 1),), (), (("0.weight", 0, 1),))
    monkeypatch.setattr(placement, "world_size", lambda: 4)
    Plan(slices=2).check(Layout(tensor=split))  # 2 copies of T=2: a slice each
    Plan(slices=4).check(Layout(tensor=split))
    monkeypatch.setattr(placement, "world_size", lambda: 6)
    with pytest.raises(
        ValueError, match=r"invariant=2\) at 3 data-parallel copies of T=2.*numbers of copies \[1, 2\]"
    ):
        Plan(slices=2).check(Layout(tensor=split))
    monkeypatch.setattr(placement, "world_size", lambda: 4)
    with pytest.raises(
        ValueError, match=r"invariant=6\) at 4 ranks.*world sizes \[1, 2, 3, 6\] only.*here 12"
    ):
        Plan(slices=6).check(Layout())


def test_the_placement_table_gives_each_layout_its_row() -> None:
    """Which gradient stage each layout runs (placement.py's table), the invariant mode's two tensor rows too."""
    from fnloop._core.shards import Shards
    from fnloop._step.collectives import Groups
    from fnloop._step.placement import Placement
    from fnloop._step.units import units_of

    split = TensorParallel(2, 0, (("0", "colwise", 1),), (), (("0.weight", 0, 1),))
    full, optimizer = Shards("full", world=2, rank=0, rows={"0.weight": 2}), Shards("optimizer", 2, 0, {})
    blocks = units_of(torch.nn.Sequential(torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))))
    assert blocks  # a model in blocks: a "full" state gathers them one at a time

    def row(layout: Layout, slices: int | None = None, group: object = "group", units=blocks) -> str:
        return Placement(Plan(units, slices), layout, group, Groups()).row

    assert row(Layout(), group=None) == "whole"
    assert row(Layout()) == "replicas"
    assert row(Layout(shards=full)) == "blocks"
    assert row(Layout(shards=full), units=Plan().units) == "sharded"
    assert row(Layout(), slices=2) == "sliced"
    assert row(Layout(tensor=split)) == "tensor"
    assert row(Layout(tensor=split, shards=full)) == "tensor blocks"
    assert row(Layout(tensor=split, shards=full), units=Plan().units) == "tensor, sharded"
    assert row(Layout(tensor=split), slices=2) == "tensor, sliced"
    assert row(Layout(tensor=split, shards=optimizer), slices=2) == "tensor, sliced"
    assert row(Layout(tensor=split, shards=full), slices=2) == "tensor, sliced, gathered"


def test_a_hook_state_of_slices_is_refused_where_a_whole_checkpoint_would_keep_rank0s_alone(tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
    split = TensorParallel(2, 0, (("0", "colwise", 1),), (), (("0.weight", 0, 1),))
    average = {"params": {"0.weight": state.params["0.weight"].clone()}}
    state = attrs.evolve(state, tensor=split, hooks={"ema": average})
    with pytest.raises(NotImplementedError, match=r"state.hooks\['ema'\] holds this rank's slices"):
        fl.save(state, tmp_path / "ckpt.safetensors")
    assert not (tmp_path / "ckpt.safetensors").exists()
