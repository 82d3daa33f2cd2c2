"""The traced function: forward, backward and update on plain dicts of tensors, and its flat form."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from fnloop._core.shards import Shards
from fnloop._step.errors import _NUMBER_METRIC, GraphBreakError, _number
from fnloop._step.sharding import all_ranks, chunk, gathered, scattered, summed
from fnloop.distributed import _group
from fnloop.optim import Optimizer, learning_rates
from fnloop.optim._base import over_shards

__all__ = ["LossFn"]

LossFn = Callable[[Callable[..., Any], Any], Any]
"""``loss_fn(model, batch) -> loss`` or ``(loss, metrics)``; ``model`` runs the forward on the state."""


def _split(out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        loss, metrics = out
    else:
        loss, metrics = out, {}
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"loss_fn must return a scalar loss tensor or (loss, metrics), got {type(loss).__name__} "
            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; reduce the loss to one "
            "value (for example .mean())."
        )
    for name, value in metrics.items():
        what = _number(value)
        if what is not None:
            raise GraphBreakError(_NUMBER_METRIC.format(name=name, what=what))
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise TypeError(
                f"loss_fn returned the metric {name!r} as a tensor of shape {tuple(value.shape)}; a "
                "metric is one number per step: reduce it (for example .mean()) or leave it out."
            )
    return loss.reshape(()), dict(metrics)


def _micro_batches(batch: Any, n: int) -> list[Any]:
    flat, spec = pytree.tree_flatten(batch)
    for leaf in flat:
        if isinstance(leaf, torch.Tensor) and leaf.shape[0] % n:
            raise ValueError(
                f"cannot split a batch of {leaf.shape[0]} rows into accumulate={n} equal micro-batches; "
                "choose a batch size divisible by accumulate."
            )
    chunks = [leaf.chunk(n) if isinstance(leaf, torch.Tensor) else [leaf] * n for leaf in flat]
    return [pytree.tree_unflatten([c[k] for c in chunks], spec) for k in range(n)]


def _all_finite(loss: torch.Tensor, grads: Mapping[str, torch.Tensor], eager: bool = False) -> torch.Tensor:
    """A 0-d bool: the loss and every gradient element are finite (one reduction per tensor, no sync).

    The largest magnitude of a tensor is finite exactly when every element is
    (``amax`` propagates NaN), so this is ``isfinite(g).all()`` for all of them,
    asked as float max-reductions that the compiled step vectorizes: the boolean
    form took a third of the update of a 2048-wide MLP. (``(g * 0).sum()`` would
    be as fast but wrong: inductor folds ``* 0``, see tests/test_nonfinite.py.)

    ``eager``: run op by op, where ``vector_norm(g, inf)`` and ``isfinite(g).all()``
    take twenty times as long as ``aminmax`` (10 ms against 0.5 ms for 4 M floats on
    one thread); the smallest and largest element are both finite exactly when every
    element is (both reductions propagate NaN).
    """
    if eager:
        flags = [torch.isfinite(loss.detach()).reshape(())]
        flags += [
            torch.isfinite(torch.stack(torch.aminmax(g.detach()))).all() for g in grads.values() if g.numel()
        ]
        return torch.stack(flags).all()
    peaks = [loss.detach().abs().reshape(())]
    # vector_norm(g, inf) is abs().amax() without an eager copy of |g|; it compiles to the same.
    peaks += [torch.linalg.vector_norm(g, math.inf) for g in grads.values() if g.numel()]
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in peaks])  # widening keeps inf and NaN
    return torch.isfinite(torch.stack([p.to(dtype) for p in peaks]).amax())


@contextlib.contextmanager
def _holding(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``model`` with ``tensors`` in place of its parameters and buffers for the block (tied weights kept tied)."""
    from torch.nn.utils.stateless import _reparametrize_module  # what functional_call uses

    with _reparametrize_module(model, tensors, tie_weights=True, strict=False):
        yield


_REENTRANT = (
    "activation checkpointing: the model checkpoints with use_reentrant=True ({how}), {why}; "
    "fnloop's step needs the non-reentrant form. Use "
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False); for a transformers model, "
    "model.activation_checkpointing_enable() (non-reentrant by default since transformers 5) or "
    'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}}).'
)

_NO_INPUT_GRAD = "None of the inputs have requires_grad=True"
"""torch's warning when reentrant checkpointing runs a block none of whose inputs needs a gradient."""


def _gradients(loss: torch.Tensor, wanted: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
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
def _reentrant_refused() -> Iterator[None]:
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


def _by_name(
    leaves: dict[str, torch.Tensor], fixed: frozenset[str], found: Iterable[torch.Tensor | None]
) -> dict[str, torch.Tensor]:
    """Each trained parameter's gradient by name, from ``found`` (those of the leaves that require grad, in order).

    A parameter autograd found no gradient for (unused, or not floating) gets zeros; frozen ones none.
    """
    found = iter(found)
    grads = {}
    for k, v in leaves.items():
        if k in fixed:
            continue
        g = next(found) if v.requires_grad else None
        grads[k] = torch.zeros_like(v) if g is None else g
    return grads


class Stepped(NamedTuple):
    """What one step computes: the new params, buffers and optimizer state, before the guard.

    ``finite`` (a 0-d bool) says whether the loss and every gradient were
    finite; the callers keep the old state where it is false.
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    opt_state: Any
    loss: torch.Tensor
    finite: torch.Tensor
    metrics: dict[str, torch.Tensor]


Update = Callable[..., Stepped]
"""``update(params, buffers, opt_state, iteration, batch, shards=None) -> Stepped``, pure; ``shards``
(the state's ``Shards``, static) makes it the sharded step."""


def _kernel(
    model: torch.nn.Module,
    loss_fn: LossFn,
    optimizer: Optimizer,
    accumulate: int,
    autocast: torch.dtype | None,
    eager: bool = False,
) -> tuple[Update, Callable[..., Any]]:
    """The step as a pure function, and as an eager one writing into the state it is given.

    ``update(params, buffers, opt_state, iteration, batch) -> Stepped`` is
    pure: forward, backward and update on plain dicts, nothing written (what
    is traced and compiled). ``in_place(params, buffers, opt_state, iteration,
    batch) -> (loss, finite, metrics)`` runs op by op and writes a finite
    step's results into the given tensors.

    Gradients come from ``torch.autograd.grad`` on leaf copies of the
    parameters, eager and traced alike: the trace records the ops autograd
    runs, so the graph holds the backward torch's own engine would run
    (``convolution_backward``, autocast's casts, the saved-tensor machinery),
    where ``torch.func.grad_and_value`` failed under bf16 autocast with
    dropout and its transform layer cost a fifth of a small CNN's eager step.

    Parameters the model marks ``requires_grad=False`` (``frozen``) get no
    gradient (their backward is not computed) and go to the optimizer not at
    all: they leave the step as they came, and ``opt_state`` is that of the
    others.

    ``eager``: the finiteness check is the one that is fast op by op.
    """
    fixed = frozen(model, "train_step")
    checked: list[bool] = []  # the first forward (eager, or traced) checks the model's checkpointing

    def loss_of(params: dict, batch: Any) -> tuple[torch.Tensor, dict]:
        device = _device(params).type
        context = torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext()
        # Once: catching a warning resets Python's record of warnings shown, so each step would
        # show a model's warnings again.
        refused = contextlib.nullcontext() if checked else _reentrant_refused()
        with refused, context:
            loss, metrics = _split(loss_fn(model, batch))
        if not checked:
            checked.append(True)
        return loss.float(), metrics

    def grads_and_loss(params: dict, buffers: dict, batch: Any) -> tuple[dict, torch.Tensor, dict]:
        leaves = {
            k: v.detach().requires_grad_(k not in fixed and (v.is_floating_point() or v.is_complex()))
            for k, v in params.items()
        }
        # The model holds the state's tensors through the backward too, not only the forward (as
        # functional_call would): activation checkpointing runs part of the forward again there,
        # and it must see these parameters, not the module's own.
        with torch.enable_grad(), _holding(model, {**leaves, **buffers}):
            loss, metrics = loss_of(leaves, batch)
            wanted = [v for v in leaves.values() if v.requires_grad]
            found = _gradients(loss, wanted) if wanted else ()
        return _by_name(leaves, fixed, found), loss.detach(), {k: v.detach() for k, v in metrics.items()}

    def gradients(
        params: dict, buffers: dict, batch: Any, shards: Shards | None
    ) -> tuple[dict, dict, torch.Tensor, dict]:
        """``(grads, new_buffers, loss, metrics)``: forward and backward, averaged over micro-batches and ranks.

        Sharded, the gradients are this rank's chunks of the average (a reduce-scatter).
        """
        # functional_call writes running statistics into the buffers it is given.
        new_buffers = {k: v.clone() for k, v in buffers.items()}
        if accumulate == 1:
            grads, loss, metrics = grads_and_loss(params, new_buffers, batch)
        else:
            grads, losses, parts = {}, [], []
            for micro in _micro_batches(batch, accumulate):
                g, l_k, m_k = grads_and_loss(params, new_buffers, micro)
                grads = {k: grads[k] + v for k, v in g.items()} if grads else g
                losses.append(l_k)
                parts.append(m_k)
            grads = {k: v / accumulate for k, v in grads.items()}
            loss = torch.stack(losses).mean()
            metrics = {k: torch.stack([m[k] for m in parts]).float().mean() for k in parts[0]}
        group = _group()
        if group is not None and shards is not None:
            grads = scattered(grads, shards, group)
            _, loss, metrics, new_buffers = _averaged({}, loss, metrics, new_buffers, group)
        elif group is not None:  # data parallel: every rank gets the same averages, inside the graph
            grads, loss, metrics, new_buffers = _averaged(grads, loss, metrics, new_buffers, group)
        return grads, new_buffers, loss, metrics

    def rates(iteration: torch.Tensor, opt_state: Any) -> dict[str, torch.Tensor]:
        # Fixed learning rates are recorded as the numbers they are, outside the graph (TrainStep.fixed);
        # an injected one is the state's (fnloop.optim.inject).
        found = learning_rates(optimizer, iteration, opt_state)
        return {k: v for k, v in found.items() if isinstance(v, torch.Tensor)}

    def update(
        params: dict,
        buffers: dict,
        opt_state: Any,
        iteration: torch.Tensor,
        batch: Any,
        shards: Shards | None = None,
    ) -> Stepped:
        # Sharded, the forward and backward run on the whole parameters, the update on this rank's chunks.
        group = _group() if shards is not None else None
        whole, mine = (params, params) if shards is None else _sharded_views(params, shards, group)
        grads, new_buffers, loss, metrics = gradients(whole, buffers, batch, shards)
        across = over_shards(lambda t: summed(t, group)) if group is not None else contextlib.nullcontext()
        with _matching(fixed), across:
            trained, new_opt_state = optimizer.update(grads, opt_state, _trained(mine, fixed), iteration)
        if shards is not None and not shards.params and group is not None:
            trained = gathered(trained, shards, group)  # whole on every rank: every rank's chunks, together
        new_params = {k: v if k in fixed else trained[k] for k, v in params.items()}
        finite = _all_finite(loss, grads, eager)
        if group is not None:  # each rank saw its own chunks of the gradients
            finite = all_ranks(finite, group)
        return Stepped(
            new_params, new_buffers, new_opt_state, loss, finite, {**rates(iteration, opt_state), **metrics}
        )

    def in_place(
        params: dict,
        buffers: dict,
        opt_state: Any,
        iteration: torch.Tensor,
        batch: Any,
        shards: Shards | None = None,
    ) -> Any:
        # Eager, on a state the step owns: whether the step is finite is read on the host (free on a
        # CPU; one sync per step on a GPU), and a finite one updates params and optimizer state in
        # place (the optimizer's update_): no second copy of the state is made, as torch.optim makes none.
        if shards is not None:  # the pure step, its results written into the state it was given
            stepped = update(params, buffers, opt_state, iteration, batch, shards)
            if stepped.finite:
                old = [*params.values(), *buffers.values(), *pytree.tree_leaves(opt_state)]
                for before, after in zip(old, _state(stepped)):
                    if after is not before:
                        before.copy_(after)
            return stepped.loss, stepped.finite, stepped.metrics
        grads, new_buffers, loss, metrics = gradients(params, buffers, batch, None)
        finite = _all_finite(loss, grads, eager)
        if finite:
            with _matching(fixed):
                optimizer.update_(grads, opt_state, _trained(params, fixed), iteration)
            if buffers:
                torch._foreach_copy_(list(buffers.values()), [new_buffers[k] for k in buffers])
        return loss, finite, {**rates(iteration, opt_state), **metrics}

    return update, in_place


def _sharded_views(params: dict[str, torch.Tensor], shards: Shards, group: Any) -> tuple[dict, dict]:
    """``(whole, mine)``: the parameters a sharded step runs the model on, and the ones it updates."""
    if shards.params:
        return (params if group is None else gathered(params, shards, group)), params
    split = shards.names
    return params, {k: chunk(v, shards, k) if k in split else v for k, v in params.items()}


def frozen(model: torch.nn.Module, where: str) -> frozenset[str]:
    """The names of the parameters ``model`` marks ``requires_grad=False``: kept in the state, never trained.

    Raises ``ValueError`` (from ``where``) when that is every parameter.
    """
    named = dict(model.named_parameters())
    names = frozenset(k for k, p in named.items() if not p.requires_grad)
    if named and len(names) == len(named):
        raise ValueError(
            f"{where}(): every parameter of the model has requires_grad=False, so there is nothing "
            "to train. fnloop trains the parameters with requires_grad=True and keeps the others "
            "as they are, as torch.optim does; unfreeze the ones to train (p.requires_grad_(True), "
            "or module.requires_grad_(True)) before fnloop.init and train_step."
        )
    return names


@contextlib.contextmanager
def _matching(fixed: frozenset[str]) -> Iterator[None]:
    """The optimizer's complaint that ``opt_state`` is for other parameters, with the likely cause."""
    try:
        yield
    except KeyError as exc:
        now = f"this step's model freezes {sorted(fixed)}" if fixed else "this step's model freezes none"
        raise KeyError(
            f"{exc.args[0]} The state's opt_state was built for other parameters than this step "
            f"trains ({now}): fnloop.init builds it for the parameters with requires_grad=True, so "
            "set the model's requires_grad flags before both fnloop.init and train_step, the same "
            "for both."
        ) from exc


def _trained(params: dict[str, torch.Tensor], fixed: frozenset[str]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in params.items() if k not in fixed} if fixed else params


def _state(stepped: Stepped) -> list[torch.Tensor]:
    return [*stepped.params.values(), *stepped.buffers.values(), *pytree.tree_leaves(stepped.opt_state)]


def _kept(keep: torch.Tensor, old: list[torch.Tensor], new: list[torch.Tensor]) -> list[torch.Tensor]:
    """``new`` where ``keep`` holds, else ``old``: a non-finite step leaves the state as it was.

    A tensor the step passed through (a frozen parameter) is ``old`` itself, left as it is.
    """
    return [o if n is o else torch.where(keep, n, o) for o, n in zip(old, new)]


def _averaged(
    grads: dict[str, torch.Tensor],
    loss: torch.Tensor,
    metrics: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    group: Any,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Gradients, loss, metrics and floating buffers averaged over the ranks of ``group``.

    One all-reduce per dtype over all of them put end to end: a step pays the
    collective's latency once, and every rank receives the same bytes, so the
    replicas stay identical. Floating buffers (BatchNorm's running statistics)
    are averaged too; integer ones (counters) agree already.
    """
    import torch.distributed._functional_collectives as funcol

    size = torch.distributed.get_world_size(group)
    named = {
        **{("g", k): v for k, v in grads.items()},
        ("l", ""): loss,
        **{("m", k): v.float() for k, v in metrics.items()},
        **{("b", k): v for k, v in buffers.items() if v.is_floating_point()},
    }
    by_dtype: dict[torch.dtype, list[tuple[Any, torch.Tensor]]] = {}
    for key, value in named.items():
        by_dtype.setdefault(value.dtype, []).append((key, value))
    out: dict[Any, torch.Tensor] = {}
    for entries in by_dtype.values():
        flat = torch.cat([v.reshape(-1) for _, v in entries])
        flat = funcol.all_reduce(flat, "sum", group) / size
        for (key, value), part in zip(entries, flat.split([v.numel() for _, v in entries])):
            out[key] = part.view(value.shape)
    return (
        {k: out["g", k] for k in grads},
        out["l", ""],
        {k: out["m", k] for k in metrics},
        {k: out.get(("b", k), v) for k, v in buffers.items()},
    )


def _leaf_name(structure: Any, index: int) -> str:
    pkeys, bkeys, ospec = structure[:3]
    if index < len(pkeys):
        return f"params[{pkeys[index]!r}]"
    index -= len(pkeys)
    if index < len(bkeys):
        return f"buffers[{bkeys[index]!r}]"
    index -= len(bkeys)
    if index < ospec.num_leaves:
        return f"opt_state leaf {index}"
    index -= ospec.num_leaves
    if index < 2:
        return ("the iteration", "the step's seed")[index]
    return f"the batch's tensor {index - 2}"


def _device(params: Mapping[str, torch.Tensor]) -> torch.device:
    for tensor in params.values():
        return tensor.device
    return torch.device("cpu")


def _cloned(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)
