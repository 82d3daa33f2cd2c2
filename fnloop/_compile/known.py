"""Inductor's known miscompiles on the torches fnloop supports, and the route fnloop takes around each.

**Scatters ordered after their readers (torch 2.13).** Inductor lowers an
out-of-place scatter (``scatter``, ``scatter_add``, ``index_put``, an
embedding's gradient) as a fresh buffer that a second node writes into. On
torch 2.13 the scheduler can fuse a reader of the scattered buffer with an
earlier node and emit the fused kernel *before* the scatter's writes: the
reader sees the buffer before the scatter (zeros). In a mixture of experts
whose top-k choices feed a load-balancing loss, the top-k's backward is such a
scatter, and the routers' gradients came out entirely wrong while the loss
agreed to 1e-5 (GraniteMoE, two layers; ``tests/test_miscompiles.py`` holds
the smallest graph found: a softmax's backward through a broadcast row, plus a
scatter). Torch 2.14 and 2.15 compile it right.

fnloop compiles every graph that holds such an op, on an affected torch, with
torch's deterministic algorithms on while inductor lowers it: inductor then
leaves scatters and index puts to torch's own kernels (``ScatterFallback``,
``IndexPutFallback``), which its scheduler orders as the graph says. The graph
runs without them on; only how it was built changes (the compile cache keys
on it). ``docs/step.md#known-miscompiles`` gives the cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from fnloop._compile.patches import LOCK

__all__ = ["SCATTERS", "affected", "routed", "scatter_fallbacks"]

SCATTERS = frozenset(
    {
        "index_put",
        "index_put_",
        "_unsafe_index_put",
        "_unsafe_index_put_",
        "_unsafe_masked_index_put_accumulate",
        "scatter",
        "scatter_",
        "scatter_add",
        "scatter_add_",
        "scatter_reduce",
        "scatter_reduce_",
    }
)
"""The ops inductor lowers as a buffer written by a second node (its ``Scatter``)."""


def affected(version: str | None = None) -> bool:
    """Whether inductor in torch ``version`` (this process's by default) orders a scatter after its readers.

    Examples:
        >>> affected("2.13.0+cpu"), affected("2.14.1"), affected("2.15.0")
        (True, False, False)
    """
    found = torch.torch_version.TorchVersion(torch.__version__ if version is None else version)
    return bool(found >= (2, 13) and found < (2, 14))  # type: ignore[operator]


def routed(nodes: Sequence[torch.fx.Node]) -> bool:
    """Whether a graph of ``nodes`` needs the route around the scatter miscompile on this torch."""
    return affected() and any(_name(node) in SCATTERS for node in nodes)


@contextlib.contextmanager
def scatter_fallbacks() -> Iterator[None]:
    """Inductor leaves scatters and index puts to torch's kernels while it lowers a graph in the block.

    It asks ``torch.are_deterministic_algorithms_enabled()`` when it lowers
    them; the switch is set back after the block, under the compiler's lock.
    """
    with LOCK:
        was = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(was, warn_only=warn_only)


def _name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return ""
