"""Evaluation: the model's forward on a state's params and buffers, without gradients."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch.func import functional_call

from fnloop._state import TrainState

__all__ = ["EvalStep", "eval_step"]


@attrs.frozen(eq=False, repr=False)
class EvalStep:
    """``(state, batch) -> metrics`` with no gradient; build it with ``eval_step``."""

    model: torch.nn.Module
    function: Callable[..., Any]

    def __call__(self, state: TrainState, batch: Any, /) -> dict[str, torch.Tensor]:
        was_training = self.model.training
        if was_training:
            self.model.eval()
        try:
            with torch.no_grad():
                return self.function(state.params, state.buffers, batch)
        finally:
            if was_training:
                self.model.train()


def eval_step(
    model: torch.nn.Module, fn: Callable[[Callable[..., Any], Any], Any], *, compile: bool = True
) -> EvalStep:
    """``(state, batch) -> dict of metric tensors``: ``fn(forward, batch)`` in eval mode, without grad.

    ``forward`` runs ``model`` on the state's params and buffers, which are
    never written (BatchNorm uses its running statistics in eval mode).

    >>> import fnloop as fl
    >>> model = torch.nn.Linear(2, 2)
    >>> evaluate = fl.eval_step(model, lambda f, b: {"out": f(b).sum()}, compile=False)
    >>> state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1)
    >>> sorted(evaluate(state, torch.ones(3, 2)))
    ['out']
    """

    def kernel(params: dict, buffers: dict, batch: Any) -> dict[str, torch.Tensor]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return functional_call(model, (params, buffers), args, kwargs)

        out = fn(forward, batch)
        return dict(out) if isinstance(out, Mapping) else {"value": out}

    function = torch.compile(kernel, fullgraph=True, dynamic=False) if compile else kernel
    return EvalStep(model, function)
