"""The traced function: forward, backward and update on plain dicts of tensors, and its flat form."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.func import functional_call, grad_and_value
from torch.utils import _pytree as pytree

from fnloop._step.errors import _LOOP_BODY, _NUMBER_METRIC, _RANDOM_STEPS, GraphBreakError, _number
from fnloop._step.jit import Flat, Jit, LoopBodyRefused, unflatten_batch
from fnloop.distributed import _group
from fnloop.optim import Optimizer, learning_rates

__all__ = ["LossFn"]

LossFn = Callable[[Callable[..., Any], Any], Any]
"""``loss_fn(model, batch) -> loss`` or ``(loss, metrics)``; ``model`` runs the forward on the state."""


def _split(out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        loss, metrics = out
    else:
        loss, metrics = out, {}
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"loss_fn must return a scalar loss tensor or (loss, metrics), got {type(loss).__name__} "
            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; reduce the loss to one "
            "value (for example .mean())."
        )
    for name, value in metrics.items():
        what = _number(value)
        if what is not None:
            raise GraphBreakError(_NUMBER_METRIC.format(name=name, what=what))
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise TypeError(
                f"loss_fn returned the metric {name!r} as a tensor of shape {tuple(value.shape)}; a "
                "metric is one number per step: reduce it (for example .mean()) or leave it out."
            )
    return loss.reshape(()), dict(metrics)


def _micro_batches(batch: Any, n: int) -> list[Any]:
    flat, spec = pytree.tree_flatten(batch)
    for leaf in flat:
        if isinstance(leaf, torch.Tensor) and leaf.shape[0] % n:
            raise ValueError(
                f"cannot split a batch of {leaf.shape[0]} rows into accumulate={n} equal micro-batches; "
                "choose a batch size divisible by accumulate."
            )
    chunks = [leaf.chunk(n) if isinstance(leaf, torch.Tensor) else [leaf] * n for leaf in flat]
    return [pytree.tree_unflatten([c[k] for c in chunks], spec) for k in range(n)]


def _all_finite(loss: torch.Tensor, grads: Mapping[str, torch.Tensor], eager: bool = False) -> torch.Tensor:
    """A 0-d bool: the loss and every gradient element are finite (one reduction per tensor, no sync).

    The largest magnitude of a tensor is finite exactly when every element is
    (``amax`` propagates NaN), so this is ``isfinite(g).all()`` for all of them,
    asked as float max-reductions that the compiled step vectorizes: the boolean
    form took a third of the update of a 2048-wide MLP. (``(g * 0).sum()`` would
    be as fast but wrong: inductor folds ``* 0``, see tests/test_nonfinite.py.)

    ``eager``: run op by op, where ``vector_norm(g, inf)`` and ``isfinite(g).all()``
    take twenty times as long as ``aminmax`` (10 ms against 0.5 ms for 4 M floats on
    one thread); the smallest and largest element are both finite exactly when every
    element is (both reductions propagate NaN).
    """
    if eager:
        flags = [torch.isfinite(loss.detach()).reshape(())]
        flags += [
            torch.isfinite(torch.stack(torch.aminmax(g.detach()))).all() for g in grads.values() if g.numel()
        ]
        return torch.stack(flags).all()
    peaks = [loss.detach().abs().reshape(())]
    # vector_norm(g, inf) is abs().amax() without an eager copy of |g|; it compiles to the same.
    peaks += [torch.linalg.vector_norm(g, math.inf) for g in grads.values() if g.numel()]
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in peaks])  # widening keeps inf and NaN
    return torch.isfinite(torch.stack([p.to(dtype) for p in peaks]).amax())


def _kernel(
    model: torch.nn.Module,
    loss_fn: LossFn,
    optimizer: Optimizer,
    accumulate: int,
    autocast: torch.dtype | None,
    eager: bool = False,
) -> Callable[..., Any]:
    """The traced function: forward, backward and update on plain dicts, writing results into its inputs.

    It returns ``(loss, finite, metrics)``. A step whose loss or any gradient is
    not finite writes the old values back (``finite`` is false): decided in the
    graph, so no host sync is needed to keep the state clean. So does a step
    given a false ``gate`` (a 0-d bool): several steps in one call stop
    changing the state after the first non-finite one.

    ``eager``: the gradients come from ``torch.autograd.grad`` on leaf copies of
    the parameters instead of ``torch.func.grad_and_value``, whose per-op
    transform layer costs about a fifth of a small CNN's eager step; traced,
    both give the same graph, so the compiled step keeps ``grad_and_value``.
    """

    def loss_of(params: dict, buffers: dict, batch: Any) -> tuple[torch.Tensor, dict]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return functional_call(model, (params, buffers), args, kwargs)

        device = _device(params).type
        context = torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext()
        with context:
            loss, metrics = _split(loss_fn(forward, batch))
        return loss.float(), metrics

    def autograd(params: dict, buffers: dict, batch: Any) -> tuple[dict, tuple[torch.Tensor, dict]]:
        leaves = {
            k: v.detach().requires_grad_(v.is_floating_point() or v.is_complex()) for k, v in params.items()
        }
        with torch.enable_grad():
            loss, metrics = loss_of(leaves, buffers, batch)
            wanted = [v for v in leaves.values() if v.requires_grad]
            found = iter(torch.autograd.grad(loss, wanted, allow_unused=True) if wanted else ())
        grads = {}
        for k, v in leaves.items():
            g = next(found) if v.requires_grad else None
            grads[k] = torch.zeros_like(v) if g is None else g
        return grads, (loss.detach(), metrics)

    grads_and_loss = autograd if eager else grad_and_value(loss_of, has_aux=True)

    def kernel(
        params: dict,
        buffers: dict,
        opt_state: Any,
        iteration: torch.Tensor,
        batch: Any,
        gate: torch.Tensor | None = None,
    ) -> Any:
        # functional_call writes running statistics into the buffers it is given.
        new_buffers = {k: v.clone() for k, v in buffers.items()}
        if accumulate == 1:
            grads, (loss, metrics) = grads_and_loss(params, new_buffers, batch)
        else:
            grads, losses, parts = {}, [], []
            for micro in _micro_batches(batch, accumulate):
                g, (l_k, m_k) = grads_and_loss(params, new_buffers, micro)
                grads = {k: grads[k] + v for k, v in g.items()} if grads else g
                losses.append(l_k)
                parts.append(m_k)
            grads = {k: v / accumulate for k, v in grads.items()}
            loss = torch.stack(losses).mean()
            metrics = {k: torch.stack([m[k] for m in parts]).float().mean() for k in parts[0]}
        group = _group()
        if group is not None:  # data parallel: every rank gets the same averages, inside the graph
            grads, loss, metrics, new_buffers = _averaged(grads, loss, metrics, new_buffers, group)
        new_params, new_opt_state = optimizer.update(grads, opt_state, params, iteration)
        finite = _all_finite(loss, grads, eager)
        # `gate` false (an earlier step of the same call was not finite) keeps the state as it is too.
        keep = finite if gate is None else finite & gate
        # Donation: the new values go into the input storage, so the compiled
        # graph updates in place and keeps no second copy alive. A non-finite
        # step writes the old values back: the state is never poisoned.
        for k, p in params.items():
            p.copy_(torch.where(keep, new_params[k], p))
        for k, b in buffers.items():
            b.copy_(torch.where(keep, new_buffers[k], b))
        for old, new in zip(pytree.tree_leaves(opt_state), pytree.tree_leaves(new_opt_state)):
            old.copy_(torch.where(keep, new, old))
        # Fixed learning rates are recorded as the numbers they are, outside the graph (TrainStep.fixed).
        rates = {k: v for k, v in learning_rates(optimizer, iteration).items() if isinstance(v, torch.Tensor)}
        return loss, finite, {**rates, **{k: v.detach() for k, v in metrics.items()}}

    return kernel


def _averaged(
    grads: dict[str, torch.Tensor],
    loss: torch.Tensor,
    metrics: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    group: Any,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Gradients, loss, metrics and floating buffers averaged over the ranks of ``group``.

    One all-reduce per dtype over all of them put end to end: a step pays the
    collective's latency once, and every rank receives the same bytes, so the
    replicas stay identical. Floating buffers (BatchNorm's running statistics)
    are averaged too; integer ones (counters) agree already.
    """
    import torch.distributed._functional_collectives as funcol

    size = torch.distributed.get_world_size(group)
    named = {
        **{("g", k): v for k, v in grads.items()},
        ("l", ""): loss,
        **{("m", k): v.float() for k, v in metrics.items()},
        **{("b", k): v for k, v in buffers.items() if v.is_floating_point()},
    }
    by_dtype: dict[torch.dtype, list[tuple[Any, torch.Tensor]]] = {}
    for key, value in named.items():
        by_dtype.setdefault(value.dtype, []).append((key, value))
    out: dict[Any, torch.Tensor] = {}
    for entries in by_dtype.values():
        flat = torch.cat([v.reshape(-1) for _, v in entries])
        flat = funcol.all_reduce(flat, "sum", group) / size
        for (key, value), part in zip(entries, flat.split([v.numel() for _, v in entries])):
            out[key] = part.view(value.shape)
    return (
        {k: out["g", k] for k in grads},
        out["l", ""],
        {k: out["m", k] for k in metrics},
        {k: out.get(("b", k), v) for k, v in buffers.items()},
    )


def _jit_kernel(kernel: Callable[..., Any], budget: int, options: Mapping[str, Any] | None) -> Jit:
    """The kernel as a function of flat tensors: params, buffers, optimizer state, iteration, batch."""

    def make(structure: Any) -> tuple[Flat, list[str]]:
        pkeys, bkeys, ospec, bstructure = structure
        names: list[str] = []
        a, b = len(pkeys), len(pkeys) + len(bkeys)
        c = b + ospec.num_leaves

        def flat(*leaves: torch.Tensor) -> list[torch.Tensor]:
            params = dict(zip(pkeys, leaves[:a]))
            buffers = dict(zip(bkeys, leaves[a:b]))
            opt_state = pytree.tree_unflatten(list(leaves[b:c]), ospec)
            batch = unflatten_batch(leaves[c + 1 :], bstructure)
            loss, finite, metrics = kernel(params, buffers, opt_state, leaves[c], batch)
            names[:] = metrics
            return [loss, finite, *metrics.values()]

        return flat, names

    return Jit(make, budget, options)


UNROLL = 2
"""Steps written out one after the other in the body of a several-step call's loop.

The loop (``torch._higher_order_ops.scan``) compiles its body once, whatever
the number of steps; each turn of it costs about 10 us on the tiny MLP (its
carry is copied, its buffers allocated), so two steps per turn halve that.
Measured on the tiny MLP with AdamW: one step per turn 34 us per step, two
24.5 us, four 21.8 us but a compile 1.4 times as long as two's (26 s against 19 s).
"""


def _jit_steps(kernel: Callable[..., Any], n: int, budget: int, options: Mapping[str, Any] | None) -> Jit:
    """The kernel run ``n`` times in one graph: ``n`` is in the structure, the batches stacked.

    Inputs: params, buffers, optimizer state, the first iteration, then each
    batch tensor with the ``n`` batches stacked on a new first dimension (so
    the graph does not grow with ``n``). Outputs: ``loss, finite, *metrics``,
    each a 1-d tensor of the ``n`` steps' values. When the structure says
    ``stop``, a step after a non-finite one leaves the state unchanged (the
    fold then stops at the first non-finite step, with the state it began),
    and one more output says whether every step was finite.

    ``n`` steps run as a loop over turns of ``UNROLL`` steps (one graph for the
    body, whatever ``n``); with ``n`` at most ``UNROLL``, or a torch without
    ``scan``, they are written out one after the other.
    """
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    try:
        from torch._higher_order_ops import scan
    except ImportError:  # torch before 2.6: every step written out
        scan = None  # type: ignore[assignment]

    def make(structure: Any) -> tuple[Flat, list[str]]:
        pkeys, bkeys, ospec, bstructure, n, stop = structure
        names: list[str] = []
        a, b = len(pkeys), len(pkeys) + len(bkeys)
        c = b + ospec.num_leaves
        unroll = UNROLL if scan is not None and n > UNROLL and n % UNROLL == 0 else n
        if unroll < n:
            # torch 2.13 keeps state from tracing one loop body into the next: a
            # second loop graph in a process failed inductor's fake tensor update
            # (tests/test_steps_per_call.py). dynamo's caches are cleared first;
            # functions compiled with torch.compile recompile at their next call.
            torch._dynamo.reset()

        def steps(
            state: list[torch.Tensor], iteration: torch.Tensor, xs: list[torch.Tensor], gate: Any
        ) -> tuple[Any, list[torch.Tensor], list[str]]:
            # `unroll` steps on `state` (written into in place), the j-th on the rows xs[:][j].
            params = dict(zip(pkeys, state[:a]))
            buffers = dict(zip(bkeys, state[a:b]))
            opt_state = pytree.tree_unflatten(list(state[b:c]), ospec)
            out: list[torch.Tensor] = []
            for j in range(unroll):
                batch = unflatten_batch([x[j] for x in xs], bstructure)
                loss, finite, metrics = kernel(params, buffers, opt_state, iteration + j, batch, gate)
                if stop:
                    gate = gate & finite
                found = list(metrics)
                out += [loss, finite, *metrics.values()]
            return gate, out, found

        def flat(*leaves: torch.Tensor) -> list[torch.Tensor]:
            state, iteration, xs = list(leaves[:c]), leaves[c], list(leaves[c + 1 :])
            gate = torch.ones((), dtype=torch.bool, device=iteration.device) if stop else None
            if unroll == n:
                gate, out, names[:] = steps(state, iteration, xs, gate)
                per = len(out) // n
                stacked = [torch.stack(out[q::per]) for q in range(per)]
                return [*stacked, gate] if stop else stacked
            turns = n // unroll
            rows = [x.reshape(turns, unroll, *x.shape[1:]) for x in xs]
            # The loop's body is traced by dynamo, which refuses side effects
            # such as keeping the metrics' names: they are found first, on fake
            # copies, with nothing recorded into the graph.
            with disable_proxy_modes_tracing():
                names[:] = steps([t.clone() for t in state], iteration, [x[0] for x in rows], gate)[2]

            def turn(carry: list[torch.Tensor], rows: list[torch.Tensor]) -> tuple[list, list]:
                # The body must not write into its carry: the steps write into copies.
                fresh = [t.clone() for t in carry[:c]]
                after, out, _ = steps(fresh, carry[c], rows, carry[c + 1] if stop else None)
                return [*fresh, carry[c] + unroll, *([after] if stop else [])], out

            try:
                carry, ys = scan(  # type: ignore[misc]
                    turn, [*state, iteration, *([gate] if stop else [])], rows
                )
            except torch._dynamo.exc.UncapturedHigherOrderOpError as exc:
                raise LoopBodyRefused(_LOOP_BODY.format(n=n, error=exc)) from exc
            for old, new in zip(state, carry[:c]):
                old.copy_(new)
            per = len(ys) // unroll  # outputs of one step; ys[j * per + q] is output q of step j of each turn
            stacked = [torch.stack(ys[q::per], dim=1).reshape(n) for q in range(per)]
            return [*stacked, carry[c + 1]] if stop else stacked

        return flat, names

    return Jit(make, budget, options, no_random=_RANDOM_STEPS.format(n=n))


def _leaf_name(structure: Any, index: int) -> str:
    pkeys, bkeys, ospec = structure[:3]
    if index < len(pkeys):
        return f"params[{pkeys[index]!r}]"
    index -= len(pkeys)
    if index < len(bkeys):
        return f"buffers[{bkeys[index]!r}]"
    index -= len(bkeys)
    if index < ospec.num_leaves:
        return f"opt_state leaf {index}"
    index -= ospec.num_leaves
    return "the iteration" if index == 0 else f"the batch's tensor {index - 1}"


def _device(params: Mapping[str, torch.Tensor]) -> torch.device:
    for tensor in params.values():
        return tensor.device
    return torch.device("cpu")


def _cloned(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)
