"""The set-up of a training run, before its loop: the run folder, the seeds, the data, and the
state a resumed run restores (see :mod:`torchvote.training.loop` for the determinism rules)."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import random
import shlex
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from torchvote.files import LOCK_NAME, file_in_the_way, folder_failure
from torchvote.training.checkpoint import (
    CheckpointError,
    CheckpointPaths,
    capture_rng_state,
    load_model_weights,
    restore_rng_state,
)
from torchvote.training.config import ConfigError, TrainConfig, config_to_dict
from torchvote.training.data import TaskData
from torchvote.training.distributed import DistributedContext
from torchvote.training.evaluation import load_data
from torchvote.training.results import find_resumable_checkpoint
from torchvote.training.schema import DataConfig
from torchvote.training.tasks import TaskHandler

__all__ = [
    "compile_model",
    "load_eval_data",
    "load_run_data",
    "model_metadata",
    "new_run_dir",
    "restore_state",
    "seed_everything",
    "training_state",
]


def new_run_dir(config: TrainConfig, context: DistributedContext) -> Path:
    """The folder of a new run: ``run_dir``, or ``<out_dir>/<preset or model>-<time>``.

    A generated folder is claimed by creating it (``mkdir`` without ``exist_ok``, atomic), so runs
    started in the same second (seeds launched side by side) get ``-2``, ``-3``, ... suffixes
    instead of sharing one folder. When distributed, rank 0 claims it and the others use its path.

    Raises:
        ConfigError: ``run_dir`` is empty text, already holds a run (its ``latest`` pointer, or
            an intact checkpoint without it: it is resumed, never overwritten), or is a file or a
            folder with other files in it (a run writes ``config.yaml``, ``metrics.jsonl``,
            ``checkpoints/`` and plots there, and would replace the user's files of those names;
            a folder of those names only is a stopped run, started over, if its ``config.yaml``
            reads as a run's).
    """
    if config.run_dir is not None:
        path = _check_new_run_dir(config.run_dir)
    elif context.is_main:
        path = _claim_run_dir(Path(config.out_dir).expanduser(), config.preset or config.model.name)
    else:
        path = Path()  # replaced by rank 0's choice below
    if context.is_distributed:  # every process uses rank 0's choice
        chosen = [str(path)]
        dist.broadcast_object_list(chosen, src=0)
        path = Path(chosen[0])
    return path


#: What a run writes into its folder (a folder of only these, without a checkpoint, is a run
#: that stopped before its first one).
_RUN_FILES = frozenset({"config.yaml", "metrics.jsonl", "tensorboard", "checkpoints", "plots"})


def _check_new_run_dir(run_dir: str) -> Path:
    """``run_dir`` as a path, if a new run may write there: a folder that does not exist yet, is
    empty, or holds only what a run writes and no checkpoint (a run stopped inside its first
    checkpoint interval starts over)."""
    if not run_dir.strip():
        raise ConfigError("run_dir must name a folder (or be null for <out_dir>/<preset>-<time>), got ''")
    path = Path(run_dir).expanduser()  # '~/runs/x' quoted, or from a YAML file, as data.root is
    try:
        _check_no_file_on_the_way(path, "run_dir")
    except OSError as err:  # a part over 255 bytes: "[Errno 36] File name too long" named no key
        raise _folder_error(err, "run_dir", path) from err
    if (path / "checkpoints" / "latest").exists() or _holds_an_intact_checkpoint(path):
        raise ConfigError(
            f"run folder {path} already holds a run; continue it with "
            f"`torchvote train --resume {shlex.quote(str(path))}` or choose another run_dir"
        )
    if path.is_dir():
        present = sorted(entry.name for entry in path.iterdir() if entry.name != LOCK_NAME)  # not a run file
        if "config.yaml" in present and set(present) <= _RUN_FILES and is_run_config(path / "config.yaml"):
            return path  # a run stopped before its first checkpoint: it starts over (reproduce reruns it)
        if present:
            shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
            raise ConfigError(
                f"run_dir {path} is not empty ({shown}): a run writes config.yaml, metrics.jsonl, "
                f"checkpoints/ and plots there and would replace files of those names; choose a "
                f"new or empty folder"
            )
    return path


def is_run_config(path: Path) -> bool:
    """Whether ``path`` reads as a run's ``config.yaml``: a YAML mapping of the training-config
    keys, as a run writes it whole (a user's own ``config.yaml``, a preset of a few keys beside its
    notes, is not a stopped run to start over on: it was overwritten). Every key of today's
    config but those added since the first release of run folders (a run of an older version
    lacks them) must be there, and no other.

    Args:
        path: the ``config.yaml`` file.

    Returns:
        The answer; False for a file that does not read as YAML.
    """
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    keys = {field.name for field in dataclasses.fields(TrainConfig)}
    return isinstance(values, dict) and keys - _KEYS_ADDED_SINCE <= set(values) <= keys


#: TrainConfig keys added after run folders were first written (2026-11-28's two).
_KEYS_ADDED_SINCE = frozenset({"stop_at_accuracy", "checkpoint_minutes"})


def _holds_an_intact_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir/checkpoints`` holds a checkpoint a resume would read (its ``latest``
    pointer may be gone); torn ones alone do not make a run (a new one moves them aside)."""
    if not (run_dir / "checkpoints").is_dir():
        return False
    try:
        find_resumable_checkpoint(run_dir)
    except CheckpointError:
        return False
    return True


def _check_no_file_on_the_way(folder: Path, key: str) -> None:
    """Refuse a folder that is, or whose path runs through, a file (``[Errno 17] File exists`` or
    ``[Errno 20] Not a directory`` otherwise, without the key).

    Raises:
        ConfigError: naming ``key`` and the file.
    """
    blocking = file_in_the_way(folder)
    if blocking is not None:
        raise ConfigError(f"{key}: {blocking} is a file; a run needs a folder there")


def _claim_run_dir(out_dir: Path, prefix: str) -> Path:
    """Create and return ``out_dir/<prefix>-<time>``, or the first free ``-<k>`` suffix of it.

    Raises:
        ConfigError: ``out_dir`` is, or runs through, a file, or names a part too long.
        OSError: the folder cannot be made (a read-only file system, a current folder deleted
            under the process ...); the message names ``out_dir``, its absolute path and why.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        _check_no_file_on_the_way(out_dir, "out_dir")
        out_dir.mkdir(parents=True, exist_ok=True)
        suffix = 1
        while True:
            path = out_dir / (f"{prefix}-{stamp}" if suffix == 1 else f"{prefix}-{stamp}-{suffix}")
            try:
                path.mkdir()
                return path
            except FileExistsError:
                suffix += 1
    except OSError as err:  # was "[Errno 30] Read-only file system: 'runs'": no key, no whole path
        raise _folder_error(err, "out_dir", out_dir) from err


def _folder_error(err: OSError, key: str, folder: Path) -> Exception:
    """``err``, met making or reading ``folder`` (config key ``key``), as the user reads it: the
    key, the folder as given and absolute (a relative one is the current folder's, which the
    user may not know), and the reason. The same ``OSError`` subclass and ``errno``; a name too
    long is the config's mistake (a :class:`ConfigError`)."""
    if err.errno == errno.ENAMETOOLONG:
        return ConfigError(f"{key}: {folder_failure(folder, err)}")  # "File name too long": a part is
    error = type(err)(f"{key}: cannot make the folder {folder_failure(folder, err)}")
    error.errno = err.errno  # not strerror: with both set, str() would lose the message
    return error


def seed_everything(config: TrainConfig, device: torch.device) -> None:
    """Seed python, numpy and torch from ``config.seed``; deterministic algorithms if asked."""
    random.seed(config.seed)
    np.random.seed(config.seed % 2**32)  # noqa: NPY002 (code that uses the global state)
    torch.manual_seed(config.seed)
    if config.deterministic:
        if device.type == "cuda":  # cuBLAS needs a fixed workspace to be deterministic
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def compile_model(model: nn.Module, enabled: bool) -> nn.Module:
    """``torch.compile(model)`` for ``compile=true``, else ``model``.

    The compiled module shares its parameters with ``model``; the loop saves and evaluates
    ``model`` itself, so checkpoints keep the eager names (no ``_orig_mod.`` prefix).

    Args:
        model: the module the training step calls (the DDP wrapper when distributed).
        enabled: the config's ``compile``.

    Returns:
        The module to call in the training step.
    """
    return torch.compile(model) if enabled else model


def load_run_data(config: TrainConfig, handler: TaskHandler) -> tuple[TaskData, TaskData, dict[str, Any]]:
    """The training and evaluation data of a run, and the model fields the data dictates.

    Returns:
        ``(train, eval, fields)``; ``fields["image_size"]`` is ``data.canvas`` when set.

    Raises:
        ConfigError: a canvas smaller than the images, or a ``data.shift`` of at least the
            image side (its largest shifts move an image entirely out of its frame).
        ValueError: an unknown data set.
    """
    data = config.data
    train = load_data(handler, data.name, "train", options=data.options, root=data.root, limit=data.limit)
    evaluation = load_eval_data(handler, data, limit=data.eval_limit)
    fields = dict(train.fields)
    side = fields.get("image_size")  # the images' own side, before any canvas
    if side is not None and data.shift >= side:
        # the largest shifts would train on blank images: on a canvas too, where the image is
        # first placed anywhere on it and then shifted, as far as its own side moves it out
        raise ConfigError(
            f"data.shift={data.shift} can move the {side}-pixel training images out of their frame: "
            f"expected at most {side - 1} (CapsNet shifts by up to 2)"
        )
    if data.canvas is not None:
        if data.canvas < fields.get("image_size", 0):
            raise ConfigError(
                f"data.canvas={data.canvas} is smaller than the {fields['image_size']}-pixel images"
            )
        fields["image_size"] = data.canvas
    return train, evaluation, fields


def load_eval_data(handler: TaskHandler, data: DataConfig, *, limit: int | None) -> TaskData:
    """The evaluation split of a run's data: ``data.eval_name`` (or ``data.name``) from
    ``data.root``, with ``data.options`` only when it is the training set itself (another set's
    options are its own: ``canvas`` of affnist-style is no option of mnist).

    Args:
        handler: the task's handler.
        data: the run's data section.
        limit: keep the first ``limit`` examples (``None``: all).

    Returns:
        The evaluation data, not yet finalised for a model.
    """
    eval_name = data.eval_name or data.name
    options = data.options if eval_name == data.name else {}
    return load_data(handler, eval_name, data.eval_split, options=options, root=data.root, limit=limit)


def model_metadata(
    spec: Any, model_config: Any, config: TrainConfig, total_steps: int, vocab: Any = None,
    code: str | None = None,
) -> dict[str, str]:
    """The strings stored with a checkpoint's weights: the registered model, its config as JSON
    (so ``torchvote evaluate`` rebuilds it from the file alone), the task, the data set, and the
    run's ``loss`` config (JSON) and length ``total_steps`` (so the file alone also rebuilds the
    run's objective, whose spread-loss margin depends on the step); with a ``vocab`` (the
    training data's :class:`~torchvote.data.CharVocab`), its characters as JSON, so that
    ``torchvote generate`` reads and writes text from the file alone; with ``code``
    (:func:`~torchvote.provenance.describe_code`), the code that trained the weights."""
    metadata = {
        "model": spec.name,
        "model_config": json.dumps(_plain(dataclasses.asdict(model_config))),
        "task": spec.task,
        "data": config.data.name,
        "loss": json.dumps(_plain(dataclasses.asdict(config.loss))),
        "total_steps": str(total_steps),
    }
    if vocab is not None:
        metadata["vocab"] = json.dumps(vocab.to_dict())
    if code is not None:
        metadata["code"] = code
    return metadata


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def training_state(
    run: Any, epoch: int, position: int, metrics_window: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """The training state a checkpoint stores for ``run`` (the loop's run object) at its step.

    Args:
        run: has ``step``, ``config``, ``context``, ``train_data``, ``optimizer``, ``scheduler``,
            ``scaler`` (a ``torch.amp.GradScaler``, disabled unless ``fp16``), ``total_steps``,
            ``reached_target`` and ``wall_s()``.
        epoch, position: where a run resumed from this step starts.
        metrics_window: the metric sums of the steps since the last metrics record, over every
            process (:meth:`~torchvote.training.progress.Progress.window_totals`), so that the
            resumed run's next record covers the same steps as the unbroken run's.

    Returns:
        ``weights_only``-safe containers and tensors.
    """
    return {
        "step": run.step,
        "epoch": epoch,
        "data_order": {
            "seed": run.config.seed,
            "epoch": epoch,
            "position": position,
            "num_examples": len(run.train_data),
            "global_batch": run.config.batch_size,
        },
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),  # fp16's loss scale and its growth count; {} without fp16
        "rng": capture_rng_state(),
        "config": config_to_dict(run.config),
        "world_size": run.context.world_size,
        "total_steps": run.total_steps,
        "wall_s": run.wall_s(),
        "metrics_window": metrics_window,
        "reached_target": run.reached_target,  # None, or where stop_at_accuracy was reached
    }


def restore_state(run: Any, paths: CheckpointPaths, state: dict[str, Any]) -> int:
    """Load a checkpoint into ``run`` (model, optimiser, scheduler, fp16's gradient scaler, RNG
    states); return its step. A checkpoint written before the scaler was saved (no fp16 run
    wrote one) leaves the run's scaler fresh.
    The caller has checked the config (:func:`~torchvote.training.results.check_resumable`).

    Raises:
        ConfigError: a onecycle schedule would be stretched, or ``epochs`` / ``max_steps`` end the
            run before the checkpoint's step.
        CheckpointError: the checkpoint was written for other data or does not fit the model.
    """
    if int(state["step"]) > run.total_steps:  # neither applicable (the steps are taken) nor finished
        raise ConfigError(
            f"{paths.weights.name} is at step {state['step']}, past the {run.total_steps} steps that "
            f"epochs={run.config.epochs} and max_steps={run.config.max_steps} give this run: resume with "
            f"at least {state['step']} steps (or evaluate that checkpoint: torchvote evaluate)"
        )
    order = state["data_order"]
    if order["num_examples"] != len(run.train_data) or order["global_batch"] != run.config.batch_size:
        raise CheckpointError(
            f"{paths.state} was written for {order['num_examples']} training examples in batches of "
            f"{order['global_batch']}; this run has {len(run.train_data)} in batches of "
            f"{run.config.batch_size}"
        )
    if run.config.optim.schedule == "onecycle" and state.get("total_steps") != run.total_steps:
        raise ConfigError(
            f"the onecycle schedule of this run was set for {state.get('total_steps')} steps; "
            f"it cannot be stretched to {run.total_steps} (keep epochs and max_steps as they were)"
        )
    load_model_weights(run.model, paths.weights)
    try:
        run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        if isinstance(run.scheduler, LambdaLR):  # the next step's rate from this run's schedule:
            # the optimiser's saved rate is the old schedule's where epochs / max_steps redraw it
            scheduler = run.scheduler
            schedule = zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
            for group, (base, rate) in zip(run.optimizer.param_groups, schedule, strict=True):
                group["lr"] = base * rate(scheduler.last_epoch)
        if state.get("scaler") and run.scaler.is_enabled():  # fp16 is not resumable: both or neither
            run.scaler.load_state_dict(state["scaler"])
    except (ValueError, KeyError, RuntimeError) as err:
        raise CheckpointError(
            f"{paths.state}: optimiser, scheduler or gradient scaler state does not fit: {err}"
        ) from None
    restore_rng_state(state["rng"])
    run.earlier_s = float(state.get("wall_s", 0.0))  # checkpoints before it was recorded: 0
    return int(state["step"])
