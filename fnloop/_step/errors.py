"""The step's errors, and the long explanations they carry."""

from __future__ import annotations

import math

import torch

from fnloop._compile import CompileFailed, TraceError, TraceFailed

__all__ = ["CompileError", "GraphBreakError", "NonFiniteLoss", "RecompileError", "public_error"]


class RecompileError(RuntimeError):
    """The compiled step would need another graph, beyond its budget; nothing of that call ran."""


class CompileError(RuntimeError):
    """The step could not be compiled: an op's shape rule refused the trace, or torch's compiler failed on the graph.

    The message names the op and the model's line where it can tell, and
    ``compile=False`` runs the step eagerly. The error torch raised is chained
    (``__cause__``).
    """


class GraphBreakError(RuntimeError):
    """The step is not one graph of tensor operations; the message names the cause and the fix.

    Raised when ``loss_fn`` or the model needs a tensor's value in Python while
    it is traced (``.item()``, ``float(t)``, ``if loss > 0:``, printing such a
    value, a loop over a mixture's experts); the message names the line. And,
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
    "{what} must compile into one graph, but tracing it stopped where Python needs a tensor's "
    "value{kind}{at}{fix} The tracer's message follows."
)

_GRAPH_BREAK_FIX = (
    "Typical causes, in loss_fn or the model: .item(), float(tensor), or branching on a tensor's value "
    "(if loss > 0). "
    "Return metrics as tensors instead, use torch.where for branches, or use train_step(..., "
    "compile=False) to run eagerly."
)

_EXPERTS_FIX = (
    "That line is a mixture of experts' routing: a loop over the experts, each on the tokens routed "
    "to it, needs their count, known only when the step runs. Use an experts implementation that "
    'traces into one graph: transformers\' default, model.set_experts_implementation("grouped_mm"), '
    'or "batched_mm"; or train_step(..., compile=False) to run eagerly.'
)

_TRACE_FAILED = (
    "tracing {what} failed{op}{at}{message}. The compiled step first runs the model on tensors "
    "without values, each op by its shape rule, and this op's rule refused what it was given. If "
    "train_step(..., compile=False) fails the same way, the model or the batch is at fault (shapes, "
    "dtypes, devices); if it runs there, the op cannot be traced as called: run with "
    "compile=False{fix}. Torch's error is chained above."
)


def public_error(
    failed: BaseException, what: str = "the training step (forward, backward and update together)"
) -> Exception:
    """The compiler room's error ``failed`` as the one a user catches: ``CompileError`` or ``GraphBreakError``."""
    if isinstance(failed, CompileFailed):
        return CompileError(_compile_failed(failed.op, failed.where))
    if isinstance(failed, TraceFailed):
        return CompileError(_trace_failed(failed.op, failed.where, failed.message, what))
    assert isinstance(failed, TraceError)
    return GraphBreakError(_graph_break(failed.where, failed.kind, str(failed), what))


def _graph_break(where: str | None, kind: str | None, message: str, what: str) -> str:
    """A ``GraphBreakError``'s message: where the trace stopped, what it needed, the fix, and the tracer's words."""
    experts = where is not None and ("expert" in where.lower() or "moe" in where.lower())
    head = _GRAPH_BREAK.format(
        what=what,
        kind=f": {kind}" if kind else "",
        at=f", at\n\n    {where}\n\n" if where else ". ",
        fix=_EXPERTS_FIX if experts else _GRAPH_BREAK_FIX,
    )
    return f"{head}\n\n{message}"


def _trace_failed(op: str | None, where: str | None, message: str, what: str) -> str:
    """A ``CompileError``'s message for an op whose shape rule refused the trace's tensors."""
    experts = where is not None and ("expert" in where.lower() or "moe" in where.lower())
    fix = (
        ", or choose another experts implementation (model.set_experts_implementation(...), "
        '"grouped_mm" or "batched_mm")'
        if experts
        else ""
    )
    first = message.strip().splitlines()[0].rstrip(".") if message.strip() else "no message"
    return _TRACE_FAILED.format(
        what=what,
        op=f" in the op {op}" if op else "",
        at=f", called at\n\n    {where}\n\n" if where else ": ",
        message=first,
        fix=fix,
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
