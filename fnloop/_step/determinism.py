"""Bit for bit at any thread count: the step under torch's deterministic algorithms, or a warning where it is not.

A compiled step whose graph adds into a tensor at indices known only when it
runs (an embedding's gradient: ``index_put`` with ``accumulate=True``) adds
in an order that varies from run to run on a CPU with several threads, and
on a GPU: two runs, or a run and its resume, then differ in the last bits.
``train_step(..., deterministic=True)`` compiles and runs the step under
``torch.use_deterministic_algorithms(True)``, where inductor leaves those
ops to torch's deterministic kernels. Without it, the first call of such a
step warns once, with the fix.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence

import torch

__all__ = ["VARYING", "VaryingOrder", "deterministic_algorithms", "varies", "warn_varying"]

VARYING = (
    "fnloop: this compiled step adds into tensors at indices known only when it runs ({ops}; an "
    "embedding's gradient is one), and {where} those additions happen in an order that varies from "
    "run to run: two runs of it, or a run and its resume, can differ in the last bits. For bit-for-bit "
    "runs, build the step with train_step(..., deterministic=True) (torch's deterministic algorithms "
    "for the step; see docs/replay.md for its cost){threads}."
)


class VaryingOrder(UserWarning):
    """A compiled step's additions at run-time indices happen in an order that varies from run to run."""


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for the block, as it was after it."""
    was, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def varies(ops: Sequence[str], device: torch.device) -> str | None:
    """Why a compiled graph with the accumulating ``ops`` on ``device`` varies from run to run, or ``None``."""
    if not ops or torch.are_deterministic_algorithms_enabled():
        return None
    threads = torch.get_num_threads()
    if device.type == "cpu" and threads == 1:
        return None
    where = f"with {threads} CPU threads" if device.type == "cpu" else f"on {device.type}"
    one = ", or torch.set_num_threads(1)" if device.type == "cpu" else ""
    return VARYING.format(ops=", ".join(ops), where=where, threads=one)


def warn_varying(ops: Sequence[str], device: torch.device) -> None:
    """Warn that a graph with the accumulating ``ops`` varies from run to run on ``device``, where it does."""
    why = varies(ops, device)
    if why is not None:
        warnings.warn(why, VaryingOrder, stacklevel=4)
