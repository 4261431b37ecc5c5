"""Training configs: dataclasses, YAML presets and type-checked ``key=value`` overrides.

A run is described by one :class:`TrainConfig`. It is built from a YAML preset (shipped in
``torchvote/presets/*.yaml`` or any file a user names), then changed by dotted overrides from the
command line::

    torchvote train mnist-cnn epochs=3 optim.lr=3e-4 model.dropout=0.2 data.shift=2

Every value is checked against the type of its dataclass field (``int``, ``float``, ``bool``,
``str``, ``Literal`` choices, tuples, ``None`` for optional fields). ``model.<field>`` keys other
than ``model.name`` and ``model.preset`` are overrides of the model's own config dataclass and are
checked against it. A wrong key or value raises :class:`ConfigError`, a ``ValueError`` whose
message lists the valid keys or choices.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

__all__ = [
    "RESUMABLE_KEYS",
    "ConfigError",
    "DataConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "apply_overrides",
    "coerce_value",
    "config_diff",
    "config_from_dict",
    "config_to_dict",
    "list_presets",
    "load_config",
    "load_preset",
    "model_config_from",
    "parse_override",
]


class ConfigError(ValueError):
    """A bad config key or value; the message says what is valid."""


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


@dataclass
class DataConfig:
    """Which data to train and evaluate on.

    Args:
        name: a data set of ``torchvote.data`` (``torchvote list datasets``).
        eval_name: the data set evaluated after each epoch; ``None`` for ``name``.
        eval_split: the split evaluated after each epoch (``None``: ``test``, or ``val`` for data
            sets without a test split).
        root: folder holding the data files, where the data set reads files.
        limit: keep only this many training examples (``None``: all).
        eval_limit: keep only this many evaluation examples.
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


@dataclass
class OptimConfig:
    """Optimiser and learning-rate schedule.

    Args:
        name: ``adam``, ``adamw`` or ``sgd`` (with ``momentum``, Nesterov off).
        lr: peak learning rate.
        weight_decay: L2 (adam, sgd) or decoupled (adamw) weight decay.
        momentum: SGD momentum.
        beta1, beta2: Adam betas.
        schedule: ``constant``; ``exponential`` (``lr * decay_rate ** (step / decay_steps)``, the
            CapsNet schedule); ``cosine`` (to ``min_lr_ratio * lr`` at the last step);
            ``onecycle`` (``torch.optim.lr_scheduler.OneCycleLR``).
        decay_rate, decay_steps: of the exponential schedule.
        warmup_steps: linear warm-up from 0 (constant, exponential, cosine).
        min_lr_ratio: final learning rate of the cosine schedule, relative to ``lr``.
        grad_clip: clip the global gradient norm to this value; ``None``: no clipping.
    """

    name: Literal["adam", "adamw", "sgd"] = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.999
    schedule: Literal["constant", "exponential", "cosine", "onecycle"] = "constant"
    decay_rate: float = 0.96
    decay_steps: int = 2000
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    grad_clip: float | None = None


@dataclass
class LossConfig:
    """The training loss.

    Args:
        name: ``auto`` (the model's registered loss), ``cross-entropy``, ``margin`` (plus the
            reconstruction loss when the model reconstructs) or ``spread``.
        label_smoothing: of the cross-entropy.
        reconstruction_weight: scale of the summed squared reconstruction error (CapsNet: 0.0005).
        positive_margin, negative_margin, down_weight: ``m+``, ``m-`` and ``lambda`` of the margin
            loss.
        spread_margin_start, spread_margin_end: the spread-loss margin schedule (0.2 -> 0.9).
        spread_ramp_steps: steps over which the margin rises; ``None``: the whole run.
    """

    name: Literal["auto", "cross-entropy", "margin", "spread"] = "auto"
    label_smoothing: float = 0.0
    reconstruction_weight: float = 0.0005
    positive_margin: float = 0.9
    negative_margin: float = 0.1
    down_weight: float = 0.5
    spread_margin_start: float = 0.2
    spread_margin_end: float = 0.9
    spread_ramp_steps: int | None = None


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
            set's options ``affnist:canvas=28``).
        checkpoint_every: also checkpoint every this many steps (0: at each epoch end only).
        keep_checkpoints: how many checkpoints to keep (the newest).
        seed: seeds the model initialisation, the data order and every random augmentation.
        bf16: run forward and loss under ``torch.autocast(dtype=torch.bfloat16)``.
        deterministic: ``torch.use_deterministic_algorithms(True)``.
        device: ``auto`` (cuda if available), ``cpu``, ``cuda`` or ``cuda:<index>``.
        num_workers: processes that assemble batches (0: the main process).
        log_every: steps between two metrics lines and progress-bar updates.
        progress: show a progress bar.
        tensorboard: also write TensorBoard events, if ``tensorboard`` is installed.
        out_dir: runs go to ``<out_dir>/<preset or model>-<time>`` unless ``run_dir`` is set.
        run_dir: where checkpoints, metrics and plots go.
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
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    seed: int = 0
    bf16: bool = False
    deterministic: bool = False
    device: str = "auto"
    num_workers: int = 0
    log_every: int = 20
    progress: bool = True
    tensorboard: bool = True
    out_dir: str = "runs"
    run_dir: str | None = None

    def __post_init__(self) -> None:
        positive = {"batch_size": self.batch_size, "eval_batch_size": self.eval_batch_size}
        positive |= {"epochs": self.epochs, "log_every": self.log_every, "optim.lr": self.optim.lr}
        positive |= {"keep_checkpoints": self.keep_checkpoints}
        for key, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{key} must be positive, got {value}")
        non_negative = {"eval_every": self.eval_every, "checkpoint_every": self.checkpoint_every}
        non_negative |= {"num_workers": self.num_workers, "data.shift": self.data.shift}
        non_negative |= {"optim.warmup_steps": self.optim.warmup_steps}
        for key, value in non_negative.items():
            if value < 0:
                raise ConfigError(f"{key} must be >= 0, got {value}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ConfigError(f"max_steps must be positive or None, got {self.max_steps}")
        if not 0.0 <= self.loss.label_smoothing < 1.0:
            raise ConfigError(f"loss.label_smoothing must be in [0, 1), got {self.loss.label_smoothing}")
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:<index>, got {self.device!r}")


#: Keys a resumed run may change (they do not change the weights it reaches).
RESUMABLE_KEYS: frozenset[str] = frozenset(
    {
        "epochs",
        "max_steps",
        "eval_every",
        "eval_on",
        "checkpoint_every",
        "keep_checkpoints",
        "device",
        "num_workers",
        "log_every",
        "progress",
        "tensorboard",
        "eval_batch_size",
        "data.eval_name",
        "data.eval_split",
        "data.eval_limit",
        "description",
    }
)

_NONE_WORDS = frozenset({"none", "null", "~"})
_TRUE_WORDS = frozenset({"true", "yes", "on", "1"})
_FALSE_WORDS = frozenset({"false", "no", "off", "0"})


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(choice) for choice in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(arm) for arm in typing.get_args(annotation))
    if origin is tuple:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"comma-separated {_type_name(args[0])}s"
        return f"tuple of ({', '.join(_type_name(a) for a in args)})"
    if annotation is type(None):
        return "none"
    return getattr(annotation, "__name__", str(annotation))


def _split_sequence(text: str) -> list[str]:
    text = text.strip()
    if len(text) >= 2 and text[0] + text[-1] in ("()", "[]"):
        text = text[1:-1]
    return [part.strip() for part in text.split(",") if part.strip()]


def coerce_value(value: Any, annotation: Any, key: str) -> Any:
    """Check ``value`` (a command-line string or a YAML value) against ``annotation``; convert it.

    Args:
        value: the raw value.
        annotation: a resolved type: ``int``, ``float``, ``bool``, ``str``, ``Literal[...]``,
            ``X | None``, ``tuple[X, ...]``, ``dict[str, Any]`` or ``Any``.
        key: the dotted key, for the error message.

    Raises:
        ConfigError: the value does not fit; the message names the key and the expected type.
    """
    origin = typing.get_origin(annotation)
    fail = ConfigError(f"{key}: expected {_type_name(annotation)}, got {value!r}")
    if annotation is Any:
        return yaml.safe_load(value) if isinstance(value, str) else value
    if origin in (Union, types.UnionType):
        arms = typing.get_args(annotation)
        if type(None) in arms and (
            value is None or (isinstance(value, str) and value.lower() in _NONE_WORDS)
        ):
            return None
        for arm in arms:
            if arm is type(None):
                continue
            try:
                return coerce_value(value, arm, key)
            except ConfigError:
                continue
        raise fail
    if origin is Literal:
        for choice in typing.get_args(annotation):
            if value == choice or (isinstance(value, str) and value == str(choice)):
                return choice
        choices = ", ".join(str(choice) for choice in typing.get_args(annotation))
        raise ConfigError(f"{key}: {value!r} is not one of: {choices}")
    if origin is tuple:
        args = typing.get_args(annotation)
        items = _split_sequence(value) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise fail
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce_value(item, args[0], f"{key}[{i}]") for i, item in enumerate(items))
        if len(items) != len(args):
            raise fail
        pairs = enumerate(zip(items, args, strict=True))
        return tuple(coerce_value(item, arm, f"{key}[{i}]") for i, (item, arm) in pairs)
    if origin is dict or annotation is dict:
        if isinstance(value, Mapping):
            return dict(value)
        raise fail
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE_WORDS | _FALSE_WORDS:
            return value.lower() in _TRUE_WORDS
        raise fail
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                raise fail from None
        raise fail
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise fail from None
        raise fail
    if annotation is str:
        if isinstance(value, str):
            return value
        raise fail
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, Mapping):
            return _dataclass_from_dict(annotation, value, key)
        raise fail
    raise ConfigError(f"{key}: unsupported field type {annotation!r}")  # a programming error


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _unknown_key(key: str, valid: Iterable[str]) -> ConfigError:
    return ConfigError(f"unknown key {key!r}; valid keys: {', '.join(valid)}")


def _dataclass_from_dict(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    types_ = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in types_:
            if cls is ModelConfig:  # any other key under `model:` overrides the model's config
                kwargs.setdefault("overrides", {})[name] = value
                continue
            raise _unknown_key(key, [f"{prefix}.{n}" if prefix else n for n in types_])
        kwargs[name] = coerce_value(value, types_[name], key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{prefix or 'config'}: {err}") from None


def config_from_dict(values: Mapping[str, Any]) -> TrainConfig:
    """Build a :class:`TrainConfig` from nested mappings (a YAML document), type-checking every
    value, the model overrides included.

    Raises:
        ConfigError: an unknown key, a value of the wrong type, an unknown model or preset.
    """
    if not isinstance(values, Mapping):
        raise ConfigError(f"a config must be a mapping of keys to values, got {type(values).__name__}")
    config = _dataclass_from_dict(TrainConfig, values, "")
    config.model.overrides = _check_model_overrides(config.model)
    return config


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """The config as plain nested dicts, lists and scalars (YAML and JSON friendly).

    Model overrides appear as keys of ``model`` beside ``name`` and ``preset``, as in a preset.
    """

    def plain(value: Any) -> Any:
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    values = plain(dataclasses.asdict(config))
    model = values["model"]
    values["model"] = {"name": model["name"], "preset": model["preset"], **model["overrides"]}
    return values


def _check_model_overrides(model: ModelConfig) -> dict[str, Any]:
    """Type-check ``model.overrides`` against the fields of the model's own config dataclass."""
    from torchvote.models.registry import build_config, get_model_spec

    try:
        spec = get_model_spec(model.name)
    except ValueError as err:
        raise ConfigError(f"model.name: {err}") from None
    types_ = _field_types(spec.config_cls)
    checked: dict[str, Any] = {}
    for name, value in model.overrides.items():
        if name not in types_:
            valid = ["model.name", "model.preset", *(f"model.{n}" for n in types_)]
            raise ConfigError(
                f"unknown key 'model.{name}' for model {model.name!r}; valid keys: {', '.join(valid)}"
            )
        checked[name] = coerce_value(value, types_[name], f"model.{name}")
    try:
        build_config(model.name, model.preset, **checked)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model: {err}") from None
    return checked


#: Data-dictated model fields that must match exactly (the others are sizes the model may exceed).
_EXACT_DATA_FIELDS = frozenset({"in_channels", "pad_id"})


def model_config_from(config: TrainConfig, **data_fields: Any) -> Any:
    """The model's config dataclass for a run: defaults, preset, overrides.

    ``data_fields`` are values the data set dictates (``image_size``, ``num_classes``,
    ``vocab_size``, ``max_len`` ...); they fill the fields the model config has, unless an override
    set them. An overridden size may exceed the data's (a 40x40 model on 28x28 digits, which are
    then centred; a larger vocabulary) but not fall short of it; ``in_channels`` and ``pad_id``
    must match.

    Raises:
        ConfigError: an override contradicts the data.
    """
    from torchvote.models.registry import build_config, get_model_spec

    spec = get_model_spec(config.model.name)
    names = set(spec.config_fields())
    values = dict(config.model.overrides)
    for name, value in data_fields.items():
        if name not in names:
            continue
        if name in values:
            exact = name in _EXACT_DATA_FIELDS
            if (values[name] != value) if exact else (values[name] < value):
                relation = "" if exact else " or more"
                raise ConfigError(
                    f"model.{name}={values[name]} does not fit the data set, which needs "
                    f"{name}={value}{relation}"
                )
        values.setdefault(name, value)
    try:
        return build_config(config.model.name, config.model.preset, **values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model: {err}") from None


def parse_override(text: str) -> tuple[list[str], str]:
    """``"optim.lr=1e-3"`` -> ``(["optim", "lr"], "1e-3")``.

    Raises:
        ConfigError: no ``=``, or an empty key.
    """
    key, sep, value = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"expected key=value (e.g. optim.lr=3e-4), got {text!r}")
    return parts, value.strip()


def apply_overrides(config: TrainConfig, overrides: Iterable[str]) -> TrainConfig:
    """A copy of ``config`` with dotted ``key=value`` overrides applied and type-checked.

    ``model.<field>`` keys that are not ``model.name`` / ``model.preset`` set fields of the model's
    own config; ``data.options.<key>`` keys pass extra keyword arguments to the data set.

    Raises:
        ConfigError: an unknown key or a value of the wrong type; the message lists valid keys or
            choices.
    """
    values = config_to_dict(config)
    for text in overrides:
        parts, raw = parse_override(text)
        key = ".".join(parts)
        node: dict[str, Any] = values
        cls: type | None = TrainConfig
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            types_ = _field_types(cls) if cls is not None else {}
            prefix = ".".join(parts[:depth])
            if cls is ModelConfig and part not in types_ and last:
                node[part] = raw  # a model override: checked against the model's config below
                break
            if cls is None:  # inside a free-form dict (data.options)
                if last:
                    node[part] = coerce_value(raw, Any, key)
                else:
                    node = node.setdefault(part, {})
                continue
            if part not in types_:
                valid = [f"{prefix}.{n}" if prefix else n for n in types_]
                if cls is ModelConfig:
                    valid.append("model.<field of the model's config>")
                raise _unknown_key(key, valid)
            annotation = types_[part]
            if last:
                if dataclasses.is_dataclass(annotation):
                    sub = ", ".join(f"{key}.{n}" for n in _field_types(annotation))
                    raise ConfigError(f"{key} is a section; set one of its keys: {sub}")
                node[part] = coerce_value(raw, annotation, key)
            elif dataclasses.is_dataclass(annotation):
                node, cls = node[part], annotation
            elif typing.get_origin(annotation) is dict or annotation is dict:
                node, cls = node.setdefault(part, {}), None
            else:
                raise ConfigError(
                    f"{prefix + '.' if prefix else ''}{part} is not a section; cannot set {key}"
                )
    return config_from_dict(values)


def config_diff(a: TrainConfig, b: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ between two configs -> (value in a, value in b)."""

    def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for name, value in values.items():
            key = f"{prefix}{name}"
            if isinstance(value, Mapping):
                flat.update(flatten(value, key + "."))
            else:
                flat[key] = value
        return flat

    flat_a, flat_b = flatten(config_to_dict(a)), flatten(config_to_dict(b))
    return {
        k: (flat_a.get(k), flat_b.get(k))
        for k in sorted(flat_a.keys() | flat_b.keys())
        if flat_a.get(k) != flat_b.get(k)
    }


# --- presets ---------------------------------------------------------------------------------------


def _preset_dir() -> Any:
    return importlib.resources.files("torchvote") / "presets"


def list_presets() -> dict[str, str]:
    """Shipped preset names -> their one-line descriptions."""
    presets: dict[str, str] = {}
    directory = _preset_dir()
    if not directory.is_dir():
        return presets
    for entry in sorted(directory.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            document = yaml.safe_load(entry.read_text(encoding="utf-8")) or {}
            presets[entry.name[: -len(".yaml")]] = str(document.get("description", ""))
    return presets


def load_preset(name_or_path: str) -> dict[str, Any]:
    """The YAML document of a shipped preset (by name) or of a YAML file (by path).

    Raises:
        ConfigError: neither a shipped preset nor an existing file; the message lists the presets.
        FileNotFoundError: never; a missing path is reported as a ConfigError.
    """
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"preset file {str(path)!r} does not exist")
        text = path.read_text(encoding="utf-8")
    else:
        entry = _preset_dir() / f"{name_or_path}.yaml"
        if not entry.is_file():
            raise ConfigError(
                f"unknown preset {name_or_path!r}; presets: {', '.join(list_presets()) or '(none)'} "
                "(or a path to a .yaml file)"
            )
        text = entry.read_text(encoding="utf-8")
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"preset {name_or_path!r} is not valid YAML: {err}") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(f"preset {name_or_path!r} must be a YAML mapping, got {type(document).__name__}")
    return document


def load_config(preset: str | None = None, overrides: Iterable[str] = ()) -> TrainConfig:
    """A preset (shipped name or YAML path; ``None`` for the defaults) plus dotted overrides.

    Raises:
        ConfigError: an unknown preset, key or value; the message lists what exists.
    """
    values = load_preset(preset) if preset is not None else {}
    if preset is not None:
        values.setdefault("preset", Path(preset).stem if Path(preset).suffix in (".yaml", ".yml") else preset)
    return apply_overrides(config_from_dict(values), overrides)
