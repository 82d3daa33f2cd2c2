"""fnloop: a training loop for PyTorch in which the whole run is a value."""

from fnloop import checkpoint, config, data, distributed, hooks, optim, replay, writers
from fnloop._core.checked import checked
from fnloop._core.combinators import (
    Hook,
    chain,
    every,
    identity,
    on,
    once,
    state_names,
    when,
)
from fnloop._core.metrics import Metrics
from fnloop._core.phase import Phase
from fnloop._core.population import PerMember, Population
from fnloop._core.schedule import Schedule
from fnloop._core.shards import Shards
from fnloop._core.state import (
    Clock,
    Effect,
    TrainState,
    Unclaimed,
    hook_state,
    record,
    request,
    with_hook_state,
)
from fnloop._core.stateful import stateful
from fnloop._core.tensor_parallel import TensorParallel
from fnloop._export import load_state_dict, state_dict, unshard
from fnloop._lr_find import LRFinding, find_lr
from fnloop._population import member, members, population
from fnloop._run import BatchesExhausted, Preempted, SlowStart, Step, UnclaimedHookState, run, scan
from fnloop._step.build import (
    CompileError,
    GraphBreakError,
    NonFiniteLoss,
    RecompileError,
    TrainStep,
    init,
    train_step,
)
from fnloop._step.check import ParameterCheck, StepCheck, check_step
from fnloop._step.eval import EvalStep, eval_step
from fnloop._step.tensor_plans import TensorPlan
from fnloop._version import __version__ as __version__
from fnloop._weights import save_weights
from fnloop.checkpoint import load, save

__all__ = [
    "BatchesExhausted",
    "Clock",
    "Effect",
    "EvalStep",
    "CompileError",
    "GraphBreakError",
    "Hook",
    "LRFinding",
    "Metrics",
    "NonFiniteLoss",
    "ParameterCheck",
    "PerMember",
    "Phase",
    "Population",
    "Preempted",
    "Schedule",
    "RecompileError",
    "Shards",
    "TensorParallel",
    "TensorPlan",
    "SlowStart",
    "Step",
    "StepCheck",
    "TrainState",
    "TrainStep",
    "Unclaimed",
    "UnclaimedHookState",
    "chain",
    "checkpoint",
    "check_step",
    "checked",
    "config",
    "data",
    "distributed",
    "eval_step",
    "every",
    "find_lr",
    "hook_state",
    "hooks",
    "identity",
    "init",
    "load",
    "load_state_dict",
    "member",
    "members",
    "on",
    "optim",
    "population",
    "once",
    "record",
    "replay",
    "request",
    "run",
    "save",
    "save_weights",
    "scan",
    "state_dict",
    "state_names",
    "stateful",
    "train_step",
    "unshard",
    "when",
    "with_hook_state",
    "writers",
]
