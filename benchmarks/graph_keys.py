"""The traced graph of every step layout, keyed: the same keys before and after a change mean the same graphs.

A change to how the step is composed (the placement, a transformation) that
leaves every layout's traced graph as it was changes neither the results'
bits nor the compiled step's speed. Run it on two checkouts and compare:

    PYTHONPATH=old python benchmarks/graph_keys.py > old.txt
    PYTHONPATH=new python benchmarks/graph_keys.py > new.txt
    torchrun --standalone --nproc_per_node=2 benchmarks/graph_keys.py   # and 4: sharded, HSDP, invariant

The graphs are traced with ``backend="graph"`` (no inductor): seconds each.
"""

import os
import sys
import warnings

import torch

import fnloop as fl
import fnloop._compile.jit as jit
from fnloop._compile.cache import graph_key

warnings.simplefilter("ignore")
print(fl.__file__, file=sys.stderr)
KEYS = []
real = jit.trace


def traced(function, leaves, **kw):
    t = real(function, leaves, **kw)
    KEYS.append(graph_key(t.graph, leaves, {}))
    return t


jit.trace = traced


def net():
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(6, 8)
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.GELU())
                for _ in range(2)
            )
            self.norm = torch.nn.BatchNorm1d(8)
            self.out = torch.nn.Linear(8, 3)

        def forward(self, x):
            x = self.inp(x)
            for layer in self.layers:
                x = layer(x)
            return self.out(self.norm(x))

    return Net()


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


g = torch.Generator().manual_seed(1)
world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    torch.distributed.init_process_group("gloo")
X, Y = torch.randn(24, 6, generator=g), torch.randint(0, 3, (24,), generator=g)
batch = (X[: 24 // world], Y[: 24 // world])


def opt():
    return fl.optim.chain(fl.optim.clip_by_global_norm(1.0), fl.optim.adamw(1e-2))


def case(name, init_kw=None, step_kw=None, state_of=None, steps=1):
    if step_kw is None:
        step_kw = {}
    if init_kw is None:
        init_kw = {}
    KEYS.clear()
    m = net()
    state = fl.init(m, opt(), seed=0, max_iter=8, **init_kw) if state_of is None else state_of(m)
    step = fl.train_step(m, loss_fn, opt(), backend="graph", **step_kw)
    state = step.steps(state, [batch] * steps) if steps > 1 else step(step(state, batch), batch)
    if int(os.environ.get("RANK", "0")) == 0:
        print(name, [k[:12] for k in KEYS], flush=True)


if world == 1:
    case("whole")
    case("accumulate", step_kw={"accumulate": 2})
    case("stats-blocks", step_kw={"stats": "blocks"})
    case("invariant-2", step_kw={"invariant": 2})
    case("invariant-2-stats", step_kw={"invariant": 2, "stats": "model"})
    case("steps-2", step_kw={"steps_per_call": 2}, steps=2)
    case("full-1proc", init_kw={"shard": "full"})
    case("full-1proc-invariant-4", init_kw={"shard": "full"}, step_kw={"invariant": 4})
    case("optimizer-1proc-stats", init_kw={"shard": "optimizer"}, step_kw={"stats": "parameters"})
    case(
        "population",
        state_of=lambda m: fl.population(lambda s: fl.init(m, opt(), seed=s, max_iter=8), seeds=[0, 1]),
    )
    case(
        "population-stats",
        step_kw={"stats": "model", "accumulate": 2},
        state_of=lambda m: fl.population(lambda s: fl.init(m, opt(), seed=s, max_iter=8), seeds=[0, 1]),
    )
else:
    case("replicas")
    case("replicas-stats", step_kw={"stats": "model"})
    case("full-blocks", init_kw={"shard": "full"})
    case("full-at-once", init_kw={"shard": "full"}, step_kw={"blocks": ()})
    case("full-blocks-stats-acc", init_kw={"shard": "full"}, step_kw={"stats": "blocks", "accumulate": 2})
    case("optimizer", init_kw={"shard": "optimizer"})
    case("invariant-4-whole", step_kw={"invariant": 4})
    case("invariant-4-full-blocks", init_kw={"shard": "full"}, step_kw={"invariant": 4, "stats": "model"})
    case("invariant-4-full-at-once", init_kw={"shard": "full"}, step_kw={"invariant": 4, "blocks": ()})
    case("invariant-6-full-whole", init_kw={"shard": "full"}, step_kw={"invariant": 6 if world == 2 else 4})
    case("invariant-4-optimizer", init_kw={"shard": "optimizer"}, step_kw={"invariant": 4})
    if world == 4:
        case("hsdp-blocks", init_kw={"shard": "full", "replicate": 2}, step_kw={"stats": "model"})
        case("hsdp-at-once", init_kw={"shard": "full", "replicate": 2}, step_kw={"blocks": ()})
if world > 1:
    torch.distributed.destroy_process_group()
