"""A model built on the meta device: its weights made one module at a time, only this rank's rows kept.

A model larger than one process's memory cannot be built whole. As with
FSDP2, build it on the meta device (``with torch.device("meta"): model =
...``): its tensors have shapes and no memory. ``fnloop.init`` then makes
each module's own tensors (``to_empty`` on a copy of that module alone) and
fills them, with the module's ``reset_parameters()`` or the ``init_weights``
given (``transformers``' ``model._init_weights``, say), keeps what the state
needs of them (this rank's chunks, for a sharded state) and lets the rest go
before the next module: the peak is the largest module, not the model.

Every rank fills every module from the same seed, a function of the run's
seed and the module's name, so the ranks agree without a broadcast and the
values do not depend on the world size.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["InitWeights", "is_meta", "materialized"]

InitWeights = Callable[[torch.nn.Module], object]
"""``init_weights(module)``: fill ``module``'s own parameters and buffers in place."""


def is_meta(model: torch.nn.Module) -> bool:
    """Whether any of ``model``'s parameters or buffers is on the meta device (has no memory)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def materialized(
    model: torch.nn.Module,
    seed: int,
    init_weights: InitWeights | None,
    keep: Callable[[str, torch.Tensor], torch.Tensor],
    device: torch.device | str = "cpu",
) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """``(name, keep(name, tensor), is_parameter)`` for each of ``model``'s tensors, made module by module.

    Tensors already real are passed as they are. ``keep`` gets the whole
    tensor and returns what to hold of it (a chunk, a copy); the whole goes
    once the module's tensors are all kept.
    """
    canonical = {id(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}
    for prefix, module in model.named_modules():
        own = [
            (f"{prefix}.{local}" if prefix else local, local, t, isinstance(t, torch.nn.Parameter))
            for local, t in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
            if t is not None
        ]
        own = [entry for entry in own if canonical.get(id(entry[2])) == entry[0]]  # a tied one once
        if not own:
            continue
        made = (
            _filled(module, prefix, seed, init_weights, device)
            if any(t.is_meta for *_, t, _ in own)
            else None
        )
        for name, local, tensor, parameter in own:
            whole = tensor if made is None else made[local]
            yield name, keep(name, whole.detach()), parameter
        del made


def _filled(
    module: torch.nn.Module,
    prefix: str,
    seed: int,
    init_weights: InitWeights | None,
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """``module``'s own tensors, made on ``device`` and filled, on a copy of the module (the model is left as it is)."""
    alone: Any = copy.copy(module)  # its own tensors replaced below; its children (still meta) shared
    alone._parameters = dict(module._parameters)
    alone._buffers = dict(module._buffers)
    where = f"its module {prefix!r}" if prefix else "the model itself"
    with torch.no_grad():
        for local, t in list(alone._parameters.items()):
            if t is not None:
                alone._parameters[local] = torch.nn.Parameter(
                    torch.empty_like(t, device=device), requires_grad=t.requires_grad
                )
        for local, t in list(alone._buffers.items()):
            if t is not None:
                alone._buffers[local] = torch.empty_like(t, device=device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(zlib.crc32(f"{seed}:{prefix}".encode()))
            if init_weights is not None:
                init_weights(alone)
            elif hasattr(alone, "reset_parameters"):
                alone.reset_parameters()
            elif hasattr(alone, "_reset_parameters"):  # torch.nn.MultiheadAttention's name for it
                alone._reset_parameters()
            else:
                meta = [
                    n
                    for n, t in (*module._parameters.items(), *module._buffers.items())
                    if t is not None and t.is_meta
                ]
                raise ValueError(
                    f"init(): the model is on the meta device, and {where} ({type(module).__name__}) has "
                    f"tensors to make ({meta}) but no reset_parameters() "
                    "to fill them. Pass init(..., init_weights=fn), where fn(module) fills a module's own "
                    "tensors in place (for a transformers model, init_weights=model._init_weights)."
                )
    return {
        **{k: v for k, v in alone._parameters.items() if v is not None},
        **{k: v for k, v in alone._buffers.items() if v is not None},
    }
