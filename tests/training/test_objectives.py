"""Training objectives: the loss ``auto`` resolves to, and the spread-loss margin schedule it gets."""

from __future__ import annotations

import pytest
import torch

from torchvote import losses
from torchvote.models.registry import ClassifierOutput, get_model_spec
from torchvote.training.config import LossConfig, build_model_config, load_config
from torchvote.training.objectives import make_objective


def _objective(overrides, total_steps):
    config = load_config("capsnet-mnist", overrides)
    spec = get_model_spec(config.model.name)
    return make_objective(config.loss, spec, total_steps, model_config=build_model_config(config.model))


def _batch():
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(6, 10, generator=generator)
    return ClassifierOutput(scores=scores), {"targets": torch.arange(6), "images": torch.zeros(6, 1, 28, 28)}


@pytest.mark.parametrize("total_steps", [10, 400])
def test_spread_selected_by_the_router_ramps_its_margin_over_the_whole_run(total_steps):
    objective = _objective(["model.router=em"], total_steps)
    output, batch = _batch()
    for step, margin in [(0, 0.2), (total_steps // 2, 0.55), (total_steps, 0.9), (2 * total_steps, 0.9)]:
        value, parts = objective(output, batch, step)
        assert parts["spread_margin"].item() == pytest.approx(margin)
        expected = losses.spread_loss(output.scores, batch["targets"], margin=margin)
        assert value.item() == pytest.approx(expected.item())


def test_the_spread_margin_term_stays_on_the_cpu_whatever_the_default_device():
    """The loop reads the margin every step; made on the default device (a GPU's, under
    ``torch.set_default_device("cuda")``) it cost a copy and a device wait per step. "meta"
    stands in for the GPU here."""
    objective = _objective(["model.router=em"], 10)
    output, batch = _batch()
    with torch.device("meta"):
        _, parts = objective(output, batch, 5)
    assert parts["spread_margin"].device.type == "cpu"
    assert parts["spread_margin"].item() == pytest.approx(0.55)


def test_an_explicit_margin_loss_is_kept_with_em_routing():
    objective = _objective(["model.router=em", "loss.name=margin", "loss.reconstruction_weight=0"], 10)
    output, batch = _batch()
    value, parts = objective(output, batch, 0)
    assert set(parts) == {"margin"}
    assert value.item() == pytest.approx(losses.margin_loss(output.scores, batch["targets"]).item())


def test_without_a_model_config_auto_is_the_registered_loss():
    spec = get_model_spec("capsnet")
    output, batch = _batch()
    _, parts = make_objective(LossConfig(reconstruction_weight=0), spec, 10)(output, batch, 0)
    assert set(parts) == {"margin"}


def test_the_spread_loss_refuses_label_sets_and_names_the_loss_that_takes_them():
    objective = _objective(["model.router=em"], 10)
    output, batch = _batch()
    batch["targets"] = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [1, 2]])  # MultiMNIST's (b, 2)
    with pytest.raises(ValueError, match=r"one label per image.*\(6, 2\).*loss\.name=margin"):
        objective(output, batch, 0)


@pytest.mark.parametrize(
    ("overrides", "dtype", "expected"),
    [
        (["loss.name=margin"], torch.float64, torch.float64),
        (["model.router=em"], torch.float64, torch.float64),
        (["loss.name=margin"], torch.bfloat16, torch.float32),
        (["model.router=em"], torch.bfloat16, torch.float32),
    ],
)
def test_the_capsule_objectives_keep_float64_and_lift_half_precision(overrides, dtype, expected):
    """The margin and spread objectives cast the scores with .float(): a float64 model's loss was
    float32 (1.8e-8 off); half precision is still summed in float32."""
    objective = _objective([*overrides, "loss.reconstruction_weight=0"], 10)
    output, batch = _batch()
    output = ClassifierOutput(scores=output.scores.to(dtype))
    value, _ = objective(output, batch, 0)
    assert value.dtype == expected
