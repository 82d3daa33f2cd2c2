"""The tracer's cache: one graph per distinct signature, and a budget that refuses exactly the one too many.

The compiler is replaced by one eager run (the trace) and the plain function, so these
laws are about the cache and the budget, checked over many call sequences
without compiling anything.
"""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import given
from hypothesis import strategies as st

from fnloop._compile import jit as _jit

calls = st.lists(
    st.tuples(st.integers(1, 3), st.sampled_from([torch.float32, torch.float64]), st.sampled_from("ab")),
    min_size=1,
    max_size=12,
)


PURE = {"a": lambda x, y: [x.sum() + y.sum()], "b": lambda x, y: [x.sum() - y.sum()]}


def fake_compile(function, leaves, options, cache=None, no_random=None, backend="inductor"):
    _, context = function(None, *leaves)  # the trace
    return _jit.Built(function.pure, False, context, (), False)


def make(structure):
    traced = []

    def flat(draws, x, y):
        traced.append(structure)
        return PURE[structure](x, y), traced

    flat.pure = PURE[structure]  # what the "compiled" graph runs, without the trace's side effect
    return flat


def leaves(rows, dtype):
    return [torch.ones(rows, 2, dtype=dtype), torch.arange(3.0)]


@given(calls, st.none() | st.integers(1, 4))
def test_one_graph_per_signature_and_the_budget_refuses_exactly_the_next(sequence, budget):
    jit = _jit.Jit(make, budget)
    seen: list = []
    last = None
    with mock.patch.object(_jit, "_compile", fake_compile):
        for rows, dtype, structure in sequence:
            key = (structure, rows, dtype)
            if key not in seen and budget is not None and len(seen) == budget:
                try:
                    jit(structure, leaves(rows, dtype))
                except _jit.OverBudget as over:
                    index, before, after = over.change
                    if structure == last[0]:  # same structure: the first tensor that differs is named
                        assert index == 0 and f"shape ({rows}, 2)" in after and str(dtype) in after
                        assert f"shape ({last[1]}, 2)" in before
                    else:
                        assert index is None and (before, after) == (last[0], structure)
                else:
                    raise AssertionError("a graph beyond the budget was built")
                assert jit.compiles == budget  # refused: nothing traced, the cache as it was
                continue
            if key not in seen:
                seen.append(key)
            outputs, traced = jit(structure, leaves(rows, dtype))
            x, y = leaves(rows, dtype)
            expected = x.sum() + y.sum() if structure == "a" else x.sum() - y.sum()
            assert torch.equal(outputs[0], expected)
            assert traced == [structure]  # traced once per graph, never again on a hit
            assert jit.compiles == len(seen)
            last = key
