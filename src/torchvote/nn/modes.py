"""Evaluation mode for the length of a block, every submodule's own mode given back afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["evaluating"]


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """Evaluation mode (no dropout, batch norm on its running statistics) inside the block.

    Afterwards each submodule is given back its own previous mode, not the top module's:
    ``module.train(was_training)`` would also put back in training mode a part the user keeps in
    evaluation mode inside a training model (a frozen batch norm, an encoder without dropout).

    Args:
        module: the module to evaluate with.

    Yields:
        Nothing: the block runs with ``module`` and all its submodules in evaluation mode.
    """
    modes = [(part, part.training) for part in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for part, training in modes:
            part.training = training
