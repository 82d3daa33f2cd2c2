"""The compiler, as the step sees it: ``compile_step`` and ``compile_steps`` give a ``Jit``.

A ``Jit`` maps a call's structure (the names, the optimizer state's and the
batch's tree, static values) and flat tensors to a compiled graph
(``Jit.entry``), tracing and compiling one only for a signature it has not
seen, and refusing beyond its budget of graphs (``OverBudget``, which the
step reports as ``RecompileError``). The step calls the graph with the
state's own tensors, which the graph overwrites with the new state.

Behind this interface, on private torch APIs:

* ``fnloop/_step/jit.py`` traces with ``make_fx`` on fake tensors (with
  inductor's decompositions, oneDNN off) and compiles with
  ``torch._inductor.standalone_compile``. It never touches dynamo's state: a
  user's own ``torch.compile``d functions stay compiled across a fnloop run.
* ``fnloop/_step/cache.py``: compiled graphs on disk, one file per graph
  (``$FNLOOP_CACHE_DIR``, else ``~/.cache/fnloop``; ``off`` turns it off),
  keyed by the traced graph, its inputs' layout, inductor's configuration,
  torch's version and the machine, so a second process starts warm. A
  damaged file is ignored and built again.
* ``fnloop/_step/probes.py``: inductor's checks of the CPU's vector
  instructions, each a fresh Python interpreter in every new process (about
  a second in all), answered once per machine, compiler and torch and
  remembered in a file beside the graph cache.
* ``fnloop/_step/seeding.py``: the graph's random ops draw from a seed input,
  a function of ``(rng, iteration)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fnloop._step.batching import unflatten_batch
from fnloop._step.errors import _RANDOM_STEPS
from fnloop._step.jit import Flat, Jit, _decompositions
from fnloop._step.kernel import Update, _kept, _state
from fnloop._step.members import PopulationUpdate, kept_rows
from fnloop._step.seeding import drawing_from

__all__ = ["UNROLL", "compile_population", "compile_step", "compile_steps"]


def compile_step(update: Update, budget: int, options: Mapping[str, Any] | None) -> Jit:
    """The step as a function of flat tensors: params, buffers, optimizer state, iteration, seed, batch.

    It writes the new state into the input tensors (the fold's donation, inside
    the graph, so nothing keeps a second copy alive) and returns ``loss,
    finite, *metrics``. Its random ops draw from the seed.
    """

    def make(structure: Any) -> tuple[Flat, list[str]]:
        pkeys, bkeys, ospec, bstructure, shards = structure
        names: list[str] = []
        c = len(pkeys) + len(bkeys) + ospec.num_leaves

        def flat(*leaves: torch.Tensor) -> list[torch.Tensor]:
            params, buffers, opt_state = _unflattened(leaves[:c], pkeys, bkeys, ospec)
            iteration, seed = leaves[c], leaves[c + 1]
            batch = unflatten_batch(leaves[c + 2 :], bstructure)
            with drawing_from(seed):
                new = update(params, buffers, opt_state, iteration, batch, shards)
            for old, value in zip(leaves[:c], _kept(new.finite, list(leaves[:c]), _state(new))):
                if value is not old:
                    old.copy_(value)
            names[:] = new.metrics
            return [new.loss, new.finite, *new.metrics.values()]

        return flat, names

    return Jit(make, budget, options)


def compile_population(update: PopulationUpdate, budget: int, options: Mapping[str, Any] | None) -> Jit:
    """A population's step as a function of flat tensors: the members' stacked state, then
    the iteration, the members' seeds (1-d int64), which members train (1-d bool), and the batch.

    It writes the new state into the input tensors, row by row for the
    members that train and whose step was finite, and returns ``loss,
    finite, *metrics``, each one value per member. When the structure says
    ``stop`` (the step raises on a non-finite loss), one non-finite member
    leaves every member as it was, as a single run's non-finite step does.
    """

    def make(structure: Any) -> tuple[Flat, list[str]]:
        pkeys, bkeys, ospec, bstructure, _members, shared, stop = structure
        names: list[str] = []
        c = len(pkeys) + len(bkeys) + ospec.num_leaves

        def flat(*leaves: torch.Tensor) -> list[torch.Tensor]:
            params, buffers, opt_state = _unflattened(leaves[:c], pkeys, bkeys, ospec)
            iteration, seeds, training = leaves[c], leaves[c + 1], leaves[c + 2]
            batch = unflatten_batch(leaves[c + 3 :], bstructure)
            with drawing_from(seeds):
                new = update(params, buffers, opt_state, iteration, batch, shared)
            keep = new.finite & training
            if stop:  # a non-finite member stops the run: the step then leaves every member as it was
                keep = keep & (new.finite | ~training).all()
            for old, value in zip(leaves[:c], kept_rows(keep, list(leaves[:c]), _state(new))):
                if value is not old:
                    old.copy_(value)
            names[:] = new.metrics
            return [new.loss, new.finite, *new.metrics.values()]

        return flat, names

    return Jit(make, budget, options)


UNROLL = 1
"""Steps written out one after the other in the body of a several-step call's loop.

The loop (``torch._higher_order_ops.scan``) compiles its body once, whatever
the number of steps, so the loop graph compiles in about the time of one
step's graph; two steps per turn would halve the loop's own cost per step
on a tiny model, and double the compile.
"""


def compile_steps(update: Update, n: int, budget: int, options: Mapping[str, Any] | None) -> Jit:
    """``n`` steps in one graph: ``n`` is in the structure, the batches and the steps' seeds stacked.

    Inputs: params, buffers, optimizer state, the first iteration, the ``n``
    steps' seeds (a 1-d int64), then each batch tensor with the ``n`` batches
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
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx

    try:
        from torch._higher_order_ops.scan import scan_op
    except ImportError:  # torch before 2.6: every step written out
        scan_op = None  # type: ignore[assignment]

    def make(structure: Any) -> tuple[Flat, list[str]]:
        pkeys, bkeys, ospec, bstructure, n, stop, shards = structure
        names: list[str] = []
        c = len(pkeys) + len(bkeys) + ospec.num_leaves
        unroll = UNROLL if scan_op is not None and n > UNROLL and n % UNROLL == 0 else n

        def steps(
            state: list[torch.Tensor],
            iteration: torch.Tensor,
            seeds: torch.Tensor,
            xs: list[torch.Tensor],
            gate: Any,
        ) -> tuple[list[torch.Tensor], Any, list[torch.Tensor]]:
            # `unroll` steps from `state`, the j-th on the rows xs[:][j] with seed seeds[j].
            out: list[torch.Tensor] = []
            for j in range(unroll):
                params, buffers, opt_state = _unflattened(state[:c], pkeys, bkeys, ospec)
                batch = unflatten_batch([x[j] for x in xs], bstructure)
                with drawing_from(seeds[j]):
                    new = update(params, buffers, opt_state, iteration + j, batch, shards)
                keep = new.finite if gate is None else new.finite & gate
                state = _kept(keep, state, _state(new))
                if stop:
                    gate = keep
                names[:] = new.metrics
                out += [new.loss, new.finite, *new.metrics.values()]
            return state, gate, out

        def flat(*leaves: torch.Tensor) -> list[torch.Tensor]:
            state, iteration, seeds = list(leaves[:c]), leaves[c], leaves[c + 1]
            xs = list(leaves[c + 2 :])
            gate = torch.ones((), dtype=torch.bool, device=iteration.device) if stop else None
            if unroll == n:
                final, gate, out = steps(state, iteration, seeds, xs, gate)
                per = len(out) // n
                stacked = [torch.stack(out[q::per]) for q in range(per)]
            else:
                turns = n // unroll
                rows = [seeds.reshape(turns, unroll), *(x.reshape(turns, unroll, *x.shape[1:]) for x in xs)]

                def turn(*flat: torch.Tensor) -> list[torch.Tensor]:
                    # One turn of the loop: the carry (state, iteration, gate), then this turn's rows.
                    carry, row = flat[:width], flat[width:]
                    after, gate, out = steps(
                        list(carry[:c]), carry[c], row[0], list(row[1:]), carry[c + 1] if stop else None
                    )
                    # A loop's outputs may not be its inputs: what the steps passed through (frozen
                    # parameters) leaves each turn as a copy.
                    after = [t.clone() if any(t is x for x in carry) else t for t in after]
                    return [*after, carry[c] + unroll, *([gate] if stop else []), *out]

                init = [*state, iteration, *([gate] if stop else [])]
                width = len(init)
                # The body is traced on its own first, as the rest of the step is (Python runs
                # once, now, and autograd records its backward); the loop then meets tensor ops only.
                with disable_proxy_modes_tracing():
                    body = make_fx(turn, decomposition_table=_decompositions(True))(
                        *[t.clone() for t in init], *[r[0].clone() for r in rows]
                    )
                body, constants = _lifted(body)
                flat_out = scan_op(body, init, rows, additional_inputs=_constants(constants))
                carry, ys = flat_out[:width], flat_out[width:]
                final, gate = carry[:c], (carry[c + 1] if stop else None)
                # The outputs of one step; ys[j * per + q] is output q of step j of each turn.
                per = len(ys) // unroll
                stacked = [torch.stack(ys[q::per], dim=1).reshape(n) for q in range(per)]
            for old, new in zip(state, final):
                if new is not old:
                    old.copy_(new)
            return [*stacked, gate] if gate is not None else stacked

        return flat, names

    return Jit(make, budget, options, no_random=_RANDOM_STEPS.format(n=n))


def _unflattened(
    state: Sequence[torch.Tensor], pkeys: tuple[str, ...], bkeys: tuple[str, ...], ospec: pytree.TreeSpec
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """``(params, buffers, opt_state)`` from a graph's flat state inputs, in that order."""
    a, b = len(pkeys), len(pkeys) + len(bkeys)
    return (
        dict(zip(pkeys, state[:a])),
        dict(zip(bkeys, state[a:b])),
        pytree.tree_unflatten(list(state[b:]), ospec),
    )


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
