"""The compiler, as the step sees it: ``compile_step`` gives a ``Jit`` of the step in its one flat form.

A ``Jit`` maps a call's ``Form`` (the names, the optimizer state's and the
batch's tree, static values, the ``Layout``) and flat tensors to a compiled graph
(``Jit.entry``), tracing and compiling one only for a signature it has not
seen, and refusing beyond its budget of graphs (``OverBudget``, which the
step reports as ``RecompileError``). The step calls the graph with the
state's own tensors, which the graph overwrites with the new state.

Tracing, compiling, the graph cache and the seed inputs are the compiler
room's (``fnloop/_compile/``, whose door note names the private torch APIs
it uses). This module says what is traced: the step for a ``Form``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from fnloop._compile import HAS_SCAN, Draws, Jit, Traceable, scan, unflatten_batch
from fnloop._step.composed import transformed
from fnloop._step.errors import _RANDOM_STEPS
from fnloop._step.guard import kept
from fnloop._step.kernel import Kernel, Update, state_of
from fnloop._step.layout import Layout
from fnloop._step.placement import Placement, Plan

__all__ = ["UNROLL", "Form", "compile_step", "leaf_name", "ranks_of"]


class Form(NamedTuple):
    """How a call's flat tensors are put back together: the one flat form every compiled step takes.

    Inputs, in order: the state (``params``' tensors, ``buffers``', the
    optimizer state's leaves), the iteration (0-d int64), the seeds (int64:
    0-d for one step, one per member or per step of a call), what the
    layout names in ``given`` (a population's: which members train, a 1-d
    bool), and the batch's tensors (stacked
    on a new first dimension for several steps). Outputs: ``loss, finite,
    *metrics``, each one value per step and per member, and for several
    steps that stop at a non-finite one, whether every step was finite.
    The graph writes the new state into the state's input tensors. (A
    tuple: one is built every call, and compared with the last call's.)
    """

    params: tuple[str, ...]
    buffers: tuple[str, ...]
    opt_state: pytree.TreeSpec
    batch: Hashable
    layout: Layout

    @property
    def width(self) -> int:
        """How many of the inputs are the state."""
        return len(self.params) + len(self.buffers) + self.opt_state.num_leaves

    def unflattened(self, state: Sequence[torch.Tensor]) -> tuple[dict, dict, Any]:
        """``(params, buffers, opt_state)`` from the state's flat tensors."""
        a, b = len(self.params), len(self.params) + len(self.buffers)
        return (
            dict(zip(self.params, state[:a])),
            dict(zip(self.buffers, state[a:b])),
            pytree.tree_unflatten(list(state[b:]), self.opt_state),
        )


def leaf_name(form: Form, index: int) -> str:
    """What the ``index``-th input of ``form`` is, for a message."""
    if index < len(form.params):
        return f"params[{form.params[index]!r}]"
    index -= len(form.params)
    if index < len(form.buffers):
        return f"buffers[{form.buffers[index]!r}]"
    index -= len(form.buffers)
    if index < form.opt_state.num_leaves:
        return f"opt_state leaf {index}"
    index -= form.opt_state.num_leaves
    inputs = ["the iteration", "the step's seed", *form.layout.given]
    if index < len(inputs):
        return inputs[index]
    return f"the batch's tensor {index - len(inputs)}"


def compile_step(
    kernel: Kernel,
    plan: Plan,
    group: Any,
    budget: int,
    options: Mapping[str, Any] | None,
    steps: int = 1,
    backend: str = "inductor",
) -> Jit:
    """The step of ``kernel`` compiled, for any ``Form`` (the call's structure); ``steps``: per call.

    Each form's graph runs the kernel placed for ``form.layout`` under ``plan``
    (``placement.py``, ``composed.py``): one step, or ``form.layout.steps`` of
    them in a loop (``several``).
    """
    updates: dict[Layout, Update] = {}

    def make(form: Hashable) -> Traceable:
        assert isinstance(form, Form)
        layout = form.layout
        update = updates.get(layout)
        if update is None:
            update = updates[layout] = transformed(kernel, Placement.of(plan, layout, group))
        return (one if layout.steps == 1 else several)(update, form)

    no_random = _RANDOM_STEPS.format(n=steps) if steps > 1 else None
    return Jit(make, budget, options, no_random=no_random, backend=backend, identity=ranks_of(group))


def ranks_of(group: Any) -> Callable[[], object]:
    """What a traced step reads besides its closures and inputs: the ranks of ``group``, read when asked."""

    def identity() -> object:
        return (
            None
            if group is None
            else (dist.get_backend(group), dist.get_world_size(group), dist.get_rank(group))
        )

    return identity


def _guarded(
    update: Update,
    draws: Draws,
    form: Form,
    state: list[torch.Tensor],
    iteration: torch.Tensor,
    seed: torch.Tensor,
    given: Sequence[torch.Tensor],
    batch: Any,
    gate: torch.Tensor | None,
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor], list[str]]:
    """One step from ``state``: the state it leaves, the keep flag, its outputs and its metrics' names.

    A step keeps its new state where the step says (``Stepped.keep``), and
    where ``gate`` (the steps before were finite) holds.
    """
    params, buffers, opt_state = form.unflattened(state)
    with draws.from_(seed):
        new = update(params, buffers, opt_state, iteration, batch, *given)
    keep = new.keep
    if gate is not None:
        keep = keep & gate
    return (
        kept(keep, state, state_of(new)),
        keep,
        [new.loss, new.finite, *new.metrics.values()],
        list(new.metrics),
    )


def one(update: Update, form: Form) -> Traceable:
    """One step as a function of the flat form, writing the new state into its state inputs."""
    c, g = form.width, len(form.layout.given)

    def flat(draws: Draws, *leaves: torch.Tensor) -> tuple[list[torch.Tensor], list[str]]:
        state, iteration, seed = list(leaves[:c]), leaves[c], leaves[c + 1]
        given, batch = leaves[c + 2 : c + 2 + g], unflatten_batch(leaves[c + 2 + g :], form.batch)
        after, _, out, names = _guarded(update, draws, form, state, iteration, seed, given, batch, None)
        for old, value in zip(state, after):
            if value is not old:
                old.copy_(value)
        return out, names

    return flat


UNROLL = 1
"""Steps written out one after the other in the body of a several-step call's loop.

The loop (``torch._higher_order_ops.scan``) compiles its body once, whatever
the number of steps, so the loop graph compiles in about the time of one
step's graph; two steps per turn would halve the loop's own cost per step
on a tiny model, and double the compile.
"""


def several(update: Update, form: Form) -> Traceable:
    """``form.layout.steps`` steps in one graph (``n``), the batches and the steps' seeds stacked.

    Inputs: params, buffers, optimizer state, the first iteration, the ``n``
    steps' seeds (int64, a row per step: its seed, or a world-size-invariant
    step's one per slice), then each batch tensor with the ``n`` batches
    stacked on a new first dimension (so the graph does not grow with ``n``).
    Outputs: ``loss, finite, *metrics``, each a 1-d tensor of the ``n`` steps'
    values. When the structure says ``stop``, a step after a non-finite one
    leaves the state unchanged (the fold then stops at the first non-finite
    step, with the state it began), and one more output says whether every
    step was finite. Each step draws its random numbers from its own seed, so
    the result is that of ``n`` single steps, bit for bit.

    The steps run as a loop over turns of ``UNROLL`` steps (one graph for the
    body, whatever ``n``); with ``n`` at most ``UNROLL``, or a torch without
    ``scan``, they are written out one after the other. The body is traced
    before the loop is (Python in ``loss_fn`` runs then, as for a single
    step), and the loop is handed the traced graph: torch's compiler, which
    traces a loop's body itself, meets only tensor ops.
    """
    n, stop = form.layout.steps, form.layout.stop
    names: list[str] = []  # the metrics' names, as the steps give them
    c = form.width
    unroll = UNROLL if HAS_SCAN and n > UNROLL and n % UNROLL == 0 else n

    def steps(
        draws: Draws,
        state: list[torch.Tensor],
        iteration: torch.Tensor,
        seeds: torch.Tensor,
        xs: list[torch.Tensor],
        gate: Any,
    ) -> tuple[list[torch.Tensor], Any, list[torch.Tensor]]:
        # `unroll` steps from `state`, the j-th on the rows xs[:][j] with seed seeds[j].
        out: list[torch.Tensor] = []
        for j in range(unroll):
            batch = unflatten_batch([x[j] for x in xs], form.batch)
            state, keep, outputs, names[:] = _guarded(
                update, draws, form, state, iteration + j, seeds[j], (), batch, gate
            )
            if stop:
                gate = keep
            out += outputs
        return state, gate, out

    def flat(draws: Draws, *leaves: torch.Tensor) -> tuple[list[torch.Tensor], list[str]]:
        state, iteration, seeds = list(leaves[:c]), leaves[c], leaves[c + 1]
        xs = list(leaves[c + 2 :])
        gate = torch.ones((), dtype=torch.bool, device=iteration.device) if stop else None
        if unroll == n:
            final, gate, out = steps(draws, state, iteration, seeds, xs, gate)
            per = len(out) // n
            stacked = [torch.stack(out[q::per]) for q in range(per)]
        else:
            turns = n // unroll
            rows = [
                seeds.reshape(turns, unroll, *seeds.shape[1:]),
                *(x.reshape(turns, unroll, *x.shape[1:]) for x in xs),
            ]

            def turn(*flat: torch.Tensor) -> list[torch.Tensor]:
                # One turn of the loop: the carry (state, iteration, gate), then this turn's rows.
                carry, row = flat[:width], flat[width:]
                after, gate, out = steps(
                    draws, list(carry[:c]), carry[c], row[0], list(row[1:]), carry[c + 1] if stop else None
                )
                # A loop's outputs may not be its inputs: what the steps passed through (frozen
                # parameters, an injected learning rate recorded as a metric) leaves each turn as a copy.
                return [
                    t.clone() if any(t is x for x in flat) else t
                    for t in [*after, carry[c] + unroll, *([gate] if stop else []), *out]
                ]

            init: list[torch.Tensor] = [*state, iteration, *([gate] if gate is not None else [])]
            width = len(init)
            flat_out = scan(turn, init, rows, draws)
            carry, ys = flat_out[:width], flat_out[width:]
            final, gate = carry[:c], (carry[c + 1] if stop else None)
            # The outputs of one step; ys[j * per + q] is output q of step j of each turn.
            per = len(ys) // unroll
            stacked = [torch.stack(ys[q::per], dim=1).reshape(n) for q in range(per)]
        for old, new in zip(state, final):
            if new is not old:
                old.copy_(new)
        return ([*stacked, gate] if gate is not None else stacked), names

    return flat
