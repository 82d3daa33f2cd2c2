"""fnloop's settings for inductor: its defaults, and the names a user's ``options`` may use."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "BACKENDS",
    "SMALL_LOOP",
    "checked_backend",
    "default_backend",
    "default_options",
    "inductor_options",
]

BACKENDS = ("inductor", "graph")
"""What runs a traced step: inductor's compiled code, or the traced graph itself, op by op."""


SMALL_LOOP = 400
"""The most ops a graph with a loop may have for fnloop to build it with the C++ wrapper."""

SMALL_GRAPH = 1_000
"""The most ops a graph may have for fnloop to build it with the C++ wrapper."""


def default_options(
    leaves: Sequence[torch.Tensor], loops: bool, ops: int, recomputes: bool = False, shards: bool = False
) -> dict[str, Any]:
    """fnloop's inductor settings for a graph of ``ops`` ops on ``leaves``, with a loop or not; options given win.

    - ``cpp_wrapper``: a C++ wrapper calls the kernels, not Python. On the
      tiny benchmark it takes about 8 us off each step (44 -> 36 us) for
      about 6 s more at the first compile. Only for a graph of at most
      ``SMALL_GRAPH`` ops: the wrapper's build grows with the graph (a
      ResNet-18's step of 3,000 ops, 332 kernels, took 12 s longer to compile
      with it: 49.7 s against 37.8) while what it saves stays microseconds a
      step, against the tens of milliseconds of such a step. For a graph with
      a loop (several steps per call) only when it is smaller still
      (``SMALL_LOOP`` ops): the wrapper
      then runs the loop in C++ (the tiny MLP's 128 steps a call: 20.0 us a
      step against 38.1 with Python's), but it writes the loop's body into its
      own source, whose build grows faster than the body: a 2-layer GPT-2's
      loop took 106 s against 18 s, a ResNet-18's twelve minutes. Never for
      a sharded step's graph (``shards``: it all-gathers and reduce-scatters),
      which the wrapper cannot build on torch 2.13 ("arg type Any is not yet
      supported by custom_op_wrapper").
    - ``layout_optimization`` off on the CPU: inductor turns convolution
      weights channels-last inside the graph, so their gradients come out
      channels-last beside parameters that are not, and the fused optimizer
      update walked them with strided loads. On a ResNet-18 (batch 64,
      AdamW, one thread) the update took 32.8 ms of the step with it and
      5.0 ms without, and the whole step 150 ms against 109.

    - ``reorder_for_locality`` off when the step recomputes (activation
      checkpointing, ``recomputes``): forward and backward are one graph, and
      inductor moved the recomputed ops up beside the forward ops that read
      the same inputs, where their results live as long as without
      checkpointing. On the checkpointing benchmark's GPT-2 the step's working
      memory was 357 MiB with it and 159 without (418 without checkpointing).

    Examples:
        >>> default_options([torch.zeros(2)], loops=False, ops=500)
        {'cpp_wrapper': True, 'layout_optimization': False}
        >>> default_options([torch.zeros(2)], loops=True, ops=1_000)
        {'cpp_wrapper': False, 'layout_optimization': False}
    """
    defaults: dict[str, Any] = {"cpp_wrapper": not shards and ops <= (SMALL_LOOP if loops else SMALL_GRAPH)}
    if all(leaf.device.type == "cpu" for leaf in leaves):
        defaults["layout_optimization"] = False
    if recomputes:
        defaults["reorder_for_locality"] = False
    return defaults


def inductor_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` as a dict, each name checked against inductor's config."""
    import torch._inductor.config as config

    given = dict(options or {})
    known = config.get_config_copy()
    for name in given:
        if name not in known:
            raise ValueError(
                f"options: {name!r} is not a setting of torch._inductor.config; use the names "
                "torch.compile(options=...) takes, for example {'cpp_wrapper': False}."
            )
    return given


def checked_backend(backend: object) -> str:
    """``backend`` if it names one of ``BACKENDS``; else a ``ValueError`` that says what each does."""
    if backend not in BACKENDS:
        raise ValueError(
            f"backend must be 'inductor' (compile the traced step, the default) or 'graph' (run the "
            f"traced graph op by op, without inductor: seconds to build, to tell a problem of the "
            f"trace from one of the compiler) (got {backend!r})."
        )
    return str(backend)


BACKEND_ENV = "FNLOOP_BACKEND"
"""The environment variable naming the backend of steps built without one (a test suite's, say)."""


def default_backend(given: object = None) -> str:
    """``given``, checked; or, when ``None``, ``$FNLOOP_BACKEND`` if set, else ``"inductor"``."""
    if given is None:
        given = os.environ.get(BACKEND_ENV) or "inductor"
    return checked_backend(given)
