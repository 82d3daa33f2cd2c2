"""Combinators: ``chain`` runs transformations in sequence, ``partition`` per group of parameters."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import overload

import attrs
import torch

from fnloop._core.messages import got
from fnloop.optim._base import (
    GradientTransformation,
    Optimizer,
    OptState,
    Params,
    Sum,
    check_keys,
    describe,
    learning_rates,
    over_shards,
    update_in_place,
)

__all__ = ["chain", "partition"]

_CHAIN_STATE = (
    "chain expected its state as a tuple with one entry per transformation ({n}), but got "
    "{got:.80}. Pass the state that init() or the previous update() returned."
)


@attrs.frozen(repr=False)
class _Chain:
    transforms: tuple[GradientTransformation, ...]

    def init(self, params: Params, /) -> tuple[OptState, ...]:
        return tuple(t.init(params) for t in self.transforms)

    def update(
        self, updates: Params, state: tuple[OptState, ...], params: Params, iteration: torch.Tensor, /
    ) -> tuple[Params, tuple[OptState, ...]]:
        if type(state) is not tuple or len(state) != len(self.transforms):
            raise ValueError(_CHAIN_STATE.format(n=len(self.transforms), got=repr(state)))
        new_state = []
        for transform, inner in zip(self.transforms, state):
            updates, inner = transform.update(updates, inner, params, iteration)
            new_state.append(inner)
        return updates, tuple(new_state)

    def update_(
        self, updates: Params, state: tuple[OptState, ...], params: Params, iteration: torch.Tensor, /
    ) -> Params:
        if type(state) is not tuple or len(state) != len(self.transforms):
            raise ValueError(_CHAIN_STATE.format(n=len(self.transforms), got=repr(state)))
        for transform, inner in zip(self.transforms, state):
            updates = update_in_place(transform, updates, inner, params, iteration)
        return updates

    def over_shards(self, sum_: Sum, /) -> _Chain:
        return _Chain(tuple(over_shards(t, sum_) for t in self.transforms))

    def learning_rates(self, iteration: torch.Tensor, /) -> dict[str, torch.Tensor | float]:
        rates: dict[str, torch.Tensor | float] = {}
        for transform in self.transforms:
            for name, value in learning_rates(transform, iteration).items():
                rates.setdefault(name, value)
        return rates

    def __repr__(self) -> str:
        return f"chain({', '.join(repr(t) for t in self.transforms)})"


def _check_transform(obj: object, where: str) -> None:
    if not isinstance(obj, GradientTransformation) or not callable(obj.update):
        raise TypeError(
            f"{where} expected a gradient transformation or an Optimizer, something with "
            f"init(params) and update(updates, state, params, iteration), but got {obj!r:.80} "
            f"(a {type(obj).__name__})."
        )


@overload
def chain(last: Optimizer, /) -> Optimizer: ...
@overload
def chain(a: GradientTransformation, last: Optimizer, /) -> Optimizer: ...
@overload
def chain(a: GradientTransformation, b: GradientTransformation, last: Optimizer, /) -> Optimizer: ...
@overload
def chain(
    a: GradientTransformation, b: GradientTransformation, c: GradientTransformation, last: Optimizer, /
) -> Optimizer: ...
@overload
def chain(*transforms: GradientTransformation | Optimizer) -> GradientTransformation | Optimizer: ...
def chain(*transforms: GradientTransformation | Optimizer) -> GradientTransformation | Optimizer:
    """Apply transformations one after another; the state is the tuple of their states.

    Nested chains are flattened, so ``chain`` is associative; ``chain()`` is the
    identity and ``chain(t)`` is ``t``. If the last entry is an ``Optimizer`` the
    result is an ``Optimizer`` too, which is how clipping goes in front of one.

    Args:
        *transforms: gradient transformations, optionally ending with an
            ``Optimizer``.

    Returns:
        An ``Optimizer`` when the last entry is one, else a gradient transformation.

    Raises:
        TypeError: an entry has no ``init``/``update``, or an ``Optimizer`` is not last.

    Examples:
        >>> from fnloop.optim import adamw, clip_by_global_norm
        >>> chain(clip_by_global_norm(1.0), adamw(1e-3))
        Optimizer(chain(clip_by_global_norm(1.0), scale_by_adam(betas=(0.9, 0.999), eps=1e-08), \
add_decayed_weights(0.01), scale_by_learning_rate(0.001)))
        >>> chain()
        chain()
    """
    flat: list[GradientTransformation] = []
    for i, transform in enumerate(transforms):
        if isinstance(transform, Optimizer):
            if i != len(transforms) - 1:
                raise TypeError(
                    f"chain() takes an Optimizer only as its last entry, because it returns new "
                    f"params rather than updates (got {transform!r:.80} at position {i} of "
                    f"{len(transforms)}). Put transformations such as clip_by_global_norm before it."
                )
            transform = transform.transform
        _check_transform(transform, f"chain() entry {i}")
        flat.extend(transform.transforms if isinstance(transform, _Chain) else [transform])
    if len(transforms) == 1:
        return transforms[0]
    combined = flat[0] if len(flat) == 1 else _Chain(tuple(flat))
    return Optimizer(combined) if transforms and isinstance(transforms[-1], Optimizer) else combined


Label = str
LabelFn = Callable[[str, torch.Tensor], Label]


@attrs.frozen(repr=False)
class _Partition:
    label_fn: LabelFn
    transforms: dict[Label, GradientTransformation]

    def _labels(self, params: Params) -> dict[str, Label]:
        labels = {}
        for name, tensor in params.items():
            label = self.label_fn(name, tensor)
            if type(label) is not str or label not in self.transforms:
                raise ValueError(
                    f"partition: label_fn {describe(self.label_fn)} gave {label!r} for parameter "
                    f"{name!r}, but the labels are {list(self.transforms)}. Add an entry for "
                    f"{label!r} to the mapping, or make label_fn return one of those labels."
                )
            labels[name] = label
        return labels

    def _check_state(self, state: object) -> None:
        if not isinstance(state, dict) or state.keys() != self.transforms.keys():
            raise KeyError(
                f"partition expected its state as a dict keyed by the labels "
                f"{list(self.transforms)}, but got {state!r:.80}. Pass the state that init() or "
                "the previous update() returned."
            )

    def init(self, params: Params, /) -> dict[Label, OptState]:
        labels = self._labels(params)
        return {
            label: transform.init({k: p for k, p in params.items() if labels[k] == label})
            for label, transform in self.transforms.items()
        }

    def update(
        self, updates: Params, state: dict[Label, OptState], params: Params, iteration: torch.Tensor, /
    ) -> tuple[Params, dict[Label, OptState]]:
        check_keys("updates", updates, params, "Give one gradient per parameter.")
        self._check_state(state)
        labels = self._labels(params)
        new_updates: Params = {}
        new_state = {}
        for label, transform in self.transforms.items():
            names = [k for k in params if labels[k] == label]
            group_updates, new_state[label] = transform.update(
                {k: updates[k] for k in names},
                state[label],
                {k: params[k] for k in names},
                iteration,
            )
            new_updates.update(group_updates)
        return {k: new_updates[k] for k in params}, new_state

    def update_(
        self, updates: Params, state: dict[Label, OptState], params: Params, iteration: torch.Tensor, /
    ) -> Params:
        check_keys("updates", updates, params, "Give one gradient per parameter.")
        self._check_state(state)
        labels = self._labels(params)
        new_updates: Params = {}
        for label, transform in self.transforms.items():
            names = [k for k in params if labels[k] == label]
            group = {k: updates[k] for k in names}
            new_updates.update(
                update_in_place(transform, group, state[label], {k: params[k] for k in names}, iteration)
            )
        return {k: new_updates[k] for k in params}

    def over_shards(self, sum_: Sum, /) -> _Partition:
        return attrs.evolve(self, transforms={k: over_shards(t, sum_) for k, t in self.transforms.items()})

    def learning_rates(self, iteration: torch.Tensor, /) -> dict[str, torch.Tensor | float]:
        return {
            f"{name}/{label}": value
            for label, transform in self.transforms.items()
            for name, value in learning_rates(transform, iteration).items()
        }

    def __repr__(self) -> str:
        return f"partition({describe(self.label_fn)}, {self.transforms!r})"


def partition(
    label_fn: LabelFn, transforms: Mapping[Label, GradientTransformation | Optimizer]
) -> GradientTransformation | Optimizer:
    """Give each group of parameters its own transformation, like torch's param groups.

    ``label_fn(name, tensor)`` names the group of every parameter; each group is
    updated by ``transforms[label]``, and the state is a dict keyed by label.

    Args:
        label_fn: ``(name, tensor) -> label``; may look at names and shapes only.
        transforms: label -> transformation. Either all values are ``Optimizer``s
            (and the result is one) or none is.

    Returns:
        An ``Optimizer`` if the values are optimizers, else a gradient transformation.

    Raises:
        TypeError: a value is not a transformation, optimizers and bare
            transformations are mixed, or the two arguments are swapped.
        ValueError: ``transforms`` is empty. At ``init``/``update``: ``label_fn``
            gave a label that is not in ``transforms``.

    Examples:
        >>> from fnloop.optim import adamw
        >>> opt = partition(
        ...     lambda name, p: "decay" if p.ndim >= 2 else "no_decay",
        ...     {"decay": adamw(1e-3, weight_decay=0.05), "no_decay": adamw(1e-3, weight_decay=0.0)},
        ... )
        >>> sorted(opt.init({"w": torch.zeros(2, 2), "b": torch.zeros(2)}))
        ['decay', 'no_decay']

    See Also:
        exclude_bias_and_norm: the one-line way to skip weight decay on biases and norms.
    """
    if isinstance(label_fn, Mapping) and callable(transforms):
        raise TypeError(
            "partition(label_fn, transforms) takes the labelling function first and the mapping "
            "label -> transformation second; these look swapped (optax's multi_transform takes them "
            "the other way round). Call partition(label_fn, {label: transformation, ...})."
        )
    if not isinstance(transforms, Mapping) or not transforms:
        raise ValueError(
            f"partition expected a non-empty mapping label -> transformation (got {transforms!r:.80})."
        )
    optimizers = [isinstance(t, Optimizer) for t in transforms.values()]
    if any(optimizers) and not all(optimizers):
        kinds = {label: type(t).__name__ for label, t in transforms.items()}
        raise TypeError(
            f"partition expected either all Optimizers or no Optimizer (got {kinds}). Wrap the "
            "bare transformations with Optimizer(...), or unwrap the optimizers."
        )
    inner = {}
    for label, transform in transforms.items():
        if type(label) is not str:
            raise TypeError(f"partition labels must be str ({got(label)}).")
        transform = transform.transform if isinstance(transform, Optimizer) else transform
        _check_transform(transform, f"partition entry {label!r}")
        inner[label] = transform
    result = _Partition(label_fn, inner)
    return Optimizer(result) if all(optimizers) else result
