"""Throughput and model FLOPs utilisation: samples/s, tokens/s, MFU, and what the loop costs beside the step."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import torch

from fnloop._core.messages import got, non_empty_str
from fnloop._core.metrics import to_floats
from fnloop._core.phase import Phase
from fnloop._core.state import TrainState, request, unchecked
from fnloop._core.stateful import recall, remember
from fnloop.hooks._unrecorded import MetricNeverRecorded, never_recorded

__all__ = [
    "PEAK_FLOPS",
    "ImpossibleMFU",
    "Throughput",
    "ThroughputState",
    "flops_per_token",
    "peak_flops",
    "throughput",
]

PEAK_FLOPS: Mapping[str, Mapping[str, float]] = {
    # Published dense peaks per GPU (no sparsity), FLOP/s: bf16 on the tensor cores, fp32 without them.
    # H100 and H200 are the SXM parts; A100 the SXM 80 GB; B200 the HGX part.
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
    "B200": {"bf16": 2250e12, "fp16": 2250e12, "fp32": 80e12},
}
"""Peak FLOP/s of common GPUs by name and dtype; ``peak_flops`` reads it, ``throughput(peak=...)`` overrides it."""


@attrs.frozen
class ThroughputState:
    """Where the previous measurement ended: its iteration, and the fold's clock then (not compared)."""

    iteration: int
    time: float = attrs.field(eq=False)


@attrs.frozen
class _Warn:
    """The effect warning that a count's metric was never recorded; a value, so states compare equal."""

    hook: str
    metric: str

    def __call__(self, state: TrainState) -> None:
        warnings.warn(never_recorded(self.hook, self.metric, state), MetricNeverRecorded, stacklevel=2)


class ImpossibleMFU(UserWarning):
    """``throughput`` measured an MFU above 1: its ``peak`` or its FLOPs per token (sample) are wrong."""


@attrs.frozen
class _Impossible:
    """The effect warning that the MFU came out above 1; a value, so states compare equal."""

    hook: str

    def __call__(self, state: TrainState) -> None:
        warnings.warn(
            f"{self.hook} recorded mfu above 1 (more FLOPs a second than the peak it was given): the "
            "peak is too low for this device and dtype, or flops_per_token too high (one token's "
            "forward and backward, about 6 x the parameters). Pass peak=fl.hooks.peak_flops(...) or the "
            "device's published figure, and fl.hooks.flops_per_token(model, seq_len).",
            ImpossibleMFU,
            stacklevel=2,
        )


@attrs.frozen(repr=False)
class Throughput:
    """Record throughput and MFU at ``AFTER_STEP``; build it with ``throughput``."""

    acts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.BEFORE_TRAIN, Phase.AFTER_STEP, Phase.AFTER_TRAIN})

    samples: int | str | None
    tokens: int | str | None
    flops: float | None
    """FLOPs of one token (of one sample, without ``tokens``), forward and backward."""
    peak: float | None
    world: int
    name: str = attrs.field(validator=non_empty_str)

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase is Phase.BEFORE_TRAIN:  # a resumed run measures from its own start
            return remember(state, self.name, ThroughputState(state.iteration - 1, -1.0))
        if phase is Phase.AFTER_TRAIN:
            return self._unrecorded(state)
        if phase is not Phase.AFTER_STEP:
            return state
        before = recall(state, self.name, ThroughputState(state.iteration - 1, -1.0))
        steps = state.iteration - before.iteration
        # The whole iterations since the previous call, hooks and all; in a run's first call,
        # this iteration up to its AFTER_STEP, and its counts alone.
        since = before.time >= 0 and steps > 0
        per_step = (state.time - before.time) / steps if since else state.step_time
        counted = before.iteration if since else state.iteration - 1
        values: dict[str, float] = {}
        if per_step > 0:
            samples = self._count(state, self.samples, counted)
            tokens = self._count(state, self.tokens, counted)
            if samples is not None:
                values["samples_per_s"] = samples * self.world / per_step
            if tokens is not None:
                values["tokens_per_s"] = tokens * self.world / per_step
            done = tokens if tokens is not None else samples
            if self.flops is not None and self.peak and done is not None:
                values["mfu"] = self.flops * done / per_step / self.peak
            if since:
                # What the fold and the hooks took per iteration beyond the step (Levanter's hook_time).
                values["hook_time"] = max(per_step - state.step_time, 0.0)
        metrics = state.metrics.record(state.iteration, values) if values else state.metrics
        moved = unchecked(state, metrics=metrics)
        if values.get("mfu", 0.0) > 1.0:  # said once: the message is the same each time
            moved = request(moved, _Impossible(repr(self)), "warn: mfu above 1")
        return remember(moved, self.name, ThroughputState(state.iteration, state.time))

    def _unrecorded(self, state: TrainState) -> TrainState:
        """``state``, with a warning requested for each count named by a metric the run never recorded."""
        for count in (self.samples, self.tokens):
            if isinstance(count, str) and count not in state.metrics.series and state.iteration > 0:
                state = request(state, _Warn(repr(self), count), f"warn: {count} never recorded")
        return state

    def _count(self, state: TrainState, count: int | str | None, since: int) -> float | None:
        """One rank's samples (tokens) per iteration, over the iterations after ``since``."""
        if count is None or isinstance(count, int):
            return count
        series = state.metrics.series.get(count)
        if not series:
            return None
        entries = [v for i, v in series if i > since] or [series[-1][1]]
        return sum(to_floats(entries)) / len(entries)  # one host read

    @property
    def state_names(self) -> tuple[str, ...]:
        return (self.name,)

    def __repr__(self) -> str:
        return f"throughput(samples={self.samples!r}, tokens={self.tokens!r}, flops={self.flops!r}, peak={self.peak!r})"


def _count_arg(name: str, value: object) -> int | str | None:
    if value is None or (type(value) is int and value > 0) or (isinstance(value, str) and value):
        return value  # type: ignore[return-value]
    raise ValueError(
        f"throughput({name}=...) must be a positive int (each rank's {name} per step), the name of a "
        f"metric your loss_fn records with that count, or None ({got(value)})."
    )


def throughput(
    *,
    samples: int | str | None = None,
    tokens: int | str | None = None,
    flops_per_token: float | None = None,
    flops_per_sample: float | None = None,
    peak: float | str | None = None,
    dtype: str = "bf16",
    name: str = "throughput",
) -> Throughput:
    """A hook recording ``samples_per_s``, ``tokens_per_s``, ``mfu`` and ``hook_time`` at ``AFTER_STEP``.

    The rates are the counts of the whole run (every rank's, ``samples * world``)
    over the wall time per iteration between two calls of the hook: the step,
    the wait for data, the hooks and their effects, as a user's clock sees
    them. Put it under ``every(n, ...)`` to measure over ``n`` iterations; its
    first call in a run measures that iteration alone. ``hook_time`` is the
    seconds per iteration beyond ``state.step_time`` (Levanter's
    ``hook_time``): what the ``AFTER_STEP`` hooks, their effects and the fold
    cost. ``mfu`` is model FLOPs utilisation per device: ``flops_per_token x
    tokens / s`` of one rank over ``peak`` (torchtitan's and PaLM's definition;
    the FLOPs are the model's, not counting activation checkpointing's recompute).
    They are floats from the fold's clock: no tensor, no host sync (unless a
    count is a metric, read once per call). The console and the progress bar show them.

    Args:
        samples: each rank's samples per step (the batch size), or the name of
            a metric ``loss_fn`` records with that count (for example
            ``{"samples": x.new_tensor(len(x))}``); a metric the run never
            records warns ``MetricNeverRecorded`` at its end.
        tokens: each rank's tokens per step (batch x sequence length), or a
            metric's name (``attention_mask.sum()``, for batches of varying length).
        flops_per_token: training FLOPs per token (``fnloop.hooks.flops_per_token``
            counts ``6N + 12 L d T``); with ``tokens``, MFU.
        flops_per_sample: training FLOPs per sample, for models without tokens.
        peak: the device's peak FLOP/s: a positive number, a name of
            ``PEAK_FLOPS`` (``"H100"``), ``"cpu"`` (measured), or ``None``: the
            CUDA device's by its name, or this CPU's, measured (``peak_flops``).
        dtype: which column of ``PEAK_FLOPS`` a name reads (``"bf16"``, ``"fp16"``, ``"fp32"``).
        name: where the hook keeps its ``ThroughputState``.

    Examples:
        >>> import fnloop as fl
        >>> hook = fl.every(10, fl.hooks.throughput(samples=32, tokens=32 * 128,
        ...                                         flops_per_token=6 * 124e6, peak="H100"))
    """
    from fnloop.distributed import world_size

    samples, tokens = _count_arg("samples", samples), _count_arg("tokens", tokens)
    if flops_per_token is not None and flops_per_sample is not None:
        raise ValueError("throughput(): give flops_per_token or flops_per_sample, not both.")
    if flops_per_token is not None and tokens is None:
        raise ValueError("throughput(flops_per_token=...) needs tokens=...: MFU counts the tokens trained.")
    flops = flops_per_token if flops_per_token is not None else flops_per_sample
    if flops is not None and not _positive(flops):
        raise ValueError(f"throughput(): the FLOPs must be a positive finite number ({got(flops)}).")
    if isinstance(peak, str):
        if peak != "cpu" and peak not in PEAK_FLOPS:
            raise ValueError(
                f"throughput(peak=...): no peak known for {peak!r}; known: {sorted(PEAK_FLOPS)}, or 'cpu' "
                "(measured). Pass the device's peak FLOP/s as a number instead."
            )
    elif peak is not None and not _positive(peak):
        raise ValueError(
            "throughput(peak=...) must be the device's peak FLOP/s, a positive finite number (for an "
            f"H100's bf16, 989e12), a name of PEAK_FLOPS, or None ({got(peak)})."
        )
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"throughput(dtype=...) must be 'bf16', 'fp16' or 'fp32' ({got(dtype)}).")
    if flops_per_sample is not None and tokens is not None:
        raise ValueError("throughput(flops_per_sample=...) with tokens=...: give flops_per_token instead.")
    if flops_per_sample is not None and samples is None:
        raise ValueError("throughput(flops_per_sample=...) needs samples=....")
    top = None
    if flops is not None:
        top = peak_flops(peak, dtype) if not isinstance(peak, (int, float)) else float(peak)
    return Throughput(samples, tokens, None if flops is None else float(flops), top, world_size(), name)


def _positive(value: object) -> bool:
    """A positive finite int or float, not a bool."""
    return type(value) in (int, float) and 0 < value < math.inf  # type: ignore[operator]


def peak_flops(device: str | None = None, dtype: str = "bf16") -> float:
    """A device's peak FLOP/s: from ``PEAK_FLOPS`` by name, or measured on this CPU.

    ``device``: a name of ``PEAK_FLOPS`` (``"H100"``); ``None``: the current
    CUDA device's, matched by name, else this CPU's; ``"cpu"``: this CPU's,
    measured as the best of five float32 2048 x 2048 matrix products on
    torch's threads (what its BLAS reaches, the ceiling of what a step can).

    Examples:
        >>> peak_flops("A100", "bf16")
        312000000000000.0
    """
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"peak_flops(dtype=...) must be 'bf16', 'fp16' or 'fp32' ({got(dtype)}).")
    if device is None and torch.cuda.is_available():
        found = torch.cuda.get_device_name()
        for known, peaks in PEAK_FLOPS.items():
            if known in found:
                return peaks[dtype]
        raise ValueError(
            f"peak_flops(): the CUDA device {found!r} is not in fnloop.hooks.PEAK_FLOPS ({sorted(PEAK_FLOPS)}); "
            "pass its peak FLOP/s: throughput(peak=...)."
        )
    if device is None or device == "cpu":
        return _measured_cpu()
    if device not in PEAK_FLOPS:
        raise ValueError(
            f"peak_flops(): no peak known for {device!r}; known: {sorted(PEAK_FLOPS)}, or 'cpu' (measured). "
            "Pass a number of FLOP/s instead."
        )
    return PEAK_FLOPS[device][dtype]


_MEASURED: list[float] = []


def _measured_cpu(n: int = 2048) -> float:
    if not _MEASURED:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        _MEASURED.append(2 * n**3 / best)
    return _MEASURED[0]


def flops_per_token(model: torch.nn.Module, seq_len: int | None = None) -> float:
    """Training FLOPs per token of ``model``: ``6 N + 12 L d T`` (PaLM's appendix B; torchtitan's count).

    ``N``: the trained parameters, embeddings (``nn.Embedding`` weights) left
    out, as they take no matrix product; ``6 N``: forward (2) and backward
    (4). With ``seq_len`` (``T``) and a ``transformers`` config giving the
    layers ``L`` and width ``d``, the attention's products add ``12 L d T``.

    Examples:
        >>> flops_per_token(torch.nn.Linear(10, 10))
        660.0
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"flops_per_token() expected the model, a torch.nn.Module ({got(model)}).")
    if seq_len is not None and (type(seq_len) is not int or seq_len < 1):
        raise ValueError(
            f"flops_per_token(model, seq_len): seq_len must be the sequence length, a positive int, or "
            f"None for 6N alone ({got(seq_len)})."
        )
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    n = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in embeddings)
    flops = 6.0 * n
    if seq_len is not None:
        config: Any = getattr(model, "config", None)
        layers = _first(config, ("num_hidden_layers", "n_layer", "num_layers"))
        width = _first(config, ("hidden_size", "n_embd", "d_model"))
        if layers is None or width is None:
            raise ValueError(
                "flops_per_token(model, seq_len): the attention term needs the model's layers and "
                "width, read from a transformers config (num_hidden_layers, hidden_size); this model "
                "has none. Leave seq_len out (6N alone) or add 12 * layers * width * seq_len yourself."
            )
        flops += 12.0 * layers * width * seq_len
    return flops


def _first(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None
