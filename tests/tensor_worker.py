"""Tensor-parallel jobs, each run the same way at any world size: alone it is the reference.

    python tests/tensor_worker.py RESULTS JOB[:BACKEND]...                         # one process, whole
    torchrun --standalone --nproc_per_node=2 tests/tensor_worker.py RESULTS JOB... # T=2
    torchrun --standalone --nproc_per_node=4 tests/tensor_worker.py RESULTS JOB... # T=2 x 2 copies
    torchrun ... --nproc_per_node=4 tests/tensor_worker.py RESULTS --shard full JOB...  # T=2 x 2 shards

Each job writes ``RESULTS/<job>/rank{r}.pt``: its losses and recorded metrics, the whole parameters
(``fl.unshard``), the bytes this rank's parameters and optimizer state take and those of the split
layers alone, and the collectives in the step's graph (counted where the compiler sees it). The
global batch is the same at every world size; each copy of the model takes its rows.

Jobs (a compiled one's backend after a colon: ``llama:inductor``; else the suite's, ``$FNLOOP_BACKEND``):

- ``llama``: ``transformers``' Llama (2 layers, tiny), compiled, AdamW after a global-norm clip,
  ``stats="model"``, 30 steps; then written with ``fl.save_weights``.
- ``gpt2``: GPT-2 (2 layers, tiny), compiled, 30 steps, at its default dropout (0.1): the residual and
  embedding dropout on whole activations, the attention's on each rank's heads.
- ``slices``: the ``gpt2`` job under the world-size-invariant mode (``invariant=4``): each slice of the
  global batch draws its own masks, whichever copy runs it; sharded, gathered all at once.
- ``sequence``: the ``llama`` job under sequence parallelism (the built-in plan's ``sequence=True``).
- ``JOB@MODE`` (``llama@optimizer``): the job with its copies sharded so (``init(..., shard=MODE)``),
  whatever ``--shard`` says; written to ``RESULTS/JOB@MODE``.
- ``quiet``: the same GPT-2 with every dropout 0; sharded, its parameters gathered all at once
  (``blocks=()``), where the Llama's are gathered block by block.
- ``eager``: the Llama run op by op, two micro-batches a step, 6 steps.
- ``compose``: the Llama's 6 steps with 2 steps per call, bf16 autocast, activation checkpointing, and
  fp16 under dynamic loss scaling, each.
- ``resume``: the Llama saved at step 10 of 20 with ``fl.save``, loaded and run on to 20; and a run of
  4 steps checkpointing every 2 in the background (and checking that the ranks agree,
  ``check_replicas``), resumed with ``fl.checkpoint.resume``.
- ``continue``: at 2 ranks, no tensor parallelism, sharded (``--shard``): the ``resume`` job's file of
  step 10 from ``--from FOLDER`` loaded and trained to step 20.

``--shard MODE``: where the world holds several copies of the model, they shard it (``init(...,
shard=MODE)``: T=2 x 2 shards at 4 ranks) instead of training as data parallel; ``--replicate R``:
in ``R`` copies of that (T=2 x 2 shards x 2 copies at 8 ranks).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

import fnloop as fl

VOCAB, ROWS, CONTEXT = 64, 8, 16


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
    )
    return LlamaForCausalLM(config)


def gpt2(dropout: float = 0.1) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=CONTEXT,
        attn_pdrop=dropout,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
    )
    return GPT2LMHeadModel(config)


SHARD: dict[str, Any] = {"mode": None, "replicate": 1}
"""``--shard``'s mode: how the copies of the model keep it (``None``: whole, data parallel); ``--replicate``'s copies of that."""


def layout(world: int, mode: str = "") -> dict:
    """``fl.init``'s layout arguments at ``world`` ranks: T=2 where there are 2 ranks or more, the copies sharded
    under ``--shard`` (or ``mode``, a job's own: ``llama@optimizer``)."""
    degree = min(world, 2)
    if not (mode or SHARD["mode"]) or world == degree:
        return {"tensor": degree}
    return {"tensor": degree, "shard": mode or SHARD["mode"], "replicate": SHARD["replicate"]}


def lm_loss(forward, ids):
    return forward(input_ids=ids, labels=ids).loss


def _watch_graphs(seen: list[dict]) -> None:
    """Count the collectives of each graph the step traces (before any compiler sees it)."""
    import fnloop._compile.jit as jit

    real = jit.trace
    functional = torch.ops._c10d_functional

    def trace(*args, **kwargs):
        traced = real(*args, **kwargs)
        targets = [n.target for n in traced.nodes]
        seen.append(
            {
                "all_reduce": targets.count(functional.all_reduce.default),
                "all_gather": targets.count(functional.all_gather_into_tensor.default),
                "reduce_scatter": targets.count(functional.reduce_scatter_tensor.default),
            }
        )
        return traced

    jit.trace = trace


def leaves(opt_state) -> dict[str, torch.Tensor]:
    """The optimizer state's tensors by path."""
    flat = pytree.tree_flatten_with_path(opt_state)[0]
    return {pytree.keystr(path): t for path, t in flat if isinstance(t, torch.Tensor)}


def held(state: fl.TrainState) -> dict[str, int]:
    """The bytes this rank holds of each parameter and the optimizer state kept for it, by name."""
    out = {name: t.nbytes for name, t in state.params.items()}
    for path, t in pytree.tree_flatten_with_path(state.opt_state)[0]:
        names = [k.key for k in path if isinstance(k, pytree.MappingKey) and k.key in out]
        if isinstance(t, torch.Tensor) and names:
            out[names[-1]] += t.nbytes
    return out


def job(spec: str, out: Path, world: int, rank: int, graphs: list[dict]) -> None:
    spec, _, backend = spec.partition(":")
    name, _, mode = spec.partition("@")
    torch.manual_seed(0)
    model = {"gpt2": gpt2, "slices": gpt2, "quiet": lambda: gpt2(0.0)}.get(name, llama)()
    plan = fl.TensorPlan.builtin(model, 2, sequence=True) if name == "sequence" and world > 1 else None
    degree = min(world, 2)
    copies, copy = world // degree, rank // degree
    generator = torch.Generator().manual_seed(1)
    steps = 6 if name == "eager" else 30
    batches = [torch.randint(0, VOCAB, (ROWS, CONTEXT), generator=generator) for _ in range(steps)]
    mine = [b.chunk(copies)[copy] for b in batches]
    optimizer = fl.optim.chain(fl.optim.clip_by_global_norm(0.5), fl.optim.adamw(1e-3))
    state = fl.init(model, optimizer, seed=3, max_iter=steps, tensor_plan=plan, **layout(world, mode))
    options = (
        {"compile": False, "accumulate": 2}
        if name == "eager"
        else {"stats": "model", "backend": backend or None}
    )
    if name in ("quiet", "slices"):
        options["blocks"] = ()
    if name == "slices":
        options["invariant"] = 4
    step = fl.train_step(model, lm_loss, optimizer, **options)
    before = len(graphs)
    losses, norms = [], []
    for batch in mine:
        state = step(state, batch)
        losses.append(float(state.metrics.latest("loss")[1]))
        if "grad_norm" in state.metrics.names:
            norms.append(float(state.metrics.latest("grad_norm")[1]))
    whole = fl.unshard(state)
    found = {
        "losses": losses,
        "grad_norms": norms,
        "params": {k: v.clone() for k, v in whole.params.items()},
        "opt_state": {k: v.clone() for k, v in leaves(whole.opt_state).items()},
        "held": held(state),
        "graphs": graphs[before:],
        "split": sorted(state.tensor.names) if state.tensor is not None else None,
        "sharded": state.shards is not None,
    }
    if name == "llama":
        fl.save_weights(state, out / spec / "model.safetensors", model)
        alone = fl.state_dict(state, rank0_only=True)
        found["alone"] = {k: v.clone() for k, v in alone.items()}
    (out / spec).mkdir(parents=True, exist_ok=True)
    torch.save(found, out / spec / f"rank{rank}.pt")


def resume(out: Path, world: int, rank: int) -> None:
    """Save at step 10 of 20 (``fl.save``), load and go on; and a run checkpointing in the background, resumed."""
    torch.manual_seed(0)
    model = llama()
    degree = min(world, 2)
    copies, copy = world // degree, rank // degree
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (ROWS, CONTEXT), generator=generator)[copy::copies] for _ in range(20)]
    optimizer = fl.optim.chain(fl.optim.clip_by_global_norm(0.5), fl.optim.adamw(1e-3))
    template = fl.init(model, optimizer, seed=3, max_iter=20, **layout(world))
    step = fl.train_step(model, lm_loss, optimizer)
    folder = out / "resume"
    state, at10 = template, None
    for i, batch in enumerate(batches):
        if i == 10:
            fl.save(state, folder / "at10.safetensors")
            at10 = state
        state = attrs.evolve(step(state, batch), iteration=i + 1)  # as the fold counts
    try:  # rank 0 cannot write here (the folder is a file): every rank hears it, and all go on
        fl.save(state, folder / "at10.safetensors" / "nested.safetensors")
        refused = "nothing"
    except OSError as exc:
        refused = type(exc).__name__
    loaded = fl.load(folder / "at10.safetensors", like=template)
    same_at10 = all(torch.equal(loaded.params[k], at10.params[k]) for k in at10.params) and all(
        torch.equal(a, b)
        for a, b in zip(pytree.tree_leaves(loaded.opt_state), pytree.tree_leaves(at10.opt_state))
    )
    again = loaded
    for batch in batches[10:]:
        again = attrs.evolve(step(again, batch), iteration=again.iteration + 1)
    short = attrs.evolve(template, max_iter=4)
    # check_replicas compares what every rank holds alike: not the slices, nor the chunks.
    hooks = [
        fl.every(2, fl.hooks.checkpoint(folder / "ckpt", background=True)),
        fl.every(2, fl.hooks.check_replicas()),
    ]
    hooked = fl.run(short, step, batches[:4], hooks)
    resumed = fl.checkpoint.resume(folder / "ckpt", like=short)
    torch.save(
        {
            "same_at10": same_at10,
            "resumed_same": all(torch.equal(again.params[k], state.params[k]) for k in state.params),
            "hooked_iteration": resumed.iteration,
            "refused": refused,
            "hooked_same": all(torch.equal(resumed.params[k], hooked.params[k]) for k in hooked.params)
            and all(
                torch.equal(a, b)
                for a, b in zip(pytree.tree_leaves(resumed.opt_state), pytree.tree_leaves(hooked.opt_state))
            ),
            "params": {k: v.clone() for k, v in fl.unshard(state).params.items()},
            "batches": batches,
        },
        folder / f"rank{rank}.pt",
    )


def compose(out: Path, world: int, rank: int) -> None:
    """The Llama's 6 steps with each of: 2 steps per call, bf16 autocast, activation checkpointing, fp16 under
    dynamic loss scaling; the suite's backend."""
    found = {}
    for variant in ("k2", "bf16", "remat", "fp16"):
        torch.manual_seed(0)
        model = llama()
        optimizer = fl.optim.adamw(1e-3)
        options: dict = {}
        if variant == "k2":
            options = {"steps_per_call": 2}
        elif variant == "bf16":
            options = {"autocast": torch.bfloat16}
        elif variant == "remat":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            optimizer = fl.optim.dynamic_loss_scale(fl.optim.adamw(1e-3))
            options = {"autocast": torch.float16}
        degree = min(world, 2)
        copies, copy = world // degree, rank // degree
        generator = torch.Generator().manual_seed(1)
        batches = [
            torch.randint(0, VOCAB, (ROWS, CONTEXT), generator=generator)[copy::copies] for _ in range(6)
        ]
        state = fl.init(model, optimizer, seed=3, max_iter=6, **layout(world))
        final = fl.run(state, fl.train_step(model, lm_loss, optimizer, **options), batches)
        found[variant] = {
            "losses": [float(v) for _, v in final.metrics.series["loss"]],
            "params": {k: v.clone() for k, v in fl.unshard(final).params.items()},
        }
    (out / "compose").mkdir(parents=True, exist_ok=True)
    torch.save(found, out / "compose" / f"rank{rank}.pt")


def go_on(out: Path, world: int, rank: int, folder: Path) -> None:
    """The ``resume`` job's file of step 10 (``folder``), loaded at 2 ranks sharded, no tensor parallelism, run to 20."""
    torch.manual_seed(0)
    model = llama()
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (ROWS, CONTEXT), generator=generator)[rank::world] for _ in range(20)]
    optimizer = fl.optim.chain(fl.optim.clip_by_global_norm(0.5), fl.optim.adamw(1e-3))
    template = fl.init(model, optimizer, seed=3, max_iter=20, shard=SHARD["mode"])
    state = fl.load(folder / "resume" / "at10.safetensors", like=template)
    step = fl.train_step(model, lm_loss, optimizer)
    for batch in batches[10:]:
        state = attrs.evolve(step(state, batch), iteration=state.iteration + 1)
    (out / "continue").mkdir(parents=True, exist_ok=True)
    found = {
        "params": {k: v.clone() for k, v in fl.unshard(state).params.items()},
        "world": state.shards.world,
    }
    torch.save(found, out / "continue" / f"rank{rank}.pt")


def main() -> None:
    torch.set_num_threads(1)
    fl.distributed.setup()
    argv = sys.argv[1:]
    options = {}
    while argv[1].startswith("--"):
        options[argv[1]] = argv[2]
        del argv[1:3]
    SHARD.update(mode=options.get("--shard"), replicate=int(options.get("--replicate", 1)))
    out, jobs = Path(argv[0]), argv[1:]
    graphs: list[dict] = []
    _watch_graphs(graphs)
    for name in jobs:
        if name == "continue":
            go_on(out, fl.distributed.world_size(), fl.distributed.rank(), Path(options["--from"]))
        elif name in ("resume", "compose"):
            (resume if name == "resume" else compose)(out, fl.distributed.world_size(), fl.distributed.rank())
        else:
            job(name, out, fl.distributed.world_size(), fl.distributed.rank(), graphs)


if __name__ == "__main__":
    main()
