"""Evaluation: the model's forward on a state's params and buffers, without gradients."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from fnloop._compile import (
    CompileFailed,
    Draws,
    Jit,
    Traceable,
    TraceError,
    TraceFailed,
    default_backend,
    flatten_batch,
    unflatten_batch,
)
from fnloop._core.state import TrainState
from fnloop._export import whole_params
from fnloop._step.calls import call_of
from fnloop._step.errors import public_error
from fnloop._step.holding import holding, holding_all

__all__ = ["EvalStep", "eval_step", "plain_module"]


def plain_module(model: object, caller: str) -> torch.nn.Module:
    """``model`` itself, or the module inside a ``torch.compile`` wrapper; raise if it is no module.

    fnloop traces and compiles the whole step itself, so a wrapper would only
    put dynamo in the way (and prefix every parameter name with ``_orig_mod.``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{caller}() expected a torch.nn.Module, got {model!r:.80} (a {type(model).__name__})."
        )
    inner = getattr(model, "_orig_mod", None)
    # Without dynamo imported nothing can be compiled by it; importing it to ask would cost a second.
    if inner is None or "torch._dynamo" not in sys.modules:
        return model
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) and isinstance(inner, torch.nn.Module):
        return inner
    return model


@attrs.frozen(eq=False, repr=False)
class EvalStep:
    """``(state, batch) -> metrics`` with no gradient; build it with ``eval_step``."""

    model: torch.nn.Module
    function: Callable[..., Any]
    """The evaluation, ``(params, buffers, batch) -> metrics``, run eagerly."""
    jit: Jit | None = None
    """The evaluation traced and compiled, when compiled."""
    built: tuple[Any, ...] = ()
    """What ``eval_step`` was given, ``(fn, compile, options, backend)``: a pickle rebuilds the step from it."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Compiled graphs do not pickle; the arguments do, and the copy compiles on its first call.
        fn, compile, options, backend = self.built
        return _rebuild, (self.model, fn, compile, options, backend)

    def __call__(self, state: TrainState, batch: Any, /) -> dict[str, torch.Tensor]:
        was_training = self.model.training
        if was_training:
            self.model.eval()
        try:
            with torch.no_grad():
                # A sharded state's parameters, whole: evaluation runs the model on all of them.
                params, buffers = whole_params(state), state.buffers
                # A population's members are evaluated at once, each value under its own name.
                call = call_of(state)
                if self.jit is None:
                    out = call.evaluated(self.function)(params, buffers, batch)
                else:
                    tensors, structure = flatten_batch(batch)
                    try:
                        outputs, names = self.jit(
                            (tuple(params), tuple(buffers), structure, call),
                            [*params.values(), *buffers.values(), *tensors],
                        )
                    except (CompileFailed, TraceFailed, TraceError) as failed:
                        raise public_error(failed, "the evaluation") from failed.__cause__
                    out = dict(zip(names, outputs))
                return call.named(state, out)
        finally:
            if was_training:
                self.model.train()

    @property
    def compiles(self) -> int:
        """How many graphs the evaluation has compiled."""
        return 0 if self.jit is None else self.jit.compiles


def eval_step(
    model: torch.nn.Module,
    fn: Callable[[Callable[..., Any], Any], Any],
    *,
    compile: bool = True,
    options: Mapping[str, Any] | None = None,
    backend: str | None = None,
) -> EvalStep:
    """``(state, batch) -> dict of metric tensors``: ``fn(forward, batch)`` in eval mode, without grad.

    ``forward`` runs ``model`` on the state's params and buffers, which are
    never written (BatchNorm uses its running statistics in eval mode).
    Compiled, it is traced once per signature like ``train_step`` (``options``
    as there); a batch of another shape compiles again, with no budget, since
    a last smaller batch is common in evaluation. A module wrapped by
    ``torch.compile`` is unwrapped: fnloop compiles the evaluation itself.
    ``backend``: ``"inductor"`` or ``"graph"``, as ``train_step``'s.

    Examples:
        >>> import fnloop as fl
        >>> model = torch.nn.Linear(2, 2)
        >>> evaluate = fl.eval_step(model, lambda f, b: {"out": f(b).sum()}, compile=False)
        >>> state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
        >>> sorted(evaluate(state, torch.ones(3, 2)))
        ['out']
    """
    model = plain_module(model, "eval_step")
    # Whether a forward has run: the first checks that the state gives every tensor the model uses.
    checked: list[bool] = []

    def kernel(params: dict, buffers: dict, batch: Any) -> dict[str, torch.Tensor]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            tensors = {**params, **buffers}
            with holding(model, tensors) if checked else holding_all(model, tensors, "eval_step"):
                out = model(*args, **kwargs)
            checked[:] = [True]
            return out

        out = fn(forward, batch)
        return dict(out) if isinstance(out, Mapping) else {"value": out}

    def make(structure: Any) -> Traceable:
        pkeys, bkeys, batch_structure, call = structure
        a, b = len(pkeys), len(pkeys) + len(bkeys)
        evaluation = call.evaluated(kernel)

        def flat(draws: Draws, *leaves: torch.Tensor) -> tuple[list[torch.Tensor], list[str]]:
            params, buffers = dict(zip(pkeys, leaves[:a])), dict(zip(bkeys, leaves[a:b]))
            out = evaluation(params, buffers, unflatten_batch(leaves[b:], batch_structure))
            return list(out.values()), list(out)

        return flat

    backend = default_backend(backend)
    jit = Jit(make, options=options, backend=backend, identity=tuple) if compile else None
    return EvalStep(model, kernel, jit, (fn, compile, None if options is None else dict(options), backend))


def _rebuild(
    model: torch.nn.Module,
    fn: Callable[..., Any],
    compile: bool,
    options: Mapping[str, Any] | None,
    backend: str | None = None,
) -> EvalStep:
    return eval_step(model, fn, compile=compile, options=options, backend=backend)
