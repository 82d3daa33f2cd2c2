"""The digits example as a plain PyTorch script: what ``python -m fnloop.examples.digits`` does, by hand.

Run: python benchmarks/digits_plain.py [--max-iter 1500]

The same split, model, initial weights, batch size, AdamW with 50 steps of
warm-up then cosine, and validation every 250 steps; no checkpoints or logs.
Prints ``test accuracy: 0.xxxx``. ``run.py`` times it against the example, each
in fresh processes, from process start to exit.
"""

from __future__ import annotations

import argparse
import math

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F

BATCH_SIZE, LR, WARMUP, EVAL_EVERY = 64, 3e-3, 50, 250


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-iter", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, val, test = order[:1300], order[1300:1500], order[1500:]

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    def factor(i: int) -> float:
        return min(1.0, (i + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * i / args.max_iter))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)

    def accuracy(index: torch.Tensor) -> float:
        model.eval()
        with torch.no_grad():
            right = (model(x[index]).argmax(1) == y[index]).float().mean().item()
        model.train()
        return right

    gen = torch.Generator().manual_seed(args.seed)
    perm, at = torch.randperm(len(train), generator=gen), 0
    for i in range(args.max_iter):
        if at + BATCH_SIZE > len(perm):
            perm, at = torch.randperm(len(train), generator=gen), 0
        batch = train[perm[at : at + BATCH_SIZE]]
        at += BATCH_SIZE
        opt.zero_grad()
        F.cross_entropy(model(x[batch]), y[batch]).backward()
        opt.step()
        schedule.step()
        if (i + 1) % EVAL_EVERY == 0:
            accuracy(val)
    print(f"test accuracy: {accuracy(test):.4f}")


if __name__ == "__main__":
    main()
