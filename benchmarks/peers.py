"""The training loops fnloop is measured against, each on any workload of ``workloads.py``.

Every maker takes a workload and returns ``train(batches)``: a loop, built once
(model, optimizer, compiled graphs), that trains one step per batch of the
iterable it is given, however many that is. ``Clocked`` stamps the time each
batch is asked for, so every loop is timed the same way, from the inside,
without the setup of a ``Trainer`` or an ``Engine``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator

import attrs
import torch
from torch.func import functional_call, grad_and_value
from torch.nn import functional as F
from workloads import Batch, Workload, loss

import fnloop as fl

Train = Callable[[Iterable[Batch]], None]


def reset_peak_rss() -> None:
    """Reset this process's RSS high-water mark (Linux), so the next peak is measured from here."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss_mb() -> float:
    """This process's resident memory now (Linux), in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Clocked:
    """``total`` batches cycled from ``data``, stamping when each is asked for.

    After ``warm`` batches it resets the RSS high-water mark (when ``rss`` is set),
    so a peak read at the end covers the timed steps only.
    """

    def __init__(self, data: list[Batch], total: int, warm: int = 0, rss: bool = False) -> None:
        self.data, self.total, self.warm, self.rss = data, total, warm, rss
        self.stamps: list[float] = []

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[Batch]:
        for i in range(self.total):
            if self.rss and i == self.warm:
                reset_peak_rss()
            self.stamps.append(time.perf_counter())
            yield self.data[i % len(self.data)]
        self.stamps.append(time.perf_counter())

    def seconds_per_step(self) -> float:
        """The mean interval between batches after the warm ones: every step, slow ones included."""
        s = self.stamps[self.warm :]
        return (s[-1] - s[0]) / (len(s) - 1)


# --------------------------------------------------------------------------- plain PyTorch


def eager(w: Workload) -> Train:
    """``zero_grad`` / ``backward`` / ``step`` with ``torch.optim``."""
    model, _ = w.make()
    opt = w.torch_optimizer(model.parameters())

    def train(batches: Iterable[Batch]) -> None:
        model.train()
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    return train


def compile_model(w: Workload) -> Train:
    """The eager loop around ``torch.compile(model)``."""
    model, _ = w.make()
    net = torch.compile(model)
    opt = w.torch_optimizer(model.parameters())

    def train(batches: Iterable[Batch]) -> None:
        model.train()
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()

    return train


def compile_opt(w: Workload) -> Train:
    """``torch.compile(model)`` and a compiled ``opt.step()``: torch's recipe for compiling the optimizer."""
    model, _ = w.make()
    net = torch.compile(model)
    opt = w.torch_optimizer(model.parameters())

    @torch.compile(fullgraph=False)
    def opt_step() -> None:
        opt.step()

    def train(batches: Iterable[Batch]) -> None:
        model.train()
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt_step()

    return train


def compile_all(w: Workload) -> Train:
    """``torch.compile`` over a function doing forward, backward and ``opt.step()``.

    Dynamo breaks the graph at ``backward()``; the forward and ``opt.step()``
    compile as graphs of their own, the backward through AOTAutograd: this is
    torch's own recipe for compiling the optimizer too.
    """
    model, _ = w.make()
    opt = w.torch_optimizer(model.parameters())

    @torch.compile
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    def train(batches: Iterable[Batch]) -> None:
        model.train()
        for x, y in batches:
            step(x, y)

    return train


# --------------------------------------------------------------------------- the seed's loop


class HookBase:
    """The seed's hook: four methods and a back reference to the trainer."""

    trainer: SimpleTrainer | None = None

    def before_train(self) -> None:
        pass

    def after_train(self) -> None:
        pass

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass


class SimpleTrainer:
    """The seed's ``TrainerBase`` with a ``SimpleTrainer``-style eager ``run_step`` (no EventStorage)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, hooks: list[HookBase]) -> None:
        self.model, self.opt = model, opt
        self._hooks = hooks
        for h in hooks:
            h.trainer = self
        self.iter = 0

    def train(self, data: Iterable[Batch], start_iter: int, max_iter: int) -> None:
        self._data = iter(data)
        self.iter = start_iter
        try:
            for h in self._hooks:
                h.before_train()
            for self.iter in range(start_iter, max_iter):
                for h in self._hooks:
                    h.before_step()
                self.run_step()
                for h in self._hooks:
                    h.after_step()
            self.iter += 1
        finally:
            for h in self._hooks:
                h.after_train()

    def run_step(self) -> None:
        start = time.perf_counter()
        x, y = next(self._data)
        self.data_time = time.perf_counter() - start
        losses = {"loss": F.cross_entropy(self.model(x), y)}
        total = sum(losses.values())
        self.opt.zero_grad()
        total.backward()
        self.opt.step()


def seed_loop(w: Workload) -> Train:
    """A minimal copy of the seed's ``TrainerBase``/``HookBase`` loop around the eager step, no hooks."""
    model, _ = w.make()
    trainer = SimpleTrainer(model, w.torch_optimizer(model.parameters()), [])

    def train(batches: Iterable[Batch]) -> None:
        model.train()
        trainer.train(batches, 0, len(batches))  # type: ignore[arg-type]

    return train


# --------------------------------------------------------------------------- ignite, lightning


def ignite(w: Workload) -> Train:
    """pytorch-ignite's ``Engine`` around the eager step, no handlers."""
    from ignite.engine import Engine

    model, _ = w.make()
    opt = w.torch_optimizer(model.parameters())

    def update(engine: Engine, batch: Batch) -> float:
        x, y = batch
        opt.zero_grad()
        value = F.cross_entropy(model(x), y)
        value.backward()
        opt.step()
        return value  # type: ignore[return-value]  # as returned by ignite's own trainer: no sync

    def train(batches: Iterable[Batch]) -> None:
        model.train()
        Engine(update).run(batches, max_epochs=1)

    return train


def _lightning(w: Workload, defaults: bool) -> Train:
    import lightning as L

    model, _ = w.make()

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Batch, index: int) -> torch.Tensor:
            value = loss(self.model, batch)
            if defaults:
                self.log("loss", value, prog_bar=True)  # what a Lightning user writes
            return value

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return w.torch_optimizer(self.parameters())

    module = Module()
    root = tempfile.mkdtemp(prefix="fnloop-bench-lightning-")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    def train(batches: Iterable[Batch]) -> None:
        n = len(batches)  # type: ignore[arg-type]
        if defaults:
            kwargs: dict = {"default_root_dir": root}
        else:
            kwargs = {
                "enable_progress_bar": False,
                "logger": False,
                "enable_checkpointing": False,
                "enable_model_summary": False,
            }
        # The progress bar draws on stdout, and warnings on stderr: not on the benchmark's own output.
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stderr(io.StringIO()),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            trainer = L.Trainer(max_steps=n, max_epochs=1, accelerator="cpu", devices=1, **kwargs)
            trainer.fit(module, train_dataloaders=batches)

    return train


def lightning_minimal(w: Workload) -> Train:
    """Lightning's ``Trainer``: progress bar, logger, checkpointing and model summary off."""
    return _lightning(w, defaults=False)


def lightning_defaults(w: Workload) -> Train:
    """Lightning's ``Trainer`` with its defaults (in a temporary directory), logging the loss each step."""
    return _lightning(w, defaults=True)


# --------------------------------------------------------------------------- fnloop


def _fnloop(w: Workload, compile: bool) -> Train:
    model, _ = w.make()
    opt = fl.optim.sgd(w.lr) if w.optimizer == "sgd" else fl.optim.adamw(w.lr, weight_decay=0.01)
    step = fl.train_step(model, loss, opt, compile=compile)
    # The run goes on from turn to turn, as the other loops' models and optimizers do, and gives
    # each turn's state up to the next (`state = fl.run(state, ..., donate_input=True)`): one copy
    # of the parameters and optimizer state, updated in place, as in the other loops.
    states = [fl.init(model, opt, seed=0, max_iter=0)]

    def train(batches: Iterable[Batch]) -> None:
        n = len(batches)  # type: ignore[arg-type]
        state = states.pop()
        start = state.iteration
        state = fl.run(attrs.evolve(state, max_iter=start + n), step, batches, donate_input=True)
        assert state.iteration == start + n
        states.append(state)

    return train


def fnloop(w: Workload) -> Train:
    """``fl.run`` around ``fl.train_step`` (compiled), no hooks."""
    return _fnloop(w, compile=True)


def fnloop_eager(w: Workload) -> Train:
    """``fl.run`` around ``fl.train_step(..., compile=False)``."""
    return _fnloop(w, compile=False)


# --------------------------------------------------------------------------- the limit


def handwritten(w: Workload, options: dict | None = None) -> Train:
    """The fastest step we can write by hand: forward, backward and an in-place update in one compiled function.

    AdamW is written with ``lerp_``/``addcmul_`` and float32 bias corrections computed as
    ``exp(t log b)``, which inductor computes once per step (a ``b ** t`` it recomputes for every
    vector of every parameter, which costs the 2048-wide step about a fifth). Inductor's C++
    wrapper is on (the faster one for small steps; fnloop's default too).
    """
    model, _ = w.make()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    model.requires_grad_(False)  # the functional step never reads the module's own tensors
    lr, wd, b1, b2, eps = w.lr, 0.01, 0.9, 0.999, 1e-8
    mu = {k: torch.zeros_like(v) for k, v in params.items()}
    nu = {k: torch.zeros_like(v) for k, v in params.items()}
    count = torch.zeros((), dtype=torch.float32)

    def loss_of(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # functional_call writes BatchNorm's running statistics into b, in place.
        return F.cross_entropy(functional_call(model, (p, b), (x,)), y)

    opts = {"cpp_wrapper": True} if options is None else options

    @torch.compile(options=opts)
    def sgd_step(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        grads, value = grad_and_value(loss_of)(p, b, x, y)
        for k, v in p.items():
            v.sub_(lr * grads[k])
        return value

    @torch.compile(options=opts)
    def adamw_step(
        p: dict, b: dict, m: dict, v: dict, t: torch.Tensor, x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        grads, value = grad_and_value(loss_of)(p, b, x, y)
        t.add_(1)
        step_size = lr / (1 - torch.exp(t * math.log(b1)))
        bc2_sqrt = (1 - torch.exp(t * math.log(b2))).sqrt()
        for k, w_ in p.items():
            g = grads[k]
            m[k].lerp_(g, 1 - b1)
            v[k].mul_(b2).addcmul_(g, g, value=1 - b2)
            w_.mul_(1 - lr * wd)
            w_.sub_(step_size * m[k] / (v[k].sqrt() / bc2_sqrt + eps))
        return value

    def train(batches: Iterable[Batch]) -> None:
        model.train()
        if w.optimizer == "sgd":
            for x, y in batches:
                sgd_step(params, buffers, x, y)
        else:
            for x, y in batches:
                adamw_step(params, buffers, mu, nu, count, x, y)

    return train


# The order of the tables. Names are the rows' labels.
PEERS: dict[str, Callable[[Workload], Train]] = {
    "eager loop": eager,
    "torch.compile(model)": compile_model,
    "torch.compile(fwd+bwd+opt.step)": compile_all,
    "torch.compile(model), compiled opt.step": compile_opt,
    "seed TrainerBase loop": seed_loop,
    "ignite Engine": ignite,
    "Lightning, minimal": lightning_minimal,
    "Lightning, defaults": lightning_defaults,
    "fnloop, compile=False": fnloop_eager,
    "fnloop": fnloop,
    "hand-written compiled step": handwritten,
}
NEEDS = {
    "ignite Engine": "ignite",
    "Lightning, minimal": "lightning",
    "Lightning, defaults": "lightning",
}
