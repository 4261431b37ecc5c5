"""Training configs: dataclasses as the schema, YAML presets, ``key=value`` overrides (OmegaConf).

A run is described by one :class:`TrainConfig`. It is built from a YAML preset (shipped in
``torchvote/presets/*.yaml`` or any file a user names), then changed by dotted overrides from the
command line, as torchtune does with OmegaConf::

    torchvote train mnist-cnn epochs=3 optim.lr=3e-4 model.dropout=0.2 data.shift=2
    torchvote train capsnet-mnist model.router_options.iterations=2   # or ={iterations: 2}

The dataclasses below are OmegaConf structured configs: every value is checked against the type of
its field (``int``, ``float``, ``bool``, ``str``, ``Literal`` choices, tuples, ``None`` for
optional fields) by :func:`~torchvote.training.keyvalue.typed_fields`. ``model.<field>`` keys other
than ``model.name`` and ``model.preset`` are fields of the model's own config dataclass, checked
against it; the model config is built from them by one function, :func:`build_model_config`, whose
``__post_init__`` is the one check of their values. A wrong key or value raises
:class:`ConfigError`, a ``ValueError`` whose message lists the valid keys or choices.

Values may use OmegaConf interpolation, ``out_dir=runs/seed-${seed}`` or ``${oc.env:HOME}``: it is
resolved once, when the config loads, so the config (and the copy a run saves) holds the values;
a key that does not exist is a :class:`ConfigError` naming the key it was given to.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import typing
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from torchvote.training.keyvalue import (
    ConfigError,
    _split_commas,
    coerce_value,
    field_types,
    parse_entry,
    parse_override,
    parse_value,
    typed_fields,
    unknown_key,
)
from torchvote.training.schema import (
    RESUMABLE_KEYS,
    DataConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from torchvote.validation import check_texts

__all__ = [
    "RESUMABLE_KEYS",
    "ConfigError",
    "DataConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "apply_overrides",
    "build_model_config",
    "coerce_value",
    "config_diff",
    "config_from_dict",
    "config_to_dict",
    "list_presets",
    "load_config",
    "load_preset",
    "model_config_from",
    "parse_override",
    "resolve_loss_name",
    "saved_config",
]


#: The keys of ``model`` that are not fields of the model's own config.
_MODEL_KEYS = ("name", "preset")


def config_from_dict(values: Mapping[str, Any]) -> TrainConfig:
    """Build a :class:`TrainConfig` from nested mappings (a YAML document), type-checking every
    value against the dataclass fields (an OmegaConf structured config), the model's fields too.

    Args:
        values: the document; keys of ``model`` other than ``name`` and ``preset`` are fields of
            the model's config (as in a preset).

    Returns:
        The config, its ``__post_init__`` checks passed.

    Raises:
        ConfigError: an unknown key, a value of the wrong type, an unknown model or preset, or a
            value a config's own checks refuse.
    """
    if not isinstance(values, Mapping):
        raise ConfigError(f"a config must be a mapping of keys to values, got {type(values).__name__}")
    values = dict(values)
    model = values.get("model")
    if isinstance(model, Mapping):  # any other key under `model:` is a field of the model's config
        overrides = {k: v for k, v in model.items() if k not in _MODEL_KEYS}
        values["model"] = {**{k: model[k] for k in _MODEL_KEYS if k in model}, "overrides": overrides}
    elif "model" in values:  # `model: capsnet` (typed_fields would list model.overrides, no key)
        raise ConfigError(
            f"model is a section, got {model!r}; set its keys: model.name, model.preset and the "
            "fields of the model's config (e.g. model: {name: capsnet, iterations: 3})"
        )
    checked = typed_fields(TrainConfig, values)
    try:
        config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), checked))
    except OmegaConfBaseException as err:  # a __post_init__ check, raised inside OmegaConf
        if isinstance(err.__cause__, ValueError):
            raise ConfigError(str(err.__cause__).splitlines()[0]) from None
        # anything else OmegaConf refuses (an interpolation `${name}` of no key) names its key
        key = getattr(err, "full_key", None)
        raise ConfigError(f"{key + ': ' if key else ''}{str(err).splitlines()[0]}") from None
    assert isinstance(config, TrainConfig)
    config.model.overrides = _typed_model_overrides(config.model)
    build_model_config(config.model)  # the model config's own checks, once, at load time
    _check_data_names(config)
    _check_image_options(config)
    return config


def _check_image_options(config: TrainConfig) -> None:
    """``data.shift`` and ``data.canvas`` move training images: refused for a model of another
    task, which would train as if they were not set (a misplaced override, silently dropped).

    Raises:
        ConfigError: naming the key, the model and its task.
    """
    task = _model_spec(config.model.name).task
    if task == "image-classification":
        return
    data = config.data
    for key, value, unset in (("data.shift", data.shift, 0), ("data.canvas", data.canvas, None)):
        if value != unset:
            raise ConfigError(
                f"{key}: only image models take it (it moves the training images); model "
                f"{config.model.name!r} has task {task!r}"
            )


def _check_data_names(config: TrainConfig) -> None:
    """The data sets a config trains and evaluates on (``data.name``, ``data.eval_name``, each
    ``eval_on`` entry) exist, and ``data.eval_split`` is a split of the evaluated one: checked at
    load, named by key, not when the run reaches them. (An ``eval_on`` entry's options and whether
    its images fit the model are checked by the run before it trains.)

    Raises:
        ConfigError: naming the key, listing the data sets or splits.
    """
    from torchvote.data.registry import dataset_splits, list_datasets

    known = list_datasets()

    def check(name: str, key: str) -> None:
        if name not in known:
            raise ConfigError(f"{key}: unknown data set {name!r}; data sets: {', '.join(known)}")

    data = config.data
    check(data.name, "data.name")
    for entry in config.eval_on:
        check(parse_entry(entry, "eval_on")[0], f"eval_on entry {entry!r}")
    if data.eval_name is not None:
        check(data.eval_name, "data.eval_name")
    evaluated = data.eval_name or data.name
    splits = dataset_splits(evaluated)
    if data.eval_split is not None and data.eval_split not in splits:
        raise ConfigError(
            f"data.eval_split: {data.eval_split!r} is not a split of {evaluated!r}; "
            f"splits: {', '.join(splits)}"
        )


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """The config as plain nested dicts, lists and scalars (YAML and JSON friendly).

    Model overrides appear as keys of ``model`` beside ``name`` and ``preset``, as in a preset.

    Raises:
        TypeError: ``config`` is no :class:`TrainConfig` (``dataclasses.asdict``'s error named
            none; :func:`apply_overrides` and :func:`config_diff` read configs through this).
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig (load_config builds one), got {type(config).__name__}")

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


def _model_spec(name: str) -> Any:
    from torchvote.models.registry import get_model_spec

    try:
        return get_model_spec(name)
    except ValueError as err:
        raise ConfigError(f"model.name: {err}") from None


def _typed_model_overrides(model: ModelConfig) -> dict[str, Any]:
    """``model.overrides`` type-checked against the fields of the model's config dataclass."""
    spec = _model_spec(model.name)
    names = field_types(spec.config_cls)
    for name in model.overrides:
        if name not in names:
            raise unknown_key(f"model.{name}", _model_keys(model.name), f" for model {model.name!r}")
    return typed_fields(spec.config_cls, model.overrides, "model")


def _model_keys(name: Any) -> list[str]:
    """The keys a user sets under ``model``: its name, its preset and the fields of the named
    model's config (``model.overrides`` is how they are stored, never a key of its own); only
    the first two when ``name`` names no model."""
    from torchvote.models.registry import get_model_spec

    try:
        fields = list(field_types(get_model_spec(name).config_cls))
    except (ValueError, TypeError):
        fields = []
    return ["model.name", "model.preset", *(f"model.{n}" for n in fields)]


#: Data-dictated model fields that must match exactly (the others are sizes the model may exceed).
_EXACT_DATA_FIELDS = frozenset({"in_channels", "pad_id"})


def build_model_config(model: ModelConfig, **data_fields: Any) -> Any:
    """The model's config dataclass: its defaults, the preset, the data's fields, the overrides.

    ``data_fields`` are values the data set dictates (``image_size``, ``num_classes``,
    ``vocab_size``, ``max_len`` ...); they fill the fields the model config has, unless an override
    set them. An overridden size may exceed the data's (a 40x40 model on 28x28 digits, which are
    then centred; a larger vocabulary) but not fall short of it; ``in_channels`` and ``pad_id``
    must match.

    Args:
        model: the ``model`` section (overrides already type-checked).
        data_fields: the data set's values.

    Returns:
        The model's config, checked by its own ``__post_init__`` (the one check of its values).

    Raises:
        ConfigError: an unknown preset, a value the model config refuses, or an override that
            contradicts the data.
    """
    from torchvote.models.registry import build_config

    names = set(_model_spec(model.name).config_fields())
    values = dict(model.overrides)
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
        return build_config(model.name, model.preset, **values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model: {err}") from None


def model_config_from(config: TrainConfig, **data_fields: Any) -> Any:
    """The model's config dataclass for a run (:func:`build_model_config` of ``config.model``).

    Raises:
        ConfigError: an override contradicts the data, or the model config refuses a value.
    """
    return build_model_config(config.model, **data_fields)


def resolve_loss_name(loss_name: str, spec: Any, model_config: Any) -> str:
    """The loss a run trains with: ``loss.name`` if the user chose one, else the model's default.

    ``loss.name`` is ``auto`` unless a preset or an override set it, so an explicit
    ``loss.name=margin`` (command line or YAML) always wins. ``auto`` gives the spread loss when
    the model routes its class capsules by EM (``router: em``): EM's output activations are
    logistic units that the spread loss (Hinton et al. 2018, sec. 3.1) compares with each other
    rather than with the margin loss's absolute targets (0.9 / 0.1), though the margin loss trains
    them too (:mod:`torchvote.models.capsnet`'s measurements). It gives cross-entropy when the
    class capsules are scored by a linear map (``scores: linear``, Tsai et al. 2020): their scores
    are logits. Otherwise ``auto`` is the loss the model was registered with (``torchvote list
    models``).

    Resolved where the run is built (:func:`~torchvote.training.objectives.make_objective`), not
    when the config is loaded: a later ``model.router=...`` override still changes it, and the
    recorded config keeps ``auto``.

    Args:
        loss_name: ``config.loss.name``.
        spec: the registered model (:class:`~torchvote.models.registry.ModelSpec`).
        model_config: the model's own config (:func:`build_model_config`).

    Returns:
        ``cross-entropy``, ``margin`` or ``spread``.
    """
    if loss_name != "auto":
        return loss_name
    if getattr(model_config, "scores", None) == "linear":
        return "cross-entropy"
    if getattr(model_config, "router", None) == "em":
        return "spread"
    return spec.loss


def _set_override(values: dict[str, Any], parts: list[str], raw: str) -> None:
    """Set one dotted override in the nested ``values`` of a config (see :func:`apply_overrides`).

    The key is looked up in the dataclass fields: a section must not be set whole, a scalar has no
    keys below it, an unknown key lists the valid ones. ``model.<field>`` keys are kept as text
    (checked against the model's config once the model is known); keys below a dict field
    (``data.options.size``, ``model.router_options.iterations``) are read by :func:`parse_value`.

    Raises:
        ConfigError: an unknown key, a section set whole, or a key below a scalar.
    """
    key = ".".join(parts)
    node: dict[str, Any] = values
    cls: type | None = TrainConfig
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        prefix = ".".join(parts[:depth])
        types_ = field_types(cls) if cls is not None else {}
        if cls is ModelConfig and part not in types_:  # a field of the model's own config
            cls = None
        if cls is None:  # the model's fields, or inside a free-form dict
            if last:
                node[part] = raw if node is values["model"] else parse_value(raw, key)
            else:
                child = node.get(part)
                here = f"{prefix}.{part}" if prefix else part
                child = parse_value(child, here) if isinstance(child, str) else dict(child or {})
                if not isinstance(child, dict):
                    raise ConfigError(f"{prefix}.{part} is not a section; cannot set {key}")
                node[part] = node = child
            continue
        if part not in types_:
            sections = {n: t for n, t in types_.items() if dataclasses.is_dataclass(t)} if depth == 0 else {}
            deeper = [f"{n}.{f}" for n, t in sections.items() for f in field_types(t)]
            raise unknown_key(key, [f"{prefix}.{n}" if prefix else n for n in types_], deeper=deeper)
        annotation = types_[part]
        if last:
            if dataclasses.is_dataclass(annotation):
                keys = [f"{key}.{n}" for n in field_types(annotation)]
                if annotation is ModelConfig:
                    keys = _model_keys(values["model"].get("name"))
                raise ConfigError(f"{key} is a section; set one of its keys: {', '.join(keys)}")
            node[part] = raw
        elif dataclasses.is_dataclass(annotation):
            node, cls = node[part], annotation
        elif annotation is dict or typing.get_origin(annotation) is dict:
            node[part], cls = dict(node.get(part) or {}), None
            node = node[part]
        else:
            raise ConfigError(f"{prefix + '.' if prefix else ''}{part} is not a section; cannot set {key}")


def apply_overrides(config: TrainConfig, overrides: Iterable[str]) -> TrainConfig:
    """A copy of ``config`` with dotted ``key=value`` overrides applied and type-checked.

    ``model.<field>`` keys that are not ``model.name`` / ``model.preset`` set fields of the model's
    own config; ``data.options.<key>`` keys pass extra keyword arguments to the data set; a dict
    field takes a mapping (``model.router_options={iterations: 2}``) or its keys one by one
    (``model.router_options.iterations=2``).

    Raises:
        ConfigError: an unknown key or a value of the wrong type; the message lists valid keys or
            choices.
    """
    try:  # one string was read as one override per character ("got 'e'")
        overrides = check_texts(overrides, "overrides")
    except TypeError as err:
        raise ConfigError(str(err)) from None
    values = config_to_dict(config)
    for text in overrides:
        parts, raw = parse_override(text)
        _set_override(values, parts, raw)
    return config_from_dict(values)


def saved_config(values: Mapping[str, Any]) -> TrainConfig:
    """The config a checkpoint's training state recorded (``state["config"]``), as
    :func:`config_from_dict` reads it, but for one thing older runs may hold: an ``eval_on`` entry
    that gives a key twice (``affnist-style:seed=3,seed=4``), which a new config refuses and these
    runs trained with the last value of. The earlier ones are dropped (a ``UserWarning`` says
    which), so the run still resumes and evaluates as it ran.

    Args:
        values: the recorded config.

    Returns:
        The config.

    Raises:
        ConfigError: as :func:`config_from_dict`.
    """
    entries = values.get("eval_on") if isinstance(values, Mapping) else None
    if isinstance(entries, (list, tuple)) and all(isinstance(entry, str) for entry in entries):
        kept = [_last_of_each_key(entry) for entry in entries]
        if kept != list(entries):
            changed = [old for old, new in zip(entries, kept, strict=True) if old != new]
            warnings.warn(
                f"the saved config's eval_on gives a key twice in {changed}; the run used the last "
                "value of each, and so does this", UserWarning, stacklevel=2,
            )
            values = {**values, "eval_on": kept}
    return config_from_dict(values)


def _last_of_each_key(entry: str) -> str:
    """An ``eval_on`` entry with only the last ``key=value`` of each repeated key."""
    name, colon, rest = entry.partition(":")
    items = [item.strip() for item in _split_commas(rest) if item.strip()]
    keys = [item.partition("=")[0].strip() for item in items]
    kept = [item for index, item in enumerate(items) if keys[index] not in keys[index + 1 :]]
    return entry if len(kept) == len(items) else f"{name}{colon}{','.join(kept)}"


def config_diff(a: TrainConfig, b: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ between two configs -> (value in a, value in b).

    ``loss.name`` differs only if the losses it resolves to do (:func:`resolve_loss_name`): a run
    made with ``margin`` and a preset that now says ``auto`` for the same margin loss are one.
    Likewise the model: where both model sections build (:func:`build_model_config`), their
    ``preset`` and ``overrides`` are compared through the model configs they give, field by field
    (``model.preset=tiny`` and ``model.d_model=32``, tiny's own value, are one model; a run of
    ``tiny`` given ``d_model=64`` differs as ``model.d_model (32, 64)``, not ``(None, 64)``). A
    field the data fill (the task handler's ``data_fields``: ``image_size``, ``vocab_size`` ...)
    is compared as given: built without the data, an override of it and none would look alike.
    """

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
    diff = {
        k: (flat_a.get(k), flat_b.get(k))
        for k in sorted(flat_a.keys() | flat_b.keys())
        if flat_a.get(k) != flat_b.get(k)
    }
    if "loss.name" in diff and _resolved_loss(a) == _resolved_loss(b) is not None:
        del diff["loss.name"]
    section = [key for key in diff if key.startswith("model.") and key != "model.name"]
    built = (_built_model(a), _built_model(b)) if section and "model.name" not in diff else (None, None)
    if None not in built:
        filled = {f"model.{name}" for name in _model_spec_data_fields(a.model.name)}
        for key in section:
            if key not in filled:
                del diff[key]
        for name in (field.name for field in dataclasses.fields(built[0])):
            if f"model.{name}" not in filled and getattr(built[0], name) != getattr(built[1], name):
                diff[f"model.{name}"] = (getattr(built[0], name), getattr(built[1], name))
        diff = dict(sorted(diff.items()))
    return diff


def _model_spec_data_fields(model_name: str) -> tuple[str, ...]:
    """The config fields the data fill for model ``model_name`` (its task handler's)."""
    from torchvote.training.tasks import get_task_handler

    return get_task_handler(_model_spec(model_name).task).data_fields


def _built_model(config: TrainConfig) -> Any:
    """The model config ``config`` builds (without the data's fields), or ``None`` where it does
    not build."""
    try:
        return build_model_config(config.model)
    except (ValueError, TypeError):
        return None


def _resolved_loss(config: TrainConfig) -> str | None:
    """The loss ``config`` trains with, or ``None`` where its model config does not build."""
    from torchvote.models.registry import get_model_spec

    try:
        return resolve_loss_name(config.loss.name, get_model_spec(config.model.name),
                                 build_model_config(config.model))
    except (ValueError, TypeError):
        return None


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
            document = _read_yaml(entry.read_text(encoding="utf-8"), entry.name)
            presets[entry.name[: -len(".yaml")]] = str(document.get("description", ""))
    return presets


def load_preset(name_or_path: str) -> dict[str, Any]:
    """The YAML document of a shipped preset (by name) or of a YAML file (by path).

    Raises:
        ConfigError: neither a shipped preset nor an existing file; the message lists the presets.
        FileNotFoundError: never; a missing path is reported as a ConfigError.
    """
    path = Path(name_or_path)
    if _names_a_file(name_or_path):
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
    return _read_yaml(text, name_or_path)


def _names_a_file(name_or_path: str) -> bool:
    """Whether a preset argument names a YAML file (a ``.yaml`` / ``.yml`` path, or any existing
    file) rather than a shipped preset. A shipped preset's bare name is the preset even where a
    file of that name lies in the working folder (``torchvote main`` beside a file ``main``
    read that file): such a file is named ``./main``."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        return True
    bare = os.sep not in name_or_path and (os.altsep is None or os.altsep not in name_or_path)
    if bare and (_preset_dir() / f"{name_or_path}.yaml").is_file():
        return False
    return path.is_file()


def _read_yaml(text: str, name: str) -> dict[str, Any]:
    """A preset's YAML text as plain dicts, read by OmegaConf.

    Raises:
        ConfigError: not YAML, or not a mapping.
    """
    try:
        document = OmegaConf.to_container(OmegaConf.create(text)) if text.strip() else {}
    except (OmegaConfBaseException, yaml.YAMLError) as err:
        raise ConfigError(f"preset {name!r} is not valid YAML: {err}") from None
    if not isinstance(document, dict):
        raise ConfigError(f"preset {name!r} must be a YAML mapping, got {type(document).__name__}")
    return document


def load_config(preset: str | None = None, overrides: Iterable[str] = ()) -> TrainConfig:
    """A preset (shipped name or YAML path; ``None`` for the defaults) plus dotted overrides.

    Raises:
        ConfigError: an unknown preset, key or value; the message lists what exists.
    """
    overrides = list(overrides)
    for text in overrides:  # it would rename the run only: the preset argument chooses the preset
        if isinstance(text, str) and text.partition("=")[0].strip() == "preset":
            raise ConfigError(
                f"{text!r}: preset is not an override; name the preset first (torchvote train NAME ...)"
            )
    values = load_preset(preset) if preset is not None else {}
    if preset is not None:  # a file's name without its folders: the run folder is <out_dir>/<preset>-<time>
        values.setdefault("preset", Path(preset).stem if _names_a_file(preset) else preset)
    return apply_overrides(config_from_dict(values), overrides)
