"""fnloop: a training loop for PyTorch in which the whole run is a value."""

from fnloop import data, optim
from fnloop._hooks import Hook, chain, checked, every, identity, on, once, state_names, stateful, when
from fnloop._loop import BatchesExhausted, Step, UnclaimedHookState, run, scan
from fnloop._metrics import Metrics
from fnloop._phase import Phase
from fnloop._state import Effect, TrainState, Unclaimed, hook_state, record, request, with_hook_state
from fnloop._step import EvalStep, GraphBreakError, RecompileError, TrainStep, eval_step, init, train_step

__version__ = "0.1.0"

__all__ = [
    "BatchesExhausted",
    "Effect",
    "EvalStep",
    "GraphBreakError",
    "Hook",
    "Metrics",
    "Phase",
    "RecompileError",
    "Step",
    "TrainState",
    "TrainStep",
    "Unclaimed",
    "UnclaimedHookState",
    "chain",
    "checked",
    "data",
    "eval_step",
    "every",
    "hook_state",
    "identity",
    "init",
    "on",
    "optim",
    "once",
    "record",
    "request",
    "run",
    "scan",
    "state_names",
    "stateful",
    "train_step",
    "when",
    "with_hook_state",
]
