"""Models created by name: ``create_model("cnn-baseline", preset="small")``.

Each model lives in its own module of this package and registers itself with
:func:`~torchvote.models.registry.register_model`; the modules are imported the first time the
registry is queried, so a new model file needs no edit here.
"""

from torchvote.models import registry
from torchvote.models.registry import TASKS as TASKS
from torchvote.models.registry import ClassifierOutput as ClassifierOutput
from torchvote.models.registry import ModelSpec as ModelSpec
from torchvote.models.registry import SequenceOutput as SequenceOutput
from torchvote.models.registry import Task as Task
from torchvote.models.registry import build_config as build_config
from torchvote.models.registry import create_model as create_model
from torchvote.models.registry import get_model_spec as get_model_spec
from torchvote.models.registry import list_models as list_models
from torchvote.models.registry import model_config as model_config
from torchvote.models.registry import register_model as register_model
from torchvote.models.registry import registered_name as registered_name

# Re-exported with redundant aliases (explicit for linters and type checkers); the list of names
# is the registry's own.
__all__ = list(registry.__all__)
