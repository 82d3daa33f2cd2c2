"""Effects off the training path: a run's writer thread, which its fold carries and asks.

An effect may hand its work to a writer thread and return at once; a
checkpoint saved in the background does, by returning a ``Job`` from its
``perform``. The fold's ``Driver`` carries the run's ``Writer``, and the fold
gives it the job. The work reads a state, and states are values, so it needs
no copy of it, with one exception: a donating step writes into the tensors
of a state the fold owns. So the job says which state it reads, and the fold
asks its writer, at its phase boundaries:

* ``check()``, as each unit begins: a job that failed is raised here, in
  the training thread, as a ``BackgroundFailed`` chained to its error; the
  warnings a finished job gave are issued here too;
* ``reading(state)``, before the step: whether the job in flight reads a
  tensor of ``state`` the step would write into. Then the fold passes
  ``owned=False`` and the step copies, which costs one extra state at most;
* ``wait()``, before ``AFTER_TRAIN``: a run ends with its job done.

At most one job of a run is in flight: ``submit`` waits for the one before.
The thread is not a daemon, so a process that exits with a job in flight
ends it first.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable, Sequence

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._core.state import TrainState
from fnloop._core.tree import leaves

__all__ = ["BackgroundFailed", "Job", "Writer"]


class BackgroundFailed(RuntimeError):
    """An effect performed off the training path failed (a background checkpoint save, say).

    Raised in the training thread at the next phase boundary after the
    failure (the next unit of iterations, the next job handed over, or
    before ``AFTER_TRAIN``), chained
    to the writer's own exception (``__cause__``). The message names what the
    job was doing (the iteration and the file, for a save). Like every error
    of a run, it carries the last consistent state as ``exc.state``, and
    ``AFTER_TRAIN`` runs first, so a checkpoint hook saves that state.
    """


@attrs.frozen
class Job:
    """Work for the run's writer thread, as an effect's ``perform`` returns it.

    Args:
        work: the effect; it returns the warnings to issue in the training
            thread (a thread's own warnings would escape the caller's filters).
        reads: the state whose tensors ``work`` reads: no donating step writes
            into them while it runs.
        what: what the work does, for the message of a failure ("the
            checkpoint of iteration 12 into run/ckpt/ckpt-00000012.safetensors").
        fix: what to do about a failure, for its message.
    """

    work: Callable[[], Sequence[Warning]]
    reads: TrainState
    what: str
    fix: str


class _Running:
    """A job in its thread, and what it reads."""

    def __init__(self, job: Job) -> None:
        self.what, self.fix = job.what, job.fix
        self.work: Callable[[], Sequence[Warning]] | None = job.work
        self.reads: TrainState | None = job.reads
        self.storages = frozenset(_storages(t for _, t in leaves(job.reads) if isinstance(t, torch.Tensor)))
        self.error: BaseException | None = None
        self.warnings: Sequence[Warning] = ()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fnloop-background")

    def _run(self) -> None:
        try:
            self.warnings = self.work()  # type: ignore[misc]
        except BaseException as exc:  # noqa: BLE001 - raised in the training thread by `_settle`
            self.error = exc
        finally:
            # The state goes as soon as the work is over, not at the next phase boundary.
            self.work = self.reads = None
            self.done.set()


class Writer:
    """A run's writer thread: the job in flight, at most one. The fold's ``Driver`` carries it."""

    def __init__(self) -> None:
        self.job: _Running | None = None
        """The job in flight, or the last one, not yet settled (``None``: none)."""
        self._guard = threading.Lock()

    def submit(self, job: Job) -> None:
        """Run ``job`` once the job in flight has finished; return when it has started.

        Raises:
            BackgroundFailed: the job before failed.
        """
        self.wait()
        running = _Running(job)
        with self._guard:
            self.job = running
        running.thread.start()

    def check(self) -> None:
        """Settle the job in flight if it has finished: issue its warnings, raise its failure.

        Raises:
            BackgroundFailed: it failed.
        """
        job = self.job
        if job is not None and job.done.is_set():
            self._settle(job)

    def wait(self) -> None:
        """Wait for the job in flight, if any, and settle it as ``check`` does.

        Raises:
            BackgroundFailed: it failed.
        """
        job = self.job
        if job is not None:
            job.thread.join()
            self._settle(job)

    def reading(self, state: TrainState) -> bool:
        """Whether the job in flight reads a tensor of ``state``'s params, buffers or optimizer state.

        Those are what a donating step writes into. Compared by storage, so a
        view of one counts.
        """
        job = self.job
        if job is None or job.done.is_set():
            return False
        read = job.reads
        if read is not None and (
            read.params is state.params
            and read.buffers is state.buffers
            and read.opt_state is state.opt_state
        ):
            return True  # the usual case: the state saved, as the next unit begins with it
        written = [*state.params.values(), *state.buffers.values(), *pytree.tree_leaves(state.opt_state)]
        return not job.storages.isdisjoint(_storages(t for t in written if isinstance(t, torch.Tensor)))

    def _settle(self, job: _Running) -> None:
        with self._guard:
            if self.job is job:
                self.job = None
        job.thread.join()
        for warning in job.warnings:
            warnings.warn(warning, stacklevel=2)
        error = job.error
        if error is not None:
            job.error = None  # the exception's traceback holds the thread's frames
            raise BackgroundFailed(
                f"{job.what} failed in a background thread: {type(error).__name__}: {error} (raised here, "
                f"in the training thread, at the first phase boundary after it). {job.fix}"
            ) from error


def _storages(tensors: Iterable[torch.Tensor]) -> Iterable[object]:
    """Each tensor's storage, by device and address; the tensor itself where it has no storage of its own.

    An empty storage (address 0) holds nothing to overwrite. A tensor subclass
    that wraps others (a distributed tensor) may refuse ``untyped_storage``:
    it is then known by its identity, which a donating step keeps.
    """
    for tensor in tensors:
        try:
            address = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            yield id(tensor)
            continue
        if address:
            yield (tensor.device.type, address)
