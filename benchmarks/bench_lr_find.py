"""``fl.find_lr`` against Lightning's ``Tuner.lr_find``: the suggestion each makes, and its wall time.

    pip install -c constraints.txt -e ".[bench]"
    python benchmarks/bench_lr_find.py                 # the digits MLP and a tiny GPT-2, one thread
    python benchmarks/bench_lr_find.py --only digits --seeds 3

Same model, data, optimizer (AdamW) and range of rates for both. Lightning's range test is one run
of ``--steps`` steps whose rate grows from ``--min-lr`` to ``--max-lr``, its suggestion where the
smoothed loss falls fastest against the rate (its default rule). fnloop's is one population: the
same range test as one member, beside ``--num`` members at constant rates over the range, the same
``--steps`` each, one compiled step for all; its suggestion by Lightning's rule on its range test
(``rule="range"``, the default), and the two rules on the constant rates beside it. Lightning runs
once per seed (``--seeds``: the weights and the data's order): its suggestions' range is the band
fnloop's is judged against. Wall times include everything each
call does (fnloop's: building the population, the compile, the steps; Lightning's: the trainer, the
steps, restoring the model). fnloop runs three times: compiled from an empty compile cache (run the
script with fresh ``FNLOOP_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` for a cold first row), again
with the cache warm, and with ``compile=False``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings
from pathlib import Path

import torch

import fnloop as fl


def digits_case():
    from fnloop.examples import digits as ex

    (x, y), _, _ = ex.digits()
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=gen)
    batches = [(x[order[i : i + 64]], y[order[i : i + 64]]) for i in range(0, len(x) - 64, 64)]

    def loss(forward, batch):
        inputs, labels = batch
        return torch.nn.functional.cross_entropy(forward(inputs), labels)

    return "digits MLP (64-128-10, batch 64)", ex.mlp, loss, batches


def gpt2_case():
    from transformers import GPT2Config, GPT2LMHeadModel

    def build():
        config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
        return GPT2LMHeadModel._from_config(config)

    text = Path(torch.__file__).with_name("nn").joinpath("modules", "module.py").read_bytes()
    ids = torch.tensor(list(text[: 64 * 8 * 200]), dtype=torch.long).reshape(-1, 64)
    batches = [ids[i : i + 8] for i in range(0, len(ids) - 8, 8)]

    def loss(forward, batch):
        return forward(input_ids=batch, labels=batch).loss

    return "GPT-2 (2 layers, 64 wide, 8 x 64 bytes of torch's source)", build, loss, batches


def fnloop_find(build, loss, batches, args, **options):
    torch.manual_seed(0)
    model = build()
    start = time.perf_counter()
    found = fl.find_lr(
        model,
        loss,
        fl.optim.adamw,
        batches,
        min_lr=args.min_lr,
        max_lr=args.max_lr,
        num=args.num,
        steps=args.steps,
        **options,
    )
    return found.suggestion, time.perf_counter() - start, found


def lightning_find(build, loss, batches, args, seed):
    import lightning as L
    from lightning.pytorch.tuner import Tuner

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build()  # its weights drawn from the seed
            self.lr = 1e-3

        def training_step(self, batch, _):
            return loss(self.model, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.lr)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(batches)

        def __getitem__(self, i):
            return batches[i]

    L.seed_everything(seed, verbose=False)
    loader = torch.utils.data.DataLoader(Data(), batch_size=None, shuffle=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1000,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Module()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        finder = Tuner(trainer).lr_find(
            module,
            train_dataloaders=loader,
            min_lr=args.min_lr,
            max_lr=args.max_lr,
            num_training=args.steps,
            update_attr=False,
        )
    return finder.suggestion(), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["digits", "gpt2"])
    parser.add_argument("--seeds", type=int, default=5, help="Lightning runs, one per seed")
    parser.add_argument("--min-lr", type=float, default=1e-6)
    parser.add_argument("--max-lr", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=100, help="both range tests' steps")
    parser.add_argument("--num", type=int, default=13, help="fnloop's constant rates (members)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = {"digits": digits_case, "gpt2": gpt2_case}
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    for key, make in cases.items():
        if args.only and key != args.only:
            continue
        name, build, loss, batches = make()
        ours, took, found = fnloop_find(build, loss, batches, args)
        _, warm, _ = fnloop_find(build, loss, batches, args)  # the compile cache now holds its graph
        eager, eager_took, _ = fnloop_find(build, loss, batches, args, compile=False)
        theirs = [lightning_find(build, loss, batches, args, seed) for seed in range(args.seeds)]
        suggestions = [s for s, _ in theirs]
        low, high = min(suggestions), max(suggestions)
        # The same rate computed two ways (a scheduler, a power) differs in its last bits.
        inside = ours is not None and low * (1 - 1e-9) <= ours <= high * (1 + 1e-9)
        print(f"\n{name}")
        print(found)
        print("| | suggestion | wall time (s) |\n|---|---:|---:|")
        said = "none" if ours is None else f"{ours:.3g}"
        print(
            f"| fnloop find_lr (a range test and {args.num} rates, {args.steps} steps, one population) | {said} | {took:.1f} |"
        )
        print(f"| the same, again (fnloop's compile cache warm) | {said} | {warm:.1f} |")
        print(
            f"| the same, compile=False | {'none' if eager is None else f'{eager:.3g}'} | {eager_took:.1f} |"
        )
        for seed, (s, t) in enumerate(theirs):
            print(f"| Lightning lr_find, seed {seed} ({args.steps} steps) | {s:.3g} | {t:.1f} |")
        spread = math.log10(high / low) if low > 0 else math.nan
        print(
            f"Lightning's range {low:.3g} to {high:.3g} ({spread:.2f} decades); fnloop's suggestion "
            f"{'inside' if inside else 'outside'} it; median Lightning time {statistics.median(t for _, t in theirs):.1f} s"
        )


if __name__ == "__main__":
    main()
