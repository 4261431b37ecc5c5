"""Models created by name: ``create_model("cnn-baseline", preset="small")``.

Each model lives in its own module of this package and registers itself with
:func:`~torchvote.models.registry.register_model`; the modules are imported the first time the
registry is queried, so a new model file needs no edit here.
"""

from torchvote.models.registry import (
    TASKS,
    ClassifierOutput,
    ModelSpec,
    SequenceOutput,
    build_config,
    create_model,
    get_model_spec,
    list_models,
    model_config,
    register_model,
    registered_name,
)

__all__ = [
    "TASKS",
    "ClassifierOutput",
    "ModelSpec",
    "SequenceOutput",
    "build_config",
    "create_model",
    "get_model_spec",
    "list_models",
    "model_config",
    "register_model",
    "registered_name",
]
