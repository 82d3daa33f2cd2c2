"""The model holding the state's tensors in place of its own, for a forward (``functional_call``'s way)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["holding", "holding_all"]


@contextlib.contextmanager
def holding(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``model`` with ``tensors`` in place of its parameters and buffers for the block (tied weights kept tied)."""
    from torch.nn.utils.stateless import _reparametrize_module  # what functional_call uses

    with _reparametrize_module(model, tensors, tie_weights=True, strict=False):
        yield


@contextlib.contextmanager
def holding_all(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str = "train_step"
) -> Iterator[None]:
    """``holding``, refusing a model left with a meta tensor (no values) that ``tensors`` has none for.

    torch computes such a tensor with real ones without a word (a CPU input times a meta weight is a
    CPU tensor of whatever the memory held), so the refusal is the only sign.
    """
    with holding(model, tensors):
        named = (
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        )
        empty = sorted(name for name, t in named if t.device.type == "meta")
        if empty:
            raise ValueError(
                f"{where}(): the model holds {empty[:3]} on the meta device (no values) and the state "
                "has no tensor for them, so the step would compute with nothing there. A weight tied to "
                "another and untied by model.to('meta')? Leave the module's weights to the state with "
                "fnloop.init(model, ..., donate_model=True), which keeps ties; else build the state from "
                "this model (fnloop.init) and pass that state."
            )
        yield
