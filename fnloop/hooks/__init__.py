"""Ready-made hooks: see a run (timer, throughput, log, progress, memory, profile), steer it (evaluate,
early_stop, stop_on_spikes, ema, precise_bn), keep it (checkpoint, best_checkpoint) and check a data-parallel
one (check_replicas).

Combinators (``every``, ``on``, ...) live at the top level, ``fnloop.every``.
"""

from fnloop.hooks._checkpoint import BackgroundFailed, Best, DirectoryInUse, TopK, best_checkpoint, checkpoint
from fnloop.hooks._early_stop import EarlyStopState, early_stop
from fnloop.hooks._ema import EmaState, ema, ema_params
from fnloop.hooks._evaluate import Evaluated, MeanOver, evaluate, mean_over
from fnloop.hooks._log import Log, LogState, log
from fnloop.hooks._memory import Memory, memory, peak_mib
from fnloop.hooks._precise_bn import PreciseBNState, precise_bn
from fnloop.hooks._profile import Profile, profile, trace_path
from fnloop.hooks._progress import Progress, progress
from fnloop.hooks._replicas import CheckReplicas, ReplicasDiverged, check_replicas
from fnloop.hooks._spikes import SpikesInARow, StopOnSpikes, stop_on_spikes
from fnloop.hooks._summary import ModelSummary, model_summary, summary
from fnloop.hooks._throughput import (
    PEAK_FLOPS,
    ImpossibleMFU,
    Throughput,
    ThroughputState,
    flops_per_token,
    peak_flops,
    throughput,
)
from fnloop.hooks._timer import Timer, TimerState, timer
from fnloop.hooks._unrecorded import MetricNeverRecorded, NonFiniteMetric

__all__ = [
    "BackgroundFailed",
    "Best",
    "DirectoryInUse",
    "MetricNeverRecorded",
    "NonFiniteMetric",
    "TopK",
    "best_checkpoint",
    "checkpoint",
    # steering a run
    "EarlyStopState",
    "EmaState",
    "Evaluated",
    "MeanOver",
    "PreciseBNState",
    "early_stop",
    "ema",
    "ema_params",
    "evaluate",
    "mean_over",
    "precise_bn",
    "SpikesInARow",
    "StopOnSpikes",
    "stop_on_spikes",
    # seeing a run
    "Log",
    "LogState",
    "Memory",
    "ModelSummary",
    "Profile",
    "Progress",
    "Timer",
    "TimerState",
    "log",
    "memory",
    "model_summary",
    "peak_mib",
    "profile",
    "progress",
    "summary",
    "timer",
    "trace_path",
    "PEAK_FLOPS",
    "Throughput",
    "ImpossibleMFU",
    "ThroughputState",
    "flops_per_token",
    "peak_flops",
    "throughput",
    # data parallel
    "CheckReplicas",
    "ReplicasDiverged",
    "check_replicas",
]
