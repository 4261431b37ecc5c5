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

    A module in evaluation mode throughout is not touched at all, so threads may share it (a
    server generating from one model in several threads). A module's mode is shared state: two
    threads in this block with a model in training mode would put its modes back under each
    other's steps; call ``model.eval()`` before serving it from threads.

    Args:
        module: the module to evaluate with.

    Yields:
        Nothing: the block runs with ``module`` and all its submodules in evaluation mode.
    """
    modes = [(part, part.training) for part in module.modules()]
    if not any(training for _, training in modes):  # nothing to switch, nothing to give back
        yield
        return
    module.eval()
    try:
        yield
    finally:
        for part, training in modes:
            part.training = training
