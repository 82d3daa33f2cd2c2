"""Trace once per signature, compile with inductor, call the compiled graph with no guards but ours.

``torch.compile`` re-checks every input at every call through dynamo's guards
and frame hook; on a small model that costs more than the step's arithmetic
(about 30 us of the tiny benchmark's 55). A training step, like ``jax.jit``,
needs less: its Python is traced once into one graph of aten ops
(``make_fx`` on fake tensors, so nothing real runs), inductor compiles that
graph (``torch._inductor.standalone_compile``), and each later call checks
only what the graph was specialized on (the structure and static values the
caller passes as ``structure``, and each tensor's shape, strides, dtype and
device), then calls the compiled graph directly.

The consequence is jit's: Python code in the step runs once, at trace time.
A ``print`` prints once; a Python number read from a global is baked in. Use
tensors for anything that changes between steps.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from fnloop._step.cache import CompileCache, default_cache, graph_key
from fnloop._step.errors import CompileFailed, _user_frames
from fnloop._step.options import default_options, inductor_options
from fnloop._step.probes import remembered_probes
from fnloop._step.seeding import drawn_decompositions, recomputations

__all__ = [
    "CompileFailed",
    "Entry",
    "Jit",
    "OverBudget",
    "RandomInGraph",
    "TraceError",
    "generator_draws",
    "trace",
]

Flat = Callable[..., Sequence[torch.Tensor]]
"""A function of flat tensors to a list of tensors."""


class TraceError(RuntimeError):
    """The function cannot be one graph: it depends on a tensor's value in Python."""


class RandomInGraph(TraceError):
    """The function draws from torch's generator where the caller cannot seed it (several steps per call)."""


class OverBudget(RuntimeError):
    """A call needs one more graph than the budget allows; nothing was traced or run.

    ``change`` says what differs from the previous call: ``(index, before,
    after)`` for the first tensor whose shape, strides, dtype or device
    changed, or ``(None, structure before, structure after)``.
    """

    def __init__(self, change: tuple[int | None, Any, Any]) -> None:
        super().__init__(change)
        self.change = change


@functools.cache
def _data_dependent() -> tuple[type[BaseException], ...]:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)


_TO_NUMBER = (
    "the traced function converts a tensor to a Python number (.item(), float(t) or int(t), for "
    "example inside a print or an f-string). While tracing, the value is not known (a print shows a "
    "symbol such as zuf0), and at run time it would force a host sync. To watch a value, return it "
    "as a metric (a tensor) and write it with a hook; to debug with print, run eagerly."
)


def _signature(leaves: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
    return [(t.shape, t.stride(), t.dtype, t.device) for t in leaves]


def _decompositions(drawn: bool) -> dict[Any, Callable[..., Any]]:
    """Inductor's own decompositions, and (``drawn``) the random ops drawn from the step's seed.

    The graph is traced with the decompositions inductor applies when it
    compiles it: traced without them, a ``reshape`` was recorded as a ``view``
    valid for the strides of the undecomposed ops, which inductor's re-trace
    with its decompositions then gave other strides (GPT-2's attention:
    "Cannot view a tensor with shape ... and strides ...").
    """
    import torch._inductor.lowering  # noqa: F401 - some of inductor's decompositions consult it
    from torch._inductor.decomposition import select_decomp_table

    return {**select_decomp_table(), **(drawn_decompositions() if drawn else {})}


def trace(
    function: Flat, leaves: Sequence[torch.Tensor], *, drawn: bool = True, stack_traces: bool = False
) -> torch.fx.GraphModule:
    """``function`` traced on fake copies of ``leaves`` into a graph of aten ops; nothing real runs.

    ``drawn``: random ops draw from the seed given to ``drawing_from`` (off
    when inductor is told ``fallback_random``, which then runs torch's own).
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        # Without oneDNN while tracing: ops that choose a oneDNN kernel in Python-visible
        # ways record it in the graph, and the CPU LSTM's (mkldnn_rnn_layer) left its backward
        # without the workspace its forward makes once compiled. Ops that choose at run time
        # (convolutions) are recorded as the generic op and still run on oneDNN.
        with _without_onednn(), _tracing_as_a_function():
            return make_fx(
                function,
                decomposition_table=_decompositions(drawn),
                tracing_mode="fake",
                _allow_non_fake_inputs=True,
                record_stack_traces=stack_traces,
            )(*leaves)
    except _data_dependent() as exc:
        raise TraceError(str(exc)) from exc


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


@contextlib.contextmanager
def _without_onednn() -> Iterator[None]:
    # torch.backends.mkldnn.flags() would also reset oneDNN's TF32 setting, with a warning.
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def _argument(node: torch.fx.Node, name: str) -> Any:
    schema = node.target._schema  # type: ignore[union-attr]
    for index, argument in enumerate(schema.arguments):
        if argument.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[index] if index < len(node.args) else argument.default_value
    return None


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


def _located(
    function: Flat, leaves: Sequence[torch.Tensor], drawn: bool, error: BaseException
) -> CompileFailed:
    """Which node of the graph ``error`` came from, traced again with stack traces to say where."""
    names = re.findall(r"While executing %(\w+)", str(error))
    target = re.findall(r"target: (\S+)", str(error))
    if not names and not target:
        return CompileFailed(None, None)
    try:
        graph = trace(function, leaves, drawn=drawn, stack_traces=True)
    except Exception:  # noqa: BLE001 - the first error is the one to report
        return CompileFailed(target[0] if target else None, None)
    for node in graph.graph.nodes:
        if names and node.name == names[-1]:
            return CompileFailed(str(node.target), _user_frames(node.meta.get("stack_trace")))
    return CompileFailed(target[0] if target else None, None)


def _compile(
    function: Flat,
    leaves: list[torch.Tensor],
    options: Mapping[str, Any],
    cache: CompileCache | None = None,
    no_random: str | None = None,
) -> tuple[Flat, bool]:
    """``function`` traced on ``leaves`` and compiled, and whether its graph draws from torch's generator.

    Random ops the trace knows (dropout's, ``rand``, ``randn``, ...) draw
    from the seed the function passes to ``drawing_from``; any other random
    op draws from torch's generator, which the caller then seeds. With a
    ``cache``, the traced graph is looked up there first (see
    ``fnloop/_step/cache.py``) and what inductor builds is kept there.
    ``no_random``: the message of the ``RandomInGraph`` raised, before
    anything is compiled, when the graph draws from the generator (the
    name of each such op is added to it).
    """
    drawn = not options.get("fallback_random", False)
    before = recomputations()
    graph = trace(function, leaves, drawn=drawn)
    recomputes = recomputations() > before
    # A number read out of a tensor whose value nothing in the graph uses (print(loss.item()))
    # traces without complaint; inductor then fails on it with an internal assertion.
    if any(node.target is torch.ops.aten._local_scalar_dense.default for node in graph.graph.nodes):
        raise TraceError(_TO_NUMBER)
    # Nodes of the graph and of its subgraphs (the body of a loop).
    nodes = [
        node
        for module in graph.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    ]
    draws = generator_draws(nodes)
    if draws and no_random is not None:
        raise RandomInGraph(f"{no_random} The ops that draw from torch's generator: {sorted(set(draws))}.")
    ops = sum(node.op == "call_function" for node in nodes)
    options = {**default_options(leaves, _has_loops(nodes), ops, recomputes, _shards(nodes)), **options}

    def failed(exc: BaseException) -> CompileFailed:
        return _located(function, leaves, drawn, exc)

    return _built(graph, leaves, options, cache, nodes, failed), bool(draws)


def _built(
    graph: torch.fx.GraphModule,
    leaves: list[torch.Tensor],
    options: Mapping[str, Any],
    cache: CompileCache | None,
    nodes: list[torch.fx.Node],
    failed: Callable[[BaseException], CompileFailed],
) -> Flat:
    """What inductor builds from ``graph``, or finds in ``cache``; ``failed`` makes inductor's errors ours."""
    import torch._inductor

    standalone = getattr(torch._inductor, "standalone_compile", None)
    if standalone is None:  # torch before 2.8: dynamo over the traced graph (flat inputs, cheap guards)
        return torch.compile(graph, fullgraph=True, dynamic=False, options=dict(options))
    with remembered_probes(None if cache is None else cache.directory):
        # A graph with tensor constants (a tensor a closure captured) is not
        # reloadable on torch 2.13: the loaded graph expects them as inputs
        # (and crashes under the C++ wrapper); inductor's own cache still serves it.
        # Nor is a graph with a loop (torch 2.13's caches refuse higher-order operators).
        uncached = cache is None or _has_constants(graph) or _has_loops(nodes)
        key = None if uncached else graph_key(graph, leaves, options)
        if cache is not None and key is not None:
            found = cache.load(key)
            if found is not None:
                return found
        # A loop's graph cannot be saved: inductor would warn so at every compile.
        quiet = (
            _quiet("torch._inductor.standalone_compile") if _has_loops(nodes) else contextlib.nullcontext()
        )
        try:
            with torch._inductor.config.patch(dict(options)), quiet:
                compiled = standalone(graph, leaves, dynamic_shapes="from_example_inputs")
        except Exception as exc:
            raise failed(exc) from exc
        if cache is not None and key is not None:
            cache.save(key, compiled)
    return compiled


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _has_loops(nodes: list[torch.fx.Node]) -> bool:
    return any(isinstance(node.target, torch._ops.HigherOrderOperator) for node in nodes)


def _shards(nodes: list[torch.fx.Node]) -> bool:
    """Whether the graph gathers or scatters across ranks (a sharded step's collectives)."""
    names = ("all_gather_into_tensor", "reduce_scatter_tensor")
    return any(
        isinstance(node.target, torch._ops.OpOverload) and node.target.name().split("::")[-1] in names
        for node in nodes
    )


def _has_constants(graph: torch.fx.GraphModule) -> bool:
    return any(
        node.op == "get_attr" and isinstance(getattr(graph, str(node.target), None), torch.Tensor)
        for node in graph.graph.nodes
    )


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _Default()
"""``Jit``'s cache when none is given: ``default_cache()``, read when the ``Jit`` is made."""


class Jit:
    """A flat function compiled once per signature; ``compiles`` counts the graphs built.

    ``make(structure)`` returns the function for one ``structure`` (a hashable
    description of how the flat tensors are put back together, and of any
    static values) and a context it may fill while it is traced (the names of
    its outputs, say): ``(f, context)`` with ``f(*tensors) -> list of
    tensors``. ``entry(structure, tensors)`` finds, or traces and compiles, the
    graph for that call: a new structure, or tensors of another shape,
    strides, dtype or device, compile again. ``cache`` keeps compiled graphs
    between processes (by default where ``$FNLOOP_CACHE_DIR`` says; ``None``
    turns it off): a graph found there is loaded instead of compiled, and
    still counts in ``compiles``.
    """

    def __init__(
        self,
        make: Callable[[Hashable], tuple[Flat, Any]],
        budget: int | None = None,
        options: Mapping[str, Any] | None = None,
        cache: CompileCache | _Default | None = DEFAULT,
        no_random: str | None = None,
    ) -> None:
        self._make = make
        self.no_random = no_random
        """Refuse graphs that draw from torch's generator, with this message (``RandomInGraph``)."""
        self.cache = default_cache() if isinstance(cache, _Default) else cache
        """Where compiled graphs are kept between processes (``None``: nowhere); see ``fnloop/_step/cache.py``."""
        self.budget = budget
        self.options = inductor_options(options)
        self._cache: dict[Hashable, Entry] = {}
        self._last: Entry | None = None
        self._last_structure: Hashable = None
        self.compiles = 0

    def entry(self, structure: Hashable, leaves: list[torch.Tensor]) -> Entry:
        """The compiled graph for ``leaves`` put together as ``structure``."""
        signature = _signature(leaves)
        last = self._last
        # The common case: what the last call had. Tuple equality tries identity
        # first, so the structure seen last is kept to compare against.
        known = self._last_structure
        if last is not None and last.signature == signature and (structure is known or structure == known):
            self._last_structure = structure
            return last
        found = self._cache.get((structure, tuple(signature)))
        if found is None:
            if self.budget is not None and self.compiles >= self.budget:
                raise OverBudget(self._change(structure, signature))
            function, context = self._make(structure)
            found = Entry(
                structure,
                signature,
                *_compile(function, leaves, self.options, self.cache, self.no_random),
                context,
            )
            self._cache[(structure, tuple(signature))] = found
            self.compiles += 1
        self._last, self._last_structure = found, structure
        return found

    def __call__(self, structure: Hashable, leaves: list[torch.Tensor]) -> tuple[Sequence[torch.Tensor], Any]:
        """The outputs of the graph for this call, and its context."""
        found = self.entry(structure, leaves)
        return found.compiled(*leaves), found.context

    def _change(self, structure: Hashable, signature: list[tuple[Any, ...]]) -> tuple[int | None, Any, Any]:
        last = self._last
        if last is None or last.structure != structure or len(last.signature) != len(signature):
            return (None, None if last is None else last.structure, structure)
        for index, (before, after) in enumerate(zip(last.signature, signature)):
            if before != after:
                return (index, _describe(before), _describe(after))
        raise AssertionError("unreachable: the signatures are equal")


@attrs.frozen(eq=False)
class Entry:
    """One compiled graph: ``compiled(*tensors)``, and what it was built for.

    ``draws`` says whether the graph draws from torch's generator (a random
    op the trace does not draw from its seed input): a caller seeds the
    generator only for those.
    """

    structure: Hashable
    signature: list[tuple[Any, ...]]
    compiled: Flat
    draws: bool
    context: Any


def _describe(meta: tuple[Any, ...]) -> str:
    shape, stride, dtype, device = meta
    return f"shape {tuple(shape)}, strides {stride}, {dtype}, on {device}"
