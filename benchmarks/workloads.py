"""The workloads every loop in ``run.py`` trains: a model, its batches, its loss and its optimizer.

Each workload is a value: ``make()`` builds a fresh model with the same initial
weights every time (seeded), so every loop starts from the same numbers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """A model, its batches and its optimizer, as the peers need them."""

    name: str
    label: str  # for the tables
    build: Callable[[], nn.Module]
    batches: Callable[[], list[Batch]]
    optimizer: str  # "sgd" or "adamw"
    lr: float

    def make(self) -> tuple[nn.Module, list[Batch]]:
        torch.manual_seed(0)
        model = self.build()
        return model, self.batches()

    def torch_optimizer(self, params) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr)
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01, foreach=True)


def loss(forward: Callable[[torch.Tensor], torch.Tensor], batch: Batch) -> torch.Tensor:
    """Cross-entropy: the loss of every workload, written once for fnloop's ``loss_fn(forward, batch)``."""
    x, y = batch
    return F.cross_entropy(forward(x), y)


def _classes(shape: tuple[int, ...], batch: int, count: int = 8) -> Callable[[], list[Batch]]:
    def make() -> list[Batch]:
        gen = torch.Generator().manual_seed(1)
        return [
            (torch.randn(batch, *shape, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
            for _ in range(count)
        ]

    return make


def mlp(width: int, depth: int = 2, inputs: int | None = None) -> Callable[[], nn.Module]:
    """``inputs -> width (x depth) -> 10`` with ReLU between."""

    def build() -> nn.Module:
        sizes = [inputs or width] + [width] * depth
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(sizes):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(sizes[-1], 10))

    return build


def cnn() -> nn.Module:
    """A small CNN for 1x28x28 images: two conv blocks with BatchNorm, dropout, a linear head."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.25),
        nn.Linear(32 * 7 * 7, 10),
    )


WIDE_BATCH = 64

TINY = Workload("tiny", "tiny MLP 32→64→10, batch 32, SGD", mlp(64, 1, 32), _classes((32,), 32), "sgd", 0.01)
WIDE = Workload(
    "wide",
    f"wide MLP 2048→2048→2048→10, batch {WIDE_BATCH}, AdamW",
    mlp(2048, 2),
    _classes((2048,), WIDE_BATCH, 4),
    "adamw",
    1e-3,
)
CNN = Workload(
    "cnn",
    "CNN (2 conv + BatchNorm, dropout) on 1x28x28, batch 64, AdamW",
    cnn,
    _classes((1, 28, 28), 64, 4),
    "adamw",
    1e-3,
)
WORKLOADS = {w.name: w for w in (TINY, WIDE, CNN)}


def wide_at(width: int) -> Workload:
    """The wide MLP at another width (for step time against width)."""
    return Workload(
        f"wide{width}",
        f"MLP {width}→{width}→{width}→10",
        mlp(width, 2),
        _classes((width,), WIDE_BATCH, 4),
        "adamw",
        1e-3,
    )
