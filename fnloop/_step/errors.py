"""The step's errors, and the long explanations they carry."""

from __future__ import annotations

import math

import torch

__all__ = ["CompileError", "GraphBreakError", "NonFiniteLoss", "RecompileError"]


class RecompileError(RuntimeError):
    """The compiled step would need another graph, beyond its budget; nothing of that call ran."""


class CompileError(RuntimeError):
    """Torch's compiler failed on the traced step; the message says where, and ``compile=False`` runs it.

    The error torch raised is chained (``__cause__``).
    """


class GraphBreakError(RuntimeError):
    """The step is not one graph of tensor operations; the message names the cause and the fix.

    Raised when ``loss_fn`` needs a tensor's value in Python while it is traced
    (``.item()``, ``float(t)``, ``if loss > 0:``, printing such a value), and,
    compiled or eager alike, when it returns a metric that is not a tensor (a
    Python number, or the result of ``.item()``).
    """


class NonFiniteLoss(FloatingPointError):
    """A step's loss or a gradient was not finite; the step left the state unchanged.

    Raised by a ``train_step`` built without ``skip_nonfinite=True``. The fold
    then runs ``AFTER_TRAIN`` and re-raises it with ``exc.state``, the state
    before that step, whose tensors are all finite (so a checkpoint hook saves a
    clean state). ``iteration`` is the index of the failed step.
    """

    def __init__(self, message: str, iteration: int) -> None:
        super().__init__(message)
        self.iteration = iteration


def _compile_failed(op: str | None, where: str | None) -> str:
    parts = [f" at the op {op}" if op else "", f", made by {where}" if where else ""]
    return _COMPILE_FAILED.format(where="".join(parts))


def _nonfinite_message(iteration: int, loss: torch.Tensor) -> str:
    value = loss.item()
    what = (
        f"the loss was {value}"
        if not math.isfinite(value)
        else f"a gradient was not finite (loss {value:.6g})"
    )
    return (
        f"step {iteration}: {what} (metric 'loss'). The step left params, buffers and optimizer state "
        "unchanged, and the run stops with the state before it. Typical fixes: a lower learning rate "
        "or a warm-up, gradient clipping (fnloop.optim.clip_by_global_norm), checking the batch for "
        "bad values; or train_step(..., skip_nonfinite=True) to skip such steps and count them in the "
        "metric 'skipped'."
    )


_GRAPH_BREAK = (
    "the training step must compile into one graph (forward, backward and update together), but "
    "tracing it stopped where Python needs a tensor's value; the tracer's message follows. Typical "
    "causes in loss_fn: .item(), float(tensor), or branching on a tensor's value (if loss > 0). "
    "Return metrics as tensors instead, use torch.where for branches, or use train_step(..., "
    "compile=False) to run eagerly."
)

_NUMBER_METRIC = (
    "loss_fn returned the metric {name!r} as {what}, not a tensor. A metric must stay a tensor, "
    "compiled or eager: the step is one graph traced once (a Python number is not an output of it, "
    "and its value would be frozen at the trace), and converting a tensor to a number forces a host "
    "sync every step. Return the tensor itself, for example {{{name!r}: acc}} instead of "
    "{{{name!r}: acc.item()}}, or torch.tensor(value) for a number; writers convert metrics to "
    "numbers only when they write."
)


def _number(value: object) -> str | None:
    """How a metric that is a Python number (or a traced one) is described, or None for a tensor."""
    if isinstance(value, (torch.SymFloat, torch.SymInt, torch.SymBool)):
        return "the result of .item() or float()/int() of a tensor (a number known only when the step runs)"
    if isinstance(value, (bool, int, float)):
        return f"a Python {type(value).__name__} ({value!r})"
    return None


_RECOMPILED = (
    "the compiled step would be compiled again at iteration {i} ({n} recompiles, budget {budget}): "
    "{change}. The step is traced once per signature (the structure of the state and batch, and "
    "each tensor's shape, strides, dtype and device). A batch of another shape (the last, smaller "
    "batch of an epoch? use drop_last=True) or a changed state compiles a new graph. Nothing of this "
    "iteration ran. Allow it with train_step(..., recompiles=N)."
)

_RANDOM_STEPS = (
    "train_step(..., steps_per_call={n}) runs {n} steps in one compiled call, but this step has "
    "random ops that draw from torch's generator rather than from the step's own seed. Dropout and "
    "the other random ops fnloop knows draw from a seed made from (seed, iteration) inside the "
    "graph, which a call of several steps gives each of them; these cannot, so the results would "
    "not be those of {n} single steps. Use steps_per_call=1 for this model, or compile=False, which "
    "runs the steps of a call one by one."
)

_COMPILE_FAILED = (
    "compiling the training step failed in torch's compiler (inductor){where}. The step traced "
    "into one graph, so the model's code is fine as Python; the compiler could not build that "
    "graph. train_step(..., compile=False) runs the same step eagerly. The compiler's error is "
    "chained above."
)
