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
import io
import json
import math
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.multiprocessing

__all__ = ["RankFailed", "RankTraceback", "launch"]

R = TypeVar("R")

START_METHODS = ("spawn", "fork", "forkserver")
"""The ways ``multiprocessing`` starts a process that ``launch`` accepts."""

ADDRESS = "127.0.0.1"
"""``MASTER_ADDR`` of a launch: one machine, the loopback."""

STORE_TIMEOUT = datetime.timedelta(minutes=5)
"""How long the launch's store waits on a request (``fl.distributed.DEFAULT_TIMEOUT``'s length)."""

POLL = 0.2
"""Seconds between two looks at the ranks' reports while they run (a failure is seen within this)."""

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

LEFT_NO_REPORT = (
    "It failed as it started, or was ended from outside; what it printed says why. With "
    "start_method='spawn' a rank that cannot import fn or unpickle its arguments ends so: fn must "
    "be importable (a module's top level, not a local function), and a script must start its work "
    'under `if __name__ == "__main__":`.'
)

ENDED_INSIDE = (
    "A signal from outside ended it (a kill, the machine's out-of-memory killer, a scheduler "
    "reclaiming the machine), or a native crash inside torch or a library did; what it printed "
    "says which. A fnloop run that checkpoints resumes from its last checkpoint when launched again."
)

AT_EXIT = (
    "Something it left running failed at the process's exit: a process group the interpreter's "
    "teardown leaves can abort it (SIGABRT, 'terminate called without an active exception'). "
    "fnloop leaves the group it joined at exit; one fn joined itself must be left by fn "
    "(torch.distributed.destroy_process_group()) before it returns."
)

PICKLED = (
    "fl.distributed.launch: start_method={method!r} pickles fn and its arguments to send them to "
    "each new interpreter, and this one did not pickle: pass arguments that pickle (tensors, "
    "numbers, strings, containers of them; a module-level function, not a lambda or a local "
    "function), build the rest inside fn, or use start_method='fork'."
)


class RankFailed(RuntimeError):
    """A rank of a launch failed, and the exception it raised cannot be raised in the caller.

    Raised by ``launch`` when the rank that failed first was killed or exited
    without an exception of ``fn`` (a signal, ``os._exit``, ``sys.exit(1)``, a
    spawned process that could not import ``fn``), or when its exception
    could not be carried across processes (it did not pickle); the message
    names the rank and how it ended, and the rank's traceback, when there is
    one, is its ``__cause__``.
    """


class RankTraceback(Exception):
    """The traceback a failed rank printed, in its process: the ``__cause__`` of what ``launch`` raises.

    Python prints it above the exception itself, as ``concurrent.futures``
    prints a worker's traceback; ``str()`` of it is the traceback's text.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text}"""'


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
        failed = _watch(processes, folder, grace_period)
        if failed is not None:
            error, cause = _failure(folder, failed, nprocs, processes[failed].exitcode)
            raise error from cause
        return _returned(folder)
    finally:
        _end(processes, grace_period, signal.SIGTERM)
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
            _write(Path(folder) / "returned", lambda f: _saved(value, f, "the value fn returned on rank 0"))
        (Path(folder) / f"done{rank}").touch()
    except Exception as exc:  # noqa: BLE001 - every failure of fn is the caller's to see
        _report(Path(folder), rank, exc)
        # At once, as it is written: the other ranks' collectives fail when this process is gone, and
        # a process group left to the interpreter's teardown could abort or wait on the others.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _saved(value: object, file: io.BufferedWriter, what: str) -> None:
    try:
        torch.save(value, file)
    except Exception as exc:
        raise TypeError(
            f"{what} cannot be pickled, so it cannot come back to the caller of fl.distributed.launch "
            f"({type(exc).__name__}: {exc}). Return tensors, numbers, strings, and dicts, lists or "
            "tuples of them (fl.state_dict(state) for a state's tensors), or write it to a file."
        ) from exc


def _write(path: Path, write: Callable[[io.BufferedWriter], object]) -> None:
    """Write ``path`` whole or not at all: the caller reads a report only once it is complete."""
    part = path.with_name(path.name + ".part")
    with part.open("wb") as file:
        write(file)
    os.replace(part, path)


def _report(folder: Path, rank: int, exc: Exception) -> None:
    """What rank ``rank`` raised: when (to tell the first failure), its traceback, and itself if it pickles."""
    facts = {
        "time": time.time(),
        "traceback": "".join(traceback.format_exception(exc)),
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "carried": True,
    }
    try:
        _write(folder / f"raised{rank}", lambda f: torch.save(exc, f))
    except Exception:  # noqa: BLE001 - its attributes may not pickle: carry it without them
        bare = type(exc).__new__(type(exc))
        bare.args = exc.args
        for note in getattr(exc, "__notes__", []):
            bare.add_note(note)
        bare.add_note("fnloop.distributed.launch: its attributes do not pickle, and were dropped.")
        try:
            _write(folder / f"raised{rank}", lambda f: torch.save(bare, f))
        except Exception:  # noqa: BLE001 - not even its arguments pickle: the caller gets its text
            facts["carried"] = False
    _write(folder / f"failed{rank}", lambda f: f.write(json.dumps(facts).encode()))


def _watch(processes: list[Any], folder: Path, grace_period: float) -> int | None:
    """Wait for every rank to end; the rank that failed first, the others ended once one failed."""
    live = {process.sentinel: rank for rank, process in enumerate(processes)}
    reports = [folder / f"failed{rank}" for rank in range(len(processes))]
    died: dict[int, float] = {}
    try:
        while live and not died and not any(report.exists() for report in reports):
            # A rank found dead here died after this moment: the time it counts for, against the
            # reports of the ranks its death made fail (their collectives with it), written later.
            since = time.time()
            for sentinel in multiprocessing.connection.wait(list(live), timeout=POLL):
                rank = live.pop(sentinel)  # type: ignore[call-overload]
                processes[rank].join()
                if processes[rank].exitcode != 0:
                    died[rank] = since
    except KeyboardInterrupt:  # as a terminal's Ctrl-C would: the ranks stop after their step
        _end(processes, grace_period, signal.SIGINT)
        raise
    _end(processes, grace_period, signal.SIGTERM)
    when = dict(died)
    for rank, report in enumerate(reports):
        if report.exists():
            when[rank] = json.loads(report.read_text())["time"]
    return min(when, key=lambda rank: when[rank]) if when else None


def _end(processes: list[Any], grace_period: float, first: signal.Signals) -> None:
    """End the ranks still running: ``first`` now, SIGKILL after ``grace_period`` seconds; all joined."""
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, first)
    deadline = time.monotonic() + grace_period
    try:
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:  # a second Ctrl-C while waiting kills them at once
        for process in alive:
            if process.is_alive():
                process.kill()
            process.join()


def _failure(
    folder: Path, rank: int, world: int, exitcode: int | None
) -> tuple[BaseException, BaseException | None]:
    """The exception to raise for rank ``rank``'s failure, and its ``__cause__`` (the rank's traceback)."""
    where = f"rank {rank} of {world}"
    report = folder / f"failed{rank}"
    if (folder / f"done{rank}").exists():
        return RankFailed(
            f"{where} {_how(exitcode)} after fn returned, as its process ended. " + AT_EXIT
        ), None
    if not report.exists() and (folder / f"started{rank}").exists():
        return RankFailed(
            f"{where} {_how(exitcode)} while fn ran, without raising an exception. " + ENDED_INSIDE
        ), None
    if not report.exists():
        return RankFailed(
            f"{where} {_how(exitcode)} before fn began, without raising an exception. " + LEFT_NO_REPORT
        ), None
    facts = json.loads(report.read_text())
    cause = RankTraceback(facts["traceback"])
    error: BaseException | None = None
    if facts["carried"]:
        with contextlib.suppress(Exception):
            error = torch.load(folder / f"raised{rank}", map_location="cpu", weights_only=False)
    if not isinstance(error, BaseException):
        error = RankFailed(
            f"{where} raised {facts['type']}: {facts['message']} (the exception itself cannot be "
            "pickled or rebuilt here, so it is given as this RuntimeError; the rank's traceback is above)"
        )
        return error, cause
    error.add_note(
        f"fnloop.distributed.launch: raised on {where}, the first rank to fail (its traceback is above); "
        "the other ranks were then ended."
    )
    return error, cause


def _how(exitcode: int | None) -> str:
    """How a process ended, from its exit code: ``multiprocessing``'s negative codes are signals."""
    if exitcode is None:
        return "did not end"
    if exitcode < 0:
        return f"was killed by {_signal_name(-exitcode)}"
    if exitcode > 128:
        return f"exited with code {exitcode} (128 + {_signal_name(exitcode - 128)}: stopped by that signal)"
    return f"exited with code {exitcode}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _returned(folder: Path) -> Any:
    """What ``fn`` returned on rank 0; ``None`` when it ended without returning (``sys.exit(0)``)."""
    path = folder / "returned"
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
