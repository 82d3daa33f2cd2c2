"""fnloop against the loops people use today, every row of issue 12, in one command.

    python benchmarks/run.py                  # everything (about an hour), rewrites docs/benchmarks.md
    python benchmarks/run.py --quick          # few iterations, small sizes: a smoke run of a few minutes
    python benchmarks/run.py --only peers     # one section (repeatable): machine, peers, width, memory,
                                              # digits, fold, steps, models, latency,
                                              # checkpoints
    python benchmarks/run.py --no-write       # print the tables, leave the page alone

One thread (``torch.set_num_threads(1)``). Loops in one table run in one
process, taking turns (interleaved), and each is timed from the inside (the
stamps of the batches it asks for), so the setup of a ``Trainer`` or an
``Engine`` is not counted but everything it does per step is. Medians over
repeats. The memory and end-to-end rows run each loop in fresh processes.

The page keeps its hand-written sections: only the text between
``<!-- run.py:begin NAME -->`` and ``<!-- run.py:end NAME -->`` is rewritten.
Plots go to ``docs/img/bench-*.png``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PAGE = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
sys.path.insert(0, str(HERE))

import peers  # noqa: E402
import workloads  # noqa: E402

X = "\u00d7"  # the multiplication sign of the tables
SECTIONS = [
    "machine",
    "peers",
    "width",
    "memory",
    "digits",
    "fold",
    "steps",
    "models",
    "latency",
    "checkpoints",
]
TITLE = "## Every peer, one command (`benchmarks/run.py`)"
INTRO = """\
Everything below this heading is written by `python benchmarks/run.py` (`--quick` for a smoke run,
`--only SECTION` for one table); rerun it to check any number on your machine. One thread. Loops in one
table share a process and take turns; each is timed from the inside, by the stamps of the batches it
asks for, so a `Trainer`'s or an `Engine`'s setup is not counted but all it does per step is. A ratio
above 1 means fnloop is faster."""


def section_markers(name: str) -> tuple[str, str]:
    return f"<!-- run.py:begin {name} -->", f"<!-- run.py:end {name} -->"


def write_section(name: str, text: str) -> None:
    """Rewrite the text between ``name``'s markers in the page, adding the markers at the end if absent."""
    page = PAGE.read_text()
    begin, end = section_markers(name)
    if TITLE not in page:
        page = page.rstrip("\n") + f"\n\n{TITLE}\n\n{INTRO}\n"
    if begin not in page:
        page = page.rstrip("\n") + f"\n\n{begin}\n{end}\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    page = pattern.sub(lambda _: f"{begin}\n{text.strip()}\n{end}", page, count=1)
    PAGE.write_text(page)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def fmt_time(seconds: float) -> str:
    if seconds != seconds:  # nan: the loop failed
        return "failed"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def available(name: str) -> bool:
    need = peers.NEEDS.get(name)
    return need is None or importlib.util.find_spec(need) is not None


# --------------------------------------------------------------------------- machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "not installed"


def machine(args: argparse.Namespace) -> str:
    rows = [
        ["date", datetime.date.today().isoformat()],
        ["CPU", f"{cpu_model()}, {os.cpu_count()} cores (the benchmarks use one thread)"],
        ["GPU", "none: no number here ran on CUDA"],
        ["Python", platform.python_version()],
        ["torch", torch.__version__],
        ["pytorch-ignite", version("ignite")],
        ["lightning", version("lightning")],
        [
            "last rewritten by",
            "`python benchmarks/run.py"
            + (" --quick`" if args.quick else "`")
            + (f" (sections: {', '.join(args.only)})" if args.only else ""),
        ],
    ]
    return "### The machine\n\n" + table(["", ""], rows)


# --------------------------------------------------------------------------- peers


def interleave(trains: dict[str, peers.Train], data: list, steps: int, repeats: int) -> dict[str, float]:
    """Median seconds per step of each loop over ``repeats`` turns, the order rotating each turn."""
    times: dict[str, list[float]] = {name: [] for name in trains}
    names = list(trains)
    warm = max(1, steps // 10)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            clocked = peers.Clocked(data, steps + warm, warm=warm)
            trains[name](clocked)
            times[name].append(clocked.seconds_per_step())
    return {name: statistics.median(v) for name, v in times.items()}


def build(names: list[str], w: workloads.Workload, notes: list[str]) -> dict[str, peers.Train]:
    """Build and warm up (compile) each loop; a loop that fails is left out with a note."""
    trains = {}
    for name in names:
        if not available(name):
            notes.append(f"{name}: not installed (`pip install fnloop[bench]`), row skipped.")
            continue
        try:
            train = peers.PEERS[name](w)
            _, data = w.make()
            t = time.perf_counter()
            train(peers.Clocked(data, 3))  # trace and compile
            train(peers.Clocked(data, 3))
            print(f"  built {name} ({time.perf_counter() - t:.1f} s)", flush=True)
            trains[name] = train
        except Exception as exc:  # noqa: BLE001  # a peer that breaks must not stop the others
            notes.append(
                f"{name}: failed on {w.name} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})."
            )
    return trains


PEER_SIZES = {  # steps per turn, turns: (full, quick)
    "tiny": ((1000, 5), (100, 2)),
    "wide": ((30, 5), (4, 2)),
    "cnn": ((40, 3), (5, 2)),
}


def peer_workloads(quick: bool) -> list[workloads.Workload]:
    if quick:  # small sizes: the wide MLP at width 256
        return [workloads.TINY, workloads.wide_at(256), workloads.CNN]
    return [workloads.TINY, workloads.WIDE, workloads.CNN]


def why_behind(name: str, w: str, med: dict[str, float]) -> str:
    ours, hand = med["fnloop"], med.get("hand-written compiled step", float("nan"))
    ratio = med[name] / ours
    text = f"fnloop is behind **{name}** on the {w} ({ratio:.2f}{X}): "
    if name == "hand-written compiled step":
        return text + (
            "that step is the limit of this design; what separates them is fnloop's per-call bookkeeping "
            "(the check of the inputs' signatures, recording the loss and learning rate, the fold) and "
            "fnloop's generated optimizer kernels."
        )
    if hand > med[name]:
        return text + (
            "the hand-written compiled step, which has none of fnloop's bookkeeping, is behind it too, so "
            "the cause is inductor's code for this graph against this loop's kernels, not fnloop's loop."
        )
    return (
        text + "the hand-written compiled step is ahead of it, so the gap is fnloop's own per-step overhead."
    )


def peers_section(args: argparse.Namespace) -> tuple[str, dict]:
    out = ["### Peers, side by side"]
    results: dict[str, dict[str, float]] = {}
    targets: list[list[str]] = []
    for w in peer_workloads(args.quick):
        steps, repeats = PEER_SIZES["wide" if w.name.startswith("wide") else w.name][1 if args.quick else 0]
        print(f"peers: {w.label}", flush=True)
        notes: list[str] = []
        # The loops of the previous workload are done: dynamo forgets them, so a compiled function
        # of the same code (the hand-written step) is compiled afresh, not recompiled over old guards.
        torch._dynamo.reset()
        trains = build(list(peers.PEERS), w, notes)
        _, data = w.make()
        med = interleave(trains, data, steps, repeats)
        results[w.name] = med
        ours = med.get("fnloop", float("nan"))
        rows = [[n, fmt_time(t), f"{t / ours:.2f}{X}"] for n, t in med.items()]
        out.append(f"\n**{w.label}**: {repeats} turns of {steps} steps, median.\n")
        out.append(table(["loop", "per step", "fnloop's speed-up"], rows))
        behind = [why_behind(n, w.label, med) for n, t in med.items() if n != "fnloop" and t < ours]
        behind = [b for b in behind if "compile=False" not in b]
        out += ["", *[f"- {b}" for b in behind + notes]] if behind or notes else []
        if "hand-written compiled step" in med and w.name != "tiny":
            r = ours / med["hand-written compiled step"]
            targets.append(
                [f"{w.name}: fnloop / hand-written compiled step", "≤ 1.05", f"{r:.2f}", ok(r <= 1.05)]
            )
        if w.name == "cnn" and "eager loop" in med:
            r = med["eager loop"] / ours
            targets.append(
                [
                    "cnn: compiled fnloop's speed-up over the eager loop",
                    f"≥ 1.5{X}",
                    f"{r:.2f}{X}",
                    ok(r >= 1.5),
                ]
            )
            if "fnloop, compile=False" in med:
                r = med["fnloop, compile=False"] / med["eager loop"]
                targets.append(["cnn: fnloop compile=False / eager loop", "≤ 1.1", f"{r:.2f}", ok(r <= 1.1)])
    if targets:
        out += [
            "",
            "Issue 12's targets on these rows:",
            "",
            table(["target", "goal", "measured", ""], targets),
        ]
    out.append("\n![fnloop's speed-up against each peer, per workload](img/bench-speedup.png)")
    plot_speedup(results)
    return "\n".join(out), results


def ok(met: bool) -> str:
    return "met" if met else "**missed**"


def plot_speedup(results: dict[str, dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in peers.PEERS if n != "fnloop" and any(n in r for r in results.values())]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs, ys = [], []
        for j, med in enumerate(results.values()):
            if name in med and "fnloop" in med:
                xs.append(j + (i - len(names) / 2 + 0.5) * width)
                ys.append(med[name] / med["fnloop"])
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(results)), list(results))
    ax.set_ylabel("peer's step time / fnloop's (above 1: fnloop faster)")
    ax.set_title("fnloop's speed-up against each peer, one thread")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG / "bench-speedup.png", dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- width

WIDTH_LOOPS = ["eager loop", "torch.compile(model)", "fnloop", "hand-written compiled step"]


def width_section(args: argparse.Namespace) -> str:
    widths = [64, 128, 256] if args.quick else [128, 512, 2048]
    results: dict[str, dict[int, float]] = {n: {} for n in WIDTH_LOOPS}
    for width in widths:
        w = workloads.wide_at(width)
        print(f"width: {width}", flush=True)
        notes: list[str] = []
        trains = build(WIDTH_LOOPS, w, notes)
        _, data = w.make()
        steps = max(5, int(200 * (256 / width) ** 2)) if not args.quick else 10
        for name, t in interleave(trains, data, steps, 2 if args.quick else 3).items():
            results[name][width] = t
        del trains
    rows = [[n, *[fmt_time(results[n].get(wd, float("nan"))) for wd in widths]] for n in WIDTH_LOOPS]
    plot_width(results)
    return "\n".join(
        [
            "### Step time against model width",
            "",
            f"MLP width→width→width→10, batch {workloads.WIDE_BATCH}, AdamW, interleaved per width, median.",
            "",
            table(["loop", *[str(wd) for wd in widths]], rows),
            "",
            "![step time against model width](img/bench-width.png)",
        ]
    )


def plot_width(results: dict[str, dict[int, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, by_width in results.items():
        if by_width:
            ws = sorted(by_width)
            ax.plot(ws, [by_width[w] * 1e3 for w in ws], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("width")
    ax.set_ylabel("ms per step")
    ax.set_title("Step time against width (AdamW, one thread)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG / "bench-width.png", dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- memory


def memory_child(name: str, quick: bool) -> None:
    """In a fresh process: one loop on the wide MLP; prints its step time and peak RSS as JSON."""
    torch.set_num_threads(1)
    w = workloads.wide_at(512) if quick else workloads.WIDE
    train = peers.PEERS[name](w)
    _, data = w.make()
    warm, timed = (3, 5) if quick else (5, 20)
    clocked = peers.Clocked(data, warm + timed, warm=warm, rss=True)
    before: list[float] = []

    class WithBaseline:  # notes the RSS when the timed steps begin
        def __len__(self) -> int:
            return len(clocked)

        def __iter__(self):  # type: ignore[no-untyped-def]
            for i, batch in enumerate(clocked):
                if i == warm:
                    before.append(rss_mb())
                yield batch

    inner = WithBaseline()
    train(inner)
    print(json.dumps({"s": clocked.seconds_per_step(), "peak": peers.peak_rss_mb(), "before": before[0]}))


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def memory_section(args: argparse.Namespace) -> str:
    names = [n for n in peers.PEERS if available(n)]
    procs = 1
    got: dict[str, list[dict]] = {n: [] for n in names}
    failed: dict[str, str] = {}
    for _ in range(procs):
        for name in names:
            if name in failed:
                continue
            print(f"memory: {name}", flush=True)
            cmd = [sys.executable, __file__, "--child-memory", name] + (["--quick"] if args.quick else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if proc.returncode:
                failed[name] = (proc.stderr.strip().splitlines() or ["?"])[-1][:120]
                continue
            got[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows = []
    eager = statistics.median(r["peak"] for r in got["eager loop"]) if got.get("eager loop") else float("nan")
    for name in names:
        if not got[name]:
            rows.append([name, "failed", "", "", ""])
            continue
        peak = statistics.median(r["peak"] for r in got[name])
        growth = statistics.median(r["peak"] - r["before"] for r in got[name])
        step = statistics.median(r["s"] for r in got[name])
        rows.append([name, f"{peak:.0f} MB", f"{growth:+.0f} MB", f"{peak / eager:.2f}", fmt_time(step)])
    w = "MLP 512→512→512→10" if args.quick else "2048-wide MLP"
    notes = [f"- {n}: {why}" for n, why in failed.items()]
    return "\n".join(
        [
            "### Memory",
            "",
            f"Peak RSS over the timed steps of the {w} (AdamW, batch {workloads.WIDE_BATCH}), each loop in a "
            f"fresh process (one each); the high-water mark is reset after warm-up and compile. "
            "'over start' is the peak minus the RSS when the timed steps began. The step time here is "
            "from fresh processes, one loop each, and varies more than the interleaved table above. "
            "The fnloop rows give each turn's state up to the next (`state = fl.run(state, ..., "
            "donate_input=True)`); a caller that keeps its first state alive while the run goes on "
            "holds one more copy of the parameters and optimizer state.",
            "",
            table(["loop", "peak RSS", "over start", "/ eager loop's", "step (fresh process)"], rows),
            *notes,
        ]
    )


# --------------------------------------------------------------------------- digits, end to end


def timed_process(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(), timeout=900
    )
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-300:]}")
    found = re.findall(r"test accuracy: ([0-9.]+)", proc.stdout)
    return wall, float(found[-1]) if found else float("nan")


def digits_section(args: argparse.Namespace) -> str:
    runs = 1 if args.quick else 3
    max_iter = ["--max-iter", "300"] if args.quick else []
    with tempfile.TemporaryDirectory(prefix="fnloop-bench-digits-") as d:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(d) / "inductor"), "PYTHONPATH": str(ROOT)}
        n = iter(range(1000))

        def example(*extra: str) -> list[str]:
            out = ["--out", str(Path(d) / f"run{next(n)}"), "--quiet"]
            return [sys.executable, "-m", "fnloop.examples.digits", *out, *max_iter, *extra]

        plain = [sys.executable, str(HERE / "digits_plain.py"), *max_iter]
        variants: dict[str, Callable[[], list[str]]] = {
            "plain PyTorch script (eager)": lambda: plain,
            "fnloop example, warm compile cache": example,
            "fnloop example, --eager": lambda: example("--eager"),
        }
        print("digits: cold compile", flush=True)
        cold = timed_process(example(), env)  # fills the compile cache
        got: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for _ in range(runs):
            for name, cmd in variants.items():
                print(f"digits: {name}", flush=True)
                got[name].append(timed_process(cmd(), env))
    rows = [["fnloop example, cold compile cache", f"{cold[0]:.2f} s", f"{cold[1]:.4f}", "1"]]
    for name, results in got.items():
        wall = statistics.median(r[0] for r in results)
        acc = min(r[1] for r in results)
        rows.append([name, f"{wall:.2f} s", f"{acc:.4f}", str(len(results))])
    steps = 300 if args.quick else 1500
    return "\n".join(
        [
            "### The digits example, end to end",
            "",
            f"Wall time of a fresh process from start to exit, {steps} steps, against the example's target of "
            "0.95 test accuracy (the lowest of the runs is shown); the variants alternate. The example also "
            "evaluates, logs to JSON lines and TensorBoard, keeps the best state and checkpoints every 100 "
            "steps; the plain script evaluates only. Each fnloop run's own startup is mostly imports and "
            "the compile of its step: see the compile latency table.",
            "",
            table(["run", "wall time (median)", "test accuracy", "runs"], rows),
        ]
    )


# --------------------------------------------------------------------------- scripts of others


def script_output(cmd: list[str], timeout: int = 900) -> tuple[str, bool]:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    text = (
        proc.stdout.strip("\n").rstrip()
        if proc.returncode == 0
        else (proc.stdout + proc.stderr).strip()[-2000:]
    )
    return text, proc.returncode == 0


def fold_section(args: argparse.Namespace) -> str:
    extra = ["--iters", "2000", "--repeats", "3"] if args.quick else []
    text, good = script_output([sys.executable, str(HERE / "bench_fold.py"), *extra])
    if not good and extra:
        text, good = script_output([sys.executable, str(HERE / "bench_fold.py")])
    head = "### The fold's overhead (`benchmarks/bench_fold.py`, as printed)"
    status = "" if good else "\n\nThe script failed; its last output:"
    return f"{head}{status}\n\n```text\n{text}\n```"


def steps_section(args: argparse.Namespace) -> str:
    extra = ["--ks", "8", "32", "--iters", "1024", "--repeats", "3", "--rounds", "1"] if args.quick else []
    text, good = script_output([sys.executable, str(HERE / "bench_steps.py"), *extra], timeout=1800)
    head = "### Several steps per call (`benchmarks/bench_steps.py`, as printed)"
    status = "" if good else "\n\nThe script failed; its last output:"
    return f"{head}{status}\n\n```text\n{text}\n```"


def models_section(args: argparse.Namespace) -> str:
    extra = ["--quick"] if args.quick else []
    text, good = script_output([sys.executable, str(HERE / "bench_models.py"), *extra], timeout=3600)
    head = "### The field's models (`benchmarks/bench_models.py`, as printed)"
    status = "" if good else "\n\nThe script failed; its last output:"
    return f"{head}{status}\n\n{text}" if good else f"{head}{status}\n\n```text\n{text}\n```"


def latency_section(args: argparse.Namespace) -> str:
    head = "### Compile latency (`benchmarks/bench_latency.py`, as printed)"
    script = HERE / "bench_latency.py"
    if not script.exists():
        return f"{head}\n\nPending: `benchmarks/bench_latency.py` does not exist yet."
    text, good = script_output([sys.executable, str(script)], timeout=1200)
    status = "" if good else "\n\nThe script failed; its last output:"
    return f"{head}{status}\n\n```text\n{text}\n```"


# --------------------------------------------------------------------------- checkpoints


def _read_all(tensors: dict[str, torch.Tensor]) -> None:
    """Touch every byte (one pass each), as a load that checks a checksum must."""
    for t in tensors.values():
        (t if t.is_floating_point() else t.view(torch.uint8)).sum()


def checkpoints_section(args: argparse.Namespace) -> str:
    import safetensors.torch as st
    from bench_checkpoint import make_state, timed, torch_save

    from fnloop import checkpoint

    sizes = [10] if args.quick else [10, 100, 1000]
    out = [
        "### Checkpoints at 10 MB, 100 MB and 1 GB" if not args.quick else "### Checkpoints (quick: 10 MB)",
        "",
        "float32 tensors (4 large, 100 small), each call writing a new file, interleaved, median seconds; "
        "loads read files just written (page cache: the libraries are measured, not the disk). `fnloop.save` "
        "is atomic (fsync, rename, fsync of the directory); `torch.save` and `safetensors.save_file` do not "
        "fsync, so the fsync'd `torch.save` is the like-for-like one.",
    ]
    for mb in sizes:
        print(f"checkpoints: {mb} MB", flush=True)
        state = make_state(mb)
        tensors = dict(state.params)
        real_mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
        repeats = 3 if mb >= 1000 else 5
        times: dict[str, list[float]] = {}
        with tempfile.TemporaryDirectory(prefix="fnloop-bench-ckpt-") as d:
            root = Path(d)
            for r in range(repeats):
                paths = {k: root / f"{k}-{r}" for k in ("pt", "ptsync", "st")}
                fl_path = checkpoint.path_for(root, r)
                runs = {
                    "fnloop save (atomic)": lambda p=fl_path, s=state: checkpoint.save(s, p),
                    "torch.save": lambda p=paths["pt"], t=tensors: torch_save(t, p, fsync=False),
                    "torch.save + fsync": lambda p=paths["ptsync"], t=tensors: torch_save(t, p, fsync=True),
                    "safetensors save_file": lambda p=paths["st"], t=tensors: st.save_file(t, str(p)),
                    "fnloop load (CRC checked)": lambda p=fl_path, s=state: checkpoint.load(p, like=s),
                    "torch.load(weights_only=True)": lambda p=paths["pt"]: torch.load(p, weights_only=True),
                    "safetensors load_file": lambda p=paths["st"]: st.load_file(str(p)),
                    "safetensors load_file, every byte read": lambda p=paths["st"]: _read_all(
                        st.load_file(str(p))
                    ),
                }
                for name, run in runs.items():
                    times.setdefault(name, []).append(timed(run))
                for p in (fl_path, *paths.values()):
                    p.unlink()
        med = {k: statistics.median(v) for k, v in times.items()}
        rows = [[k, f"{s:.4f}", f"{real_mb / s:.0f}"] for k, s in med.items()]
        save, load = med["fnloop save (atomic)"], med["fnloop load (CRC checked)"]
        ratios = (
            f"fnloop's throughput over torch.save {med['torch.save'] / save:.2f}{X}, over torch.save + fsync "
            f"{med['torch.save + fsync'] / save:.2f}{X}, over safetensors {med['safetensors save_file'] / save:.2f}{X}; "
            f"load over torch.load {med['torch.load(weights_only=True)'] / load:.2f}{X}, over safetensors "
            f"{med['safetensors load_file'] / load:.2f}{X} (its tensors map the file and are read when used), "
            f"over safetensors with every byte read {med['safetensors load_file, every byte read'] / load:.2f}{X}."
        )
        out += [
            "",
            f"**{real_mb:.0f} MB**, {repeats} repeats:",
            "",
            table(["", "seconds", "MB/s"], rows),
            "",
            ratios,
        ]
    return "\n".join(out)


# --------------------------------------------------------------------------- main

RUNNERS: dict[str, Callable[[argparse.Namespace], str]] = {
    "machine": machine,
    "peers": lambda a: peers_section(a)[0],
    "width": width_section,
    "memory": memory_section,
    "digits": digits_section,
    "fold": fold_section,
    "steps": steps_section,
    "models": models_section,
    "latency": latency_section,
    "checkpoints": checkpoints_section,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few iterations, small sizes (a smoke run)")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run this section (repeatable)")
    parser.add_argument("--no-write", action="store_true", help="print the tables; leave docs/benchmarks.md")
    parser.add_argument("--child-memory", metavar="LOOP", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.child_memory:
        memory_child(args.child_memory, args.quick)
        return
    chosen = args.only or SECTIONS
    if "machine" not in chosen and not args.no_write:
        chosen = ["machine", *chosen]  # every rewrite says where it ran
    for name in chosen:
        start = time.perf_counter()
        try:
            text = RUNNERS[name](args)
        except Exception as exc:  # noqa: BLE001  # one broken section must not cost the others
            text = f"### {name}\n\nThis section failed on its last run: `{type(exc).__name__}: {exc}`"
        print(f"\n{text}\n\n({name}: {time.perf_counter() - start:.0f} s)\n", flush=True)
        if not args.no_write:
            write_section(name, text)


if __name__ == "__main__":
    main()
