"""Which parameters weight decay reaches (``optim.weight_decay_on``), checked by one optimiser step
on zero gradients against each optimiser's update written out by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchvote.training import train
from torchvote.training.config import ConfigError, apply_overrides
from torchvote.training.optim import build_optimizer
from torchvote.training.schema import OptimConfig

from .test_loop import _StopAfter

LR, DECAY = 0.1, 0.5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 3), nn.LayerNorm(3))


def _step(model: nn.Module, config: OptimConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (before, after)}`` of one step on gradients of zero: what moves, weight decay moved."""
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(model.parameters(), config)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return {name: (before[name], p.detach()) for name, p in model.named_parameters()}


def _decayed(name: str, optimizer: str, before: torch.Tensor) -> torch.Tensor:
    """One step on a zero loss gradient with decay ``DECAY``, by hand: AdamW shrinks the weight by
    ``lr * decay`` (Loshchilov and Hutter 2019, Algorithm 2, line 12); SGD's gradient is
    ``decay * p`` and its first momentum buffer that gradient; Adam's gradient is ``decay * p``
    too, and its first bias-corrected step is ``lr * g / (|g| + eps)``."""
    if optimizer == "adamw":
        return before * (1 - LR * DECAY)
    gradient = DECAY * before
    if optimizer == "sgd":
        return before - LR * gradient
    return before - LR * gradient / (gradient.abs() + 1e-8)


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
def test_matrices_only_spares_biases_and_norm_gains(optimizer):
    config = OptimConfig(name=optimizer, lr=LR, weight_decay=DECAY, weight_decay_on="matrices")
    moved = _step(_model(), config)
    for name, (before, after) in moved.items():
        if before.dim() >= 2:  # the embedding and the linear weight
            torch.testing.assert_close(after, _decayed(name, optimizer, before))
        else:  # the linear bias, the norm's gain and bias: as they were
            assert torch.equal(after, before), name
    assert sum(before.dim() >= 2 for before, _ in moved.values()) == 2


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
def test_all_decays_every_parameter(optimizer):
    moved = _step(_model(), OptimConfig(name=optimizer, lr=LR, weight_decay=DECAY))
    for name, (before, after) in moved.items():
        torch.testing.assert_close(after, _decayed(name, optimizer, before))


def test_without_weight_decay_the_parameters_stay_one_group():
    model = _model()
    for on in ("all", "matrices"):
        optimizer = build_optimizer(model.parameters(), OptimConfig(name="adamw", weight_decay_on=on))
        assert len(optimizer.param_groups) == 1
    only_vectors = nn.LayerNorm(3)  # nothing of two dimensions: no empty group
    config = OptimConfig(name="adamw", weight_decay=DECAY, weight_decay_on="matrices")
    (group,) = build_optimizer(only_vectors.parameters(), config).param_groups
    assert group["weight_decay"] == 0.0


def test_a_run_takes_it_from_the_command_line_and_resumes_with_it(tiny_config):
    config = tiny_config("run", "optim.name=adamw", "optim.weight_decay=0.1",
                         "optim.weight_decay_on=matrices")
    stopped = train(config, callbacks=[_StopAfter(3)], verbose=False)
    state = torch.load(stopped.checkpoint.state, weights_only=True)
    assert [group["weight_decay"] for group in state["optimizer"]["param_groups"]] == [0.1, 0.0]
    resumed = train(config, resume=stopped.run_dir, verbose=False)  # the two groups' state loads
    assert resumed.step > stopped.step and not resumed.interrupted
    with pytest.raises(ConfigError, match="optim.weight_decay_on: 'biases' is not one of: all, matrices"):
        apply_overrides(config, ["optim.weight_decay_on=biases"])


@pytest.mark.parametrize("preset", ["lm-shakespeare", "seq2seq-reverse", "vit-mnist"])
def test_transformer_presets_decay_weight_matrices_only(preset):
    """As nanoGPT trains GPT-2, the weight matrices and embeddings decay, not the biases nor
    LayerNorm's gains and shifts (timm's ViT also spares its class token and position embeddings,
    which decay here): one AdamW step of the preset's optimiser on zero gradients shrinks exactly
    the tensors of two or more dimensions by ``1 - lr * decay``."""
    from torchvote.models.registry import create_model
    from torchvote.training.config import load_config

    config = load_config(preset)
    model = create_model(config.model.name, "tiny")
    moved = _step(model, config.optim)
    norms = {name for name, module in model.named_modules() if isinstance(module, nn.LayerNorm)}
    assert norms and any(name.endswith(".bias") for name in moved)  # the exempt kinds are there
    shrink = 1 - config.optim.lr * config.optim.weight_decay
    for name, (before, after) in moved.items():
        torch.testing.assert_close(after, before * shrink if before.dim() >= 2 else before,
                                   rtol=0, atol=0, msg=name)  # the same float32 product AdamW forms
