"""What a training run gives back (:class:`TrainResult`, :class:`StepInfo`), and what a resumed
run starts from: its newest intact checkpoint (:func:`find_resumable_checkpoint`) and its config
(:func:`load_run_config`)."""

from __future__ import annotations

import os
import shlex
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from torchvote.training.checkpoint import (
    LATEST,
    CheckpointError,
    CheckpointPaths,
    checkpoint_folder,
    checkpoint_step,
    find_checkpoint,
    load_training_state,
    read_weights,
    step_checkpoints,
)
from torchvote.training.config import (
    RESUMABLE_KEYS,
    ConfigError,
    TrainConfig,
    apply_overrides,
    config_diff,
    saved_config,
)
from torchvote.training.evaluation import result_row
from torchvote.training.metrics import format_table
from torchvote.validation import as_path

__all__ = [
    "StepInfo",
    "TrainResult",
    "check_resumable",
    "find_resumable_checkpoint",
    "last_set_up_config",
    "load_run_config",
]


@dataclass
class StepInfo:
    """What a callback sees after each optimiser step.

    Attributes:
        step: optimiser steps completed so far.
        epoch: the epoch the step belongs to (from 0).
        loss: the loss of this process's part of the batch.
        model: the model (not the DDP wrapper).
    """

    step: int
    epoch: int
    loss: float
    model: nn.Module


@dataclass
class TrainResult:
    """The outcome of :func:`~torchvote.training.train`.

    Attributes:
        run_dir: where checkpoints, metrics and plots went.
        checkpoint: the last checkpoint written (``None`` on ranks other than 0).
        metrics_path: the ``metrics.jsonl`` file (rank 0).
        results: evaluation metrics per data set (``"mnist/test"`` -> metrics).
        step, epoch: progress reached.
        interrupted: the run stopped on Ctrl-C / SIGTERM / KeyboardInterrupt.
        stop_signal: the signal that stopped it (``"SIGINT"``, ``"SIGTERM"``); ``""`` when it was
            not stopped by one.
        model: the trained model (not the DDP wrapper). After an interruption inside a step its
            weights may be that step's, half updated: ``checkpoint`` (of ``step``) holds the
            weights to trust, and a resume starts from it.
        config: the run's config.
        plots: plot files drawn after the run (:func:`~torchvote.training.plots.plot_run`, which
            the command line calls); empty until then.
        wall_s: seconds the run took over all its segments: this one's, plus each earlier
            segment's up to its last checkpoint (the work redone after a kill counts once).
        reached_target: ``{"step", "accuracy", "target"}`` of the evaluation that reached
            ``stop_at_accuracy``; ``None`` without a target, or when no evaluation reached it.
    """

    run_dir: Path
    checkpoint: CheckpointPaths | None
    metrics_path: Path | None
    results: dict[str, dict[str, float]]
    step: int
    epoch: int
    interrupted: bool
    model: nn.Module
    config: TrainConfig
    plots: list[Path] = field(default_factory=list)
    wall_s: float = 0.0
    reached_target: dict[str, Any] | None = None
    stop_signal: str = ""

    def table(self) -> str:
        """The plain-text result table."""
        return format_table([{"data": name, **result_row(metrics)} for name, metrics in self.results.items()])


def load_run_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """The config a run last ran with (from its newest intact checkpoint, or its ``config.yaml``:
    :func:`last_set_up_config`), plus ``overrides``
    of the keys a resumed run may change (:data:`~torchvote.training.config.RESUMABLE_KEYS`).

    Args:
        run_dir: the run folder.
        overrides: ``key=value`` texts.

    Returns:
        The config to pass to ``train(config, resume=run_dir)``.

    Raises:
        CheckpointError: no readable checkpoint in ``run_dir``.
        ConfigError: an override of a key that would change the weights.
    """
    run_dir = as_path(run_dir, "run_dir")
    _, state, _ = find_resumable_checkpoint(run_dir)
    saved = saved_config(state["config"])
    config = apply_overrides(last_set_up_config(run_dir, saved), overrides)
    check_resumable(saved, config)
    return config


def last_set_up_config(run_dir: Path, saved: TrainConfig) -> TrainConfig:
    """The config a run folder's last set-up ran with: its ``config.yaml``, where that reads as
    the same run as ``saved`` (the config its checkpoint recorded) but for keys a resume may
    change, else ``saved``. A resume that wrote no checkpoint left its overrides in
    ``config.yaml`` alone: one that only evaluated a finished run on a new ``eval_on`` entry, or
    one killed before its first checkpoint (a run writes ``config.yaml`` once its data and model
    are set up).

    Args:
        run_dir: the run folder.
        saved: the config of the checkpoint read there.

    Returns:
        The config.

    Warns:
        UserWarning: ``config.yaml`` differs from ``saved`` in a key a resume keeps (edited by
            hand, or copied from another run), or is no config this version reads (a name that
            does not exist, an older version's file): it is not read.
    """
    import yaml

    from torchvote.training.setup import is_run_config

    path = run_dir / "config.yaml"
    if not is_run_config(path):
        return saved
    try:
        written = saved_config(yaml.safe_load(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ConfigError, TypeError, ValueError) as err:
        # one of an older version, or edited by hand (a preset that does not exist): the
        # checkpoint's is used, and the resume writes it there: said, or the edit went unseen
        message = " ".join(str(err).split()) or type(err).__name__
        warnings.warn(
            f"{path} is not read: it is no config this version reads ({message}); the checkpoint's "
            "config is used and written there",
            UserWarning,
            stacklevel=3,
        )
        return saved
    try:
        check_resumable(saved, written)
    except ConfigError as err:  # edited by hand, or another run's: said, not silently dropped
        warnings.warn(
            f"{path} is not read: it differs from its checkpoint's config where a resume cannot change "
            f"it, and the checkpoint's is used ({err})",
            UserWarning,
            stacklevel=3,
        )
        return saved
    return written


def check_resumable(saved: TrainConfig, config: TrainConfig) -> None:
    """Check that ``config`` changes only :data:`~torchvote.training.config.RESUMABLE_KEYS` of a
    run's ``saved`` config.

    Raises:
        ConfigError: naming every other key that changed, with both values.
    """
    changed = {
        k: v
        for k, v in config_diff(saved, config).items()
        if k not in RESUMABLE_KEYS | {"run_dir", "out_dir"}
    }
    if changed:
        details = ", ".join(f"{k} (run: {a!r}, now: {b!r})" for k, (a, b) in changed.items())
        raise ConfigError(
            f"cannot resume with a different config: {details}; a resumed run may only change "
            f"{', '.join(sorted(RESUMABLE_KEYS))}"
        )


def find_resumable_checkpoint(
    location: str | os.PathLike[str],
) -> tuple[CheckpointPaths, dict[str, Any], list[str]]:
    """The newest checkpoint of a run whose two files both read back whole.

    For a run (or checkpoints) folder the candidates are the ``latest`` one, then the older
    ``step-*`` checkpoints, newest first; a truncated or corrupt weights or state file, or a
    missing one, makes it skip to the next. Nothing is deleted or changed. A file named directly
    is read as it is, without falling back.

    Args:
        location: a run folder, its checkpoints folder, or one checkpoint's file.

    Returns:
        ``(paths, state, skipped)``: the checkpoint, its training state, and one line per newer
        checkpoint skipped, saying what is wrong with it (empty when the newest was intact).

    Raises:
        TypeError: ``location`` neither a ``str`` nor an ``os.PathLike`` (``''`` is a ValueError).
        CheckpointError: no checkpoint there, or none intact; the message names every file and
            what is wrong with it.
    """
    location = as_path(location, "location")
    if not location.is_dir():
        paths = find_checkpoint(location)
        read_weights(paths.weights)
        return paths, load_training_state(paths.state), []
    directory = checkpoint_folder(location)
    pointer = directory / LATEST
    latest = pointer.read_text(errors="replace").strip() if pointer.is_file() else ""
    stems = step_checkpoints(directory)  # the highest step first
    pointed = checkpoint_step(latest) >= 0
    newest = checkpoint_step(latest) if pointed else checkpoint_step(stems[0]) if stems else -1
    older = [n for n in stems if checkpoint_step(n) < newest]
    names = ([latest] if pointed else [n for n in stems if checkpoint_step(n) == newest]) + older
    if not names:
        try:
            find_checkpoint(location)  # raises: no checkpoint there
        except CheckpointError as err:
            raise CheckpointError(f"{err}{_start_over_hint(location, stopped_early=True)}") from None
    skipped: list[str] = []
    for name in names:
        paths = CheckpointPaths.of(directory, name)
        try:
            read_weights(paths.weights)
            state = load_training_state(paths.state)
        except CheckpointError as err:
            skipped.append(" ".join(str(err).split()))
            continue
        return paths, state, skipped
    hint = _start_over_hint(location, stopped_early=False)
    raise CheckpointError(f"no intact checkpoint in {directory}: " + "; ".join(skipped) + hint)


def _start_over_hint(run_dir: Path, *, stopped_early: bool) -> str:
    """How to go on from a run folder with nothing to resume from: start it over from its saved
    ``config.yaml`` (a run stopped before its first checkpoint), after moving the unreadable
    checkpoints aside (every one damaged); ``""`` without a saved config."""
    config = run_dir / "config.yaml"
    if not config.is_file():
        return ""
    start = shlex.join(["torchvote", "train", str(config), f"run_dir={run_dir}"])
    if stopped_early:
        return f". The run stopped before its first checkpoint: start it again with: {start}"
    aside = run_dir.parent / f"{run_dir.name}-unreadable-checkpoints"  # out of the folder: a new run's
    aside = shlex.join(["mv", str(run_dir / "checkpoints"), str(aside)])
    return f". To start the run over, move its checkpoints aside and start it again: {aside}; {start}"
