"""Trace a function of flat tensors into one graph of aten ops (``make_fx`` on fake tensors): a ``Traced`` record.

The function traced takes the trace's ``Draws`` first (where its random ops
draw from, see ``seeding.py``), then the flat tensors, and returns its output
tensors and a context of its own (their names, say), which the record keeps.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from fnloop._compile.errors import (
    CompileFailed,
    TraceError,
    TraceFailed,
    op_of,
    outside,
    raised_by_torch,
    user_frames,
)
from fnloop._compile.patches import compiling, onednn_off, quiet_shape_rules
from fnloop._compile.seeding import Draws

__all__ = [
    "Flat",
    "Traceable",
    "Traced",
    "accumulating",
    "dead_constants_dropped",
    "decompositions",
    "generator_draws",
    "has_constants",
    "trace",
]

Flat = Callable[..., Sequence[torch.Tensor]]
"""A function of flat tensors to a list of tensors (what a compiled graph is)."""

Traceable = Callable[..., tuple[Sequence[torch.Tensor], Any]]
"""``f(draws, *tensors) -> (outputs, context)``: what ``trace`` takes."""


@attrs.frozen(eq=False)
class Traced:
    """One traced graph and what the trace learned of it.

    Attributes:
        graph: the graph of aten ops.
        nodes: the nodes of the graph and of its subgraphs (a loop's body).
        draws: the ops that draw from torch's generator when they run (not
            from the seed input): the caller seeds the generator for those.
        recomputes: whether the trace ran part of the forward again in the
            backward (activation checkpointing).
        context: what the traced function returned beside its outputs.
        seeded: how many random ops draw from the seed input.
    """

    graph: torch.fx.GraphModule
    nodes: list[torch.fx.Node]
    draws: list[str]
    recomputes: bool
    context: Any
    seeded: int = 0


_TO_NUMBER = (
    "the traced function converts a tensor to a Python number (.item(), float(t) or int(t), for "
    "example inside a print or an f-string). While tracing, the value is not known (a print shows a "
    "symbol such as zuf0), and at run time it would force a host sync. To watch a value, return it "
    "as a metric (a tensor) and write it with a hook; to debug with print, run eagerly."
)


def trace(
    function: Traceable,
    leaves: Sequence[torch.Tensor],
    *,
    drawn: bool = True,
    stack_traces: bool = False,
    portable: bool = False,
) -> Traced:
    """``function`` traced on fake copies of ``leaves``; nothing real runs.

    ``drawn``: random ops draw from the seed the function names (off when
    inductor is told ``fallback_random``, which then runs torch's own).
    ``portable``: they draw the same on every device when the graph runs op
    by op (``Draws``), not through inductor's GPU generator.
    Raises ``TraceError`` where the function needs a tensor's value in Python.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    draws = Draws(portable)
    context: list[Any] = [None]

    def flat(*tensors: torch.Tensor) -> list[torch.Tensor]:
        outputs, context[0] = function(draws, *tensors)
        return list(outputs)

    try:
        # Without oneDNN while tracing: ops that choose a oneDNN kernel in Python-visible
        # ways record it in the graph, and the CPU LSTM's (mkldnn_rnn_layer) left its backward
        # without the workspace its forward makes once compiled. Ops that choose at run time
        # (convolutions) are recorded as the generic op and still run on oneDNN.
        with onednn_off(), _tracing_as_a_function(), compiling(), quiet_shape_rules():
            graph = make_fx(
                flat,
                decomposition_table=decompositions(draws if drawn else None),
                tracing_mode="fake",
                _allow_non_fake_inputs=True,
                record_stack_traces=stack_traces,
            )(*leaves)
    except _data_dependent() as exc:
        raise TraceError(str(exc), outside(exc.__traceback__), _KINDS.get(type(exc).__name__)) from exc
    except Exception as exc:
        if not raised_by_torch(exc.__traceback__):
            raise  # the user's code, or fnloop's, raised it: as it would eagerly
        raise TraceFailed(op_of(exc.__traceback__), outside(exc.__traceback__), str(exc)) from exc
    # A number read out of a tensor whose value nothing in the graph uses (print(loss.item()))
    # traces without complaint; inductor then fails on it with an internal assertion. Where it was
    # read: the trace again, with stack traces (paid only on this error).
    read = [n for n in graph.graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default]
    if read:
        if not stack_traces:
            again = trace(function, leaves, drawn=drawn, stack_traces=True, portable=portable)
            read = [
                n for n in again.graph.graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default
            ]
        where = next((w for w in (user_frames(n.meta.get("stack_trace")) for n in read) if w), None)
        raise TraceError(_TO_NUMBER, where, "a tensor converted to a Python number")
    nodes = [
        node
        for module in graph.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    ]
    return Traced(graph, nodes, generator_draws(nodes), draws.restored > 0, context[0], draws.drawn)


def decompositions(draws: Draws | None) -> dict[Any, Callable[..., Any]]:
    """Inductor's own decompositions, and the random ops drawn from the seeds ``draws`` is given.

    The graph is traced with the decompositions inductor applies when it
    compiles it: traced without them, a ``reshape`` was recorded as a ``view``
    valid for the strides of the undecomposed ops, which inductor's re-trace
    with its decompositions then gave other strides (GPT-2's attention:
    "Cannot view a tensor with shape ... and strides ...").
    """
    import torch._inductor.lowering  # noqa: F401 - some of inductor's decompositions consult it
    from torch._inductor.decomposition import select_decomp_table

    return {**select_decomp_table(), **(draws.decompositions() if draws is not None else {})}


_KINDS = {
    "GuardOnDataDependentSymNode": "data-dependent control flow, a branch or a loop on a tensor's value",
    "DataDependentOutputException": "a host sync, a tensor's value read in Python (.item(), .tolist(), .any())",
    "DynamicOutputShapeException": "an op whose output's shape depends on the values (nonzero, unique, masked indexing)",
}
"""What each of the tracer's data-dependent errors means, in the user's terms."""


@functools.cache
def _data_dependent() -> tuple[type[BaseException], ...]:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)


def _tracing_as_a_function() -> contextlib.AbstractContextManager[Any]:
    """torch told that a make_fx trace of forward and backward runs (as torchtitan's is).

    Selective activation checkpointing (``create_selective_checkpoint_contexts``)
    otherwise takes a proxy mode for AOTAutograd's, caches every op of the
    region and leaves recomputation to a partitioner this trace has none of:
    nothing would be recomputed, and an in-place op on a cached output fails.
    Told, it recomputes in the backward as it does eagerly, which the trace
    records. Nothing else in torch reads the flag.
    """
    context = getattr(torch.compiler, "_non_strict_tracing_context", None)
    return context() if context is not None else contextlib.nullcontext()


def _argument(node: torch.fx.Node, name: str) -> Any:
    schema = node.target._schema  # type: ignore[union-attr]
    for index, argument in enumerate(schema.arguments):
        if argument.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[index] if index < len(node.args) else argument.default_value
    return None


_ADDING = frozenset(
    {
        "index_add",
        "scatter_add",
        "scatter_reduce",
        "embedding_dense_backward",
        "_embedding_bag_backward",
        "_unsafe_masked_index_put_accumulate",  # what inductor's decomposition makes of an embedding's gradient
    }
)
_ADDING_IF_ASKED = frozenset({"index_put", "_unsafe_index_put", "index_put_"})


def accumulating(nodes: Sequence[torch.fx.Node]) -> tuple[str, ...]:
    """The ops among ``nodes`` that add into a tensor at indices known only when they run, each named once.

    An embedding's gradient is one (``index_put`` with ``accumulate=True``).
    Compiled for a CPU with several threads, or for a GPU, such an op adds
    in an order that varies from run to run, unless torch's deterministic
    algorithms are on while it is compiled and run.
    """
    found: dict[str, None] = {}
    for node in nodes:
        if not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = node.target._schema.name.split("::")[-1]
        if name in _ADDING or (name in _ADDING_IF_ASKED and _argument(node, "accumulate")):
            found[str(node.target)] = None
    return tuple(found)


def generator_draws(nodes: Sequence[torch.fx.Node]) -> list[str]:
    """The ops among ``nodes`` that draw from torch's generator when they run.

    An op draws when it is tagged as seeded and it would draw numbers: fused
    attention with a ``dropout_p`` of zero draws none, though its tag says it
    may (the CPU flash-attention op carries the tag whatever ``dropout_p``
    is). The random ops the step draws from its seed are not among them.
    """
    found = []
    for node in nodes:
        target = node.target
        if (
            not isinstance(target, torch._ops.OpOverload)
            or torch.Tag.nondeterministic_seeded not in target.tags
        ):
            continue
        if _argument(node, "dropout_p") in (0, 0.0):
            continue
        found.append(str(target))
    return found


def located(
    function: Traceable, leaves: Sequence[torch.Tensor], drawn: bool, error: BaseException
) -> CompileFailed:
    """Which node of the graph ``error`` came from, traced again with stack traces to say where."""
    names = re.findall(r"While executing %(\w+)", str(error))
    target = re.findall(r"target: (\S+)", str(error))
    if not names and not target:
        return CompileFailed(None, None)
    try:
        graph = trace(function, leaves, drawn=drawn, stack_traces=True).graph
    except Exception:  # noqa: BLE001 - the first error is the one to report
        return CompileFailed(target[0] if target else None, None)
    for node in graph.graph.nodes:
        if names and node.name == names[-1]:
            return CompileFailed(str(node.target), user_frames(node.meta.get("stack_trace")))
    return CompileFailed(target[0] if target else None, None)


def dead_constants_dropped(graph: torch.fx.GraphModule) -> bool:
    """Drop the tensor constants that nothing reads (a pure op of one, whose result nothing reads); whether any was.

    A model's forward may make a tensor it never uses (``torch.tensor([])``
    in ``transformers``' masks): traced, it is a constant copied into the
    graph and dropped, which inductor would drop too. Dropped here, the
    graph holds no constant, so the compile cache keeps it (see ``jit._built``).
    """
    dropped = False
    for node in list(graph.graph.nodes):
        if node.op != "get_attr" or not isinstance(getattr(graph, str(node.target), None), torch.Tensor):
            continue
        readers = list(node.users)
        if all(not reader.users and not reader.is_impure() for reader in readers):
            for reader in readers:
                graph.graph.erase_node(reader)
            graph.graph.erase_node(node)
            delattr(graph, str(node.target))
            dropped = True
    if dropped:
        graph.recompile()
    return dropped


def has_constants(graph: torch.fx.GraphModule) -> bool:
    return any(
        node.op == "get_attr" and isinstance(getattr(graph, str(node.target), None), torch.Tensor)
        for node in graph.graph.nodes
    )
