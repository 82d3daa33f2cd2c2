"""The ranks of one machine started from Python, without ``torchrun``: from a script or a notebook.

``launch(fn, *args, nprocs=N, **kwargs)`` runs ``fn(*args, **kwargs)`` in ``N``
new processes, each given the environment ``torchrun --standalone`` gives its
workers, so that ``fl.distributed.setup`` (and every fnloop call that makes
it) joins them exactly as under ``torchrun``: the launching process hosts the
group's store, as ``torchrun``'s agent does (``TORCHELASTIC_USE_AGENT_STORE``).
It is what Lightning Fabric's launcher, accelerate's ``notebook_launcher`` and
detectron2's ``launch`` give their users, with fnloop's terms: nothing of the
script changes between ``torchrun`` and ``launch``.

The processes are started by ``multiprocessing`` (``torch.multiprocessing``'s
context): fresh interpreters (spawn) where ``fn`` can be imported, and forks of
the caller where it cannot (a notebook's function, which accelerate's
``notebook_launcher`` forks for the same reason). Each rank reports what it
returned, or what it raised, through a file of a folder of the launch's own:
a file is the one-shot message that cannot deadlock (``torch.multiprocessing``
moved its spawn errors to files for that reason).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.multiprocessing

from fnloop._launch_reports import (
    RankFailed,
    RankTraceback,
    ended,
    failure,
    returned,
    saved,
    watched,
    write_report,
    written,
)

__all__ = ["RankFailed", "RankTraceback", "launch"]

R = TypeVar("R")

START_METHODS = ("spawn", "fork", "forkserver")
"""The ways ``multiprocessing`` starts a process that ``launch`` accepts."""

ADDRESS = "127.0.0.1"
"""``MASTER_ADDR`` of a launch: one machine, the loopback."""

STORE_TIMEOUT = datetime.timedelta(minutes=5)
"""How long the launch's store waits on a request (``fl.distributed.DEFAULT_TIMEOUT``'s length)."""

INTERACTIVE = (
    "is defined in the __main__ of an interactive session (a notebook, IPython or the REPL), "
    "which a process started with start_method={method!r} cannot import: that method pickles fn "
    "by its module and name and imports them in a fresh interpreter. Leave start_method at None "
    "(launch then forks this process, as accelerate's notebook_launcher does), or move fn into a "
    "module (a .py file beside the notebook) and import it from there."
)

CUDA_FORKED = (
    "fl.distributed.launch cannot fork this process: CUDA is already initialized in it "
    "(torch.cuda.is_initialized()), and a forked child cannot use CUDA then. Restart the kernel "
    "and call launch before anything touches CUDA (a tensor or a model moved to the GPU, "
    "torch.cuda.* calls, fl.distributed.device()); or move fn into a module (a .py file beside "
    "the notebook) and import it, so that launch starts fresh interpreters (spawn), which CUDA allows."
)

PICKLED = (
    "fl.distributed.launch: start_method={method!r} pickles fn and its arguments to send them to "
    "each new interpreter, and this one did not pickle: pass arguments that pickle (tensors, "
    "numbers, strings, containers of them; a module-level function, not a lambda or a local "
    "function), build the rest inside fn, or use start_method='fork'."
)


def launch(
    fn: Callable[..., R],
    /,
    *args: Any,
    nprocs: int,
    start_method: str | None = None,
    grace_period: float = 30.0,
    **kwargs: Any,
) -> R:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` new processes of this machine, as ``torchrun`` would.

    Each process gets the variables ``torchrun --standalone
    --nproc_per_node=nprocs`` gives its workers (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``,
    ``TORCHELASTIC_*``..., and ``OMP_NUM_THREADS=1`` where it is unset), and
    this process hosts the group's store, as ``torchrun``'s agent does: ``fn``
    is the body of a ``torchrun`` script, whose first fnloop call joins the
    group. See docs/distributed.md, "Without torchrun".

    Args:
        fn: what each rank runs, given ``args`` and ``kwargs`` (not its rank:
            ``fl.distributed.rank()`` says it).
        *args: positional arguments of ``fn``.
        nprocs: how many processes (ranks) to start.
        start_method: ``"spawn"`` (fresh interpreters, which import ``fn`` and
            unpickle its arguments; a script starts its work under
            ``if __name__ == "__main__":``), ``"fork"`` (copies of this
            process) or ``"forkserver"``. ``None``: ``"fork"`` where a fresh
            interpreter cannot import ``fn`` (defined in a notebook, the REPL,
            ``python -c``; a lambda), ``"spawn"`` otherwise.
        grace_period: seconds the other ranks have to end once one failed
            (they are sent SIGTERM at once, as ``torchrun`` does, which a
            fnloop run obeys after its step) before they are killed.
        **kwargs: keyword arguments of ``fn``, any but ``launch``'s own
            (``functools.partial`` passes those).

    Returns:
        What ``fn`` returned on rank 0, pickled across (tensors come back on
        the CPU). To have every rank's, return
        ``fl.distributed.gather_object(value)`` from ``fn``.

    Raises:
        Exception: the exception of the rank that failed first, once every
            rank has ended: its own type, message and attributes (a failed
            run's ``exc.state``), a note naming the rank, and that rank's
            traceback as its ``__cause__`` (a ``RankTraceback``).
        RankFailed: (a ``RuntimeError``) that rank raised nothing (killed by
            a signal, an exit code of its own), or its exception does not pickle.
        RuntimeError: before anything starts, when a fork cannot work (CUDA
            initialized here, a process group joined here, no fork on this
            platform) or this process is itself a rank.
        ValueError: ``nprocs``, ``start_method`` or ``grace_period`` out of
            range, or ``"spawn"`` asked for a notebook's function.
        TypeError: ``fn`` is not callable.

    Examples:
        >>> import fnloop as fl
        >>> def train(lr):
        ...     ...  # fl.init, fl.train_step, fl.run, as in a torchrun script
        ...     return fl.distributed.world_size()
        >>> fl.distributed.launch(train, 0.1, nprocs=2)  # doctest: +SKIP
        2
        >>> fl.distributed.launch(train, 0.1, nprocs=0)
        Traceback (most recent call last):
        ...
        ValueError: 'nprocs' must be a positive int (got 0 that is a int).
    """
    method = _checked(fn, nprocs, start_method, grace_period)
    context: Any = torch.multiprocessing.get_context(method)  # the method's own context, with its Process
    folder = Path(tempfile.mkdtemp(prefix="fnloop-launch-"))
    listening = socket.create_server((ADDRESS, 0), backlog=max(128, nprocs))
    port = listening.getsockname()[1]
    one_thread = "OMP_NUM_THREADS" not in os.environ and nprocs > 1
    run_id = uuid.uuid4().hex
    processes: list[Any] = []
    store = None
    try:
        for rank in range(nprocs):
            env = _environment(rank, nprocs, port, run_id, one_thread)
            inherited = listening.fileno() if method == "fork" else None
            process = context.Process(
                target=_rank_main,
                args=(rank, fn, args, kwargs, env, str(folder), inherited),
                name=f"fnloop-rank-{rank}",
            )
            with _environ(env):  # read at a spawned interpreter's start (torch reads OMP_NUM_THREADS)
                try:
                    process.start()
                except Exception as exc:
                    if method != "fork":
                        exc.add_note(PICKLED.format(method=method))
                    raise
            processes.append(process)
        # The store starts once every fork is made, so that no thread of its own is copied into
        # them; the ranks' connections wait in the socket's backlog until then.
        store = _store(listening.detach(), port)
        failed = watched(processes, folder, grace_period)
        if failed is not None:
            error, cause = failure(folder, failed, nprocs, processes[failed].exitcode)
            raise error from cause
        return returned(folder)
    finally:
        ended(processes, grace_period, signal.SIGTERM)
        del store
        listening.close()
        shutil.rmtree(folder, ignore_errors=True)


def _store(fd: int, port: int) -> Any:
    """The group's store, served on the listening socket ``fd`` (which it then owns), as torchrun's agent serves it."""
    try:
        return torch.distributed.TCPStore(
            ADDRESS, port, None, True, STORE_TIMEOUT, wait_for_workers=False, master_listen_fd=fd
        )
    except BaseException:
        os.close(fd)
        raise


MOST_RANKS = 1_024
"""The most ranks ``launch`` starts on one machine."""


def _checked(fn: object, nprocs: object, start_method: object, grace_period: object) -> str:
    """The start method ``launch`` uses, once its arguments are found sound and the launch possible."""
    import torch.distributed as dist

    from fnloop.distributed import _launched

    if not callable(fn):
        raise TypeError(f"'fn' must be callable (got {fn!r:.80} that is a {type(fn).__name__}).")
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(
            f"'nprocs' must be a positive int (got {nprocs!r:.80} that is a {type(nprocs).__name__})."
        )
    if nprocs > MOST_RANKS:
        raise ValueError(
            f"'nprocs' is {nprocs:,}, more ranks than one machine runs: each is a process importing torch "
            f"(hundreds of MB) on this machine's {os.cpu_count()} cores. launch starts at most "
            f"{MOST_RANKS:,}; for more, start several machines' ranks with torchrun."
        )
    if (
        not isinstance(grace_period, (int, float))
        or isinstance(grace_period, bool)
        or not 0 <= grace_period < math.inf
    ):
        raise ValueError(
            f"'grace_period' must be a number of seconds, 0 or more and finite (got {grace_period!r:.80} "
            f"that is a {type(grace_period).__name__})."
        )
    if start_method is not None and start_method not in START_METHODS:
        raise ValueError(f"'start_method' must be None or one of {START_METHODS} (got {start_method!r:.80}).")
    if _launched():
        raise RuntimeError(
            f"fl.distributed.launch was called in a rank of a launch already (RANK={os.environ['RANK']}, "
            f"WORLD_SIZE={os.environ['WORLD_SIZE']}): every rank would start {nprocs} processes of its "
            "own. Under torchrun, call fn directly; to launch from this script, run it with plain "
            "python (or unset RANK and WORLD_SIZE)."
        )
    interactive = _in_interactive_main(fn)
    method = start_method or ("fork" if interactive or not _pickles(fn) else "spawn")
    if method != "fork" and interactive:
        raise ValueError(f"fn ({_name(fn)}) " + INTERACTIVE.format(method=method))
    if method not in multiprocessing.get_all_start_methods():
        raise RuntimeError(
            f"fl.distributed.launch needs start_method={method!r}, which this platform does not offer "
            f"(it offers {multiprocessing.get_all_start_methods()}). Move fn ({_name(fn)}) into a "
            "module (a .py file) and import it, so that launch can spawn fresh interpreters."
        )
    if method == "fork":
        if torch.cuda.is_initialized():
            raise RuntimeError(CUDA_FORKED)
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(
                "fl.distributed.launch cannot fork this process: it has joined a process group "
                "(torch.distributed.is_initialized()), which every fork would inherit and take for "
                "its own. Call torch.distributed.destroy_process_group() first, or move fn into a "
                "module (a .py file) and import it, so that launch starts fresh interpreters (spawn)."
            )
    return method


def _in_interactive_main(fn: object) -> bool:
    """Whether ``fn`` (or the function a ``functools.partial`` wraps) lives in a ``__main__`` without a file.

    A spawned interpreter imports such a ``__main__`` again from its file; a notebook has none, and
    ``python -`` and the REPL name one that is not a file (``<stdin>``).
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return getattr(fn, "__module__", None) == "__main__" and not (main and os.path.isfile(main))


def _pickles(fn: object) -> bool:
    try:
        pickle.dumps(fn)
    except Exception:  # noqa: BLE001 - any failure to pickle means: fork it instead
        return False
    return True


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)[:80]


def _environment(rank: int, nprocs: int, port: int, run_id: str, one_thread: bool) -> dict[str, str]:
    """The variables ``torchrun --standalone --nproc_per_node=nprocs`` sets for its worker ``rank``."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(nprocs),
        "WORLD_SIZE": str(nprocs),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nprocs),
        "MASTER_ADDR": ADDRESS,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    return env


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` set, as it was afterwards."""
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: dict[str, str],
    folder: str,
    inherited: int | None,
) -> None:
    """One rank: ``fn(*args, **kwargs)``, what it returned (rank 0) or raised written into ``folder``."""
    # The caller gone (a notebook's kernel restarted, a script killed) is a preemption to the ranks,
    # which a fnloop run obeys after its current step. The call is torch's own, for its spawn.
    torch.multiprocessing._prctl_pr_set_pdeathsig(signal.SIGTERM)  # type: ignore[attr-defined]
    if inherited is not None:  # a fork holds the caller's listening socket: only the caller serves it
        os.close(inherited)
    os.environ.update(env)  # a forkserver's children start with the server's environment
    if "OMP_NUM_THREADS" in env:  # a fork's torch runs with the caller's threads
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    (Path(folder) / f"started{rank}").touch()  # past the imports and unpickling: fn begins
    try:
        value = fn(*args, **kwargs)
        if rank == 0:
            written(Path(folder) / "returned", lambda f: saved(value, f, "the value fn returned on rank 0"))
        (Path(folder) / f"done{rank}").touch()
    except Exception as exc:  # noqa: BLE001 - every failure of fn is the caller's to see
        write_report(Path(folder), rank, exc)
        # At once, as it is written: the other ranks' collectives fail when this process is gone, and
        # a process group left to the interpreter's teardown could abort or wait on the others.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
