"""Ready-made hooks: checkpoints (more to come).

Combinators (``every``, ``on``, ...) live at the top level, ``fnloop.every``.
"""

from fnloop.hooks._checkpoint import Best, DirectoryInUse, MetricNeverRecorded, best_checkpoint, checkpoint
from fnloop.hooks._early_stop import EarlyStopState, MetricNotRecorded, early_stop
from fnloop.hooks._ema import EmaState, ema, ema_params
from fnloop.hooks._evaluate import Evaluated, MeanOver, evaluate, mean_over
from fnloop.hooks._precise_bn import PreciseBNState, precise_bn

__all__ = [
    "Best",
    "DirectoryInUse",
    "MetricNeverRecorded",
    "best_checkpoint",
    "checkpoint",
    # steering a run
    "EarlyStopState",
    "EmaState",
    "Evaluated",
    "MeanOver",
    "MetricNotRecorded",
    "PreciseBNState",
    "early_stop",
    "ema",
    "ema_params",
    "evaluate",
    "mean_over",
    "precise_bn",
]
