"""The old path of :mod:`torchvote.training.evaluation`, kept so that imports from it still work.

``torchvote.training.evaluate`` is also the function :func:`~torchvote.training.evaluate` that the
package exports, which hid this module: ``import torchvote.training.evaluate as m`` gave the
function, and ``monkeypatch.setattr("torchvote.training.evaluate.load_data", ...)`` failed. The
module is now :mod:`torchvote.training.evaluation`; import from there, and patch names there (a
name set on this module reaches no caller). Every name is looked up there, so
``from torchvote.training.evaluate import evaluate_checkpoint`` gives the same object. The package
loads this module before it binds the function, so importing this path leaves
``torchvote.training.evaluate`` the function.
"""

from __future__ import annotations

from typing import Any

from torchvote.training import evaluation

__all__ = list(evaluation.__all__)


def __getattr__(name: str) -> Any:
    return getattr(evaluation, name)


def __dir__() -> list[str]:
    return sorted(set(dir(evaluation)) | set(globals()))
