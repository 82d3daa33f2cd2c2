"""Resuming a run: the newest checkpoint of a directory, under the template's run settings."""

from __future__ import annotations

import warnings

import attrs

from fnloop._core.config import changes
from fnloop._core.population import Population
from fnloop._core.state import TrainState
from fnloop.checkpoint._codec import CheckpointMismatch
from fnloop.checkpoint._files import StrPath, checked_path, latest

__all__ = ["RunChanged", "resume"]


class RunChanged(UserWarning):
    """``resume`` continues a run whose template changed a setting; the message names both values.

    The template's ``max_iter`` and configuration win; a population's
    hyperparameters stay the checkpoint's (they are part of its state).
    """


def resume(directory: StrPath, *, like: TrainState) -> TrainState:
    """The run in ``directory`` to continue (the newest valid checkpoint, as ``latest``), or ``like`` if none.

    ``like`` is the run's first state, built by the training code: it is the
    template the checkpoint is checked against, and it says the run's
    settings. The template's ``max_iter`` wins: a run saved with
    ``max_iter=200`` and resumed with a template of 500 continues to 500 (and
    one of 100 would stop there), with a ``RunChanged`` warning naming both.
    A schedule spanning ``max_iter`` (``cosine(lr, max_iter)``) is built from
    the code, so it follows the template and now spans the new length. A
    template with another seed (``rng``) would make it another run: that is an
    error. So is, for a population, a template whose members are seeded
    otherwise; one whose members were built with other hyperparameters (their
    labels differ) resumes with the checkpoint's, which its state holds, and a
    ``RunChanged`` warning naming both. A template whose configuration
    (``state.config``) differs from the saved one's continues with the
    template's, with a ``RunChanged`` warning naming each setting that changed,
    its saved and its new value (a checkpoint saved without one takes the
    template's silently).

    Args:
        directory: the run's checkpoint directory (missing or empty: a fresh start).
        like: the run's first state, built by the same code as the saved one.

    Returns:
        The saved state with the template's ``max_iter``, or ``like`` itself.

    Raises:
        CheckpointMismatch: the checkpoint was written with another seed (for
            a population, any member's), is past the template's ``max_iter``,
            or does not fit ``like``.
        CheckpointError: as ``latest``.

    Examples:
        >>> import tempfile
        >>> from fnloop.checkpoint import path_for, save
        >>> template = TrainState(max_iter=500, rng=7)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     fresh = resume(d, like=template)
        ...     _ = save(attrs.evolve(template, max_iter=200, iteration=200), path_for(d, 200))
        ...     with warnings.catch_warnings(record=True) as caught:
        ...         warnings.simplefilter("always")
        ...         resumed = resume(d, like=template)
        >>> fresh is template, resumed.iteration, resumed.max_iter, caught[0].category.__name__
        (True, 200, 500, 'RunChanged')
    """
    if type(like) is not TrainState:
        raise TypeError(f"resume() expected like= a fnloop.TrainState, got {like!r:.80}.")
    checked_path(directory, "directory", "resume()")
    saved = latest(directory, like=like)
    if saved is None:
        return like
    where = f"{directory} holds a run at iteration {saved.iteration}"
    if saved.population is not None and like.population is not None:
        _check_members(saved.population, like.population, where)
    if saved.rng != like.rng:
        raise CheckpointMismatch(
            f"{where} seeded {saved.rng}, but the template is seeded {like.rng}: under another seed it "
            f"would be another run. Build the template with seed={saved.rng} to resume it, or give the "
            "new run another directory."
        )
    if saved.population is not None and like.population is not None:
        _warn_hyperparameters(saved.population, like.population, where)
    changed = _changed_config(saved, like)
    saved = attrs.evolve(saved, config=like.config) if saved.config != like.config else saved
    if saved.max_iter == like.max_iter:
        if changed:
            warnings.warn(f"{where} {changed}", RunChanged, stacklevel=2)
        return saved
    if saved.iteration > like.max_iter:
        raise CheckpointMismatch(
            f"{where}, past the template's max_iter={like.max_iter}: a run cannot end before the steps "
            f"it took. Build the template with max_iter >= {saved.iteration} to resume it, or give the "
            "new run another directory."
        )
    warnings.warn(  # one warning, the configuration's changes after max_iter's
        f"{where} with max_iter={saved.max_iter}; it continues to the template's max_iter={like.max_iter}. "
        f"A schedule spanning max_iter is built from the code, so it spans the template's {like.max_iter} "
        f"steps. To keep the run as it was, build the template with max_iter={saved.max_iter}."
        + (f" It also {changed}" if changed else ""),
        RunChanged,
        stacklevel=2,
    )
    return attrs.evolve(saved, max_iter=like.max_iter)


def _changed_config(saved: TrainState, like: TrainState) -> str:
    """What ``resume`` says of a template whose configuration differs from the saved one's ("" if none).

    A checkpoint saved without a configuration takes the template's silently.
    """
    changed = changes(saved.config, like.config) if saved.config is not None else []
    if not changed:
        return ""
    listed = "; ".join(changed[:10]) + (f"; and {len(changed) - 10} more" if len(changed) > 10 else "")
    return (
        "started with another configuration; it continues with the template's. Changed "
        f"(saved -> now): {listed}. What the code builds from them (the schedule, the step) follows the "
        "new settings; the tensors, optimizer state and data cursor are the checkpoint's. To keep the "
        "run as it was, start it with the saved settings; to train with the new ones from scratch, "
        "give the run another directory."
    )


def _check_members(saved: Population, like: Population, where: str) -> None:
    """Refuse a population template whose members are seeded otherwise than the saved ones."""
    if saved.seeds == like.seeds:
        return
    differ = [m for m, (a, b) in enumerate(zip(saved.seeds, like.seeds)) if a != b]
    named = "; ".join(
        f"member {m}: {saved.seeds[m]} saved, {like.seeds[m]} in the template" for m in differ[:3]
    )
    raise CheckpointMismatch(
        f"{where}: a population whose members are seeded {list(saved.seeds)}, but the template's are "
        f"seeded {list(like.seeds)} ({named}): under another seed a member would be another run. Build "
        f"the template with seeds={list(saved.seeds)} to resume it, or give the new population another "
        "directory."
    )


def _warn_hyperparameters(saved: Population, like: Population, where: str) -> None:
    """Warn when the template's members were built with other hyperparameters (their labels) than the saved."""
    if saved.labels == like.labels:
        return
    differ = [m for m, (a, b) in enumerate(zip(saved.labels, like.labels)) if a != b]
    named = "; ".join(
        f"member {m}: {saved.labels[m]!r} saved, {like.labels[m]!r} in the template" for m in differ[:3]
    )
    warnings.warn(
        f"{where}: a population whose members were built with other hyperparameters than the template's "
        f"({named}). They are part of its state (the optimizer's injected tensors, which a hook may have "
        "changed since), so the run continues with the checkpoint's. To train with the template's, start "
        "the new population in another directory; to resume without this warning, build the template "
        "with the saved hyperparameters.",
        RunChanged,
        stacklevel=3,
    )
