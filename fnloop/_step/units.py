"""The model's blocks: the units a sharded step gathers one at a time, and the statistics group by.

``train_step(..., blocks=...)`` names them (module names or classes), or
they are found (``units_of``). A parameter belongs to a block when every
name it goes by (tied weights have several) is inside it; the others are
the root's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from fnloop._core.messages import got

__all__ = ["Blocks", "Units", "units_of"]

Blocks = Sequence[str | type[torch.nn.Module]] | None
"""What ``train_step(..., blocks=...)`` takes: module names or classes; ``None`` finds them; ``()`` none."""


@attrs.frozen
class Units:
    """The blocks a sharded step gathers one at a time: each block's module name and its parameters' names.

    A parameter belongs to a block when every name it goes by (tied
    weights have several) is inside the block; the others are the root's,
    gathered for the whole forward.
    """

    blocks: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def names(self) -> frozenset[str]:
        """Every parameter some block holds."""
        return frozenset(name for _, names in self.blocks for name in names)

    def __bool__(self) -> bool:
        return bool(self.blocks)


def units_of(model: torch.nn.Module, blocks: Blocks = None) -> Units:
    """The blocks of ``model``: those ``blocks`` names (module names, or classes), or else found.

    Found: the modules ``transformers`` names in ``model._no_split_modules``
    (its decoder layers), or else the children of each ``nn.ModuleList``;
    outermost only (a block inside a block is the outer one's).

    Examples:
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(layers))
        >>> [name for name, _ in units_of(model).blocks]
        ['1.0.0', '1.0.1']
        >>> units_of(model, [torch.nn.Linear]).blocks[0]
        ('0', ('0.weight', '0.bias'))
        >>> bool(units_of(model, ()))
        False
    """
    modules = dict(model.named_modules())
    chosen = _found(model, modules) if blocks is None else _named(blocks, modules)
    outermost = [m for m in chosen if not any(m.startswith(o + ".") for o in chosen if o != m)]
    aliases: dict[str, list[str]] = {}  # the name a parameter is kept under -> every name it goes by
    canonical = {id(p): n for n, p in model.named_parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(canonical[id(p)], []).append(name)
    units = []
    for block in outermost:
        inside = tuple(
            name for name, names in aliases.items() if all(alias.startswith(block + ".") for alias in names)
        )
        if inside:
            units.append((block, inside))
    return Units(tuple(units))


def _found(model: torch.nn.Module, modules: Mapping[str, torch.nn.Module]) -> list[str]:
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    if kinds:
        named = [name for name, m in modules.items() if name and type(m).__name__ in kinds]
        if named:
            return named
    return [
        f"{name}.{child}" if name else child
        for name, m in modules.items()
        if isinstance(m, torch.nn.ModuleList)
        for child in m._modules
    ]


def _named(blocks: Sequence[Any], modules: Mapping[str, torch.nn.Module]) -> list[str]:
    if isinstance(blocks, (str, type)) or not isinstance(blocks, Sequence):
        raise TypeError(
            "train_step(blocks=...) must be a list of module names or module classes, () to gather "
            f"every parameter at once, or None to find the blocks ({got(blocks)})."
        )
    chosen: list[str] = []
    for block in blocks:
        if isinstance(block, str):
            if block not in modules or not block:
                near = [n for n in modules if n and n.split(".")[-1] == block.split(".")[-1]][:3]
                raise ValueError(
                    f"train_step(blocks=...): the model has no submodule named {block!r}"
                    + (f" (some it has: {near})" if near else "")
                    + "; name them as model.named_modules() does, for example 'layers.0'."
                )
            chosen.append(block)
        elif isinstance(block, type) and issubclass(block, torch.nn.Module):
            found = [n for n, m in modules.items() if n and isinstance(m, block)]
            if not found:
                raise ValueError(
                    f"train_step(blocks=...): the model has no submodule of class {block.__qualname__}."
                )
            chosen += found
        else:
            raise TypeError(
                f"train_step(blocks=...): each block is a module name or a module class ({got(block)})."
            )
    return list(dict.fromkeys(chosen))
