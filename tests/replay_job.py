"""A tiny job for replay tests: ``job()`` returns (state, step, batches, hooks).

With FNLOOP_TEST_NOISE set, every step from step 7 on adds unseeded noise (from
the operating system's entropy) to the weight: a planted nondeterminism.
"""

from __future__ import annotations

import os
import random

import attrs
import torch

import fnloop as fl


def mse(forward, batch):
    x, y = batch
    return ((forward(x) - y) ** 2).mean()


def noisy(step):
    def run(state, batch):
        new = step(state, batch)
        if os.environ.get("FNLOOP_TEST_NOISE") and state.iteration >= 7:
            weight = new.params["0.weight"] + random.SystemRandom().random() * 1e-3
            new = attrs.evolve(new, params={**new.params, "0.weight": weight})
        return new

    return run


def job(max_iter: int = 12):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = fl.optim.adamw(fl.optim.cosine(0.01, max_iter))
    data = (
        torch.randn(64, 4, generator=torch.Generator().manual_seed(1)),
        torch.randn(64, 1, generator=torch.Generator().manual_seed(2)),
    )
    state = fl.init(model, optimizer, seed=3, max_iter=max_iter)
    step = noisy(fl.train_step(model, mse, optimizer, compile=False))
    return state, step, fl.data.batches(data, batch_size=16, seed=4), []
