"""fnloop: a training loop for PyTorch in which the whole run is a value."""

from fnloop import data
from fnloop._hooks import Hook, chain, every, identity, on, once, state_names, stateful, when
from fnloop._loop import BatchesExhausted, Step, UnclaimedHookState, run, scan
from fnloop._metrics import Metrics
from fnloop._phase import Phase
from fnloop._state import Effect, TrainState, Unclaimed, hook_state, record, request, with_hook_state

__version__ = "0.1.0"

__all__ = [
    "BatchesExhausted",
    "Effect",
    "Hook",
    "Metrics",
    "Phase",
    "Step",
    "TrainState",
    "Unclaimed",
    "UnclaimedHookState",
    "chain",
    "data",
    "every",
    "hook_state",
    "identity",
    "on",
    "once",
    "record",
    "request",
    "run",
    "scan",
    "state_names",
    "stateful",
    "when",
    "with_hook_state",
]
