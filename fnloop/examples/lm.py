"""Train a small GPT-2 on Python's own standard library, byte by byte: fnloop on a Hugging Face model.

Run it with ``python -m fnloop.examples.lm`` (``pip install -e ".[examples]"``:
it needs ``transformers``); ``--help`` lists its settings, which ``--config
FILE`` (TOML or YAML) and ``--key=value`` flags set. The model is ``transformers``' GPT-2 built from a
config (2 layers, 128 wide, 4 heads, 128 positions), randomly initialised, at
the library's defaults (dropout 0.1 in the embeddings, attention and residuals),
trained on the raw bytes (a vocabulary of 256) of the ``.py`` files that ship
with the Python running it: no download. It logs the training loss, the
validation loss and perplexity to the console and to
``runs/lm/metrics.jsonl``, checkpoints into ``runs/lm/ckpt``, and at the end
prints a few lines the model writes from a prompt. Run the same command again
after a crash or a Ctrl-C and it resumes from the newest checkpoint.
Walkthrough: ``docs/huggingface.md``.
"""

from __future__ import annotations

import functools
import math
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

import fnloop as fl

MAX_ITER = 500
BATCH_SIZE = 16
CONTEXT = 128
LR = 2e-3
WARMUP = 50
LOG_EVERY = 50
EVAL_EVERY = 100
CHECKPOINT_EVERY = 100
CORPUS_BYTES = 1_500_000
VAL_SEQUENCES = 64
PROMPT = "def main():\n"


@attrs.frozen
class Settings:
    """Train a small GPT-2 on Python's own standard library, byte by byte."""

    out: str = "runs/lm"
    """The run's directory; the same one resumes."""
    max_iter: int = MAX_ITER
    """Training steps; the learning rate schedule spans them."""
    seed: int = 0
    """Seeds the weights, data order and dropout."""
    checkpoint_every: int = CHECKPOINT_EVERY
    """Save every this many steps (and when the run ends)."""
    eval_every: int = EVAL_EVERY
    """Evaluate on the held-out sequences every this many steps (and at the end)."""
    sample: int = 200
    """Bytes to generate at the end."""
    eager: bool = False
    """Do not compile the step (debugging)."""
    quiet: bool = False
    """No console lines or progress bar (the log file is still written)."""


@functools.cache
def corpus(limit: int = CORPUS_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard library's top-level ``.py`` files as bytes, cut into training and validation sequences.

    Files are taken in name order up to ``limit`` bytes, then cut into
    sequences of ``CONTEXT`` bytes; the last ``VAL_SEQUENCES`` are held out.

    Returns:
        ``(train, validation)``: int64 tensors of shape ``(n, CONTEXT)``.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for path in sorted(stdlib.glob("*.py")):
        data += path.read_bytes()
        if len(data) >= limit:
            break
    usable = len(data[:limit]) // CONTEXT * CONTEXT
    if usable < (VAL_SEQUENCES + BATCH_SIZE) * CONTEXT:
        raise RuntimeError(
            f"found only {len(data)} bytes of Python sources in {stdlib}; the example needs more."
        )
    tokens = torch.frombuffer(data[:usable], dtype=torch.uint8).to(torch.int64)
    sequences = tokens.view(-1, CONTEXT)
    return sequences[:-VAL_SEQUENCES], sequences[-VAL_SEQUENCES:]


def gpt2() -> Any:
    """A GPT-2 over bytes, from a config: ``transformers``' defaults except its size."""
    from transformers import GPT2Config, GPT2LMHeadModel  # pip install -e ".[examples]"

    config = GPT2Config(
        vocab_size=256, n_positions=CONTEXT, n_embd=128, n_layer=2, n_head=4, bos_token_id=10, eos_token_id=10
    )
    model = GPT2LMHeadModel(config)
    # The class's name names no loss of transformers' table, which then warns at the first forward
    # (`loss_type=None` ... unrecognized) and uses the causal LM loss: name that one.
    model.loss_type = "ForCausalLM"
    return model


def loss_fn(forward: Any, batch: tuple[torch.Tensor]) -> torch.Tensor:
    """The model's own next-byte loss: ``labels=`` makes it shift and score every position."""
    (ids,) = batch
    return forward(input_ids=ids, labels=ids).loss


def val_loss(forward: Any, batch: tuple[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The validation loss of a batch (the model is in eval mode: no dropout)."""
    (ids,) = batch
    return {"loss": forward(input_ids=ids, labels=ids).loss}


def job(
    out: str = "runs/lm",
    seed: int = 0,
    max_iter: int = MAX_ITER,
    *,
    checkpoint_every: int = CHECKPOINT_EVERY,
    eval_every: int = EVAL_EVERY,
    sample: int = 200,
    compile: bool = True,
    quiet: bool = False,
) -> tuple[fl.TrainState, fl.Step, fl.data.Batches, list[fl.Hook | None], Any]:
    """The run, as data: its first state, step, batches and hooks, and the model they train.

    Args:
        out: the run's directory: checkpoints go to ``out/ckpt``, logs to ``out/metrics.jsonl``.
        seed: seeds the initial weights, the data order and dropout.
        max_iter: how many steps; the learning rate schedule spans them.
        checkpoint_every: save every this many steps (and when the run ends).
        eval_every: evaluate on the held-out sequences every this many steps (and at the end).
        sample: how many bytes ``main`` generates at the end (kept with the settings).
        compile: compile the step (``False`` runs it eagerly).
        quiet: no console lines and no progress bar (the log file is still written).

    Returns:
        ``(state, step, batches, hooks, model)``; ``state`` is also the template to load checkpoints into.
    """
    torch.set_num_threads(1)  # the bits of a run depend on the thread count: it is part of the run
    train, val = corpus()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = gpt2()
    schedule = fl.optim.warmup(fl.optim.cosine(LR, max_iter), WARMUP)
    optimizer = fl.optim.adamw(schedule, weight_decay=0.1, decay_mask=fl.optim.exclude_bias_and_norm)
    # The settings go into every checkpoint: fnloop inspect shows them, resume names what changed.
    # Where the run writes and whether it prints are no part of it: the same run in two directories
    # is the same state (a resume check compares such runs).
    settings = attrs.asdict(
        Settings(out, max_iter, seed, checkpoint_every, eval_every, sample, not compile, quiet)
    )
    settings = {k: v for k, v in settings.items() if k not in ("out", "quiet")}
    state = fl.init(model, optimizer, seed=seed, max_iter=max_iter, config=settings)
    step = fl.train_step(model, loss_fn, optimizer, compile=compile)
    batches = fl.data.batches((train,), batch_size=BATCH_SIZE, seed=seed)
    # Four forwards every few hundred steps: compiling them would cost more than it saves.
    held_out = [(rows,) for rows in val.split(16)]
    mean_loss = fl.hooks.mean_over(fl.eval_step(model, val_loss, compile=False), held_out)

    def validate(state: fl.TrainState) -> dict[str, torch.Tensor]:
        loss = torch.as_tensor(mean_loss(state)["loss"])
        return {"val_loss": loss, "val_perplexity": loss.exp()}

    writers: list[fl.writers.Writer] = [fl.writers.jsonl(Path(out) / "metrics.jsonl")]
    if not quiet:
        writers.append(fl.writers.console())
    hooks: list[fl.Hook | None] = [
        fl.hooks.timer(),
        None if quiet else fl.hooks.model_summary(model),  # parameters per block, logged at the start
        None if quiet else fl.hooks.progress(),  # drawn only when stderr is a terminal
        fl.every(eval_every, fl.hooks.evaluate(validate)),
        fl.every(LOG_EVERY, fl.hooks.log(*writers)),
        fl.every(checkpoint_every, fl.hooks.checkpoint(Path(out) / "ckpt", keep=2)),
    ]
    return state, step, batches, hooks, model


def generate(model: Any, state: fl.TrainState, prompt: str = PROMPT, length: int = 200) -> str:
    """``length`` bytes the trained model writes after ``prompt``, sampled (top 20) from a fixed seed."""
    model.load_state_dict(fl.state_dict(state, model))  # with the model: the tied lm_head too
    model.eval()
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = model.generate(
            ids,
            max_new_tokens=length,
            do_sample=True,
            top_k=20,
            pad_token_id=10,
            attention_mask=torch.ones_like(ids),
        )
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def main(argv: Sequence[str] | None = None) -> None:
    """Train (or resume), then print the validation perplexity and a sample."""
    # --config FILE (TOML or YAML) and --key=value flags; --help lists the settings (docs/config.md).
    args = fl.config.parse(Settings, argv, prog="python -m fnloop.examples.lm")
    template, step, batches, hooks, model = job(
        args.out,
        args.seed,
        args.max_iter,
        checkpoint_every=args.checkpoint_every,
        eval_every=args.eval_every,
        sample=args.sample,
        compile=not args.eager,
        quiet=args.quiet,
    )
    ckpt = Path(args.out) / "ckpt"
    try:
        state = fl.checkpoint.resume(ckpt, like=template)
    except fl.checkpoint.CheckpointMismatch as exc:
        sys.exit(f"cannot resume: {exc}\nResume with the --seed it was run with, or use another --out.")
    say(
        f"started fresh: checkpoints go to {ckpt}"
        if state is template
        else f"resumed from iteration {state.iteration} ({ckpt})"
    )
    try:
        final = fl.run(state, step, batches, hooks)
    except (fl.Preempted, KeyboardInterrupt) as stop:
        ended = getattr(stop, "state", None)
        where = f"at iteration {ended.iteration}, saved" if ended is not None else "mid-step"
        say(f"stopped {where} in {ckpt}: run the same command to resume", file=sys.stderr)
        sys.exit(stop.code if isinstance(stop, fl.Preempted) else 130)
    loss = final.metrics.latest_float("val_loss")[1]
    say(f"validation loss: {loss:.4f} (perplexity {math.exp(loss):.2f} per byte)")
    if args.sample:
        say(f"sample:\n{generate(model, final, length=args.sample)}")


def say(*args: object, **kwargs: Any) -> None:
    """``print``, on rank 0 alone under ``torchrun``."""
    if fl.distributed.is_main():
        print(*args, **kwargs)


if __name__ == "__main__":
    main()
