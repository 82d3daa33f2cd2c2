"""Tensor-parallel plans: which modules a model's layers are split at, and how (``TensorPlan``).

A plan maps module name patterns (matched part by part, as ``parallelize_module``'s
dict) to styles, in the words of torch's and torchtitan's plans; the styles
and their collectives are the transformation's (``tensor.py``). ``layout_of``
checks a plan against a model and makes the state's record of the split
(``TensorParallel``): each split parameter and its dimension. The built-in
plans are those of ``transformers``' Llama family and GPT-2.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from fnloop._core.messages import got
from fnloop._core.tensor_parallel import SEQUENCE, TensorParallel
from fnloop.distributed import rank, world_size

__all__ = ["STYLES", "TensorPlan", "builtin_plan", "layout_of", "tensor_layout"]

STYLES = ("colwise", "rowwise", "gathered", "vocab", "sequence", "split", "gather")
"""The styles a plan gives a module (see ``tensor.py``'s table)."""

Style = str | tuple[str, int] | Any
"""What a plan maps a module pattern to: a style, ``(style, parts)``, or one of torch's ``ColwiseParallel`` / ``RowwiseParallel``."""


def _as_dict(value: Mapping[str, Any]) -> dict[str, Any]:
    return dict(value)


@attrs.frozen
class TensorPlan:
    """How a model's layers are split by tensor parallelism (``init(..., tensor=T, tensor_plan=...)``).

    Args:
        layers: module name pattern (each dotted part matched with ``fnmatch``, as ``parallelize_module``'s
            dict: ``"model.layers.*.self_attn.q_proj"``) -> style:
            ``"colwise"``, ``"rowwise"``, ``"gathered"`` (column-wise with its
            output gathered: a language model's head), ``"vocab"`` (an
            embedding's vocabulary rows), ``(style, parts)`` for ``parts``
            projections fused side by side, or torch's ``ColwiseParallel()``
            (``output_layouts=Replicate()``: ``"gathered"``) and
            ``RowwiseParallel()`` (on an ``Embedding``: ``"vocab"``).
            Sequence parallelism: ``"sequence"`` (torch's ``SequenceParallel()``)
            for a module that runs on this rank's slice of the sequence (a
            norm), ``"split"`` for the module whose first input is cut into
            those slices (the first layer), and ``"gather"`` for one whose
            input's slices are put together (an attention, an MLP: what holds
            the column-wise layers); with them, each row-wise layer
            reduce-scatters its output on the sequence, and the head gathers
            its input.
            Every pattern must match a module.
        divide: module name pattern -> names of integer attributes divided by
            the degree while the step runs: those a module's ``forward`` reads
            to count heads or widths it splits (GPT-2's ``split_size``).
            Attributes read only to view with ``-1`` need nothing.

    Examples:
        >>> plan = TensorPlan({"0": "colwise", "2": "rowwise"})
        >>> sorted(plan.layers.items())
        [('0', 'colwise'), ('2', 'rowwise')]
    """

    layers: Mapping[str, Style] = attrs.field(converter=_as_dict)
    divide: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict, converter=_as_dict)

    @classmethod
    def builtin(cls, model: torch.nn.Module, degree: int, *, sequence: bool = False) -> TensorPlan:
        """The built-in plan of a ``transformers`` Llama, Mistral, Qwen2 or GPT-2 (what ``tensor_plan=None`` takes).

        ``sequence``: with sequence parallelism (the Llama family's): the
        norms run on each rank's slice of the sequence, and the activations
        between the layers are held in those slices.
        """
        return builtin_plan(model, degree, sequence=sequence)


def _llama(prefix: str, sequence: bool) -> TensorPlan:
    layers = f"{prefix}layers.*."
    plan = {
        f"{prefix}embed_tokens": "vocab",
        **{f"{layers}self_attn.{p}_proj": "colwise" for p in "qkv"},
        f"{layers}self_attn.o_proj": "rowwise",
        f"{layers}mlp.gate_proj": "colwise",
        f"{layers}mlp.up_proj": "colwise",
        f"{layers}mlp.down_proj": "rowwise",
    }
    if sequence:  # the sequence cut where the layers begin: the model's masks and positions are made whole
        plan[f"{prefix}layers.0"] = "split"
        plan[f"{layers}input_layernorm"] = "sequence"
        plan[f"{layers}post_attention_layernorm"] = "sequence"
        plan[f"{layers}self_attn"] = "gather"
        plan[f"{layers}mlp"] = "gather"
        plan[f"{prefix}norm"] = "sequence"
    return TensorPlan(plan)


def _gpt2(prefix: str, sequence: bool) -> TensorPlan:
    if sequence:
        raise ValueError(
            "TensorPlan.builtin(..., sequence=True): the built-in plans with sequence parallelism are "
            "the Llama family's. GPT-2 drops out on its residual stream, which sequence parallelism "
            "holds in slices, where each rank would draw its own mask, not its slice of one process's. "
            "Leave sequence out, or write the plan with 'sequence' and 'split' yourself."
        )
    layers = f"{prefix}h.*."
    return TensorPlan(
        {
            f"{prefix}wte": "vocab",
            f"{layers}attn.c_attn": ("colwise", 3),
            f"{layers}attn.c_proj": "rowwise",
            f"{layers}mlp.c_fc": "colwise",
            f"{layers}mlp.c_proj": "rowwise",
        },
        {f"{layers}attn": ("split_size",)},
    )


_FAMILIES: dict[str, Callable[[str, bool], TensorPlan]] = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _llama,
    "gpt2": _gpt2,
}
"""The ``transformers`` model types with a built-in plan, by ``config.model_type``."""


def builtin_plan(model: torch.nn.Module, degree: int, sequence: bool = False) -> TensorPlan:
    """The built-in plan for ``model`` (a ``transformers`` Llama, Mistral, Qwen2 or GPT-2), checked against its heads."""
    config: Any = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in _FAMILIES:
        raise ValueError(
            f"init(tensor={degree}): fnloop has built-in tensor-parallel plans for transformers' "
            f"{sorted(_FAMILIES)} models, and this model is a {type(model).__qualname__}"
            f"{f' ({kind})' if kind else ''}. Give its plan: init(..., tensor_plan=fnloop.TensorPlan("
            "{'layers.*.attn.q': 'colwise', 'layers.*.attn.out': 'rowwise', ...})), as "
            "parallelize_module's dict (docs/distributed.md#tensor-parallelism)."
        )
    heads = {"num_attention_heads": config.num_attention_heads}
    if kind != "gpt2":
        heads["num_key_value_heads"] = (
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        )
    for field, count in heads.items():
        if count % degree:
            raise ValueError(
                f"init(tensor={degree}): each rank holds whole attention heads, and the model's "
                f"config.{field} is {count}, which {degree} ranks cannot share equally. Choose a "
                f"tensor degree that divides {count}."
            )
    names = {name for name, _ in model.named_modules()}
    embedding = "embed_tokens" if kind != "gpt2" else "wte"
    prefix = next((n[: -len(embedding)] for n in sorted(names, key=len) if n.endswith(embedding)), "")
    plan = _FAMILIES[kind](prefix, sequence)
    if "lm_head" in names:
        plan = attrs.evolve(plan, layers={**plan.layers, "lm_head": "gathered"})
    return plan


def _style(value: object, module: torch.nn.Module, where: str) -> tuple[str, int]:
    """``value`` as ``(style, parts)``, checked against the module it is given."""
    style, parts = value if isinstance(value, tuple) and len(value) == 2 else (value, 1)
    if not isinstance(style, str):  # one of torch's styles, in the same words
        style = _torch_style(style, module)
    if style not in STYLES or type(parts) is not int or parts < 1:
        raise ValueError(
            f"tensor_plan[{where!r}] must be one of {STYLES}, (style, parts) for a fused projection, or "
            f"torch's ColwiseParallel() / RowwiseParallel() / SequenceParallel() ({got(value)})."
        )
    if style in SEQUENCE:
        return style, 1
    embedding = isinstance(module, torch.nn.Embedding)
    if (style == "vocab") != embedding or not (embedding or _linear(module)):
        wants = "an nn.Embedding" if style == "vocab" else "an nn.Linear or transformers' Conv1D"
        raise ValueError(
            f"tensor_plan[{where!r}] = {style!r} applies to {wants}, and this module is a "
            f"{type(module).__qualname__}. Give 'vocab' to embeddings, and 'colwise', 'rowwise' or "
            "'gathered' to linear layers; leave other modules out (they stay whole on every rank)."
        )
    return style, parts


def _torch_style(style: object, module: torch.nn.Module) -> object:
    """One of torch's ``ParallelStyle``s in the plan's words (anything else as it is, to be refused)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if isinstance(style, ColwiseParallel):
        layouts = style.output_layouts
        first = layouts[0] if isinstance(layouts, tuple) else layouts
        return "gathered" if isinstance(first, Replicate) else "colwise"
    if isinstance(style, RowwiseParallel):
        return "vocab" if isinstance(module, torch.nn.Embedding) else "rowwise"
    if isinstance(style, SequenceParallel):
        return "sequence"
    return style


def _linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or _conv1d(module)


def _conv1d(module: torch.nn.Module) -> bool:
    """``transformers``' ``Conv1D``: a linear layer whose weight is ``[in, out]`` and whose width is ``nf``.

    Only a model built with ``transformers`` holds one, so its module is looked up where it is loaded
    already, never imported here.
    """
    utils = sys.modules.get("transformers.pytorch_utils")
    return utils is not None and isinstance(module, utils.Conv1D)


def _dims(module: torch.nn.Module, style: str) -> dict[str, int]:
    """Which dimension of each of the module's own parameters the style splits (a parameter left out: whole)."""
    if style in SEQUENCE:
        return {}
    if style == "vocab":
        return {"weight": 0}
    out, into = (1, 0) if _conv1d(module) else (0, 1)  # Conv1D's weight is [in, out]
    if style == "rowwise":
        return {"weight": into}
    return {"weight": out, "bias": 0}


def layout_of(model: torch.nn.Module, plan: TensorPlan, degree: int, rank: int) -> TensorParallel:
    """The ``TensorParallel`` record of ``model`` split by ``plan`` over ``degree`` ranks, for ``rank``; checked."""
    modules = dict(model.named_modules())
    canonical = {id(p): n for n, p in model.named_parameters()}
    layers: list[tuple[str, str, int]] = []
    params: dict[str, tuple[int, int, str]] = {}
    for pattern, value in plan.layers.items():
        matched = _matched(pattern, modules)
        if not matched:
            raise ValueError(_unmatched("tensor_plan", pattern, modules))
        for name in matched:
            module = modules[name]
            style, parts = _style(value, module, pattern)
            if any(name == other for other, _, _ in layers):
                raise ValueError(
                    f"tensor_plan: the module {name!r} is matched by {pattern!r} and by an earlier "
                    "pattern; give each module one style (narrow the patterns)."
                )
            layers.append((name, style, parts))
            for local, dim in _dims(module, style).items():
                p = getattr(module, local, None)
                if not isinstance(p, torch.Tensor):
                    continue
                full = canonical[id(p)]
                split = (dim, parts)
                if p.shape[split[0]] % (degree * parts):
                    raise ValueError(
                        f"init(tensor={degree}): {full} ({style} in tensor_plan[{pattern!r}]) has "
                        f"{p.shape[split[0]]} along the dimension split, which {degree} ranks"
                        f"{f' times {parts} parts' if parts > 1 else ''} cannot share equally. Choose a "
                        "degree that divides it."
                    )
                before = params.get(full)
                if before is not None and before[:2] != split:
                    raise ValueError(
                        f"init(tensor={degree}): the parameter {full} is tied between {before[2]!r} and "
                        f"{name!r}, and the plan splits it two ways. Give both modules styles that split "
                        "the same dimension ('vocab' and 'gathered' for tied embeddings and head), or "
                        "leave both out."
                    )
                params[full] = (*split, name)
    divided: list[tuple[str, str]] = []
    for pattern, names in plan.divide.items():
        matched = _matched(pattern, modules)
        if not matched:
            raise ValueError(_unmatched("tensor_plan.divide", pattern, modules))
        for name in matched:
            for attribute in names:
                value = getattr(modules[name], attribute, None)
                if type(value) is not int or value % degree:
                    raise ValueError(
                        f"init(tensor={degree}): tensor_plan.divide[{pattern!r}] names {name}.{attribute}, "
                        f"which must be an int that {degree} divides ({got(value)})."
                    )
                divided.append((name, attribute))
    for name, style, _ in layers:
        if style in ("colwise", "gathered") and _conv1d(modules[name]):
            divided.append((name, "nf"))  # Conv1D views its output with its width
    return TensorParallel(
        degree,
        rank,
        tuple(layers),
        tuple(divided),
        tuple((n, dim, parts) for n, (dim, parts, _) in params.items()),
    )


def tensor_layout(model: torch.nn.Module, degree: object, plan: object) -> TensorParallel | None:
    """``init(..., tensor=degree, tensor_plan=plan)``'s layout for this rank, checked; ``None`` for ``tensor=1``."""
    if type(degree) is not int or degree < 1:
        raise ValueError(
            f"init(tensor=...) must be a positive int: the ranks that split each layer ({got(degree)})."
        )
    if degree == 1:
        if plan is not None:
            raise ValueError(
                "init(tensor_plan=...) is given, but tensor is 1: pass tensor=T, the ranks that split each layer."
            )
        return None
    world = world_size()
    if world % degree:
        raise ValueError(
            f"init(tensor={degree}) at {world} rank(s): the ranks split into groups of {degree}, one "
            f"copy of the model each, so the world size must be a multiple of {degree}. Launch "
            f"{degree} x copies ranks (torchrun --nproc-per-node), or choose a degree that divides {world}."
        )
    if plan is None:
        plan = builtin_plan(model, degree)
    elif isinstance(plan, Mapping):
        plan = TensorPlan(plan)
    elif not isinstance(plan, TensorPlan):
        raise TypeError(
            f"init(tensor_plan=...) must be a fnloop.TensorPlan or a dict of module pattern -> style ({got(plan)})."
        )
    return layout_of(model, plan, degree, rank() % degree)


def _matched(pattern: str, modules: Mapping[str, Any]) -> list[str]:
    """The module names ``pattern`` matches part by part, as ``parallelize_module`` matches them.

    ``*`` stands for one dotted part: ``layers.*.output.dense`` matches ``layers.0.output.dense``,
    not ``layers.0.attention.output.dense``.

    Examples:
        >>> _matched("layers.*.output.dense", {"layers.0.output.dense": 0, "layers.0.attention.output.dense": 0})
        ['layers.0.output.dense']
    """
    parts = pattern.split(".")
    return [
        name
        for name in modules
        if len(name.split(".")) == len(parts)
        and all(fnmatch.fnmatchcase(atom, want) for atom, want in zip(name.split("."), parts))
    ]


def _unmatched(where: str, pattern: str, modules: Mapping[str, Any]) -> str:
    some = [n for n in modules if n][:6]
    return (
        f"{where}: the pattern {pattern!r} matches no module of the model. Patterns are matched "
        f"against module names as model.named_modules() gives them ({some} ...), part by part: '*' stands for one dotted part."
    )
