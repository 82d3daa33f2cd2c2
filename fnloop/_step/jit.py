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
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._step.cache import CompileCache, default_cache, graph_key
from fnloop._step.probes import remembered_probes

__all__ = [
    "Entry",
    "Jit",
    "LoopBodyRefused",
    "OverBudget",
    "RandomInGraph",
    "TraceError",
    "flatten_batch",
    "unflatten_batch",
]

Flat = Callable[..., Sequence[torch.Tensor]]
"""A function of flat tensors to a list of tensors."""


class TraceError(RuntimeError):
    """The function cannot be one graph: it depends on a tensor's value in Python."""


class LoopBodyRefused(TraceError):
    """The compiler refused the body of a loop (dynamo traces it): the message says why and the fix."""


class RandomInGraph(TraceError):
    """The function draws random numbers where the caller cannot seed them (several steps per call)."""


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

DEFAULT_OPTIONS: Mapping[str, Any] = {"cpp_wrapper": True}
"""fnloop's inductor settings: a C++ wrapper calls the kernels, not Python.

On the tiny benchmark it takes about 8 us off each step (44 -> 36 us per
iteration) for about 6 s more at the first compile, which inductor's cache
then keeps.
"""


def inductor_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``DEFAULT_OPTIONS`` updated with ``options``, each name checked against inductor's config."""
    import torch._inductor.config as config

    merged = {**DEFAULT_OPTIONS, **(options or {})}
    known = config.get_config_copy()
    for name in merged:
        if name not in known:
            raise ValueError(
                f"options: {name!r} is not a setting of torch._inductor.config; use the names "
                "torch.compile(options=...) takes, for example {'cpp_wrapper': False}."
            )
    return merged


def _signature(leaves: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
    return [(t.shape, t.stride(), t.dtype, t.device) for t in leaves]


def _compile(
    function: Flat,
    leaves: list[torch.Tensor],
    options: Mapping[str, Any],
    cache: CompileCache | None = None,
    no_random: str | None = None,
) -> tuple[Flat, bool]:
    """``function`` traced on ``leaves`` and compiled, and whether its graph draws random numbers.

    With a ``cache``, the traced graph is looked up there first (see
    ``fnloop/_step/cache.py``) and what inductor builds is kept there.
    ``no_random``: the message of the ``RandomInGraph`` raised, before
    anything is compiled, when the graph draws random numbers.
    """
    import torch._inductor
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        graph = make_fx(function, tracing_mode="fake", _allow_non_fake_inputs=True)(*leaves)
    except _data_dependent() as exc:
        raise TraceError(str(exc)) from exc
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
    random = any(
        isinstance(node.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in node.target.tags
        for node in nodes
    )
    if random and no_random is not None:
        raise RandomInGraph(no_random)
    standalone = getattr(torch._inductor, "standalone_compile", None)
    if standalone is None:  # torch before 2.8: dynamo over the traced graph (flat inputs, cheap guards)
        compiled = torch.compile(graph, fullgraph=True, dynamic=False, options=dict(options))
        return compiled, random
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
                return found, random
        # A loop's graph cannot be saved: inductor would warn so at every compile.
        quiet = (
            _quiet("torch._inductor.standalone_compile") if _has_loops(nodes) else contextlib.nullcontext()
        )
        with torch._inductor.config.patch(dict(options)), quiet:
            compiled = standalone(graph, leaves, dynamic_shapes="from_example_inputs")
        if cache is not None and key is not None:
            cache.save(key, compiled)
    return compiled, random


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


def _has_constants(graph: torch.fx.GraphModule) -> bool:
    return any(
        node.op == "get_attr" and isinstance(getattr(graph, str(node.target), None), torch.Tensor)
        for node in graph.graph.nodes
    )


_TENSOR = "tensor"


def flatten_batch(batch: Any) -> tuple[list[torch.Tensor], Hashable]:
    """The batch's tensors, and a hashable structure with its other (static) values."""
    kind = type(batch)
    if kind is torch.Tensor:
        return [batch], _TENSOR
    if (kind is tuple or kind is list) and all(type(x) is torch.Tensor for x in batch):
        return list(batch), (kind, len(batch))
    leaves, spec = pytree.tree_flatten(batch)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    static = tuple(_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
    try:
        hash(static)
    except TypeError:
        odd = next(leaf for leaf in static if leaf is not _TENSOR and not _hashable(leaf))
        raise TypeError(
            f"a compiled step takes batches of tensors and of hashable static values (ints, strings...); "
            f"this batch holds {odd!r:.80} (a {type(odd).__name__}), which is neither. Convert it to a "
            "tensor or a tuple, or use compile=False."
        ) from None
    return tensors, (spec, static)


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def unflatten_batch(tensors: Sequence[torch.Tensor], structure: Any) -> Any:
    if structure is _TENSOR:
        return tensors[0]
    first, second = structure
    if first is tuple or first is list:
        return first(tensors)
    it = iter(tensors)
    return pytree.tree_unflatten([next(it) if leaf is _TENSOR else leaf for leaf in second], first)


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
        """Refuse graphs that draw random numbers, with this message (``RandomInGraph``)."""
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

    ``random`` says whether the graph draws random numbers (dropout, say): a
    caller seeds the generator only for those.
    """

    structure: Hashable
    signature: list[tuple[Any, ...]]
    compiled: Flat
    random: bool
    context: Any


def _describe(meta: tuple[Any, ...]) -> str:
    shape, stride, dtype, device = meta
    return f"shape {tuple(shape)}, strides {stride}, {dtype}, on {device}"
