"""The CNN baseline of the CapsNet paper: the paper's size, and geometry taken from the config."""

from __future__ import annotations

import pytest
import torch

from torchvote.models import create_model
from torchvote.models.cnn_baseline import CNNBaseline, CNNBaselineConfig


def test_paper_size_has_the_papers_35_4m_parameters():
    # Sabour et al. 2017, sec. 5: "The baseline ... has 35.4M parameters".
    with torch.device("meta"):
        model = create_model("cnn-baseline", "paper")
    count = sum(p.numel() for p in model.parameters())
    assert round(count / 1e6, 1) == 35.4
    convs = [m for m in model.features if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [256, 256, 128]
    assert all(c.kernel_size == (5, 5) and c.stride == (1, 1) for c in convs)
    linears = [m for m in model.fully_connected if isinstance(m, torch.nn.Linear)]
    assert [lin.out_features for lin in linears] == [328, 192]
    assert model.classifier.out_features == 10


@pytest.mark.parametrize(
    ("image_size", "in_channels", "num_classes", "pool_after"),
    [(28, 1, 10, ()), (40, 1, 10, (0, 1)), (32, 3, 5, (0,)), (9, 2, 3, (0, 1, 2))],
)
def test_geometry_follows_the_config(image_size, in_channels, num_classes, pool_after):
    config = CNNBaselineConfig(
        image_size=image_size,
        in_channels=in_channels,
        num_classes=num_classes,
        channels=(4, 6, 8),
        pool_after=pool_after,
        hidden=(12,),
    )
    model = CNNBaseline(config)
    output = model(torch.rand(2, in_channels, image_size, image_size))
    assert output.scores.shape == (2, num_classes)
    side = image_size
    for _ in pool_after:
        side //= 2
    assert model.fully_connected[1].in_features == 8 * side * side


def test_wrong_input_shape_is_a_clear_error():
    model = create_model("cnn-baseline", "tiny")
    with pytest.raises(ValueError, match=r"images must have shape \(b, 1, 28, 28\), got \(2, 1, 40, 40\)"):
        model(torch.rand(2, 1, 40, 40))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kernel_size": 4}, "kernel_size must be odd"),
        ({"channels": ()}, "channels must be a non-empty"),
        ({"pool_after": (3,)}, "pool_after indices \\[3\\]"),
        ({"dropout": 1.0}, "dropout must be in"),
        ({"num_classes": 1}, "num_classes must be an integer >= 2, got 1"),
        ({"image_size": 2, "pool_after": (0, 1)}, "shrink 2x2 to nothing"),
    ],
)
def test_bad_configs_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        CNNBaselineConfig(**overrides)


def test_dropout_is_active_only_in_training():
    torch.manual_seed(0)
    model = create_model("cnn-baseline", "tiny", dropout=0.5)
    images = torch.rand(4, 1, 28, 28)
    model.eval()
    assert torch.equal(model(images).scores, model(images).scores)
    model.train()
    assert not torch.equal(model(images).scores, model(images).scores)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # A zero width cut the classifier off its input (its logits were the bias alone); a
        # negative one failed in nn.Linear, a float one in torch.empty.
        ({"hidden": (0,)}, r"hidden must hold positive integers, got \(0,\)"),
        ({"hidden": (-3,)}, r"hidden must hold positive integers, got \(-3,\)"),
        ({"hidden": 16}, "hidden must be a tuple"),
        ({"channels": 64}, "channels must be a tuple"),
        ({"channels": (8.0,)}, r"channels must hold positive integers, got \(8.0,\)"),
        ({"image_size": 28.0}, "image_size must be a positive integer, got 28.0"),
        ({"in_channels": True}, "in_channels must be a positive integer, got True"),
        ({"kernel_size": 3.0}, "kernel_size must be a positive integer, got 3.0"),
        ({"num_classes": 10.0}, "num_classes must be an integer >= 2, got 10.0"),
    ],
)
def test_sizes_that_are_not_positive_integers_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        create_model("cnn-baseline", "tiny", **overrides)


def test_images_that_are_not_floats_of_the_models_dtype_are_named():
    model = create_model("cnn-baseline", "tiny")
    with pytest.raises(TypeError, match="images must be a floating-point tensor, got torch.uint8"):
        model(torch.randint(0, 255, (2, 1, 28, 28), dtype=torch.uint8))
    with pytest.raises(TypeError, match="images has dtype torch.float64 but the module's parameters are"):
        model(torch.rand(2, 1, 28, 28, dtype=torch.float64))
    with pytest.raises(TypeError, match="images must be a floating-point tensor, got list"):
        model(torch.rand(2, 1, 28, 28).tolist())
    assert model.double()(torch.rand(2, 1, 28, 28, dtype=torch.float64)).scores.dtype == torch.float64
