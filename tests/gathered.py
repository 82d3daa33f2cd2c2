"""How many all-gathered elements a graph keeps alive at once: what the block-by-block tests measure."""

from __future__ import annotations

import torch

from fnloop._compile.regather import _made_from


def live(graph: torch.fx.Graph) -> int:
    """The most elements of all-gathered tensors alive at one point of ``graph``.

    A gather lives from where it runs to the last read of what is made from it
    alone (its wait, views, casts), the graph's output aside.
    """
    functional = torch.ops._c10d_functional
    gather = functional.all_gather_into_tensor.default
    collectives = frozenset({gather, functional.reduce_scatter_tensor.default})
    nodes = list(graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    spans = []
    for g in (n for n in nodes if n.target is gather):
        chain = _made_from(g, nodes, at, collectives)
        end = max((at[u] for c in chain for u in c.users if u.op != "output"), default=at[g])
        spans.append((at[g], end, g.meta["val"].numel()))
    return max((sum(k for a, b, k in spans if a <= i <= b) for i in range(len(nodes))), default=0)
