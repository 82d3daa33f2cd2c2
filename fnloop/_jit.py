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

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

__all__ = ["Jit", "TraceError"]

Flat = Callable[..., Sequence[torch.Tensor]]
"""A function of flat tensors to a list of tensors."""


class TraceError(RuntimeError):
    """The function cannot be one graph: it depends on a tensor's value in Python."""


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


def _signature(leaves: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
    return [(t.shape, t.stride(), t.dtype, t.device) for t in leaves]


def _compile(function: Flat, leaves: list[torch.Tensor]) -> Flat:
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        graph = make_fx(function, tracing_mode="fake")(*leaves)
    except _data_dependent() as exc:
        raise TraceError(str(exc)) from exc
    import torch._inductor

    standalone = getattr(torch._inductor, "standalone_compile", None)
    if standalone is None:  # torch before 2.8: dynamo over the traced graph (flat inputs, cheap guards)
        return torch.compile(graph, fullgraph=True, dynamic=False)  # type: ignore[return-value]
    return standalone(graph, leaves, dynamic_shapes="from_example_inputs")  # type: ignore[no-any-return]


class Jit:
    """A flat function compiled once per signature; ``compiles`` counts the graphs built.

    ``make(structure)`` returns the function for one ``structure`` (a hashable
    description of how the flat tensors are put back together, and of any
    static values) and a context it may fill while it is traced (the names of
    its outputs, say): ``(f, context)`` with ``f(*tensors) -> list of
    tensors``. A call returns the outputs and that context. A new structure,
    or tensors of another shape, strides, dtype or device, trace and compile
    again.
    """

    def __init__(self, make: Callable[[Hashable], tuple[Flat, Any]], budget: int | None = None) -> None:
        self._make = make
        self.budget = budget
        self._cache: dict[Hashable, _Entry] = {}
        self._last: _Entry | None = None
        self.compiles = 0

    def __call__(self, structure: Hashable, leaves: list[torch.Tensor]) -> tuple[Sequence[torch.Tensor], Any]:
        signature = _signature(leaves)
        last = self._last
        # The common case: what the last call had. Tuple equality tries identity first.
        if last is None or last.structure != structure or last.signature != signature:
            last = self._cache.get((structure, tuple(signature)))
            if last is None:
                if self.budget is not None and self.compiles >= self.budget:
                    raise OverBudget(self._change(structure, signature))
                function, context = self._make(structure)
                last = _Entry(structure, signature, _compile(function, leaves), context)
                self._cache[(structure, tuple(signature))] = last
                self.compiles += 1
            self._last = last
        return last.compiled(*leaves), last.context

    def _change(self, structure: Hashable, signature: list[tuple[Any, ...]]) -> tuple[int | None, Any, Any]:
        last = self._last
        if last is None or last.structure != structure or len(last.signature) != len(signature):
            return (None, None if last is None else last.structure, structure)
        for index, (before, after) in enumerate(zip(last.signature, signature)):
            if before != after:
                return (index, _describe(before), _describe(after))
        raise AssertionError("unreachable: the signatures are equal")


def _describe(meta: tuple[Any, ...]) -> str:
    shape, stride, dtype, device = meta
    return f"shape {tuple(shape)}, strides {stride}, {dtype}, on {device}"


class _Entry:
    __slots__ = ("compiled", "context", "signature", "structure")

    def __init__(self, structure: Hashable, signature: list[tuple[Any, ...]], compiled: Flat, context: Any):
        self.structure, self.signature, self.compiled, self.context = structure, signature, compiled, context
