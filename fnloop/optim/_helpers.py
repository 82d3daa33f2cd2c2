"""What the optimizers share: settings checked as numbers, keys checked, a device, counters, a skipped update.

A setting is a finite float in its range, or a 0-d floating tensor taken as
it is: ``inject`` builds the optimizer from a state's hyperparameters, and
checked them as floats first. A tensor given by hand is refused where an
optimizer meets a model (``fnloop.init``, ``fnloop.train_step``), by a walk of
the optimizer's own records (``tensor_settings``): between ``inject`` and the
checks sits the user's own ``make`` (``inject(make, lr=...)``), so no argument
of fnloop's could tell the checks where a tensor came from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fnloop._core.messages import got

__all__ = [
    "apply_updates",
    "check_keys",
    "first_device",
    "is_setting",
    "kept_unless",
    "zero_count",
]


def check_keys(what: str, got: Mapping[str, Any], params: Mapping[str, Any], fix: str) -> None:
    """Raise ``KeyError`` naming the keys ``got`` lacks or has beyond ``params``'s.

    Runs at trace time: it looks at keys only.
    """
    if got.keys() == params.keys():
        return
    missing = [k for k in params if k not in got]
    unexpected = [k for k in got if k not in params]
    raise KeyError(
        f"{what} must have the same keys as params; missing: {missing}, unexpected: {unexpected}. {fix}"
    )


def first_device(params: dict[str, torch.Tensor]) -> torch.device:
    """The device of the first parameter (CPU if there is none): where scalar state lives."""
    for tensor in params.values():
        return tensor.device
    return torch.device("cpu")


def zero_count(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """A 0-d int64 zero on the device of the first parameter, for step counters."""
    return torch.zeros((), dtype=torch.int64, device=first_device(params))


def kept_unless(
    skip: torch.Tensor,
    new_params: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    new_state: Any,
    state: Any,
) -> tuple[dict[str, torch.Tensor], Any]:
    """``(new_params, new_state)``, or where the 0-d bool ``skip`` holds ``(params, state)``: a skipped update, in the graph."""
    ok = ~skip
    kept = {k: torch.where(ok, v, params[k]) for k, v in new_params.items()}
    return kept, pytree.tree_map(lambda new, old: torch.where(ok, new, old), new_state, state)


def apply_updates(
    params: dict[str, torch.Tensor], updates: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """New parameters ``params[k] + updates[k]``, each in its parameter's dtype.

    Args:
        params: the current parameters; left untouched.
        updates: what to add, keyed like ``params``.

    Returns:
        A new dict of new tensors.

    Raises:
        KeyError: ``updates`` and ``params`` have different keys.

    Examples:
        >>> apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), 0.5)})
        {'w': tensor([1.5000, 1.5000])}
    """
    check_keys("updates", updates, params, "Transformations must return one update per parameter.")
    return {k: (p + updates[k]).to(p.dtype) for k, p in params.items()}


def is_setting(value: object) -> bool:
    """Whether ``value`` is a setting given as a 0-d floating tensor (a state's, given by ``inject``)."""
    return isinstance(value, torch.Tensor) and value.ndim == 0 and value.is_floating_point()


def _number(name: str, value: object, *, low: float = 0.0, below: float | None = None) -> float:
    """``value`` as a float, checked to lie in ``[low, below)``; the error names ``name``.

    A 0-d floating tensor is returned as it is: ``inject`` checked its value as a float.
    """
    if is_setting(value):
        return value  # type: ignore[return-value]
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        raise TypeError(f"'{name}' must be a finite float ({got(value)}).")
    value = float(value)  # type: ignore[arg-type]
    if value < low or (below is not None and value >= below):
        upper = f" and below {below}" if below is not None else ""
        raise ValueError(f"'{name}' must be at least {low}{upper} (got {value!r}).")
    return value
