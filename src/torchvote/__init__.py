"""torchvote: self-attention and capsule routing as one operator, weighted voting.

``import torchvote`` is light (no torch import): the subpackages load on first use, so
``torchvote.nn.CapsuleLinear`` works after a plain ``import torchvote``, as ``torch.nn`` does.

Subpackages, from the operator up (``docs/architecture.md`` draws them):

- :mod:`torchvote.functional`: the voting operator and every attention and routing procedure;
- :mod:`torchvote.nn`: the modules that own parameters (attention, capsule layers, routers);
- :mod:`torchvote.models`: the registered models (CapsNet, Efficient-CapsNet, Transformers, ...);
- :mod:`torchvote.losses`, :mod:`torchvote.data`, :mod:`torchvote.training`: what a run needs;
- :mod:`torchvote.pretrained`, :mod:`torchvote.explain`, :mod:`torchvote.experiments`: the
  pretrained encoder, the pictures of the votes, the experiments of ``docs/results.md``.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

__all__ = [
    "__version__",
    "data",
    "experiments",
    "explain",
    "functional",
    "losses",
    "models",
    "nn",
    "pretrained",
    "training",
    "validation",
]

_SUBMODULES = frozenset(__all__) - {"__version__"}

try:
    __version__: str = version("torchvote")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> ModuleType:
    """Import a subpackage on first attribute access (PEP 562)."""
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
