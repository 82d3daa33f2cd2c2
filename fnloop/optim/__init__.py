"""Pure optimizers on dicts of tensors: ``init(params)`` and ``update(grads, state, params, iteration)``.

Everything here can be traced by ``torch.compile(fullgraph=True)`` together
with the forward and backward pass. States are dicts, tuples and
``NamedTuple``s of tensors; the iteration and the learning rate are 0-d
tensors, so a schedule never causes a recompile. The numbers match
``torch.optim`` and ``torch.optim.lr_scheduler``.

Examples:
    >>> import torch
    >>> from fnloop import optim
    >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.cosine(1e-3, 100)))
    >>> params = {"w": torch.ones(3)}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.ones(3)}, state, params, torch.tensor(0))
"""

from fnloop.optim._adam import ScaleByAdamState, scale_by_adam
from fnloop.optim._base import (
    EmptyState,
    GradientTransformation,
    InPlaceTransformation,
    LearningRate,
    Optimizer,
    OptState,
    OverShards,
    Params,
    Schedule,
    SquaresSum,
    apply_updates,
    learning_rates,
)
from fnloop.optim._combining import chain, partition
from fnloop.optim._inject import InjectedState, inject
from fnloop.optim._learning_rate import scale_by_learning_rate
from fnloop.optim._loss_scale import LossScaled, LossScaleState, dynamic_loss_scale
from fnloop.optim._optimizers import adam, adamw, exclude_bias_and_norm, sgd
from fnloop.optim._schedules import (
    constant,
    cosine,
    join,
    linear_warmup,
    multistep,
    warmup,
    warmup_multistep,
)
from fnloop.optim._spikes import SkipsSpikes, SpikeState, skip_spikes
from fnloop.optim._transforms import (
    ClipByGlobalNormState,
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    trace,
)

__all__ = [
    "ClipByGlobalNormState",
    "EmptyState",
    "GradientTransformation",
    "InPlaceTransformation",
    "OverShards",
    "InjectedState",
    "LearningRate",
    "LossScaleState",
    "LossScaled",
    "OptState",
    "Optimizer",
    "Params",
    "ScaleByAdamState",
    "SkipsSpikes",
    "SpikeState",
    "Schedule",
    "SquaresSum",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "dynamic_loss_scale",
    "cosine",
    "exclude_bias_and_norm",
    "inject",
    "join",
    "learning_rates",
    "linear_warmup",
    "multistep",
    "partition",
    "scale_by_adam",
    "scale_by_learning_rate",
    "sgd",
    "skip_spikes",
    "trace",
    "warmup",
    "warmup_multistep",
]
