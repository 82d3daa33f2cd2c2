"""Writers: where ``fnloop.hooks.log`` sends the metrics (console, JSON lines, CSV, TensorBoard, MLflow, W&B).

A writer is a small picklable record with three methods, all called at the
edge (inside effects the fold performs), never inside a hook:

* ``start(iteration)`` when a run begins at ``iteration``: drop whatever the
  writer holds for iterations ``>= iteration``, so that a resumed run's log
  reads as one run (the JSON lines file is cut back; TensorBoard gets
  ``purge_step``; W&B rewinds the run, ``resume_from``);
* ``write(line)`` with a ``Line``: the metrics recorded since the previous write;
* ``close()`` when the run ends.

Live objects (TensorBoard's ``SummaryWriter``) are kept in a registry of
this process, keyed by the writer's path; the records themselves hold only
configuration.
"""

# Beside the public names: the records the factories return, and what the log hook calls a writer by.
from fnloop.writers._console import Console, console, format_line  # noqa: F401
from fnloop.writers._files import Csv, Jsonl, csv, jsonl  # noqa: F401
from fnloop.writers._line import LOGGER, Line, Writer, claim, release, since  # noqa: F401
from fnloop.writers._mlflow import Mlflow, mlflow  # noqa: F401
from fnloop.writers._tensorboard import Tensorboard, tensorboard  # noqa: F401
from fnloop.writers._wandb import Wandb, wandb  # noqa: F401

__all__ = ["Line", "Writer", "console", "csv", "jsonl", "mlflow", "tensorboard", "wandb"]
