"""The field's models under fnloop against the loops a user writes with stock PyTorch.

    python benchmarks/bench_models.py                      # the three workloads, every row (~45 min)
    python benchmarks/bench_models.py --only gpt2          # one workload (repeatable)
    python benchmarks/bench_models.py --skip-processes     # speed only: no memory, no cold/warm compile
    python benchmarks/bench_models.py --skip-cold-ranks    # every row but the 4-rank job's cold start
    python benchmarks/bench_models.py --quick              # tiny sizes, few steps: a smoke run
    python benchmarks/bench_models.py --device cuda --dtype bf16   # on a GPU, under bf16 autocast

Workloads, randomly initialised, at the library's defaults unless said:

- ``gpt2``: ``transformers``' GPT-2, 2 layers, 128 wide, 4 heads, 128 positions, a vocabulary of 256
  (bytes of the standard library's sources, ``fnloop.examples.lm``), batch 16, dropout 0.1 (its
  default), its own loss (``labels=``);
- ``resnet``: ``transformers``' ResNet-18 (basic blocks, depths 2-2-2-2, widths 64-512), 10 classes,
  on scikit-learn's digits upsampled to 3x32x32, batch 64;
- ``vit``: ``transformers``' ViT, 4 layers, 192 wide (ViT-Tiny's width), 3 heads, image 32, patch 4,
  hidden and attention dropout 0.1, 10 classes, the same digits, batch 32.

Every loop uses AdamW (lr 1e-3, weight decay 0.01). The speed rows run in one process, the loops
taking turns (interleaved), one thread; each round times ``--steps`` steps of each loop; the table
gives the median over ``--repeats`` rounds in ms per step, and each ratio as the median, lowest and
highest of the rounds' own ratios (each round compares loops that ran side by side). The loops:

- ``fnloop``: ``fl.run`` over ``train_step(...)`` (the whole step compiled, donated); each round is a
  run of its own, given its state (``donate_input=True``), as one long run threads it;
- ``fnloop model``: the same with ``compile="model"`` (the forward and backward compiled, the update
  outside the graph with torch's fused AdamW kernel, as ``torch.compile(model)`` leaves it);
- ``fnloop eager``: the same with ``compile=False``;
- ``eager``: ``zero_grad(set_to_none=True)`` / ``backward`` / ``step``, with the faster of
  ``torch.optim.AdamW(foreach=True)`` and ``AdamW(fused=True)`` (measured, named in the table);
- ``torch.compile``: the same loop around ``torch.compile(model)``, with the faster of the same two
  optimizers and, for the ResNet, the faster of inductor's layout optimization on and off;
- ``fnloop k=4``: ``train_step(..., steps_per_call=4)`` (GPT-2 only).

For the ResNet, the cold compile of the loop graph of ``steps_per_call=4`` against the single step's.
For each workload, the cold first step of a data-parallel job of 4 ranks (torchrun, one thread each,
each rank its rows of the global batch) against one rank's, taking turns (``--cold-ranks``: that
row alone):

    python benchmarks/bench_models.py --only gpt2 --cold-ranks
On glibc, a conv net's speed can depend on how the allocator served its first blocks (see the
step's page on glibc's malloc); pin it for steady numbers:

    MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824 python benchmarks/bench_models.py

Memory and compile times run each loop in fresh processes, ``--process-repeats`` rounds (3), the
loops taking turns: peak RSS over the timed steps (the high-water mark reset after the warm-up), the
first step with empty inductor and fnloop caches (cold) and with the caches that run left (warm,
from the start of the process). There fnloop runs as a script does by default: each run's first
step copies the state it is given. Every fnloop loop gives the module's weights to its state
(``fl.init(..., donate_model=True)``), so that they are held once, as the stock loops hold them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import fnloop as fl

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = "-ranks"
"""A probe's loop name ending so runs as a data-parallel job of ``JOB_RANKS`` ranks under torchrun."""
JOB_RANKS = 4
X = "\u00d7"
Batch = Any
Train = Callable[..., None]
"""``train(n, mark=None)``: ``n`` steps of a loop, built once, on its own batches.

``mark(i)`` is called before step ``i`` (the memory probe resets the RSS high-water mark there).
"""


@dataclass(frozen=True)
class Workload:
    name: str
    label: str
    build: Callable[[], torch.nn.Module]
    batches: Callable[[torch.device], list[Batch]]
    loss: Callable[[Any, Batch], torch.Tensor]
    convolutional: bool = False


def _lm_loss(forward: Any, batch: Batch) -> torch.Tensor:
    return forward(input_ids=batch, labels=batch).loss


def _image_loss(forward: Any, batch: Batch) -> torch.Tensor:
    x, y = batch
    return forward(pixel_values=x, labels=y).loss


def _text(device: torch.device, batch: int, context: int) -> list[Batch]:
    from fnloop.examples import lm

    train, _ = lm.corpus()
    gen = torch.Generator().manual_seed(1)
    rows = train[:, :context]
    return [rows[torch.randint(0, len(rows), (batch,), generator=gen)].to(device) for _ in range(8)]


def _digits(device: torch.device, batch: int, side: int) -> list[Batch]:
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    x = F.interpolate(x, size=side, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    y = torch.tensor(labels, dtype=torch.int64)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(4):
        pick = torch.randint(0, len(x), (batch,), generator=gen)
        out.append((x[pick].to(device), y[pick].to(device)))
    return out


def workloads(quick: bool) -> dict[str, Workload]:
    import transformers as T

    width, layers, batch, context = (32, 1, 4, 32) if quick else (128, 2, 16, 128)
    gpt2 = Workload(
        "gpt2",
        f"GPT-2 ({layers} layers, {width} wide, 4 heads, {context} positions, bytes), batch {batch}, dropout 0.1",
        lambda: T.GPT2LMHeadModel(
            T.GPT2Config(
                vocab_size=256,
                n_positions=context,
                n_embd=width,
                n_layer=layers,
                n_head=4,
                bos_token_id=10,  # a newline: GPT-2's own 50256 is outside a vocabulary of bytes
                eos_token_id=10,
            )
        ),
        lambda d: _text(d, batch, context),
        _lm_loss,
    )
    side, ibatch = (16, 8) if quick else (32, 64)
    sizes = ([8, 16], [1, 1], 8) if quick else ([64, 128, 256, 512], [2, 2, 2, 2], 64)
    resnet = Workload(
        "resnet",
        f"ResNet-18 ({'tiny' if quick else 'basic, 2-2-2-2, 64-512'}) on digits 3x{side}x{side}, batch {ibatch}",
        lambda: T.ResNetForImageClassification(
            T.ResNetConfig(
                layer_type="basic",
                hidden_sizes=sizes[0],
                depths=sizes[1],
                embedding_size=sizes[2],
                num_labels=10,
            )
        ),
        lambda d: _digits(d, ibatch, side),
        _image_loss,
        convolutional=True,
    )
    hidden, vlayers, vbatch = (32, 1, ibatch) if quick else (192, 4, 32)
    vit = Workload(
        "vit",
        f"ViT ({vlayers} layers, {hidden} wide, patch 4) on digits 3x{side}x{side}, batch {vbatch}, dropout 0.1",
        lambda: T.ViTForImageClassification(
            T.ViTConfig(
                image_size=side,
                patch_size=4,
                hidden_size=hidden,
                num_hidden_layers=vlayers,
                num_attention_heads=max(hidden // 64, 2),  # 3 heads of 64 at 192 wide, ViT-Tiny's
                intermediate_size=4 * hidden,
                hidden_dropout_prob=0.1,
                attention_probs_dropout_prob=0.1,
                num_labels=10,
            )
        ),
        lambda d: _digits(d, vbatch, side),
        _image_loss,
    )
    return {w.name: w for w in (gpt2, resnet, vit)}


# --------------------------------------------------------------------------- the loops


@dataclass(frozen=True)
class Settings:
    device: torch.device
    dtype: torch.dtype | None  # autocast


def _model(w: Workload, s: Settings) -> torch.nn.Module:
    torch.manual_seed(0)
    return w.build().to(s.device)


def _autocast(s: Settings) -> contextlib.AbstractContextManager[Any]:
    if s.dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(s.device.type, dtype=s.dtype)


def fnloop_loop(
    w: Workload, s: Settings, *, compile: bool | Literal["model"] = True, k: int = 1, donate: bool = False
) -> Train:
    """``fl.run`` over ``train_step``; each ``train(n)`` is a run of its own, from the last one's state.

    ``donate``: each run is given its state to write into from its first step
    (``fl.run(..., donate_input=True)``). The speed rows do so: a round is a run
    of its own only because the loops take turns, and one long run makes its
    first step's copy once. The fresh processes do not: they measure the
    default, where the first step copies the state it is given.
    """
    model = _model(w, s)
    data = w.batches(s.device)
    if fl.distributed.world_size() > 1:  # a rank of a data-parallel job: its rows of each global batch
        rank, world = fl.distributed.rank(), fl.distributed.world_size()
        data = [pytree.tree_map(lambda t: t[rank::world], b) for b in data]
    opt = fl.optim.adamw(1e-3, weight_decay=0.01)
    step = fl.train_step(model, w.loss, opt, compile=compile, autocast=s.dtype, steps_per_call=k)
    # The state takes the module's weights (no copy; the module left on meta), as the docs advise.
    state = fl.init(model, opt, seed=0, max_iter=0, donate_model=True)
    del model

    def train(n: int, mark: Callable[[int], None] | None = None) -> None:
        nonlocal state

        def batches(start: int) -> Any:
            for i in range(n):
                if mark is not None:
                    mark(i)
                yield data[(start + i) % len(data)]

        start = state.iteration
        # The run is given the only reference to its state, so the state of the first step is freed
        # once it has run: a script that keeps its initial state (the template it resumes into,
        # say) holds one more copy of the parameters and optimizer state.
        given = [fl.TrainState(**{**state.__dict__, "max_iter": start + n})]
        state = None
        state = fl.run(given.pop(), step, batches(start), donate_input=donate)

    return train


def _torch_optimizer(params: Any, kind: str) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **{kind: True})


def torch_loop(w: Workload, s: Settings, *, kind: str, compiled: dict[str, Any] | None = None) -> Train:
    model = _model(w, s)
    data = w.batches(s.device)
    net = model if compiled is None else torch.compile(model, options=compiled)
    opt = _torch_optimizer(model.parameters(), kind)
    done = [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        return net(*args, **kwargs)

    def train(n: int, mark: Callable[[int], None] | None = None) -> None:
        model.train()
        for i in range(n):
            if mark is not None:
                mark(i)
            batch = data[done[0] % len(data)]
            done[0] += 1
            with _autocast(s):
                loss = w.loss(forward, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return train


def _sync(s: Settings) -> None:
    if s.device.type == "cuda":
        torch.cuda.synchronize(s.device)


def rounds(
    loops: dict[str, Train], s: Settings, steps: int, repeats: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each round's ms per step of each loop, the loops taking turns, ``steps`` steps a turn;
    and each loop's minor page faults per step, the median over the rounds."""
    for train in loops.values():
        train(steps)  # compile and warm up: a turn's own calls (steps_per_call=4's loop graph too)
    _sync(s)
    times: dict[str, list[float]] = {name: [] for name in loops}
    faults: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(repeats):
        for name, train in loops.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            train(steps)
            _sync(s)
            times[name].append((time.perf_counter() - start) / steps * 1e3)
            faults[name].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps)
    return times, {name: statistics.median(f) for name, f in faults.items()}


def interleave(loops: dict[str, Train], s: Settings, steps: int, repeats: int) -> dict[str, float]:
    """Median ms per step of each loop, the loops taking turns, ``steps`` steps a turn."""
    return {name: statistics.median(t) for name, t in rounds(loops, s, steps, repeats)[0].items()}


def spread(values: list[float], digits: int = 2, unit: str = X) -> str:
    """``median (min-max)`` of ``values``."""
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"


def fastest(candidates: dict[str, Train], s: Settings, steps: int) -> tuple[str, Train]:
    """The faster of some versions of one loop, by a short interleaved measurement."""
    if len(candidates) == 1:
        return next(iter(candidates.items()))
    med = interleave(candidates, s, max(steps // 2, 2), 3)
    best = min(med, key=med.__getitem__)
    return best, candidates[best]


# --------------------------------------------------------------------------- one process per loop


def probe(w: Workload, s: Settings, loop: str, steps: int) -> dict[str, float]:
    """In a fresh process: the first step's seconds, then peak RSS and ms per step over ``steps`` steps."""
    import psutil
    from peers import peak_rss_mb, reset_peak_rss

    ranks = loop.endswith(RANKS)
    if ranks:
        fl.distributed.setup()
        loop = loop.removesuffix(RANKS)
    train = build_loop(w, s, loop)
    begun = time.perf_counter()
    train(4 if loop == "fnloop-k4" else 1)  # one call: of four steps for the loop graph
    _sync(s)
    first = time.perf_counter() - begun
    since_start = time.time() - psutil.Process().create_time()
    if ranks:  # the job's first step: its slowest rank's
        every: list[Any] = [None] * fl.distributed.world_size()
        torch.distributed.all_gather_object(every, (first, since_start))
        return {"first_step_s": max(f for f, _ in every), "process_s": max(p for _, p in every)}
    if loop == "fnloop-k4":
        return {"first_step_s": first, "process_s": since_start}
    _sync(s)
    timed: list[float] = []

    faults: list[int] = []

    def mark(i: int) -> None:
        # After two steps of the run: the peak covers the steady state, not the run's first step.
        if i == 2:
            _sync(s)
            reset_peak_rss()
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
            timed.append(time.perf_counter())

    train(steps + 2, mark)
    _sync(s)
    start = timed[0]
    return {
        "first_step_s": first,
        "process_s": since_start,
        "ms_per_step": (time.perf_counter() - start) / steps * 1e3,
        "faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults[0]) / steps,
        "peak_rss_mb": peak_rss_mb(),
    }


def build_loop(w: Workload, s: Settings, loop: str) -> Train:
    if loop == "fnloop":
        return fnloop_loop(w, s)
    if loop == "fnloop-eager":
        return fnloop_loop(w, s, compile=False)
    if loop == "fnloop-model":
        return fnloop_loop(w, s, compile="model")
    if loop == "fnloop-k4":
        return fnloop_loop(w, s, k=4)
    if loop.startswith("eager-"):
        return torch_loop(w, s, kind=loop.split("-", 1)[1])
    if loop.startswith("compile-"):
        _, kind, layout = loop.split("-")
        options = {} if layout == "default" else {"layout_optimization": False}
        return torch_loop(w, s, kind=kind, compiled=options)
    raise ValueError(loop)


def run_probe(name: str, loop: str, args: argparse.Namespace, caches: str) -> dict[str, float]:
    env = {
        **os.environ,
        "FNLOOP_CACHE_DIR": os.path.join(caches, "fnloop"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
    }
    runner = [sys.executable]
    if loop.endswith(RANKS):
        runner += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={JOB_RANKS}"]
        env["OMP_NUM_THREADS"] = "1"
    cmd = [*runner, __file__, "--probe", name, loop, "--device", args.device, "--dtype", args.dtype]
    cmd += ["--steps", str(args.steps)] + (["--quick"] if args.quick else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"probe {name} {loop} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # a job's ranks print the same line


def cold_ranks(w: Workload, args: argparse.Namespace, n: int) -> list[str]:
    """The cold first step of a data-parallel job of ``JOB_RANKS`` ranks against one rank's, taking turns."""
    one: list[float] = []
    job: list[float] = []
    for _ in range(n):
        with tempfile.TemporaryDirectory() as caches:
            one.append(run_probe(w.name, "fnloop", args, caches)["first_step_s"])
        with tempfile.TemporaryDirectory() as caches:
            job.append(run_probe(w.name, "fnloop" + RANKS, args, caches)["first_step_s"])
    return [
        f"A data-parallel job of {JOB_RANKS} ranks (torchrun, gloo, one thread each), cold, rounds: {n}, "
        f"taking turns with one rank: its first step (the slowest rank's) {spread(job, 1, ' s')}, against "
        f"one rank's {spread(one, 1, ' s')}: {spread([j / o for j, o in zip(job, one)])} per round.",
    ]


# --------------------------------------------------------------------------- the table


def measure(w: Workload, args: argparse.Namespace, s: Settings) -> list[str]:
    steps, repeats = args.steps, args.repeats
    optim_kinds = ["foreach", "fused"]
    kind, _ = fastest({k: torch_loop(w, s, kind=k) for k in optim_kinds}, s, steps)
    layouts = ["on", "off"] if w.convolutional and s.device.type == "cpu" else ["on"]
    compiled_candidates = {
        layout: torch_loop(w, s, kind=kind, compiled={} if layout == "on" else {"layout_optimization": False})
        for layout in layouts
    }
    layout, compiled = fastest(compiled_candidates, s, steps)
    loops = {
        "fnloop": fnloop_loop(w, s, donate=True),
        "fnloop model": fnloop_loop(w, s, compile="model", donate=True),
        "fnloop eager": fnloop_loop(w, s, compile=False, donate=True),
        "eager": torch_loop(w, s, kind=kind),
        "torch.compile": compiled,
    }
    if w.name == "gpt2":
        loops["fnloop k=4"] = fnloop_loop(w, s, k=4, donate=True)
    times, faults = rounds(loops, s, steps, repeats)
    med = {name: statistics.median(t) for name, t in times.items()}
    ref = min(("eager", "torch.compile"), key=med.__getitem__)
    lines = [
        f"#### {w.label}",
        "",
        f"Eager and `torch.compile` use `AdamW({kind}=True)`"
        + (f", inductor's layout optimization {layout} (the faster)" if len(layouts) > 1 else "")
        + f". {repeats} rounds of {steps} steps, the loops taking turns; each ratio is that of each round, "
        "as median (lowest-highest) over the rounds.",
        "",
        f"| loop | ms per step | speed against the faster of eager and `torch.compile` ({ref}) | against eager "
        "| minor page faults per step |",
        "|---|---|---|---|---|",
    ]
    for name, t in times.items():
        against_ref = [r / m for r, m in zip(times[ref], t)]
        against_eager = [e / m for e, m in zip(times["eager"], t)]
        lines.append(
            f"| {name} | {med[name]:.1f} | {spread(against_ref)} | {spread(against_eager)} | {faults[name]:.0f} |"
        )
    if "fnloop k=4" in med:
        per_call = [a / b for a, b in zip(times["fnloop"], times["fnloop k=4"])]
        lines += ["", f"`steps_per_call=4` against single steps: {spread(per_call)}."]
    if not args.skip_processes:
        lines += ["", *processes(w, args, kind, layout)]
        if not args.skip_cold_ranks:
            lines += ["", *cold_ranks(w, args, args.process_repeats)]
    return lines


def processes(w: Workload, args: argparse.Namespace, kind: str, layout: str) -> list[str]:
    loops = {
        "fnloop": "fnloop",
        "fnloop model": "fnloop-model",
        "fnloop eager": "fnloop-eager",
        "eager": f"eager-{kind}",
        "torch.compile": f"compile-{kind}-{layout}",
    }
    n = args.process_repeats
    results: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {label: [] for label in loops}
    traced: list[float] = []  # fnloop's warm first step when it traces the step (its start files removed)
    for _ in range(n):  # the loops take turns here too: a slow spell of the machine hits them all
        for label, loop in loops.items():
            with tempfile.TemporaryDirectory() as caches:
                cold = run_probe(w.name, loop, args, caches)
                warm = run_probe(w.name, loop, args, caches)
                if label == "fnloop":
                    for start in Path(caches, "fnloop", "compile").glob("*.start"):
                        start.unlink()
                    traced.append(run_probe(w.name, loop, args, caches)["first_step_s"])
            results[label].append((cold, warm))
    loop_compile = []
    if w.convolutional:  # the loop graph of several steps per call, against the single step's
        with tempfile.TemporaryDirectory() as caches:
            cold = run_probe(w.name, "fnloop-k4", args, caches)
        single = statistics.median(c["first_step_s"] for c, _ in results["fnloop"])
        loop_compile = [
            "",
            f"The loop graph of `steps_per_call=4`, cold: {cold['first_step_s']:.1f} s for its first call, "
            f"{cold['first_step_s'] / single:.2f}{X} the single step's {single:.1f} s.",
        ]

    def each(label: str, which: int, key: str) -> list[float]:
        return [runs[which][key] for runs in results[label]]

    rows = []
    warm_traced = f"{statistics.median(traced):.2f}"
    for label in loops:
        cold_s, rss = each(label, 0, "first_step_s"), each(label, 1, "peak_rss_mb")
        against_compile = [c / t for c, t in zip(cold_s, each("torch.compile", 0, "first_step_s"))]
        compiles = label in ("fnloop", "fnloop model", "torch.compile")
        against_eager = [r / e for r, e in zip(rss, each("eager", 1, "peak_rss_mb"))]
        rows.append(
            f"| {label} | {spread(cold_s, 1, ' s')} | {spread(against_compile) if compiles else '-'} "
            f"| {statistics.median(each(label, 1, 'first_step_s')):.2f} "
            f"| {warm_traced if label == 'fnloop' else '-'} "
            f"| {statistics.median(each(label, 1, 'process_s')):.1f} "
            f"| {statistics.median(each(label, 1, 'ms_per_step')):.1f} "
            f"| {statistics.median(each(label, 1, 'faults_per_step')):.0f} "
            f"| {spread(rss, 0, ' MiB')} | {spread(against_eager)} |"
        )
    return [
        f"Fresh processes, rounds: {n}, the loops taking turns: the first step (its own call) with empty "
        "inductor and fnloop caches (cold) and with the caches that run left (warm; fnloop's also with its "
        "start files removed, so that it traces the step to find its graph); the process from "
        "its start to the end of that warm first step (Python, imports, the model, the data); then, "
        "alone in its process, ms per step, minor page faults per step and peak RSS over the timed "
        "steps. Ratios are per round, median (lowest-highest); the rest are medians:",
        "",
        "| loop | first step, cold | cold against `torch.compile`'s | first step, warm (s) "
        "| warm, traced (s) | process to first step, warm (s) | ms per step, alone "
        "| page faults per step, alone | peak RSS | RSS against eager |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        *loop_compile,
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=["gpt2", "resnet", "vit"])
    parser.add_argument("--steps", type=int, default=None, help="steps per turn (default 10, quick 3)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 7, quick 2)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-processes", action="store_true", help="no memory or compile-time rows")
    parser.add_argument(
        "--process-repeats", type=int, default=None, help="rounds of fresh processes (default 3, quick 1)"
    )
    parser.add_argument(
        "--cold-ranks", action="store_true", help=f"only the cold first step of {JOB_RANKS} ranks against 1"
    )
    parser.add_argument(
        "--skip-cold-ranks", action="store_true", help=f"leave out the cold first step of {JOB_RANKS} ranks"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--probe", nargs=2, metavar=("WORKLOAD", "LOOP"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (3 if args.quick else 10)
    args.repeats = args.repeats or (2 if args.quick else 7)
    args.process_repeats = args.process_repeats or (1 if args.quick else 3)
    torch.set_num_threads(1)
    sys.path.insert(0, HERE)
    # Each round of a loop is a new fl.run over its next batches, on purpose.
    warnings.simplefilter("ignore", fl.data.DataRestarts)
    settings = Settings(torch.device(args.device), torch.bfloat16 if args.dtype == "bf16" else None)
    chosen = workloads(args.quick)
    if args.probe:
        name, loop = args.probe
        print(json.dumps(probe(chosen[name], settings, loop, args.steps)))
        return
    if args.cold_ranks:  # that row alone
        for name in args.only or list(chosen):
            print(
                "\n".join(
                    [f"#### {chosen[name].label}", *cold_ranks(chosen[name], args, args.process_repeats)]
                )
            )
        return
    print(f"device {args.device}, {args.dtype}, torch {torch.__version__}, one thread")
    for name in args.only or list(chosen):
        print("\n".join(["", *measure(chosen[name], args, settings)]), flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
