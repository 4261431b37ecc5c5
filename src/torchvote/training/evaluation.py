"""Evaluation: a metrics dict for a model on a data split, and models rebuilt from checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchvote.models.registry import ModelSpec, get_model_spec
from torchvote.nn.modes import evaluating
from torchvote.training.checkpoint import (
    CheckpointError,
    CheckpointPaths,
    check_weights_fit,
    find_checkpoint,
    load_model_weights,
    load_training_state,
    read_model_metadata,
)
from torchvote.training.config import saved_config
from torchvote.training.data import TaskData, build_task_data, load_raw_dataset, pin_memory_for
from torchvote.training.distributed import DistributedContext, all_reduce_sum, resolve_device
from torchvote.training.keyvalue import parse_entry, typed_fields
from torchvote.training.schema import LossConfig, TrainConfig
from torchvote.training.tasks import Objective, TaskHandler, get_task_handler, make_objective
from torchvote.validation import check_device_exists, check_flag, check_positive_int, check_texts

__all__ = ["evaluate", "evaluate_checkpoint", "load_data", "load_eval_entry", "load_model_from_checkpoint"]


def autocast_dtype(bf16: bool = False, fp16: bool = False) -> torch.dtype | None:
    """The autocast dtype the mixed-precision flags of a run (``bf16``, ``fp16``) ask for.

    Args:
        bf16: autocast to bfloat16.
        fp16: autocast to float16 (a training step then also scales its loss, see
            :class:`torch.amp.GradScaler`).

    Returns:
        ``torch.bfloat16``, ``torch.float16``, or ``None`` (autocast off).

    Raises:
        TypeError: a flag that is not ``True`` or ``False``.
        ValueError: both flags set.
    """
    check_flag(bf16, "bf16")
    check_flag(fp16, "fp16")
    if bf16 and fp16:
        raise ValueError("bf16 and fp16 are both true: choose one autocast dtype (bf16 or fp16)")
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else None


def autocast(device: torch.device, bf16: bool = False, fp16: bool = False) -> Any:
    """``torch.autocast`` on the device's type to bfloat16 (``bf16``) or float16 (``fp16``), or a
    no-op (neither); see :func:`autocast_dtype` for what it raises."""
    dtype = autocast_dtype(bf16, fp16)
    return nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: TaskData,
    handler: TaskHandler,
    *,
    objective: Objective | None = None,
    batch_size: int = 500,
    device: torch.device | None = None,
    context: DistributedContext | None = None,
    bf16: bool = False,
    fp16: bool = False,
    step: int = 0,
) -> dict[str, float]:
    """Evaluate ``model`` on all of ``data``.

    Under data parallelism every process takes every ``world_size``-th example and the sums are
    added up, so the result is the same on 1 or N processes.

    Args:
        model: the model (not a DDP wrapper); it is put in eval mode and back.
        data: a finalised :class:`TaskData` (its images fit the model).
        handler: the task's handler.
        objective: also report the mean ``loss`` under this objective.
        batch_size: examples per forward pass (per process).
        device: where to compute (default: the model's device); a name as
            :func:`~torchvote.validation.resolve_device` takes it (``"auto"``) or a
            ``torch.device``.
        context: the data-parallel context (default: single process).
        bf16: evaluate under bfloat16 autocast.
        fp16: evaluate under float16 autocast (not with ``bf16``).
        step: passed to the objective (the spread-loss margin depends on it).

    Returns:
        ``{"accuracy": ..., "loss": ..., "count": ..., "examples": ...}`` (``count``: the images or
        tokens the accuracy counts; plus task extras such as
        ``sequence_accuracy``).

    Raises:
        ValueError: ``bf16`` and ``fp16`` both set, a ``batch_size`` below 1 (-1 evaluated nothing
            and reported accuracy 0), a negative ``step``, empty ``data`` (nothing to measure) or
            data without the tensors ``handler``'s task reads, an unknown device (before anything
            is evaluated).
        TypeError: ``bf16`` or ``fp16`` not ``True`` or ``False``, a ``batch_size`` or ``step``
            that is no integer.
    """
    autocast_dtype(bf16, fp16)  # checked before the model is touched
    check_positive_int(batch_size, "batch_size")
    check_positive_int(step, "step", minimum=0)  # the spread loss's margin compared it with a number
    if len(data) == 0:
        raise ValueError(f"data holds no examples to evaluate on ({data.name}/{data.split})")
    missing = [key for key in handler.batch_keys if key not in data.tensors]
    if missing:  # another task's handler: a KeyError inside its forward
        raise ValueError(
            f"data {data.name}/{data.split} holds {sorted(data.tensors)}, not the {missing} a "
            f"{handler.task} batch needs: a handler of another task, or data not finalised for the model"
        )
    context = context or DistributedContext()
    device = next(model.parameters()).device if device is None else _as_device(device)
    indices = torch.arange(context.rank, len(data), context.world_size)
    totals: dict[str, torch.Tensor] = {}
    # On CUDA each batch goes through pinned memory: a copy from pageable memory makes the host
    # wait for the device (every kernel of the previous batch) before it can queue the next one
    pinned = pin_memory_for(device)
    with evaluating(model):
        for start in range(0, len(indices), batch_size):
            selected = data.select(indices[start : start + batch_size])
            host_arguments = handler.host_arguments(model, selected)  # e.g. source_lengths, on the CPU
            batch = {
                key: (value.pin_memory() if pinned and value.device.type == "cpu" else value).to(
                    device, non_blocking=pinned
                )
                for key, value in selected.items()
            }
            with autocast(device, bf16, fp16):
                output = handler.forward(model, batch, **host_arguments)
                sums = handler.metric_sums(output, batch)
                if objective is not None:
                    loss, _ = objective(output, batch, step)
                    count = (
                        sums["count"]
                        if "count" in sums
                        else torch.tensor(float(len(next(iter(batch.values())))))
                    )
                    sums = {**sums, "loss_sum": loss.float() * count, "loss_count": count}
            for key, value in sums.items():
                totals[key] = totals.get(key, torch.zeros((), device=device)) + value.float()
    keys = sorted(totals)
    stacked = all_reduce_sum(
        torch.stack([totals[k] for k in keys]) if keys else torch.zeros(0, device=device), context
    )
    return handler.summarize({k: float(v) for k, v in zip(keys, stacked.tolist(), strict=True)})


def evaluate_loss_where_it_applies(
    model: nn.Module,
    data: TaskData,
    handler: TaskHandler,
    objective: Objective | None,
    *,
    echo: Callable[[str], None] | None = None,
    **options: Any,
) -> dict[str, float]:
    """:func:`evaluate` with ``objective``'s ``loss``, or without it on a data set whose labels
    that loss does not take (a cross-entropy run evaluated on MultiMNIST's label pairs): the
    accuracy is reported all the same, and ``echo`` says why the loss is not.

    Args:
        model, data, handler: as :func:`evaluate`.
        objective: the run's objective; ``None``: no loss.
        echo: called with one line when the loss does not apply; ``None``: nothing is said.
        **options: :func:`evaluate`'s other keyword arguments.

    Returns:
        :func:`evaluate`'s metrics.

    Raises:
        ValueError: as :func:`evaluate` without an objective (an error of the model or the data
            raises again).
    """
    try:
        return evaluate(model, data, handler, objective=objective, **options)
    except ValueError as err:
        if objective is None:
            raise
        metrics = evaluate(model, data, handler, **options)
        if echo is not None:
            label = f"{data.name}/{data.split}"
            echo(f"loss: not reported on {label}: the run's loss does not apply to it ({err})")
        return metrics


def parse_eval_entry(entry: str) -> tuple[str, dict[str, Any]]:
    """Split an ``eval_on`` entry ``"name"`` or ``"name:key=value,key=value"`` into the data set's
    name and its options (values read as every command-line value is, by
    :func:`~torchvote.training.keyvalue.parse_value`).

    Raises:
        ValueError: if an option is not ``key=value``, or a key is given twice.
    """
    return parse_entry(entry, "eval_on")


def load_data(
    handler: TaskHandler,
    name: str,
    split: str | None,
    *,
    options: dict[str, Any] | None = None,
    root: str | None = None,
    limit: int | None = None,
) -> TaskData:
    """Load a data set split through ``torchvote.data`` as a :class:`TaskData` of ``handler``'s task
    (``limit`` keeps the first examples).

    Args:
        handler: the task handler that turns the raw data into tensors.
        name: a data set name (:func:`torchvote.data.list_datasets`).
        split: the split; ``None``: ``test``, or ``val`` for a data set without one.
        options: keyword arguments of the data set.
        root: the folder to read files from (passed on only when given).
        limit: keep the first ``limit`` examples (of each draw, for drawn data); ``None``: all.

    Returns:
        The split, not yet fitted to a model (see :meth:`TaskHandler.finalize`).

    Raises:
        ValueError: an unknown data set or split, an option the data set does not take or a bad
            option value, data of another task, or a ``limit`` that is not a positive integer
            (a negative one would drop examples from the end, 0 would leave none).
        TypeError: ``options`` that is no mapping.
        DataNotFoundError: the data set's files are not there.
    """
    if limit is not None:  # checked before anything is loaded
        check_positive_int(limit, "limit")
    if options is not None and not isinstance(options, Mapping):  # "size=8": a dict update error
        raise TypeError(f"options must be a mapping of keyword arguments, got {options!r}")
    split, raw = load_raw_dataset(name, split, options=options or {}, root=root)
    data = build_task_data(handler, name, split, raw)
    if limit is not None:  # and the same of each draw of drawn data
        data = data.map(
            lambda each: dataclasses.replace(each, tensors={k: v[:limit] for k, v in each.tensors.items()})
        )
    return data


def _check_root_is_read(root: object, datasets: Sequence[str]) -> None:
    """Refuse a ``root`` that none of ``datasets`` (known names, as entries) reads files from."""
    from torchvote.data import dataset_reads_files, list_datasets

    names = [parse_eval_entry(entry)[0] for entry in datasets]
    known = [name for name in names if name in list_datasets()]
    if root is not None and known and not any(dataset_reads_files(name) for name in known):
        raise ValueError(
            f"root (--root): none of the data sets {', '.join(known)} reads files (each is generated); "
            f"drop it"
        )


def load_eval_entry(
    handler: TaskHandler,
    entry: str,
    model_config: Any,
    *,
    root: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    options: dict[str, Any] | None = None,
) -> TaskData:
    """The split an ``eval_on``-style entry names (``"mnist"``, ``"affnist-style:canvas=28"``,
    ``"mnist:split=train"``), finalised for a model of ``model_config``.

    Args:
        handler: the model's task handler.
        entry: ``"name"`` or ``"name:key=value,..."``; the entry's options win over ``options``;
            ``split=`` chooses the split (default: ``test``, or ``val`` for a data set without
            one), as ``data.eval_split`` does for a run's own data set.
        model_config: the config of the model that will see the data (its image size is checked).
        root: the folder to read files from unless the entry names its own ``root=``; data sets
            generated rather than read (the sequence tasks) ignore it.
        limit: keep the first ``limit`` examples; ``None``: all.
        options: keyword arguments of the data set, below the entry's own.

    Raises:
        ValueError: an unknown data set, options it does not take, data of another task,
            images that do not fit the model (the message names the fix), or a ``limit`` that is
            not a positive integer.
        DataNotFoundError: the data set's files are not there.
    """
    from torchvote.data import dataset_reads_files

    name, own = parse_eval_entry(entry)
    own = {**(options or {}), **own}
    shared_root = root if dataset_reads_files(name) else None
    entry_root = own.pop("root", shared_root)  # an entry's own root wins
    split = own.pop("split", None)
    if split is not None and not isinstance(split, str):
        raise ValueError(f"eval_on entry {entry!r}: split must be a split's name, got {split!r}")
    data = load_data(
        handler, name, split, options=own, root=None if entry_root is None else str(entry_root), limit=limit
    )
    return handler.finalize(data, model_config)


def model_config_from_metadata(spec: ModelSpec, metadata: dict[str, str], source: str) -> Any:
    """Rebuild a model config from the JSON stored with the weights (type-checked).

    Raises:
        CheckpointError: no readable config, or one that does not fit the model's config class.
    """
    try:
        values = json.loads(metadata["model_config"])
    except (KeyError, json.JSONDecodeError):
        raise CheckpointError(f"{source} has no readable model config in its metadata") from None
    fields = {f.name for f in dataclasses.fields(spec.config_cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise CheckpointError(
            f"{source}: model config fields {unknown} do not exist in {spec.config_cls.__name__}"
        )
    try:
        return spec.config_cls(**typed_fields(spec.config_cls, values, "model"))
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"{source}: stored model config does not fit {spec.config_cls.__name__}: {err}"
        ) from None


def _as_device(device: torch.device | str) -> torch.device:
    """A ``torch.device`` if this machine has it (``check_device_exists``); a name through
    ``resolve_device`` (``"auto"`` failed inside torch: "Expected one of cpu, cuda, ... at start of
    device string: auto")."""
    return check_device_exists(device) if isinstance(device, torch.device) else resolve_device(device)


#: Held while a build sets torch's default dtype (process-wide) and puts it back.
_DEFAULT_DTYPE_LOCK = threading.Lock()


def build_float32_model(spec: ModelSpec, config: Any) -> nn.Module:
    """``spec``'s model built from ``config`` in float32, whatever torch's default dtype, as runs
    train (bf16 and fp16 are autocast's), as the tasks hand it float32 images and as checkpoints
    hold it. The default is set for the build only (not ``dtype=``, which a registered model need
    not take), so the same seed draws the same weights under any default.

    Args:
        spec: the registered model.
        config: its config.

    The default dtype is process-wide: where it is float32 already (torch's own default) nothing
    is set, so models built in several threads at once (a server loading checkpoints) touch no
    shared state; otherwise builds take turns, and a tensor another thread makes meanwhile is
    float32 too.

    Returns:
        The model, on the CPU (or where its class puts it).
    """
    if torch.get_default_dtype() == torch.float32:
        return spec.model_cls(config)
    with _DEFAULT_DTYPE_LOCK:  # two builds interleaved gave back each other's default: float64 models
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            return spec.model_cls(config)
        finally:
            torch.set_default_dtype(previous)


def _meta_model(spec: ModelSpec, config: Any) -> nn.Module | None:
    """``spec``'s model built on the ``meta`` device (shapes, no memory), or ``None`` where it
    cannot be built there: a class that reads a tensor's values as it builds (``.item()``,
    ``.numpy()`` of a meta tensor raise RuntimeError, TypeError ...), or a config the model
    refuses, which the real build then refuses with its own message."""
    try:
        with torch.device("meta"):
            return build_float32_model(spec, config)
    except Exception:  # noqa: BLE001 (the real build, next, decides and says what is wrong)
        return None


def load_model_from_checkpoint(
    location: str | os.PathLike[str], device: torch.device | str = "cpu"
) -> tuple[nn.Module, ModelSpec, dict[str, str]]:
    """Rebuild the model of a checkpoint (run folder, checkpoint folder or ``.safetensors`` file).

    Args:
        location: anything :func:`~torchvote.training.checkpoint.find_checkpoint` resolves.
        device: where to put the model: a ``torch.device`` or a name
            :func:`~torchvote.validation.resolve_device` takes (``"auto"``, ``"cpu"``,
            ``"cuda:1"``).

    Returns:
        ``(model, spec, metadata)``: the model in eval mode on ``device``.

    Raises:
        CheckpointError: nothing there, corrupt, or not fitting the registered model.
        ValueError: an unknown or unavailable device (checked before the model is read).
    """
    device = _as_device(device)
    paths = find_checkpoint(location)
    try:
        metadata = read_model_metadata(paths.weights)
        if "model" not in metadata:
            raise CheckpointError(
                f"{paths.weights} names no model in its metadata; it is not a torchvote checkpoint"
            )
        try:
            spec = get_model_spec(metadata["model"])
        except ValueError as err:
            raise CheckpointError(f"{paths.weights}: {err}") from None
        config = model_config_from_metadata(spec, metadata, str(paths.weights))
        outline = _meta_model(spec, config)
        if outline is not None:  # a config asking for more than the file holds: refused unallocated
            check_weights_fit(outline, paths.weights)
        try:  # what the config's fields only settle together (a router's options) is checked here
            model = build_float32_model(spec, config)
        except (TypeError, ValueError) as err:
            message = f"{paths.weights} records a model config that {metadata['model']} refuses: {err}"
            raise CheckpointError(message) from None
        load_model_weights(model, paths.weights)
    except CheckpointError as err:
        raise CheckpointError(f"{err}{_intact_one_beside(location, paths)}") from None
    return model.to(device).eval(), spec, {**metadata, "path": str(paths.weights)}


def newest_intact_checkpoint(location: str | os.PathLike[str]) -> CheckpointPaths | None:
    """For a run or checkpoints folder: its newest checkpoint that can be read, the one
    ``train --resume`` goes on from (found by the same search); ``None`` for a file, or where none
    is intact. What the messages about a damaged checkpoint name instead.

    Args:
        location: a run folder, its ``checkpoints/`` folder or a checkpoint's file.

    Returns:
        The intact checkpoint's paths, or ``None``.
    """
    from torchvote.training.results import find_resumable_checkpoint

    folder = Path(location).expanduser()
    if not folder.is_dir():
        return None
    try:
        intact, _, _ = find_resumable_checkpoint(folder)
    except CheckpointError:
        return None
    return intact


def _intact_one_beside(location: str | os.PathLike[str], failed: CheckpointPaths) -> str:
    """For a folder whose latest checkpoint cannot be read: the newest one there that can,
    named for the user to pass instead; ``""`` for a file, or none."""
    intact = newest_intact_checkpoint(location)
    if intact is None or intact.weights == failed.weights:
        return ""
    return f". The newest intact checkpoint there is {intact.weights}: pass that file to read it"


def _run_loss(paths: CheckpointPaths, metadata: dict[str, str]) -> tuple[LossConfig, int, int]:
    """What the run that wrote a checkpoint needs to rebuild its objective: ``(loss config,
    total_steps, step)``, read from the weights' ``metadata`` (``loss``, ``total_steps``,
    ``step``), or, for a checkpoint written before the weights recorded them, from the training
    state beside the weights.

    Raises:
        CheckpointError: the weights do not record them and there is no training state beside
            them, or what records them is corrupt; the message says which file.
    """
    if "loss" in metadata:
        try:
            recorded = json.loads(metadata["loss"])
            if not isinstance(recorded, dict):
                raise TypeError(f"a JSON object expected, got {type(recorded).__name__}")
            loss = LossConfig(**typed_fields(LossConfig, recorded, "loss"))
            return loss, int(metadata["total_steps"]), int(metadata["step"])
        except (KeyError, TypeError, ValueError) as err:  # ConfigError and JSONDecodeError too
            raise CheckpointError(f"{paths.weights} records its run's loss unreadably ({err})") from None
    config, state = run_state_beside(paths, "their run's loss", "which records it", "loss and length")
    try:
        return config.loss, int(state["total_steps"]), int(state["step"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{paths.state} does not record its run's loss and length ({err})") from None


def run_state_beside(
    paths: CheckpointPaths, recorded: str | None, state_role: str, needed: str
) -> tuple[TrainConfig, dict[str, Any]]:
    """The run config and training state beside a checkpoint's weights: an older checkpoint's
    fallback for what its weights do not record, and what ``torchvote evaluate`` reads a run's
    own data sets from.

    Args:
        paths: the checkpoint.
        recorded, state_role, needed: words of the messages: what the weights lack (``"their
            vocabulary"``; ``None`` where they were never to record it), what the state is to it
            (``"which records it"``), what the state must hold (``"data set"``).

    Returns:
        ``(config, state)``.

    Raises:
        CheckpointError: no state file, a damaged one, or a state without a readable run config.
    """
    if not paths.state.is_file():
        older = "" if recorded is None else (
            f"{paths.weights} was written before checkpoints recorded {recorded}, and "
        )
        raise CheckpointError(f"{older}{paths.state}, {state_role}, does not exist")
    state = load_training_state(paths.state)
    return run_config_of_state(state, paths.state, needed), state


def run_config_of_state(state: dict[str, Any], path: Path, needed: str) -> TrainConfig:
    """The run config a training state records.

    Args:
        state: the state, as :func:`~torchvote.training.checkpoint.load_training_state` read it.
        path: its file, for the message.
        needed: what the state must hold, for the message (``"data sets"``).

    Returns:
        The run's :class:`~torchvote.training.schema.TrainConfig`.

    Raises:
        CheckpointError: no config in the state, or one this version cannot read.
    """
    try:
        return saved_config(state["config"])
    except (KeyError, TypeError, ValueError) as err:  # ConfigError too: a config of another version
        raise CheckpointError(f"{path} does not record its run's {needed} ({err})") from None


def evaluate_checkpoint(
    location: str | os.PathLike[str],
    datasets: Sequence[str],
    *,
    batch_size: int = 500,
    limit: int | None = None,
    device: str = "auto",
    bf16: bool = False,
    fp16: bool = False,
    root: str | None = None,
    options: dict[str, Any] | None = None,
    echo: Callable[[str], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Evaluate a checkpoint on the test split of each data set (or the split an entry names with
    ``split=``); one result row per data set.

    ``datasets`` are names or ``eval_on``-style entries ``"name:key=value,..."`` whose options
    apply to that data set alone (``"affnist-style:canvas=28"``, ``"mnist:split=train"``);
    ``options`` are keyword arguments of every data set (``max_len=``, ``num_pairs=`` ...), an
    entry's own ones win.

    The ``loss`` is the run's own objective (its ``loss`` config, built by
    :func:`~torchvote.training.objectives.make_objective` as the trainer builds it) at the
    checkpoint's step (the spread-loss margin depends on it), so it is the number training's own
    evaluation reports for the same weights and data. The run's loss config and length are read
    from the weights' metadata, so a ``.safetensors`` file copied on its own reports it too; a
    checkpoint written before the weights recorded them reads them from its training state
    (``<name>.state.pt`` beside the weights). Where neither records them, the rows have no
    ``loss`` (and ``echo`` says why): a loss under default settings would not be the run's. Nor
    has the row of a data set whose labels the run's loss does not take (a cross-entropy run
    evaluated on MultiMNIST's label pairs): its accuracy is reported all the same.

    Args:
        location: anything :func:`~torchvote.training.checkpoint.find_checkpoint` resolves.
        datasets: data set names or ``eval_on``-style entries, one result row each.
        batch_size: examples per forward pass.
        limit: evaluate the first ``limit`` examples of each data set; ``None``: all.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:<index>``.
        bf16: evaluate under bfloat16 autocast.
        fp16: evaluate under float16 autocast (not with ``bf16``).
        root: the folder to read data files from (data sets read from files only), unless an
            entry names its own ``root=``.
        options: keyword arguments of every data set, below each entry's own.
        echo: called with one line saying why the rows, or a row, have no ``loss``, when they
            have none; ``None``: nothing is said.
        on_phase: called with ``"load"`` before each data set is loaded (and checked against
            the model: a misfit is the caller's request) and ``"evaluate"`` before it is
            evaluated (an error from then on is a failure while running), so that a command
            line tells the two apart.

    Returns:
        One row per data set: ``{"data": "<name>/<split>", "accuracy": ..., "loss": ...,
        <task extras>..., "examples": n}`` (``loss`` only when the run's training state was
        found and its loss takes the data set's labels).

    Raises:
        CheckpointError: the checkpoint's weights cannot be loaded.
        ValueError: an unknown data set, one whose images do not fit the model, a
            ``batch_size`` / ``limit`` below 1, an unknown or unavailable device, ``bf16`` and
            ``fp16`` both set, or a ``root`` that no data set reads (all generated: it was
            ignored in silence, where training refuses it).
        DataNotFoundError: a data set's files are not there.
        TypeError: ``datasets`` one string rather than a list of them; ``on_phase`` not callable.
    """
    check_positive_int(batch_size, "batch_size")
    if limit is not None:
        check_positive_int(limit, "limit")
    if on_phase is not None and not callable(on_phase):
        raise TypeError(f"on_phase must be a callable taking the phase's name or None, got {on_phase!r}")
    datasets = check_texts(datasets, "datasets")  # "small-digits" was read as 's', 'm', ...
    _check_root_is_read(root, datasets)
    autocast_dtype(bf16, fp16)
    torch_device = resolve_device(device)
    model, spec, metadata = load_model_from_checkpoint(location, torch_device)
    handler = get_task_handler(spec.task)
    try:  # the run's loss as the weights loaded record it (not the `latest` of now)
        run_loss: tuple[LossConfig, int, int] | None = _run_loss(find_checkpoint(metadata["path"]), metadata)
    except CheckpointError as err:
        run_loss = None
        if echo is not None:
            echo(f"loss: not reported: {' '.join(str(err).split())}")
    rows = []
    for entry in datasets:
        if on_phase is not None:
            on_phase("load")
        data = load_eval_entry(handler, entry, model.config, root=root, limit=limit, options=options)
        if on_phase is not None:
            on_phase("evaluate")
        objective, step = None, 0
        if run_loss is not None:
            loss, total_steps, step = run_loss
            pad_id = data.fields.get("pad_id")  # as the trainer takes it: from the data's fields
            objective = make_objective(loss, spec, total_steps, pad_id, model_config=model.config)
        metrics = evaluate_loss_where_it_applies(
            model, data, handler, objective, echo=echo,
            batch_size=batch_size, device=torch_device, bf16=bf16, fp16=fp16, step=step,
        )
        rows.append({"data": f"{data.name}/{data.split}", **result_row(metrics)})
    return rows


def result_row(metrics: dict[str, float]) -> dict[str, Any]:
    """Metrics -> a result-table row: the metrics, then the number of examples."""
    row: dict[str, Any] = {key: value for key, value in metrics.items() if key not in ("count", "examples")}
    row["examples"] = int(metrics.get("examples", 0))
    return row


def checkpoint_summary(location: str | os.PathLike[str]) -> str:
    """One line naming the model and step of a checkpoint, and the code that trained it where its
    weights record that (:func:`~torchvote.provenance.describe_code`; not before 2026-11-30)."""
    paths = find_checkpoint(location)
    metadata = read_model_metadata(paths.weights)
    code = f", trained by {metadata['code']}" if metadata.get("code") else ""
    return f"{metadata.get('model', '?')} at step {metadata.get('step', '?')} ({Path(paths.weights)}){code}"
