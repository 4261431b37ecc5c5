"""What one optimiser step of the loop does with its options."""

from __future__ import annotations

import math

import torch

from torchvote.training import StepInfo, train


def test_grad_clip_bounds_the_norm_of_each_update(tiny_config):
    """Plain SGD (no momentum, no decay, constant rate) moves the weights by ``lr * g``: with the
    global gradient norm clipped to ``c`` (``torch.nn.utils.clip_grad_norm_``), every step moves
    them by exactly ``lr * c`` (the tiny CNN's gradient norm is far above ``c`` = 1e-3). Without
    the clip the steps are ``lr * |g|`` long, a different length each step."""
    lr, clip = 0.5, 1e-3
    optim = ["optim.name=sgd", "optim.momentum=0", f"optim.lr={lr}", "optim.schedule=constant"]
    optim.append("optim.warmup_steps=0")

    def step_lengths(*overrides: str) -> list[float]:
        previous: list[torch.Tensor] = []
        lengths: list[float] = []

        def record(info: StepInfo) -> None:
            now = [p.detach().clone() for p in info.model.parameters()]
            if previous:
                moved = sum(float((a - b).square().sum()) for a, b in zip(now, previous, strict=True))
                lengths.append(math.sqrt(moved))
            previous[:] = now

        name = "-".join(overrides) or "plain"
        config = tiny_config(name, *optim, *overrides, "max_steps=4", "eval_every=0")
        train(config, callbacks=[record], verbose=False)
        return lengths

    clipped = step_lengths(f"optim.grad_clip={clip}")
    assert len(clipped) == 3
    for length in clipped:
        assert math.isclose(length, lr * clip, rel_tol=1e-3), clipped
    assert all(length > 10 * lr * clip for length in step_lengths()), "the gradients are far above the clip"
