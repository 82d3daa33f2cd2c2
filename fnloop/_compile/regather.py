"""A graph pass: what a gather made, gathered anew where the graph needs it again after other gathers.

A sharded step gathering block by block (``fnloop/_step/blocks.py``) all-gathers
a block's parameters just before the block's forward. Forward and backward are
one traced graph, so the backward's uses of those parameters (a linear layer's
input gradient needs its weight) would keep the gathered block alive from its
forward to its backward: every block at once at the turn, as if everything had
been gathered. torchtitan's SimpleFSDP marks such gathers "must recompute" for
AOTAutograd's partitioner; fnloop's trace has no partitioner, so this pass
does the same on the graph: where a gather's results are read again after
another collective ran since their last read (an all-gather, a reduce-scatter, or the all-to-all
a world-size-invariant step scatters with), it copies
the gather and the ops that make the parameters from it (the wait, the
copy-out, an autocast's cast, a transpose) just before that use, and the
later uses read the copy. The forward's gathered block then dies after the
block's forward, and the copy after its backward.

Nothing else changes: the copies compute the same values from the same
chunks, so results are bit for bit those of the graph before the pass.
"""

from __future__ import annotations

import bisect

import torch

__all__ = ["regathered"]


def _ops() -> tuple[object, frozenset[object]]:
    functional = torch.ops._c10d_functional
    gather = functional.all_gather_into_tensor.default
    # A world-size-invariant step's reduce-scatter is an all-to-all (fnloop/_step/invariant.py).
    return gather, frozenset(
        {gather, functional.reduce_scatter_tensor.default, functional.all_to_all_single.default}
    )


def regathered(graph: torch.fx.GraphModule) -> int:
    """``graph`` and its subgraphs with each gather copied where it is needed again; how many copies were made."""
    made = 0
    for module in graph.modules():
        if isinstance(module, torch.fx.GraphModule):
            made += _regather(module.graph)
    if made:
        graph.recompile()
    return made


def _regather(graph: torch.fx.Graph) -> int:
    gather, collectives = _ops()
    nodes = list(graph.nodes)
    at = {node: i for i, node in enumerate(nodes)}
    fences = [at[n] for n in nodes if n.op == "call_function" and n.target in collectives]
    gathers = [n for n in nodes if n.op == "call_function" and n.target is gather]
    if len(fences) < 2:
        return 0
    made = 0
    for start in gathers:
        chain = _made_from(start, nodes, at, collectives)
        inside = set(chain)
        reads = sorted(
            (
                (at[user], user, node)
                for node in chain
                for user in node.users
                if user not in inside and user.op != "output"
            ),
            key=lambda read: read[0],
        )
        # Reads one after another with no collective between them share a gathering: the first
        # such run reads the gather itself, each later run a copy made just before it.
        runs: list[list[tuple[int, torch.fx.Node, torch.fx.Node]]] = []
        for read in reads:
            if runs and not _between(fences, runs[-1][-1][0], read[0]):
                runs[-1].append(read)
            else:
                runs.append([read])
        for run in runs[1:]:
            _copy_for(run, chain, graph)
            made += 1
        _drop_unread(chain, graph)
    if made:
        graph.lint()
    return made


def _between(fences: list[int], after: int, before: int) -> bool:
    """Whether a collective lies strictly between the positions ``after`` and ``before``."""
    return bisect.bisect_right(fences, before - 1) > bisect.bisect_right(fences, after)


def _drop_unread(chain: list[torch.fx.Node], graph: torch.fx.Graph) -> None:
    """The ops of ``chain`` nothing reads any more (their readers read copies now), removed."""
    for node in reversed(chain):
        if not node.users:
            graph.erase_node(node)


def _made_from(
    start: torch.fx.Node,
    nodes: list[torch.fx.Node],
    at: dict[torch.fx.Node, int],
    collectives: frozenset[object],
) -> list[torch.fx.Node]:
    """``start`` and the ops after it computed from it alone (in the graph's order): what the gather makes."""
    chain = {start}
    for node in nodes[at[start] + 1 :]:
        if node.op != "call_function" or node.target in collectives or _draws(node):
            continue
        inputs = node.all_input_nodes
        if inputs and all(n in chain for n in inputs):
            chain.add(node)
    return [n for n in nodes if n in chain]


def _draws(node: torch.fx.Node) -> bool:
    target = node.target
    return bool(getattr(target, "_nondeterministic_seeded", False)) or bool(
        isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable
    )


def _copy_for(
    group: list[tuple[int, torch.fx.Node, torch.fx.Node]], chain: list[torch.fx.Node], graph: torch.fx.Graph
) -> None:
    """The part of ``chain`` the uses in ``group`` read, copied just before the first of them, and read there."""
    needed: set[torch.fx.Node] = set()
    pending = [node for _, _, node in group]
    members = set(chain)
    while pending:
        node = pending.pop()
        if node in needed:
            continue
        needed.add(node)
        pending += [n for n in node.all_input_nodes if n in members]
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    with graph.inserting_before(group[0][1]):
        for node in chain:
            if node in needed:
                copies[node] = graph.node_copy(node, lambda n: copies.get(n, n))
    for _, user, node in group:
        user.replace_input_with(node, copies[node])
