"""Every change fnloop makes to process-wide state while it traces or compiles, in one place, behind one lock.

Each is undone when its block ends, and each is taken under ``LOCK`` (one
re-entrant lock), so two threads tracing or compiling at once never see
each other's: a thread waits for the other's block to end.

- ``onednn_off``: oneDNN off while a step is traced (``torch._C._set_mkldnn_enabled``).
- ``rng_state_hooks``: ``torch.get_rng_state`` and ``torch.set_rng_state``
  wrapped, so a traced step learns when checkpointing saves and restores the
  generator (``fnloop/_compile/seeding.py``).
- ``probe_load``: inductor's CPU probe (``VecISA._probe_load``) answered from
  fnloop's record (``fnloop/_compile/probes.py``).
- ``compiling``: ``torch.compiler.is_compiling()`` true while a step is traced,
  as while ``torch.compile`` compiles.
- ``quiet_shape_rules``: the fake tensors' logger silent while a step is
  traced: an op's shape rule that refuses its inputs is reported once, as
  fnloop's ``CompileError`` with torch's error chained, not also logged.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["LOCK", "compiling", "onednn_off", "probe_load", "quiet_shape_rules", "rng_state_hooks"]

LOCK = threading.RLock()


@contextlib.contextmanager
def onednn_off() -> Iterator[None]:
    """oneDNN off for the block.

    ``torch.backends.mkldnn.flags()`` would also reset oneDNN's TF32 setting, with a warning.
    """
    with LOCK:
        enabled = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            yield
        finally:
            torch._C._set_mkldnn_enabled(enabled)


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` true for the block, as it is while ``torch.compile`` compiles.

    Library code asks it to take the path meant for a compiled graph: a model
    of ``transformers`` picks a kernel the compiler can build (its mixture of
    experts avoids ``aten._grouped_mm``, whose shape rule takes bfloat16 only)
    and skips checks that read a tensor's value. fnloop compiles what its
    trace records, so that path is the one meant.
    ``torch.compiler._compile_session_context`` is how ``torch.compile`` sets
    it; a torch without it leaves the flag as it is.
    """
    context = getattr(torch.compiler, "_compile_session_context", None)
    with LOCK, context() if context is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def quiet_shape_rules() -> Iterator[None]:
    """The fake tensors' logger (``torch._subclasses.fake_tensor``) silent for the block, but for critical records."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    with LOCK:
        level = log.level
        log.setLevel(logging.CRITICAL)
        try:
            yield
        finally:
            log.setLevel(level)


@contextlib.contextmanager
def rng_state_hooks(
    saved: Callable[[torch.Tensor], None], restored: Callable[[torch.Tensor], None]
) -> Iterator[None]:
    """For the block, ``saved(state)`` runs after ``torch.get_rng_state`` and ``restored(state)`` after ``torch.set_rng_state``."""
    with LOCK:
        get, put = torch.get_rng_state, torch.set_rng_state

        def get_rng_state() -> torch.Tensor:
            state = get()
            saved(state)
            return state

        def set_rng_state(new_state: torch.Tensor) -> None:
            put(new_state)
            restored(new_state)

        torch.get_rng_state, torch.set_rng_state = get_rng_state, set_rng_state  # type: ignore[assignment]
        try:
            yield
        finally:
            torch.get_rng_state, torch.set_rng_state = get, put  # type: ignore[assignment]


@contextlib.contextmanager
def probe_load(answer: Callable[[Callable[[Any, str], bool], Any, str], bool]) -> Iterator[None]:
    """For the block, inductor's CPU probe asks ``answer(original, isa, path)``; nothing where torch has no such probe."""
    vec_isa = _vec_isa()
    if vec_isa is None:
        yield
        return
    with LOCK:
        original = vec_isa._probe_load

        def probe(self: Any, output_path: str) -> bool:
            return answer(original, self, output_path)

        vec_isa._probe_load = probe
        try:
            yield
        finally:
            vec_isa._probe_load = original


def _vec_isa() -> Any:
    try:
        from torch._inductor.cpu_vec_isa import VecISA
    except ImportError:
        return None
    # Only torch versions whose probe is this one function are taught to remember it.
    return VecISA if callable(getattr(VecISA, "_probe_load", None)) else None
