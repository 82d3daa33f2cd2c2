"""The gradient stage compiled alone, the update run outside the graph: ``train_step(..., compile="model")``.

``torch.compile(model)`` with ``AdamW(fused=True)`` compiles the forward and
the backward and leaves the update to torch's fused kernel. So does a step
built with ``compile="model"``: its graph is the placement's gradient stage
and the guard (forward, backward, whether the loss and every gradient are
finite), and the eager step's in-place update follows it
(``composed.in_place``: ``adam`` and ``adamw`` with torch's fused kernels).
The graph has no update in it: on a ResNet-18, 1,150 ops against the whole
step's 3,000 (the update's element-wise ops over every parameter are the
ones inductor's scheduler takes longest to fuse), and a restart loads a
smaller graph; a step then reads one flag on the host, as the eager step does.

``entry_of`` is the step's one way from a ``Jit`` and a call to the graph,
with the compiler's errors made the step's own (``TrainStep`` uses it too).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import torch

from fnloop._compile import (
    CompileFailed,
    Draws,
    Entry,
    Jit,
    OverBudget,
    RandomInGraph,
    Traceable,
    TraceError,
    TraceFailed,
    flatten_batch,
    unflatten_batch,
)
from fnloop._step.compiler import ranks_of
from fnloop._step.determinism import warn_varying
from fnloop._step.errors import _RECOMPILED, RecompileError, public_error
from fnloop._step.kernel import Grads, Kernel
from fnloop._step.layout import Layout
from fnloop._step.placement import Placement, Plan
from fnloop._step.seeds import step_seed_of

__all__ = ["CompiledGradient", "GradientForm", "entry_of"]


class GradientForm(NamedTuple):
    """How the gradient graph's flat inputs are put back together.

    Inputs, in order: ``params``' tensors, ``buffers``', the loss scale where
    ``scaled``, the step's seed (0-d int64), the batch's tensors. Outputs: each
    trained parameter's gradient, the buffers the forward leaves, the loss,
    whether it and every gradient are finite, the metrics.
    """

    params: tuple[str, ...]
    buffers: tuple[str, ...]
    scaled: bool
    batch: Hashable
    layout: Layout

    def leaf_name(self, index: int) -> str:
        """What the ``index``-th input is, for a message."""
        names = [
            *(f"params[{k!r}]" for k in self.params),
            *(f"buffers[{k!r}]" for k in self.buffers),
            *(["the loss scale"] if self.scaled else []),
            "the step's seed",
        ]
        return names[index] if index < len(names) else f"the batch's tensor {index - len(names)}"


def entry_of(
    jit: Jit,
    form: Hashable,
    flat: list[torch.Tensor],
    iteration: int | torch.Tensor,
    name: Callable[[int], str],
) -> Entry:
    """``jit``'s graph for ``flat`` put together as ``form``, its errors the step's: ``name`` says what an input is.

    ``iteration``: the step's, for the message of a recompile (a tensor is read only then).
    """
    try:
        return jit.entry(form, flat)
    except OverBudget as over:
        index, before, after = over.change
        what = (
            "the structure of the state or batch changed"
            if index is None
            else f"{name(index)} was {before}, is now {after}"
        )
        budget = (jit.budget or 1) - 1
        raise RecompileError(
            _RECOMPILED.format(i=int(iteration), n=jit.compiles, budget=budget, change=what)
        ) from None
    except RandomInGraph as random:
        raise ValueError(str(random)) from None
    except (CompileFailed, TraceFailed, TraceError) as failed:
        raise public_error(failed) from failed.__cause__


class CompiledGradient:
    """The gradient stage and the guard of each layout, compiled: ``(params, buffers, batch, scale, layout) -> (Grads, finite)``.

    Called inside the eager step's seeding (``calls.py``): the graph's random
    ops draw from that step's seed, as the whole compiled step's do.
    """

    def __init__(
        self,
        kernel: Kernel,
        plan: Plan,
        group: Any,
        budget: int,
        options: Mapping[str, Any] | None,
        backend: str = "inductor",
    ) -> None:
        stages: dict[Layout, Callable[..., Grads]] = {}

        def make(form: Hashable) -> Traceable:
            assert isinstance(form, GradientForm)
            gradient = stages.get(form.layout)
            if gradient is None:
                gradient = stages[form.layout] = Placement.of(plan, form.layout, group).gradient(kernel)
            return _flat(kernel, gradient, form)

        self.jit = Jit(make, budget, options, backend=backend, identity=ranks_of(group))
        self._seeds: dict[torch.device, torch.Tensor] = {}
        self._looked = False

    def __call__(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        batch: Any,
        scale: torch.Tensor | None,
        layout: Layout,
        iteration: torch.Tensor,
    ) -> tuple[Grads, torch.Tensor]:
        tensors, structure = flatten_batch(batch)
        device = next(iter(params.values())).device
        seed = self._seeds.get(device)
        if seed is None:
            seed = self._seeds[device] = torch.zeros((), dtype=torch.int64, device=device)
        seed.fill_(step_seed_of(device))  # the step's, as the eager step's random ops would draw
        form = GradientForm(tuple(params), tuple(buffers), scale is not None, structure, layout)
        flat = [*params.values(), *buffers.values(), *([scale] if scale is not None else []), seed, *tensors]
        entry = entry_of(self.jit, form, flat, iteration, form.leaf_name)
        if entry.accumulates and not self._looked:  # once: see fnloop/_step/determinism.py
            self._looked = True
            warn_varying(entry.accumulates, device)
        out = entry.compiled(*flat)
        grads, kept, metrics = entry.context
        g, b = len(grads), len(grads) + len(kept)
        found = Grads(
            dict(zip(grads, out[:g])),
            dict(zip(kept, out[g:b])),
            out[b],
            dict(zip(metrics, out[b + 2 :])),
        )
        return found, out[b + 1]


def _flat(kernel: Kernel, gradient: Callable[..., Grads], form: GradientForm) -> Traceable:
    """The gradient stage and the guard as a function of ``form``'s flat inputs."""
    a, b = len(form.params), len(form.params) + len(form.buffers)

    def flat(draws: Draws, *leaves: torch.Tensor) -> tuple[list[torch.Tensor], list[list[str]]]:
        params = dict(zip(form.params, leaves[:a]))
        buffers = {k: v.clone() for k, v in zip(form.buffers, leaves[a:b])}  # the forward writes into them
        rest = leaves[b:]
        scale, rest = (rest[0], rest[1:]) if form.scaled else (None, rest)
        batch = unflatten_batch(rest[1:], form.batch)
        with draws.from_(rest[0]):
            found = gradient(params, buffers, batch, scale)
        finite = kernel.finite(found.loss, found.grads)
        outputs = [
            *found.grads.values(),
            *found.buffers.values(),
            found.loss,
            finite,
            *found.metrics.values(),
        ]
        # Lists: the context goes into the start file as JSON, and comes back as it went.
        return outputs, [list(found.grads), list(found.buffers), list(found.metrics)]

    return flat
