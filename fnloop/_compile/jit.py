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
import logging
import sys
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from fnloop._compile.cache import CompileCache, default_cache, graph_key, start_key
from fnloop._compile.errors import CompileFailed, OverBudget, RandomInGraph
from fnloop._compile.identity import fingerprint
from fnloop._compile.known import routed, scatter_fallbacks
from fnloop._compile.options import checked_backend, default_options, inductor_options
from fnloop._compile.probes import remembered_probes
from fnloop._compile.regather import regathered
from fnloop._compile.trace import (
    Flat,
    Traceable,
    accumulating,
    dead_constants_dropped,
    has_constants,
    located,
    trace,
)

__all__ = ["Entry", "Jit"]


def _signature(leaves: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
    return [(t.shape, t.stride(), t.dtype, t.device) for t in leaves]


@attrs.frozen(eq=False)
class Built:
    """What ``_compile`` made of a function: the compiled graph, what its trace learned, and its key in the cache.

    ``key``: the graph's file in the compile cache, where it was saved or
    found there (``None``: it is not there, so no start file may name it).
    """

    compiled: Flat
    draws: bool
    context: Any
    accumulates: tuple[str, ...]
    random: bool
    key: str | None = None


def _compile(
    function: Traceable,
    leaves: list[torch.Tensor],
    options: Mapping[str, Any],
    cache: CompileCache | None = None,
    no_random: str | None = None,
    backend: str = "inductor",
) -> Built:
    """``function`` traced on ``leaves`` and compiled: the graph, whether it draws from torch's generator, its context, its accumulating ops, whether it draws at all.

    Random ops the trace knows (dropout's, ``rand``, ``randn``, ...) draw
    from the seed the function names; any other random op draws from
    torch's generator, which the caller then seeds. With a ``cache``, the
    traced graph is looked up there first (see ``fnloop/_compile/cache.py``)
    and what inductor builds is kept there. ``no_random``: the message of
    the ``RandomInGraph`` raised, before anything is compiled, when the graph
    draws from the generator (the name of each such op is added to it).
    ``backend="graph"``: the traced graph itself, run op by op (see ``Jit``).
    """
    drawn = not options.get("fallback_random", False)
    traced = trace(function, leaves, drawn=drawn, portable=backend == "graph")
    if traced.draws and no_random is not None:
        raise RandomInGraph(
            f"{no_random} The ops that draw from torch's generator: {sorted(set(traced.draws))}."
        )
    nodes = traced.nodes
    random = bool(traced.draws) or traced.seeded > 0
    if backend == "graph":
        return Built(traced.graph, bool(traced.draws), traced.context, accumulating(nodes), random)
    regather = _shards(nodes) and regathered(traced.graph)  # a block's gather made anew for its backward
    if dead_constants_dropped(traced.graph) or regather:
        nodes = [
            n for m in traced.graph.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
        ]
    ops = sum(node.op == "call_function" for node in nodes)
    options = {
        **default_options(leaves, _has_loops(nodes), ops, traced.recomputes, _shards(nodes)),
        **options,
    }

    def failed(exc: BaseException) -> CompileFailed:
        return located(function, leaves, drawn, exc)

    compiled, key = _built(traced.graph, leaves, options, cache, nodes, failed)
    return Built(compiled, bool(traced.draws), traced.context, accumulating(nodes), random, key)


def _built(
    graph: torch.fx.GraphModule,
    leaves: list[torch.Tensor],
    options: Mapping[str, Any],
    cache: CompileCache | None,
    nodes: list[torch.fx.Node],
    failed: Callable[[BaseException], CompileFailed],
) -> tuple[Flat, str | None]:
    """What inductor builds from ``graph``, or finds in ``cache``, and its key there (``None``: not kept); ``failed`` makes inductor's errors ours."""
    from torch._inductor import standalone_compile as standalone

    # Around torch 2.13's scatter miscompile (known.py): the scatters left to torch's kernels (which
    # the key records: it is taken inside).
    route = scatter_fallbacks() if routed(nodes) else contextlib.nullcontext()
    with route, remembered_probes(None if cache is None else cache.directory), contextlib.ExitStack() as held:
        key = None if cache is None else graph_key(graph, leaves, options)
        if cache is not None and key is not None:  # one process of the machine builds it (cache.py)
            held.enter_context(cache.claimed(key))
        # A graph with tensor constants (a tensor a closure captured) is not
        # reloadable on torch 2.13: the loaded graph expects them as inputs
        # (and crashes under the C++ wrapper); inductor's own cache still serves it,
        # to the processes that waited. Nor is a graph with a loop (torch 2.13's
        # caches refuse higher-order operators).
        if cache is not None and (has_constants(graph) or _has_loops(nodes)):
            cache = None
        if cache is not None and key is not None:
            found = cache.load(key)
            if found is not None:
                return found, key
        # A loop's graph cannot be saved: inductor would warn so at every compile.
        quiet = (
            _quiet("torch._inductor.standalone_compile") if _has_loops(nodes) else contextlib.nullcontext()
        )
        try:
            with torch._inductor.config.patch(dict(options)), quiet:
                compiled = standalone(graph, list[Any](leaves), dynamic_shapes="from_example_inputs")
        except Exception as exc:
            raise failed(exc) from exc
        saved = cache is not None and key is not None and cache.save(key, compiled)
    return compiled, key if saved else None


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


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _Default()
"""``Jit``'s cache when none is given: ``default_cache()``, read when the ``Jit`` is made."""


class Jit:
    """A flat function compiled once per signature; ``compiles`` counts the graphs built.

    ``make(structure)`` returns the function for one ``structure`` (a hashable
    description of how the flat tensors are put back together, and of any
    static values): ``f(draws, *tensors) -> (outputs, context)``, traced once
    (see ``trace.py``); the context (the names of its outputs, say) is kept
    with the graph. ``entry(structure, tensors)`` finds, or traces and compiles, the
    graph for that call: a new structure, or tensors of another shape,
    strides, dtype or device, compile again. ``cache`` keeps compiled graphs
    between processes (by default where ``$FNLOOP_CACHE_DIR`` says; ``None``
    turns it off): a graph found there is loaded instead of compiled, and
    still counts in ``compiles``.

    ``backend="graph"`` runs each traced graph as it is, op by op, without
    inductor (``torch.compile(backend="aot_eager")`` does the same for
    dynamo's graphs): the trace's results in seconds, with nothing compiled
    or cached. A difference from ``"inductor"``'s results is the compiler's.
    """

    def __init__(
        self,
        make: Callable[[Hashable], Traceable],
        budget: int | None = None,
        options: Mapping[str, Any] | None = None,
        cache: CompileCache | _Default | None = DEFAULT,
        no_random: str | None = None,
        backend: str = "inductor",
        identity: Callable[[], object] | None = None,
    ) -> None:
        self._make = make
        self._identity = identity
        self.backend = checked_backend(backend)
        """``"inductor"`` compiles each graph; ``"graph"`` runs the traced graph op by op, nothing compiled."""
        self.no_random = no_random
        """Refuse graphs that draw from torch's generator, with this message (``RandomInGraph``)."""
        self.cache = default_cache() if isinstance(cache, _Default) else cache
        """Where compiled graphs are kept between processes (``None``: nowhere); see ``fnloop/_compile/cache.py``."""
        self.budget = budget
        self.options = inductor_options(options)
        self._cache: dict[Hashable, Entry] = {}
        self._last: Entry | None = None
        self._last_structure: Hashable = None
        self.compiles = 0
        self.traces = 0
        self.started = 0

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
            function = self._make(structure)  # built every time: its checks and warnings are the call's
            start = self._start_key(structure, leaves, function)
            found = None if start is None else self._start(start, structure, signature)
            if found is None:
                built = _compile(function, leaves, self.options, self.cache, self.no_random, self.backend)
                self.traces += 1
                found = Entry(
                    structure,
                    signature,
                    built.compiled,
                    built.draws,
                    built.context,
                    built.accumulates,
                    built.random,
                )
                if start is not None and built.key is not None:
                    assert self.cache is not None
                    self.cache.keep_start(start, {"graph": built.key, **_learned(found)})
            self._cache[(structure, tuple(signature))] = found
            self.compiles += 1
        self._last, self._last_structure = found, structure
        return found

    def _start_key(self, structure: Hashable, leaves: list[torch.Tensor], function: Traceable) -> str | None:
        """The key of the start file of this call (``cache.start_key``), or ``None`` where there is none.

        Its identity is the ``fingerprint`` of ``function`` (the closures it is
        built from: the model, the loss function, the optimizer, and the
        stages between them) and of what ``identity`` adds.
        """
        if self.cache is None or self.backend != "inductor" or self._identity is None:
            return None
        text = repr(structure)
        if " at 0x" in text:  # something described by its address: trace
            return None
        identity = fingerprint(function, self._identity())
        if identity is None:
            return None
        return start_key(identity + _compiler(), text, leaves, self.options, self.no_random)

    def _start(self, key: str, structure: Hashable, signature: list[tuple[Any, ...]]) -> Entry | None:
        """The graph the start file ``key`` names, loaded without a trace; ``None`` where it is not there."""
        assert self.cache is not None
        record = self.cache.start(key)
        if record is None:
            return None
        with remembered_probes(self.cache.directory):
            compiled = self.cache.load(record["graph"])
        if compiled is None:  # gone, or damaged: compiled again and saved whole
            self.cache.forget(record["graph"])
            return None
        self.started += 1
        accumulates = tuple(record["accumulates"])
        return Entry(
            structure, signature, compiled, record["draws"], record["context"], accumulates, record["random"]
        )

    @property
    def last(self) -> Entry | None:
        """The graph of the last call, ``None`` before the first."""
        return self._last

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
    generator only for those. ``accumulates``: the graph's ops that add into
    a tensor at indices known only when it runs (``trace.accumulating``).
    ``random``: whether the graph draws random numbers at all (dropout).
    """

    structure: Hashable
    signature: list[tuple[Any, ...]]
    compiled: Flat
    draws: bool
    context: Any
    accumulates: tuple[str, ...] = ()
    random: bool = False


def _compiler() -> str:
    """The compile path's own functions, by name, as this module finds them now: one replaced is another start key."""
    inductor = getattr(sys.modules.get("torch._inductor"), "standalone_compile", None)
    path = (
        _compile,
        _built,
        trace,
        graph_key,
        routed,
        scatter_fallbacks,
        regathered,
        default_options,
        inductor,
    )
    return repr([f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', '?')}" for f in path])


def _learned(entry: Entry) -> dict[str, Any]:
    """What a start file keeps of an entry beside its graph: what the trace learned."""
    return {
        "draws": entry.draws,
        "context": entry.context,
        "accumulates": list(entry.accumulates),
        "random": entry.random,
    }


def _describe(meta: tuple[Any, ...]) -> str:
    shape, stride, dtype, device = meta
    return f"shape {tuple(shape)}, strides {stride}, {dtype}, on {device}"
