"""The schema of a training run: :class:`TrainConfig` and its sections, as dataclasses.

They are OmegaConf structured configs: :mod:`torchvote.training.config` checks every value of a
preset or an override against these field types, then builds the dataclasses, whose
``__post_init__`` checks the values.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from torchvote.losses import check_margin_options
from torchvote.training.keyvalue import ConfigError, parse_entry
from torchvote.validation import (
    check_choice,
    check_device_name,
    check_flag,
    check_in_range,
    check_positive_int,
    check_probability,
    check_seed,
    check_texts,
)

__all__ = [
    "RESUMABLE_KEYS",
    "DataConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
]


def _paths_as_strings(section: Any, *keys: str) -> None:
    """A path field given a ``Path`` (from Python) keeps the string it names, as YAML gives it."""
    for key in keys:
        if isinstance(getattr(section, key), os.PathLike):
            setattr(section, key, os.fspath(getattr(section, key)))


def _absolute_folder(path: str) -> str:
    """A folder of the config as an absolute path, ``~`` expanded, links kept as named: a relative
    one is read from the current folder of each later command (``evaluate``, ``train --resume``
    elsewhere), which found no data there."""
    return os.path.abspath(os.path.expanduser(path))


def _with_absolute_root(entry: str) -> str:
    """An ``eval_on`` entry (checked: :func:`parse_entry`) with its ``root=`` option absolute;
    the text as given otherwise, and where an absolute root would not read back the same."""
    name, options = parse_entry(entry, "eval_on")
    root = options.get("root")
    if not isinstance(root, str) or not root or _absolute_folder(root) == root:
        return entry
    absolute = _absolute_folder(root)
    # a root= holds no comma (one would have split the entry): its value runs to the next comma
    rewritten = re.sub(r"((?:^|[:,])\s*root\s*=)[^,]*", lambda found: found[1] + absolute, entry)
    try:
        same = parse_entry(rewritten, "eval_on") == (name, {**options, "root": absolute})
    except ConfigError:  # a folder whose name YAML reads otherwise ("a: b"): kept as given
        same = False
    return rewritten if same else entry


def _check_field_types(section: Any, prefix: str) -> None:
    """The fields of a config ``section`` that hold what their annotations say: a choice of a
    ``Literal`` field among its values, ``True``/``False`` for a ``bool`` (``"yes"`` was truthy), a
    string for ``str`` (``None`` where optional), a list of strings for ``tuple[str, ...]`` (one
    string was read as its characters) and a dict for ``dict``. A section built in Python skips the
    typed check of :func:`~torchvote.training.config.load_config`, and a bad value was accepted,
    then trained on (``weight_decay_on="bias"`` as ``"matrices"``) or failed hours later.

    Raises:
        ConfigError: naming the first bad field (with ``prefix``) and what it takes.
    """
    hints = typing.get_type_hints(type(section))
    for item in dataclasses.fields(section):
        hint, value, key = hints[item.name], getattr(section, item.name), f"{prefix}{item.name}"
        origin, arguments = typing.get_origin(hint), typing.get_args(hint)
        optional = origin in (typing.Union, types.UnionType) and type(None) in arguments
        if optional:
            if value is None:
                continue
            hint = next(argument for argument in arguments if argument is not type(None))
            origin, arguments = typing.get_origin(hint), typing.get_args(hint)
        try:
            if origin is Literal:
                check_choice(value, arguments, key)
            elif hint is bool:
                check_flag(value, key)
            elif hint is str and not isinstance(value, str):
                raise TypeError(f"{key} must be a string{' or None' if optional else ''}, got {value!r}")
            elif origin is tuple and arguments == (str, Ellipsis):
                check_texts(value, key)
            elif origin is dict and not isinstance(value, dict):
                raise TypeError(f"{key} must be a mapping of options, got {value!r}")
        except (TypeError, ValueError) as err:
            raise ConfigError(str(err)) from None


def _check_optional_positive(value: Any, key: str) -> None:
    """``None`` or an integer >= 1 (not a bool: ``True`` would be 1, ``2.5`` steps a float).

    Raises:
        ConfigError: naming ``key``.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ConfigError(f"{key} must be a positive integer or None, got {value!r}")


@dataclass
class ModelConfig:
    """Which model to train.

    Args:
        name: a registered model (``torchvote list models``).
        preset: one of the model's size presets; ``None`` for its defaults.
        overrides: fields of the model's own config (``model.<field>=value`` on the command line).
    """

    name: str = "cnn-baseline"
    preset: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_field_types(self, "model.")


@dataclass
class DataConfig:
    """Which data to train and evaluate on.

    Args:
        name: a data set of ``torchvote.data`` (``torchvote list datasets``).
        eval_name: the data set evaluated after each epoch; ``None`` for ``name``.
        eval_split: the split evaluated after each epoch (``None``: ``test``, or ``val`` for data
            sets without a test split).
        root: folder holding the data files, where the data set reads files; kept absolute,
            ``~`` expanded (a relative one from the current folder when the config is made), so
            that a later command in another folder reads the same files. A resumed run may name
            another (the files moved).
        limit: keep only this many training examples (``None``: all). A text data set for the
            language-model task (``shakespeare``) is one token stream: there it keeps the first
            ``limit`` tokens (characters), which are then cut into windows.
        eval_limit: keep only this many evaluation examples (tokens for a text stream, as
            ``limit``).
        shift: random shift of each training image by up to this many pixels (CapsNet: 2).
        canvas: place each training image at a random position on a black canvas of this side
            (the affNIST recipe: 40); evaluation images are centred on it.
        options: further keyword arguments of the data set (``data.options.<key>=value``).
    """

    name: str = "small-digits"
    eval_name: str | None = None
    eval_split: str | None = None
    root: str | None = None
    limit: int | None = None
    eval_limit: int | None = None
    shift: int = 0
    canvas: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _paths_as_strings(self, "root")
        _check_field_types(self, "data.")
        if self.root:  # None (or empty): each data set's own place, the offline package's for some
            # absolute, as every config is made: a relative root ("mnist") was stored as written
            # and read from the cwd of each later command, so evaluate and --resume from another
            # folder found no data. Not resolved: a symbolic link the user named stays named.
            self.root = _absolute_folder(self.root)


@dataclass
class OptimConfig:
    """Optimiser and learning-rate schedule.

    Args:
        name: ``adam``, ``adamw`` or ``sgd`` (with ``momentum``, Nesterov off).
        lr: peak learning rate.
        weight_decay: L2 (adam, sgd) or decoupled (adamw) weight decay, on the parameters
            ``weight_decay_on`` names.
        weight_decay_on: ``all`` (every parameter, as PyTorch's optimisers decay them) or
            ``matrices``: only the parameters of two or more dimensions (the weights of linear
            and convolutional layers, embeddings, capsule transformation matrices), not biases,
            norm gains, EM's ``beta_u`` / ``beta_a`` or other vectors and scalars: the GPT-2
            recipe, as nanoGPT and Hugging Face's Trainer apply it.
        momentum: SGD momentum.
        beta1, beta2: Adam betas.
        schedule: ``constant``; ``exponential`` (``lr * decay_rate ** (t / decay_steps)``, ``t``
            the steps since the warm-up, the CapsNet schedule); ``cosine`` (from ``lr`` at the
            end of the warm-up to ``min_lr_ratio * lr`` one step after the last, the curve of
            Hugging Face's cosine schedule; a resume with other ``epochs`` or ``max_steps``
            redraws it over the new length, and says so);
            ``onecycle`` (``torch.optim.lr_scheduler.OneCycleLR``, from ``lr / 25`` up to ``lr``
            over ``warmup_steps``, or the first 30% of the run when 0, then down to
            ``lr / 2.5e5``; a resume may not change its length).
        decay_rate, decay_steps: of the exponential schedule.
        warmup_steps: linear warm-up (constant, exponential, cosine; onecycle's own rise takes
            this many steps): step ``k`` (from 0) of
            the first ``warmup_steps`` takes ``lr * (k + 1) / warmup_steps``, so the first step
            already moves (Hugging Face's warm-up starts at 0, a step that changes nothing, and
            reaches ``lr`` one step later).
        min_lr_ratio: final learning rate of the cosine schedule, relative to ``lr``.
        grad_clip: clip the global gradient norm to this value; ``None``: no clipping.
    """

    name: Literal["adam", "adamw", "sgd"] = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    weight_decay_on: Literal["all", "matrices"] = "all"
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.999

    # the learning-rate schedule
    schedule: Literal["constant", "exponential", "cosine", "onecycle"] = "constant"
    decay_rate: float = 0.96
    decay_steps: int = 2000
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    grad_clip: float | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """The choices, and the real-valued options where the optimiser means them (a learning
        rate of inf, a negative clip norm, which flips every gradient, trained on without a word).

        Raises:
            ConfigError: naming the first bad key.
        """
        _check_field_types(self, "optim.")
        try:
            check_positive_int(self.decay_steps, "optim.decay_steps")
            check_positive_int(self.warmup_steps, "optim.warmup_steps", minimum=0)
            check_in_range(self.lr, "optim.lr", 0.0, include_low=False)
            check_in_range(self.weight_decay, "optim.weight_decay", 0.0)
            check_in_range(self.momentum, "optim.momentum", 0.0, 1.0, include_high=False)
            check_in_range(self.beta1, "optim.beta1", 0.0, 1.0, include_high=False)
            check_in_range(self.beta2, "optim.beta2", 0.0, 1.0, include_high=False)
            check_in_range(self.decay_rate, "optim.decay_rate", 0.0, include_low=False)
            check_in_range(self.min_lr_ratio, "optim.min_lr_ratio", 0.0, 1.0)
            if self.grad_clip is not None:
                check_in_range(self.grad_clip, "optim.grad_clip", 0.0, include_low=False)
        except ValueError as err:
            raise ConfigError(str(err)) from None


@dataclass
class LossConfig:
    """The training loss.

    Args:
        name: ``auto``, ``cross-entropy``, ``margin`` (plus the reconstruction loss when the
            model reconstructs) or ``spread``. ``auto`` means "not chosen": the spread loss when
            the model routes by EM (``model.router=em``), else the model's registered loss (see
            :func:`~torchvote.training.config.resolve_loss_name`); any other value, from a preset
            or the command line, is used as it is.
        label_smoothing: of the cross-entropy.
        reconstruction_weight: scale of the summed squared reconstruction error (CapsNet: 0.0005).
        positive_margin, negative_margin, down_weight: ``m+``, ``m-`` and ``lambda`` of the margin
            loss.
        spread_margin_start, spread_margin_end: the spread-loss margin schedule (0.2 -> 0.9).
        spread_ramp_steps: steps over which the margin rises; ``None``: the whole run (also
            when ``auto`` selects the spread loss).
    """

    name: Literal["auto", "cross-entropy", "margin", "spread"] = "auto"
    label_smoothing: float = 0.0
    reconstruction_weight: float = 0.0005

    # the margin loss
    positive_margin: float = 0.9
    negative_margin: float = 0.1
    down_weight: float = 0.5

    # the spread loss
    spread_margin_start: float = 0.2
    spread_margin_end: float = 0.9
    spread_ramp_steps: int | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """The loss's name and its options where the losses mean them (a negative reconstruction
        weight would reward reconstructing badly).

        Raises:
            ConfigError: naming the first bad key.
        """
        _check_field_types(self, "loss.")
        try:
            check_probability(self.label_smoothing, "loss.label_smoothing")
            check_in_range(self.reconstruction_weight, "loss.reconstruction_weight", 0.0)
            check_margin_options(self.positive_margin, self.negative_margin, self.down_weight, prefix="loss.")
            for key in ("spread_margin_start", "spread_margin_end"):
                check_in_range(getattr(self, key), f"loss.{key}", 0.0, 1.0, include_low=False)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        _check_optional_positive(self.spread_ramp_steps, "loss.spread_ramp_steps")


@dataclass
class TrainConfig:
    """Everything that defines a training run.

    Args:
        description: one line shown by ``torchvote list presets``.
        preset: the preset the config was loaded from (set by :func:`load_config`, for the record
            and the run folder's name).
        model, data, optim, loss: the sections above.
        batch_size: the global batch size; each of N data-parallel processes takes
            ``batch_size / N`` of it, so the same config gives the same training on 1 or N.
        eval_batch_size: batch size of evaluation (per process).
        epochs: passes over the training set.
        max_steps: stop after this many optimiser steps (``None``: ``epochs`` decide).
        eval_every: evaluate every this many epochs (0: only at the end).
        eval_on: further data sets evaluated at the end of the run (e.g. ``affnist``, or with the data
            set's options ``affnist-style:canvas=28``). Each is read from ``data.root`` unless the
            entry names its own (``affnist:root=DIR`` beside ``data.root=MNIST_DIR``).
        stop_at_accuracy: end the run at the first evaluation (every ``eval_every`` epochs) whose
            accuracy on the run's test set reaches this fraction, e.g. ``0.992``: the affNIST
            experiment trains both models to the same accuracy (Sabour et al. 2017, sec. 5.2).
            A finished run ends there: the final evaluation and checkpoint are of that step, and
            resuming it trains on only with a higher target or none. ``None``: train to the end.
        checkpoint_every: also checkpoint every this many steps (0: at each epoch end only).
        checkpoint_minutes: also checkpoint when this many minutes have passed since the last
            checkpoint (0: never by time), so that a hard kill (power, an out-of-memory kill, a
            preempted machine) loses at most that much of a long epoch.
        keep_checkpoints: how many checkpoints to keep (the newest).
        seed: seeds the model initialisation, the data order and every random augmentation.
        bf16: run forward and loss under ``torch.autocast(dtype=torch.bfloat16)``.
        fp16: run forward and loss under ``torch.autocast(dtype=torch.float16)``, the gradients
            through ``torch.amp.GradScaler`` (the loss scaled up so that small float16 gradients
            do not flush to zero; unscaled before ``optim.grad_clip``, a step whose gradients
            overflowed skipped and the scale lowered): mixed precision for GPUs without fast
            bfloat16 (T4, V100). The scaler's state is checkpointed. Not with ``bf16``.
        compile: train through ``torch.compile(model)`` (compiled on the first step; evaluation
            runs the eager model). Checkpoints hold the eager model's weights, whose names carry
            no ``_orig_mod.``: they load into an uncompiled model.
        deterministic: ``torch.use_deterministic_algorithms(True)``.
        device: ``auto`` (cuda if available), ``cpu``, ``cuda`` or ``cuda:<index>``.
        num_workers: processes that assemble batches (0: the main process).
        log_every: steps between two metrics lines and progress-bar updates.
        progress: show a progress bar.
        tensorboard: also write TensorBoard events, if ``tensorboard`` is installed.
        out_dir: runs go to ``<out_dir>/<preset or model>-<time>`` unless ``run_dir`` is set.
        run_dir: where checkpoints, metrics and plots go.

    Raises:
        ConfigError: a value of the wrong type or out of range, naming its dotted key (the
            counts and sizes must be integers, not floats or bools, also when the dataclass is
            built in Python rather than by :func:`~torchvote.training.config.load_config`).
    """

    description: str = ""
    preset: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    batch_size: int = 128
    eval_batch_size: int = 500
    epochs: int = 1
    max_steps: int | None = None
    eval_every: int = 1
    eval_on: tuple[str, ...] = ()
    stop_at_accuracy: float | None = None
    checkpoint_every: int = 0
    checkpoint_minutes: float = 10.0
    keep_checkpoints: int = 2
    seed: int = 0
    bf16: bool = False
    fp16: bool = False
    compile: bool = False
    deterministic: bool = False
    device: str = "auto"
    num_workers: int = 0
    log_every: int = 20
    progress: bool = True
    tensorboard: bool = True
    out_dir: str = "runs"
    run_dir: str | None = None

    def __post_init__(self) -> None:
        _paths_as_strings(self, "out_dir", "run_dir")
        _check_field_types(self, "")
        for section, kind in ((self.model, ModelConfig), (self.data, DataConfig), (self.optim, OptimConfig),
                              (self.loss, LossConfig)):
            if not isinstance(section, kind):
                raise ConfigError(f"{kind.__name__} expected for that section, got {type(section).__name__}")
            section.__post_init__()  # again: a section may have been changed since it was built
        positive = {"batch_size": self.batch_size, "eval_batch_size": self.eval_batch_size}
        positive |= {"epochs": self.epochs, "log_every": self.log_every}
        positive |= {"keep_checkpoints": self.keep_checkpoints}
        # integers, not merely values above 0: a dataclass built in Python (``TrainConfig(epochs=2.5)``,
        # ``dataclasses.replace``) skips the typed-field check of load_config, and 2.5 epochs or a
        # batch size of ``True`` (1) would train on without a word
        non_negative = {"eval_every": self.eval_every, "checkpoint_every": self.checkpoint_every}
        non_negative |= {"num_workers": self.num_workers, "data.shift": self.data.shift}
        optional_positive = {"max_steps": self.max_steps, "data.limit": self.data.limit}
        optional_positive |= {"data.eval_limit": self.data.eval_limit, "data.canvas": self.data.canvas}
        try:
            for key, value in positive.items():
                check_positive_int(value, key)
            for key, value in non_negative.items():
                check_positive_int(value, key, minimum=0)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.bf16 and self.fp16:  # one autocast dtype
            raise ConfigError(
                "bf16 and fp16 are both true: choose one autocast dtype (bf16=false or fp16=false)"
            )
        try:
            self.seed = check_seed(self.seed)  # a NumPy seed as its int, as the config file holds it
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if not self.out_dir.strip():  # '': runs in the working folder (a string: _check_field_types)
            raise ConfigError(f"out_dir must name a folder, got {self.out_dir!r}")
        for key, value in optional_positive.items():  # a limit of -5 would drop the last 5 examples
            _check_optional_positive(value, key)
        try:
            self._check_ranges()
        except ValueError as err:
            raise ConfigError(str(err)) from None
        try:
            check_device_name(self.device)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        # read now, not after hours of training; a root= kept absolute, as data.root is
        self.eval_on = tuple(_with_absolute_root(entry) for entry in self.eval_on)

    def _check_ranges(self) -> None:
        """The real-valued options of the run (the sections check their own)."""
        check_in_range(self.checkpoint_minutes, "checkpoint_minutes", 0.0)
        if self.stop_at_accuracy is not None:
            check_in_range(self.stop_at_accuracy, "stop_at_accuracy", 0.0, 1.0, include_low=False)
            if not self.eval_every:  # no evaluation during the run: the target could never be seen
                raise ValueError(
                    "stop_at_accuracy needs evaluations during the run: eval_every must be >= 1, got 0"
                )


#: Keys a resumed run may change (they do not change the weights it reaches).
RESUMABLE_KEYS: frozenset[str] = frozenset(
    {
        "epochs",
        "max_steps",
        "eval_every",
        "eval_on",
        "stop_at_accuracy",
        "checkpoint_every",
        "checkpoint_minutes",
        "keep_checkpoints",
        "device",
        "compile",
        "num_workers",
        "log_every",
        "progress",
        "tensorboard",
        "eval_batch_size",
        "data.eval_name",
        "data.eval_split",
        "data.eval_limit",
        "data.root",  # where the files are (another disk, another machine), not what they hold
        "description",
    }
)
