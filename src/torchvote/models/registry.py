"""The model registry: every model is created by name, from a dataclass config and named presets.

A model is one file in ``torchvote/models/`` that registers itself::

    @dataclass
    class MyNetConfig:
        image_size: int = 28
        in_channels: int = 1
        num_classes: int = 10
        width: int = 64

    @register_model(
        "my-net",
        config=MyNetConfig,
        presets={"small": {"width": 16}},
        task="image-classification",
        loss="cross-entropy",
    )
    class MyNet(nn.Module):
        def __init__(self, config: MyNetConfig, *, device=None, dtype=None) -> None: ...
        def forward(self, images, targets=None) -> ClassifierOutput: ...

``device`` and ``dtype`` are torch's factory keywords (as ``nn.Linear(..., device=, dtype=)``):
the model passes them to every submodule and creates every parameter and buffer there, so that
``dtype=torch.bfloat16`` builds in that precision without a float32 copy first, and
``device="meta"`` allocates nothing. A model built on ``"meta"`` is made real the PyTorch way::

    model = create_model("transformer-lm", device="meta").to_empty(device="cuda")
    for module in model.modules():  # what no checkpoint holds (a sinusoidal table) is computed
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    model.load_state_dict(checkpoint)

Without a checkpoint the loop alone initialises the model: every parameter gets real values
(tested for every model, ``tests/nn/test_meta_init.py``), each torchvote module's own drawn as
its constructor draws them; a ``torch.nn`` layer inside takes torch's default initialisation
where the constructor chose another (a zero output bias, GPT-2's embedding scale).

Every module in this package is imported the first time the registry is queried, so adding the
file is all it takes; ``list_models()`` then returns it and the registry sweep test covers it.

**What the training loop expects of each task** (the conventions that keep the loop generic):

``image-classification``
    config fields ``image_size`` (square side), ``in_channels`` and ``num_classes``, filled from the
    data set when training; ``forward(images (b, c, h, w), targets)`` returns a
    :class:`ClassifierOutput`. ``targets`` are ``(b,)`` class indices, or ``(b, k)`` the ``k``
    classes present in each image (MultiMNIST), during training, and ``None`` at evaluation: only
    models that mask a decoder with the true class use them. With ``loss="margin"`` the
    ``reconstructions`` (``(b, c, h, w)``, or ``(b, k, c, h, w)`` against MultiMNIST's separate
    digits) add the reconstruction loss.
``language-model``
    config fields ``vocab_size`` and ``context_length``; ``forward(tokens (b, t))`` returns a
    :class:`SequenceOutput` with next-token logits ``(b, t, vocab_size)``.
``seq2seq``
    config fields ``src_vocab_size``, ``tgt_vocab_size`` and ``max_len``; ``forward(source (b, s),
    target_input (b, t))`` returns a :class:`SequenceOutput` with logits ``(b, t, tgt_vocab_size)``.
    Token id ``pad_id`` (config field, 0 when absent) is padding in both sequences. The property
    ``max_source_length`` is the longest source it reads (``None``: any length).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from torchvote.nn.routers.base import is_redefinition
from torchvote.tracing import register_output
from torchvote.validation import check_choice, check_factory_device, check_float_dtype

__all__ = [
    "TASKS",
    "ClassifierOutput",
    "ModelSpec",
    "SequenceOutput",
    "Task",
    "build_config",
    "create_model",
    "get_model_spec",
    "list_models",
    "model_config",
    "register_model",
    "registered_name",
]

Task = Literal["image-classification", "seq2seq", "language-model"]
TASKS: tuple[str, ...] = get_args(Task)
LOSSES: tuple[str, ...] = ("cross-entropy", "margin", "spread")


@dataclass
class ClassifierOutput:
    """What an image classifier returns.

    Args:
        scores: ``(b, num_classes)`` class scores whose argmax is the prediction: logits for a CNN,
            capsule lengths (margin loss) or activations (spread loss) for a capsule network.
        reconstructions: ``(b, c, h, w)`` decoder output, for the reconstruction loss.
        poses: ``(b, num_classes, d)`` class capsules, when the model has them.
        couplings: ``(b, i, j)`` routing / attention weights of the last voting layer.
        intermediates: anything else a plot may want (per-iteration weights, ...).
    """

    scores: Tensor
    reconstructions: Tensor | None = None
    poses: Tensor | None = None
    couplings: Tensor | None = None
    intermediates: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class SequenceOutput:
    """What a language model or a sequence-to-sequence model returns.

    Args:
        logits: ``(b, t, vocab)`` next-token logits.
        attention: attention / routing weights per layer, when recorded.
        intermediates: anything else a plot may want.
    """

    logits: Tensor
    attention: list[Tensor] | None = None
    intermediates: dict[str, Tensor] = field(default_factory=dict)


register_output(ClassifierOutput)  # pytree nodes: torch.export can return them
register_output(SequenceOutput)


@dataclass(frozen=True)
class ModelSpec:
    """One registered model: how to build it and what the training loop does with it.

    Attributes:
        name: the registry name.
        model_cls: the ``nn.Module`` class, built as ``model_cls(config, device=None,
            dtype=None)``.
        config_cls: its ``@dataclass`` config.
        presets: preset name -> the config fields it sets.
        task: ``"image-classification"``, ``"seq2seq"`` or ``"language-model"``.
        loss: the training loop's default loss: ``"cross-entropy"``, ``"margin"`` or ``"spread"``.
        default_preset: the preset used when none is named; ``None``: the config's defaults.
        description: the first line of the model class's docstring.
    """

    name: str
    model_cls: type[nn.Module]
    config_cls: type
    presets: Mapping[str, Mapping[str, Any]]
    task: str
    loss: str
    default_preset: str | None
    description: str

    def config_fields(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.config_cls)]


_REGISTRY: dict[str, ModelSpec] = {}
_LOADED = False  # every model module imported (and so registered)
_LOADING = False  # the model modules are being imported, by the thread holding _LOAD_LOCK
# A server's first requests may ask for models from several threads at once: each waits here
# for the modules, where they read a half-filled registry ("unknown model 'capsnet'; models: ").
# Re-entrant: a model module that queries the registry while it is imported is that same thread.
_LOAD_LOCK = threading.RLock()


def register_model(
    name: str,
    *,
    config: type,
    presets: Mapping[str, Mapping[str, Any] | Any] | None = None,
    task: Task = "image-classification",
    loss: str | None = None,
    default_preset: str | None = None,
) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator that registers an ``nn.Module`` built as ``Model(config, *, device=None,
    dtype=None)`` (torch's factory keywords, passed to every submodule).

    Args:
        name: the registry name (lower case, dashes), e.g. ``"cnn-baseline"``.
        config: the model's ``@dataclass`` config; its defaults are the paper's sizes.
        presets: named sizes, each a mapping of config fields to values (or a config instance).
        task: ``"image-classification"``, ``"seq2seq"`` or ``"language-model"``.
        loss: the loss the training loop uses by default: ``"cross-entropy"`` (default),
            ``"margin"`` (plus the reconstruction loss if the model returns reconstructions) or
            ``"spread"``.
        default_preset: the preset used when none is named (default: the config's defaults).

    Returns:
        The decorator; it registers the class and returns it unchanged.

    Raises:
        ValueError: a name another class is registered under (a class of the same module and
            qualified name, such as a notebook cell run again defines, replaces the one
            registered: :func:`~torchvote.nn.routers.base.is_redefinition`), an unknown task or
            loss, a config that is not a dataclass, or a preset naming a field the config does
            not have.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    loss = loss or "cross-entropy"
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; losses: {', '.join(LOSSES)}")
    if not dataclasses.is_dataclass(config):
        raise ValueError(f"config of model {name!r} must be a @dataclass, got {config!r}")
    field_names = {f.name for f in dataclasses.fields(config)}
    checked: dict[str, dict[str, Any]] = {}
    for preset_name, values in (presets or {}).items():
        values = dataclasses.asdict(values) if dataclasses.is_dataclass(values) else dict(values)
        unknown = sorted(set(values) - field_names)
        if unknown:
            raise ValueError(
                f"preset {preset_name!r} of model {name!r} sets unknown fields {unknown}; "
                f"fields: {', '.join(sorted(field_names))}"
            )
        checked[preset_name] = values
    if default_preset is not None and default_preset not in checked:
        raise ValueError(f"default_preset {default_preset!r} of model {name!r} is not a preset")

    def decorator(model_cls: type[nn.Module]) -> type[nn.Module]:
        existing = _REGISTRY.get(name)
        if existing is not None and not is_redefinition(existing.model_cls, model_cls):
            raise ValueError(f"model {name!r} is already registered by {existing.model_cls!r}")
        doc = (model_cls.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = ModelSpec(
            name=name,
            model_cls=model_cls,
            config_cls=config,
            presets=checked,
            task=task,
            loss=loss,
            default_preset=default_preset,
            description=doc[0] if doc else "",
        )
        return model_cls

    return decorator


def _load_all() -> None:
    """Import every module of ``torchvote.models`` once, so that each registers its models.

    A model file that fails to import is an error naming that file: a registry that silently
    lacks a model would be worse.
    """
    global _LOADED, _LOADING
    if _LOADED:
        return
    with _LOAD_LOCK:
        if _LOADED or _LOADING:  # _LOADING: a model module querying the registry as it is imported
            return
        _LOADING = True
        try:
            package = importlib.import_module("torchvote.models")
            for module in pkgutil.iter_modules(package.__path__):
                if module.name.startswith("_") or module.name == "registry":
                    continue
                name = f"torchvote.models.{module.name}"
                try:
                    importlib.import_module(name)
                except Exception as err:
                    raise ImportError(f"model module {name} failed to import: {err}") from err
            _LOADED = True  # last: a failure tries again (and fails loudly again) on the next query
        finally:
            _LOADING = False


def list_models(task: str | None = None) -> list[str]:
    """Sorted names of the registered models (of one task if given).

    Args:
        task: one of :data:`TASKS`; ``None`` lists every model.

    Returns:
        The names, sorted.

    Raises:
        ValueError: a ``task`` that is not one of :data:`TASKS` (it would list no model).

    Examples:
        >>> from torchvote.models import list_models
        >>> names = list_models()
        >>> "capsnet" in names and names == sorted(names)
        True
        >>> "transformer-lm" in list_models("language-model")
        True
        >>> "transformer-lm" in list_models("image-classification")
        False
    """
    if task is not None:
        check_choice(task, TASKS, "task")
    _load_all()
    return sorted(name for name, spec in _REGISTRY.items() if task is None or spec.task == task)


def get_model_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of a registered model.

    Args:
        name: a name from :func:`list_models`.

    Returns:
        Its spec.

    Raises:
        ValueError: an unknown name (anything but a registered ``str``); the message lists the
            registered models.
    """
    _load_all()
    if not isinstance(name, str) or name not in _REGISTRY:  # a list would fail as unhashable
        raise ValueError(f"unknown model {name!r}; models: {', '.join(list_models())}")
    return _REGISTRY[name]


def build_config(name: str, preset: str | None = None, **overrides: Any) -> Any:
    """The config of model ``name``: its defaults, then the preset, then ``overrides``.

    Args:
        name: a name from :func:`list_models`.
        preset: one of the model's presets; ``None``: its default preset, if it has one.
        **overrides: config fields to set, applied after the preset.

    Returns:
        An instance of the model's config dataclass.

    Raises:
        ValueError: an unknown model, preset or config field (the message lists what exists).
    """
    spec = get_model_spec(name)
    preset = preset if preset is not None else spec.default_preset
    values: dict[str, Any] = {}
    if preset is not None:
        if not isinstance(preset, str) or preset not in spec.presets:  # a list: unhashable
            choices = ", ".join(sorted(spec.presets)) or "(none)"
            raise ValueError(f"unknown preset {preset!r} for model {name!r}; presets: {choices}")
        values.update(spec.presets[preset])
    unknown = sorted(set(overrides) - set(spec.config_fields()))
    if unknown:
        raise ValueError(
            f"unknown config field(s) {', '.join(unknown)} for model {name!r}; "
            f"fields: {', '.join(spec.config_fields())}"
        )
    values.update(overrides)
    return spec.config_cls(**values)


def create_model(
    name: str,
    preset: str | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> nn.Module:
    """Build model ``name`` from its config defaults, a named preset and keyword overrides.

    Args:
        name: a name from :func:`list_models`.
        preset: one of the model's presets; ``None``: its default preset, if it has one.
        device: where to create the parameters and buffers (``None``: torch's default device).
        dtype: their floating-point dtype (``None``: torch's default dtype).
        **overrides: config fields to set, applied after the preset.

    Returns:
        The model, freshly initialised.

    Raises:
        ValueError: an unknown model, preset or config field (the message lists what exists), or
            a ``device`` torch does not read or this machine lacks.
        TypeError: a ``dtype`` that is not a floating-point ``torch.dtype``.

    Examples:
        >>> import torch
        >>> from torchvote.models import create_model
        >>> model = create_model("cnn-baseline", preset="tiny", dropout=0.2)
        >>> model.config.dropout
        0.2
        >>> size = model.config.image_size
        >>> model(torch.zeros(2, model.config.in_channels, size, size)).scores.shape  # (batch, classes)
        torch.Size([2, 10])
        >>> skeleton = create_model("capsnet", device="meta")  # no memory; to_empty() later
        >>> next(skeleton.parameters()).device
        device(type='meta')
    """
    spec = get_model_spec(name)
    config = build_config(name, preset, **overrides)
    # Only the keywords given: a model registered without them still builds by default.
    factory = {"device": check_factory_device(device), "dtype": check_float_dtype(dtype)}
    return spec.model_cls(config, **{key: value for key, value in factory.items() if value is not None})


def model_config(model: nn.Module) -> Any:
    """The config a registered model was built with (``model.config``).

    Args:
        model: a model built from a config (any module with a dataclass ``config`` attribute).

    Returns:
        ``model.config``.

    Raises:
        ValueError: ``model`` has no ``config`` attribute, or one that is not a dataclass.
    """
    config = getattr(model, "config", None)
    if config is None or not dataclasses.is_dataclass(config):
        raise ValueError(f"{type(model).__name__} has no dataclass `config` attribute")
    return config


def registered_name(model: nn.Module) -> str:
    """The registry name of a model instance.

    Args:
        model: the model; its exact class must be registered (a subclass is not). A
            ``torch.compile`` wrapper is seen through to the module it wraps.

    Returns:
        The name it is registered under.

    Raises:
        ValueError: the model's class is not registered.
    """
    _load_all()
    model = getattr(model, "_orig_mod", model)  # a torch.compile wrapper: name the module it wraps
    for name, spec in _REGISTRY.items():
        if type(model) is spec.model_cls:
            return name
    raise ValueError(f"{type(model).__name__} is not a registered model")
