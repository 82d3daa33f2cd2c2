"""Activation checkpointing inside the step: the reentrant form refused, with the fix.

fnloop's step takes gradients with ``torch.autograd.grad`` and traces forward
and backward together; torch's reentrant checkpointing supports neither. The
non-reentrant form runs the checkpointed region again in the backward, which
the trace records (see ``fnloop/_compile/seeding.py`` for its dropout masks).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

__all__ = ["gradients", "reentrant_refused"]

_REENTRANT = (
    "activation checkpointing: the model checkpoints with use_reentrant=True ({how}), {why}; "
    "fnloop's step needs the non-reentrant form. Use "
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False); for a transformers model, "
    "model.activation_checkpointing_enable() (non-reentrant by default since transformers 5) or "
    'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}}).'
)

_NO_INPUT_GRAD = "None of the inputs have requires_grad=True"
"""torch's warning when reentrant checkpointing runs a block none of whose inputs needs a gradient."""


def gradients(loss: torch.Tensor, wanted: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``loss`` with respect to ``wanted``; reentrant checkpointing refused with the fix."""
    try:
        return torch.autograd.grad(loss, wanted, allow_unused=True)
    except RuntimeError as exc:
        if "compatible with .grad()" not in str(exc):  # "not compatible", or "incompatible" (newer torch)
            raise
        raise TypeError(
            _REENTRANT.format(
                how="passed, or left to torch's default",
                why="which torch cannot take the gradients of as a function (torch.autograd.grad)",
            )
        ) from None


@contextlib.contextmanager
def reentrant_refused() -> Iterator[None]:
    """The forward; a reentrant checkpoint around a block whose inputs need no gradient refused with the fix.

    Reentrant checkpointing runs the block under ``no_grad`` and gives its
    output a gradient only through its inputs: fed the batch (the first
    layers), the block's parameters get none, and would silently never train.
    torch says so with a warning alone, which this turns into the error.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=_NO_INPUT_GRAD, category=UserWarning)
        try:
            yield
        except UserWarning as warning:
            if _NO_INPUT_GRAD not in str(warning):
                raise
            raise TypeError(
                _REENTRANT.format(
                    how="passed, or left to torch's default",
                    why="around a block none of whose inputs needs a gradient (the first layers, fed the "
                    "batch): torch runs such a block without recording it, so its parameters would get "
                    "no gradient and never train",
                )
            ) from None
