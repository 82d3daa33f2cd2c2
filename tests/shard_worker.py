"""A small sharded run for the sharding tests; the same script on one process or under torchrun.

    torchrun --standalone --nproc_per_node=N tests/shard_worker.py RESULTS [options] [--then RESULTS [options] ...]

It trains a small network of three blocks whose first dimensions do not divide by the
world size (the chunks are padded) with AdamW behind a global-norm clip, on fixed data
(global batch 8), and saves what the tests compare into ``RESULTS/rank{r}.pt``:
the whole parameters (``fl.state_dict``, gathered; and ``rank0_only``, as ``alone``), the loss and global-norm
history, the bytes of the state this rank holds, and the number of compiled
graphs. ``--then`` starts another job in the same processes, after the one before ended (one launch,
several runs: the tests share launches where they need the same ranks). Every job also writes its
weights with ``fl.save_weights`` into ``RESULTS/model.safetensors`` (and a transformers model's
``config.json`` beside them). Each job also writes the
warnings it gave into ``RESULTS/warnings{r}.json``.

Options:
    --shard MODE       None (data parallel), full or optimizer
    --replicate R      init(..., replicate=R): R copies of the sharded state (HSDP)
    --max-iter N       steps in all (default 50)
    --compile          compile the step (default: eager)
    --backend NAME     its backend, inductor or graph (default: $FNLOOP_BACKEND, as the test's)
    --steps-per-call K train_step(..., steps_per_call=K)
    --checkpoint DIR   resume from DIR, and checkpoint into it every --every steps
    --every N          (default 10)
    --background       checkpoint(..., background=True): saves off the training path
    --die-at I         every rank ends its process at once (os._exit) after step I
    --kill-in-save R:I:WHEN
                       rank R SIGKILLs itself while saving the checkpoint of iteration I, WHEN
                       "before" or "after" writing its own file (rank 0's is the index), in the
                       launcher's first attempt only
    --sigterm-at I     rank 0 sends SIGTERM to its launcher (torchrun forwards it to every rank) at
                       AFTER_STEP of step I: a preemption
    --blocks none      gather every parameter before the forward (train_step(..., blocks=())); default:
                       the three blocks one at a time
    --model KIND       net (default), gpt2 or llama: a transformers model of two layers from a tiny
                       config, dropout on, activation checkpointing on, on random tokens
    --bf16             train_step(..., autocast=torch.bfloat16)
    --watch            float16 with dynamic loss scaling (an initial scale of 2**24, growth every 3 steps: it
                       overflows often), spikes skipped (a window of 8, 3 sigma) and stats="blocks"; RESULTS
                       holds each step's overflow, loss_scale, spike and norms
    --accumulate K     train_step(..., accumulate=K)
    --from DIR:I       start from DIR's checkpoint of iteration I (at this job's world size)
    --lose-rank R:I:HOW
                       rank R, alone, at AFTER_STEP of step I: HOW "kill" (SIGKILL) or "raise" (an
                       error of its own); every rank writes RESULTS/left{r}.json as its run ends
                       with an error (the time, and the error)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import warnings
from pathlib import Path

import torch
from gathered import live
from torch.utils import _pytree as pytree
from worker_exit import jobs, leave

import fnloop as fl
from fnloop import Phase

BATCH = 8


class Net(torch.nn.Module):
    """An input layer, three blocks in a ``ModuleList`` (a sharded step gathers them one at a time), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 17)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(17, 9), torch.nn.Tanh(), torch.nn.Linear(9, 17))
            for _ in range(3)
        )
        self.head = torch.nn.Linear(17, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Net()


def language_model(kind: str) -> torch.nn.Module:
    """A ``transformers`` GPT-2 or Llama of two layers from a tiny config, dropout on (GPT-2's default 0.1),
    each layer recomputed in the backward (activation checkpointing, non-reentrant)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=61, n_positions=16, n_embd=16, n_layer=2, n_head=2)
        net = GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=61,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
        )
        net = LlamaForCausalLM(config)
    net.activation_checkpointing_enable()
    return net.train()


def tokens() -> torch.Tensor:
    return torch.randint(0, 61, (64, 12), generator=torch.Generator().manual_seed(1))


def lm_loss(forward, batch):
    return forward(input_ids=batch, labels=batch).loss


def _watch_graphs(seen: list[dict]) -> None:
    """Record, for each graph the regathering pass sees, its collectives and the gathered elements alive at once.

    ``reduces``: all-reduces. ``live_before``/``live_after``: the most elements of all-gathered tensors alive at one point of
    the graph, before and after the pass (a gather lives until the last use of what is made from it).
    """
    import fnloop._compile.jit as jit

    real = jit.regathered
    functional = torch.ops._c10d_functional
    gather, scatter = functional.all_gather_into_tensor.default, functional.reduce_scatter_tensor.default
    reduce = functional.all_reduce.default

    def regathered(graph: torch.fx.GraphModule) -> int:
        count = lambda target: sum(n.target is target for n in graph.graph.nodes)  # noqa: E731
        before = live(graph.graph)
        made = real(graph)
        seen.append(
            {
                "gathers": count(gather) - made,
                "regathers": made,
                "scatters": count(scatter),
                "reduces": count(reduce),
                # The ranks each gather spans (its group's size).
                "gathered_over": sorted({n.args[1] for n in graph.graph.nodes if n.target is gather}),
                "live_before": before,
                "live_after": live(graph.graph),
            }
        )
        return made

    jit.regathered = regathered


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)


def loss_fn(forward, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(forward(x), y)


def optimizer() -> fl.optim.Optimizer:
    # A small max_norm, so that the clip acts at every step and its global norm matters.
    return fl.optim.chain(fl.optim.clip_by_global_norm(0.05), fl.optim.adamw(lr=fl.optim.cosine(3e-2, 60)))


WATCHED = (
    "loss_scale",
    "overflow",
    "spikes",
    "grad_norm",
    "param_norm",
    "update_norm",
    "grad_norm/blocks.0",
    "update_norm/head",
)
"""What ``--watch`` records into RESULTS."""


def _clip_state(state: fl.TrainState):
    """The clip's state, inside the loss scale's and the spikes' (``--watch``) or not."""
    opt_state = state.opt_state
    while isinstance(opt_state, (fl.optim.LossScaleState, fl.optim.SpikeState)):
        opt_state = opt_state.inner
    return opt_state[0]


def held_bytes(state: fl.TrainState) -> int:
    tensors = [*state.params.values(), *pytree.tree_leaves(state.opt_state)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class _Preempt:
    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, state, phase, /):
        if phase is Phase.AFTER_STEP and state.iteration == self.at and fl.distributed.rank() == 0:
            os.kill(os.getppid(), signal.SIGTERM)
        return state


class _Die:
    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, state, phase, /):
        if phase is Phase.AFTER_STEP and state.iteration == self.at:
            os._exit(3)
        return state


class _Lose:
    """Rank ``rank`` alone is lost at AFTER_STEP of ``at``: killed, or failing with an error of its own."""

    def __init__(self, rank: int, at: int, how: str, results: Path) -> None:
        self.rank, self.at, self.how, self.results = rank, at, how, results

    def __call__(self, state, phase, /):
        if phase is Phase.AFTER_STEP and state.iteration == self.at and fl.distributed.rank() == self.rank:
            self.results.mkdir(parents=True, exist_ok=True)
            (self.results / "lost.json").write_text(json.dumps({"at": time.time()}))
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"rank {self.rank} fails alone at step {self.at}")
        return state


def _kill_in_save(rank: int, iteration: int, when: str) -> None:
    """Make rank ``rank`` SIGKILL itself before or after it writes its file of the sharded save of ``iteration``."""
    from fnloop.checkpoint import _files

    real = _files.write_file

    def write_file(path, skeleton, tensors, index=None):
        mine = fl.distributed.rank() == rank and f"ckpt-{iteration:08d}." in path.name
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if mine and first and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        checksum = real(path, skeleton, tensors, index)
        if mine and first and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return checksum

    _files.write_file = write_file


def main() -> None:
    import sys

    torch.set_num_threads(1)
    for job in jobs(sys.argv[1:]):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            out = run(job)
        (out / f"warnings{fl.distributed.rank()}.json").write_text(json.dumps([str(w.message) for w in said]))
    leave(fl.distributed.rank())


def run(argv: list[str]) -> Path:
    """One job: train as ``argv`` says, and write what the tests compare; the results' directory."""
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("--shard", default="None")
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--max-iter", type=int, default=50)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument(
        "--backend", help="train_step(..., backend=...); default: $FNLOOP_BACKEND, else inductor"
    )
    parser.add_argument("--steps-per-call", type=int, default=1)
    parser.add_argument("--checkpoint")
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--background", action="store_true")
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--kill-in-save")
    parser.add_argument("--sigterm-at", type=int)
    parser.add_argument("--lose-rank")
    parser.add_argument("--blocks", choices=("found", "none"), default="found")
    parser.add_argument("--model", choices=("net", "gpt2", "llama"), default="net")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--watch", action="store_true")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--from", dest="start", help="DIR:I, start from DIR's checkpoint of iteration I")
    args = parser.parse_args(argv)
    graphs: list[dict] = []
    _watch_graphs(graphs)
    if args.kill_in_save:
        r, i, when = args.kill_in_save.split(":")
        _kill_in_save(int(r), int(i), when)
    shard = None if args.shard == "None" else args.shard
    net, opt = (model() if args.model == "net" else language_model(args.model)), optimizer()
    if args.watch:
        spikes = fl.optim.skip_spikes(opt, window=8, threshold=3.0, warmup=4)
        opt = fl.optim.dynamic_loss_scale(spikes, init_scale=2.0**24, growth_interval=3)
    state = fl.init(net, opt, seed=0, max_iter=args.max_iter, shard=shard, replicate=args.replicate)
    hooks: list = []
    if args.checkpoint:
        state = fl.checkpoint.resume(args.checkpoint, like=state)
    if args.start:
        where, at = args.start.rsplit(":", 1)
        state = fl.load(fl.checkpoint.path_for(where, int(at)), like=state)
    began = state.iteration
    if args.checkpoint:
        saving = fl.hooks.checkpoint(args.checkpoint, keep=None, background=args.background)
        hooks.append(fl.every(args.every, saving))
    if args.die_at is not None:
        hooks.append(_Die(args.die_at))
    if args.sigterm_at is not None:
        hooks.append(_Preempt(args.sigterm_at))
    out = Path(args.results)
    if args.lose_rank:
        r, i, how = args.lose_rank.split(":")
        hooks.append(_Lose(int(r), int(i), how, out))
    blocks = None if args.blocks == "found" else ()
    step = fl.train_step(
        net,
        loss_fn if args.model == "net" else lm_loss,
        opt,
        compile=args.compile,
        backend=args.backend,
        steps_per_call=args.steps_per_call,
        blocks=blocks,
        autocast=torch.float16 if args.watch else torch.bfloat16 if args.bf16 else None,
        accumulate=args.accumulate,
        stats="blocks" if args.watch else None,
    )
    batches = fl.data.batches(data() if args.model == "net" else tokens(), batch_size=BATCH, seed=0)
    rank = fl.distributed.rank()
    try:
        final = fl.run(state, step, batches, hooks)
    except Exception as exc:
        if args.lose_rank:
            out.mkdir(parents=True, exist_ok=True)
            left = {
                "at": time.time(),
                "error": f"{type(exc).__name__}: {exc}",
                "notes": getattr(exc, "__notes__", []),
            }
            (out / f"left{rank}.json").write_text(json.dumps(left))
        raise
    whole = fl.state_dict(final)
    out.mkdir(parents=True, exist_ok=True)
    # The weights to a file and to rank 0 alone, one tensor at a time (and, for transformers' models,
    # the config beside them: the folder is what from_pretrained reads).
    fl.save_weights(final, out / "model.safetensors", None if args.model == "net" else net)
    if args.model != "net" and rank == 0:
        net.config.save_pretrained(out)
    alone = fl.state_dict(final, rank0_only=True)
    torch.save(
        {
            "params": {k: v.clone() for k, v in whole.items()},
            "alone": {k: v.clone() for k, v in alone.items()},
            "losses": [float(v) for _, v in final.metrics.series["loss"]],
            "norms": [float(_clip_state(fl.unshard(final)).global_norm)] if final.iteration else [],
            "spikes": int(final.opt_state.inner.skipped) if args.watch else None,
            "watched": {
                name: [(i, float(v)) for i, v in final.metrics.series[name]]
                for name in WATCHED
                if name in final.metrics.series
            },
            "held": held_bytes(final),
            "iteration": final.iteration,
            "began": began,
            "data": final.data,
            "compiles": step.compiles,
            "graphs": graphs,
            "shards": None if final.shards is None else (final.shards.world, final.shards.rank),
            "copies": None if final.shards is None else (final.shards.replicas, final.shards.replica),
        },
        out / f"rank{rank}.pt",
    )
    return out


if __name__ == "__main__":
    main()
