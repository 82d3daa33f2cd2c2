"""A loop inside a traced graph: ``scan`` over a body traced on its own first (several steps per call).

torch's loop operator (``torch._higher_order_ops.scan``) compiles its body
once, whatever the number of turns. The body is traced here before the loop
is (Python in it runs then, once, and autograd records its backward), and the
loop is handed the traced graph: torch's compiler, which traces a loop's body
itself, meets only tensor ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fnloop._compile.seeding import Draws
from fnloop._compile.trace import decompositions

__all__ = ["HAS_SCAN", "scan"]

try:
    from torch._higher_order_ops.scan import scan_op
except ImportError:  # torch before 2.6: the caller writes every turn out
    scan_op = None  # type: ignore[assignment]

HAS_SCAN = scan_op is not None
"""Whether this torch has the loop operator."""


def scan(
    turn: Callable[..., list[torch.Tensor]],
    init: list[torch.Tensor],
    rows: list[torch.Tensor],
    draws: Draws,
) -> list[torch.Tensor]:
    """Inside a trace: ``turn(*carry, *row)`` for each row of ``rows`` (their first dimension), carry from ``init``.

    ``turn`` returns the next carry (as many tensors as ``init``), then the
    turn's outputs; the result is the last carry, then each output stacked
    over the turns. Its random ops draw from the seeds ``draws`` is given.
    """
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx

    with disable_proxy_modes_tracing():
        body = make_fx(turn, decomposition_table=decompositions(draws))(
            *[t.clone() for t in init], *[r[0].clone() for r in rows]
        )
    body, constants = _lifted(body)
    return list(scan_op(body, init, rows, additional_inputs=_constants(constants)))


def _lifted(body: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """``body`` with its tensor constants (a ``torch.tensor(...)`` in the model, say) as inputs after the others.

    A loop's body may not hold tensors of its own: the loop passes them in.
    Constants nothing uses are dropped first.
    """
    graph = body.graph
    graph.eliminate_dead_code()
    last = [node for node in graph.nodes if node.op == "placeholder"][-1]
    constants: list[torch.Tensor] = []
    for node in list(graph.nodes):
        value = getattr(body, str(node.target), None) if node.op == "get_attr" else None
        if isinstance(value, torch.Tensor):
            with graph.inserting_after(last):
                last = graph.placeholder(f"constant_{len(constants)}")
            node.replace_all_uses_with(last)
            graph.erase_node(node)
            constants.append(value)
    body.recompile()
    return body, constants


def _constants(constants: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    # Made where the loop is traced, so the outer graph holds them as its own constants.
    return tuple(torch.ops.aten.lift_fresh_copy.default(t) for t in constants)
