"""The compiler room: trace a function of flat tensors once, compile it with inductor, call it with no guards but ours.

Everything fnloop does with torch's tracer and compiler lives here; the rest
of fnloop imports this package's names, never its modules. The step
(``fnloop/_step/compiler.py``) hands a ``Jit`` a function ``f(draws,
*tensors) -> (outputs, context)`` per call structure; the ``Jit`` traces it
(``trace.py``: a ``Traced`` record), compiles the graph (``jit.py``), keeps it
on disk (``cache.py``), and calls it.

Modules: ``jit.py`` (``Jit``, ``Entry``: one graph per signature, a budget),
``trace.py`` (``make_fx`` on fake tensors, the ``Traced`` record, where an
inductor error came from), ``seeding.py`` (random ops drawn from a seed
input: ``Draws``), ``loop.py`` (``scan`` over a traced body), ``cache.py``
(compiled graphs on disk), ``probes.py`` (inductor's CPU probes remembered),
``keys.py`` (the cache's keys), ``identity.py`` and ``loaded.py`` (what a trace
reads, and the code and settings loaded: a restart finds its graph without
tracing), ``options.py`` (fnloop's inductor settings, the backends), ``known.py``
(inductor's known miscompiles, and the route around each), ``batching.py`` (a batch as
tensors and a static structure), ``regather.py`` (a sharded step's block
gathered anew for its backward: a pass over the traced graph),
``patches.py`` (every process-wide change, behind one lock), ``errors.py``.

Private torch APIs used here, each where it is used:

- ``torch.fx.experimental.proxy_tensor.make_fx`` and
  ``disable_proxy_modes_tracing``, ``torch.compiler._non_strict_tracing_context``,
  ``torch._subclasses.fake_tensor`` and ``torch.fx.experimental.symbolic_shapes``
  exceptions (``trace.py``, ``loop.py``);
- ``torch._inductor.standalone_compile``, ``torch._inductor.config``,
  ``torch.use_deterministic_algorithms`` while a graph is lowered (``known.py``),
  ``torch._inductor.decomposition.select_decomp_table`` (``jit.py``,
  ``trace.py``, ``options.py``); ``torch._inductor.CompiledArtifact`` and
  ``torch._functorch.config`` (``cache.py``);
- ``torch._inductor.inductor_prims.random`` (``seeding.py``, GPU only);
- ``torch._higher_order_ops.scan.scan_op`` (``loop.py``);
- ``torch._inductor.cpu_vec_isa.VecISA._probe_load``, ``torch._C._set_mkldnn_enabled``,
  ``torch.compiler._compile_session_context`` (``is_compiling()`` true while a step is
  traced, as under ``torch.compile``), the fake tensors' logger silenced, and
  ``torch.get_rng_state``/``set_rng_state`` replaced for a block (``patches.py``);
- the ops ``torch.ops._c10d_functional.all_gather_into_tensor`` and
  ``reduce_scatter_tensor`` found in a traced graph by name (``regather.py``,
  ``jit.py``).

Outside the room, the step uses ``torch.nn.utils.stateless._reparametrize_module``
(``fnloop/_step/kernel.py``, what ``functional_call`` uses) and
``torch.distributed._functional_collectives`` (``fnloop/_step/collectives.py``,
the one module of the step that calls them).

One channel that is not an argument or a record: ``Draws._tracing``
(``seeding.py``), the ``Draws`` whose ``from_`` is open. The random ops'
decompositions are called by torch's tracer, not by fnloop, so they find the
seed of the step being traced there; the world-size-invariant step's slices
find theirs the same way (``fnloop/_step/invariant.py``). Run eagerly, those
slices find the step's seed in torch's generator, where ``seeded`` put it
(``fnloop/_step/seeds.py``, ``step_seed_of``). The optimizers have none: a
setting given as a 0-d tensor is taken as it is, and one given by hand rather
than by ``inject`` is refused where the optimizer meets a model, by a walk of
its records (``fnloop/optim/_inject.py``, ``tensor_settings``).

Supported: torch 2.13 to 2.15 (``pyproject.toml``'s floor; CI runs the suite on
2.13.0, ``constraints.txt``, and a tier of it on 2.15.0). Inductor's known
miscompiles on those, and the route around each, are in ``known.py``. Switches:
``$FNLOOP_CACHE_DIR`` (``off`` turns the graph cache off), ``$FNLOOP_BACKEND``
(the backend of a step built without one), ``train_step(..., options=...)``
(inductor's settings over ``default_options``) and ``backend=...`` (``"graph"``:
the traced graph run op by op, nothing compiled).

Before changing anything here, run the models suite (``tests/test_models.py``),
``tests/test_remat.py``, ``tests/test_compile_cache.py``,
``tests/test_steps_per_call.py``, ``tests/test_population.py``,
``tests/test_blocks.py``, ``tests/test_sharding.py`` and ``tests/test_architecture.py``, and
``benchmarks/bench_step.py`` against the change.
"""

from fnloop._compile.batching import flatten_batch, unflatten_batch
from fnloop._compile.cache import CompileCache, default_cache
from fnloop._compile.errors import CompileFailed, OverBudget, RandomInGraph, TraceError, TraceFailed
from fnloop._compile.identity import fingerprint
from fnloop._compile.jit import Entry, Jit
from fnloop._compile.loop import HAS_SCAN, scan
from fnloop._compile.options import BACKENDS, default_backend, default_options, inductor_options
from fnloop._compile.seeding import DrawOutsideMembers, Draws
from fnloop._compile.trace import Flat, Traceable, Traced, accumulating, trace

__all__ = [
    "BACKENDS",
    "HAS_SCAN",
    "CompileCache",
    "CompileFailed",
    "DrawOutsideMembers",
    "Draws",
    "Entry",
    "Flat",
    "Jit",
    "OverBudget",
    "RandomInGraph",
    "TraceError",
    "TraceFailed",
    "accumulating",
    "Traceable",
    "Traced",
    "default_backend",
    "default_cache",
    "default_options",
    "fingerprint",
    "flatten_batch",
    "inductor_options",
    "scan",
    "trace",
    "unflatten_batch",
]
