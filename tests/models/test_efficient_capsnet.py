"""Efficient-CapsNet (Mazzia et al. 2021): the paper's 161,824 parameters, geometry from the config,
the depthwise primary capsules and efficient squash, every router, the masked decoder, and a tiny
training run through ``torchvote.training.train``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchvote.functional.routing import list_routers
from torchvote.models import create_model, get_model_spec
from torchvote.models.efficient_capsnet import DepthwisePrimaryCapsules, EfficientCapsNetConfig
from torchvote.nn.routers import SelfAttentionRouter
from torchvote.training import get_task_handler, make_objective, train
from torchvote.training.config import LossConfig, load_config, model_config_from

ROUTERS = sorted(list_routers())


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see the fixture


def _batch(config: EfficientCapsNetConfig, size: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(size, config.in_channels, config.image_size, config.image_size, generator=generator)
    return images, torch.randint(config.num_classes, (size,), generator=generator)


def test_paper_configuration_has_161_824_parameters():
    # Mazzia et al. 2021 (and the authors' Keras model summary): each convolution has a bias and
    # is followed by a batch norm (gain and bias trainable); the depthwise 9x9 convolution has
    # one kernel and bias per channel; the class layer has W (10, 16, 16, 8) and a (16, 10) prior.
    with torch.device("meta"):
        model = create_model("efficient-capsnet", "paper")
    convs = [m for m in model.features if isinstance(m, torch.nn.Conv2d)]
    norms = [m for m in model.features if isinstance(m, torch.nn.BatchNorm2d)]
    conv_counts = [sum(p.numel() for p in conv.parameters()) for conv in convs]
    assert conv_counts == [
        5 * 5 * 1 * 32 + 32,
        3 * 3 * 32 * 64 + 64,
        3 * 3 * 64 * 64 + 64,
        3 * 3 * 64 * 128 + 128,
    ]
    assert conv_counts == [832, 18_496, 36_928, 73_856]
    assert [sum(p.numel() for p in norm.parameters()) for norm in norms] == [64, 128, 128, 256]
    assert sum(p.numel() for p in model.primary.parameters()) == 9 * 9 * 128 + 128 == 10_496
    assert model.head.class_capsules.weight.numel() == 10 * 16 * 16 * 8 == 20_480
    assert isinstance(model.head.class_capsules.router, SelfAttentionRouter)
    assert model.head.class_capsules.router.log_prior.shape == (10, 16)  # (out_caps, in_caps)
    without_decoder = sum(
        p.numel() for name, p in model.named_parameters() if not name.startswith("head.decoder")
    )
    assert without_decoder == 161_824  # the paper's "161K"
    assert sum(p.numel() for p in model.head.decoder.parameters()) == 1_411_344
    assert (
        convs[-1].stride == (2, 2) and model.config.feature_grid == 9 and model.config.num_primary_caps == 16
    )


@pytest.mark.parametrize(("preset", "primary_caps", "class_dim"), [("tiny", 4, 8), ("paper", 16, 16)])
def test_shapes_per_preset(preset, primary_caps, class_dim):
    torch.manual_seed(0)
    model = create_model("efficient-capsnet", preset)
    images, targets = _batch(model.config, 3)
    output = model(images, targets)
    assert output.scores.shape == (3, 10)
    assert output.reconstructions.shape == (3, 1, 28, 28)
    assert output.poses.shape == (3, 10, class_dim)
    assert output.couplings.shape == (3, 10, primary_caps)
    torch.testing.assert_close(output.couplings.sum(dim=1), torch.ones(3, primary_caps))
    torch.testing.assert_close(output.scores, output.poses.norm(dim=-1))
    assert ((output.scores >= 0) & (output.scores < 1)).all()


@pytest.mark.parametrize(
    ("image_size", "in_channels", "primary_kernel", "grid", "caps"),
    [(28, 1, None, 9, 4), (40, 1, None, 15, 4), (32, 3, None, 11, 4), (28, 1, 5, 9, 4 * 25)],
)
def test_geometry_is_derived_from_the_config(image_size, in_channels, primary_kernel, grid, caps):
    model = create_model(
        "efficient-capsnet",
        "tiny",
        image_size=image_size,
        in_channels=in_channels,
        primary_kernel=primary_kernel,
    )
    assert model.config.feature_grid == grid and model.config.num_primary_caps == caps
    assert model.head.class_capsules.in_caps == caps
    output = model(torch.rand(2, in_channels, image_size, image_size), torch.tensor([1, 2]))
    assert output.scores.shape == (2, 10) and output.couplings.shape == (2, 10, caps)
    assert output.reconstructions.shape == (2, in_channels, image_size, image_size)


@pytest.mark.parametrize(
    ("sizes", "kernel_size", "match"),
    [
        ((8, 2, 4), 0, "kernel_size must be a positive integer, got 0"),  # was: accepted
        ((8, 2, 4), 2.5, "kernel_size must be a positive integer, got 2.5"),
        ((0, 0, 4), 3, "channels must be a positive integer, got 0"),
        ((8, -2, -4), 3, "num_types must be a positive integer, got -2"),
    ],
)
def test_depthwise_primary_capsules_refuse_sizes_that_are_not_positive_integers(sizes, kernel_size, match):
    with pytest.raises(ValueError, match=match):
        DepthwisePrimaryCapsules(*sizes, kernel_size=kernel_size)


@pytest.mark.parametrize("map_size", [9, 12])
def test_depthwise_primary_capsules_match_the_grouped_convolution_and_efficient_squash(map_size):
    torch.manual_seed(0)
    layer = DepthwisePrimaryCapsules(32, 4, 8, kernel_size=9)
    features = torch.randn(3, 32, map_size, map_size)
    capsules = layer(features)
    maps = F.conv2d(features, layer.conv.weight, layer.conv.bias, groups=32)  # (b, 32, h', w')
    side = map_size - 8
    assert capsules.shape == (3, 4 * side * side, 8)
    # Channels at one position form a capsule, type-major (t, h, w); eq. 6 rescales its length.
    s = maps.view(3, 4, 8, side, side).permute(0, 1, 3, 4, 2).reshape(3, -1, 8)
    norm = s.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(capsules, (1 - torch.exp(-norm)) * s / norm, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("router", ROUTERS)
def test_every_router_trains_a_step(router):
    torch.manual_seed(0)
    model = create_model("efficient-capsnet", "tiny", router=router)
    images, targets = _batch(model.config)
    model.train()
    output = model(images, targets)
    assert output.scores.shape == (4, 10) and torch.isfinite(output.scores).all()
    batch = {"images": images, "targets": targets}
    loss, _ = make_objective(LossConfig(), get_model_spec("efficient-capsnet"), total_steps=10)(
        output, batch, 0
    )
    loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, f"router {router}: no gradient reaches {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(images).scores).all()


def test_decoder_masks_with_the_target_in_training_and_the_longest_capsule_at_eval():
    torch.manual_seed(0)
    model = create_model("efficient-capsnet", "tiny")
    images, _ = _batch(model.config)
    handler = get_task_handler("image-classification")

    def hand(poses: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        masked = torch.zeros_like(poses)
        rows = torch.arange(len(poses))
        masked[rows, classes] = poses[rows, classes]
        return model.head.decoder.layers(masked.flatten(1)).view(len(poses), 1, 28, 28)

    with torch.no_grad():
        model.eval()
        evaluated = handler.forward(model, {"images": images, "targets": torch.zeros(4, dtype=torch.long)})
        longest = evaluated.scores.argmax(dim=-1)
        torch.testing.assert_close(evaluated.reconstructions, hand(evaluated.poses, longest))
        targets = (longest + 3) % 10
        model.train()
        trained = handler.forward(model, {"images": images, "targets": targets})
        torch.testing.assert_close(trained.reconstructions, hand(trained.poses, targets))


def test_zero_images_give_finite_outputs_and_gradients():
    torch.manual_seed(0)
    model = create_model("efficient-capsnet", "tiny")
    images = torch.zeros(2, 1, 28, 28, requires_grad=True)
    output = model(images, torch.tensor([0, 9]))
    assert torch.isfinite(output.scores).all() and torch.isfinite(output.reconstructions).all()
    (output.scores.sum() + output.reconstructions.sum()).backward()
    assert torch.isfinite(images.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"router": "attention"}, r"router must be one of \['dynamic', 'em'"),
        (
            {"router_options": {"log_prior": True, "agreement": "dot"}},
            "router_options=.*router='self_attention'",
        ),
        ({"router_options": {"iterations": 2}}, r"router_options must not set \['iterations'\]"),
        (
            {"primary_types": 3},
            r"primary_types \* primary_dim \(3 \* 8\) must equal conv_channels\[-1\] \(32\)",
        ),
        ({"conv_kernels": (5, 3, 3)}, "conv_channels, conv_kernels and conv_strides"),
        ({"conv_strides": (1, 1, 1, 0)}, "conv_strides must hold positive integers"),
        ({"image_size": 10}, "image_size=10 is too small"),
        ({"primary_kernel": 10}, "primary_kernel=10 is larger than the 9x9 map"),
        ({"num_classes": 1}, "num_classes must be at least 2"),
        ({"init_std": -1.0}, "init_std must be a positive finite number"),
        ({"batch_norm_momentum": 1.5}, "batch_norm_momentum"),
        ({"batch_norm_eps": 0.0}, "batch_norm_eps"),
        ({"conv_init": "he_uniform"}, "conv_init"),
    ],
)
def test_bad_configs_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        create_model("efficient-capsnet", "tiny", **overrides)


def test_shipped_preset_loads():
    config = load_config("efficient-capsnet-mnist")
    model_config = model_config_from(config, image_size=28, in_channels=1, num_classes=10)
    assert isinstance(model_config, EfficientCapsNetConfig) and model_config.router == "self_attention"


def test_tiny_training_run_lowers_the_loss(tmp_path):
    losses: list[float] = []
    config = load_config(
        "efficient-capsnet-mnist",
        [
            "model.preset=tiny",
            "data.name=small-digits",
            "data.limit=480",
            "data.eval_limit=100",
            "optim.lr=0.003",
            "optim.schedule=constant",
            "batch_size=32",
            "eval_batch_size=100",
            "max_steps=30",
            "eval_every=0",
            "progress=false",
            "tensorboard=false",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    result = train(config, callbacks=[lambda info: losses.append(info.loss)], verbose=False)
    assert len(losses) == 30
    start, end = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert end < 0.75 * start, f"loss went from {start:.3f} to {end:.3f}"
    assert result.results["small-digits/test"]["accuracy"] > 0.2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"init_std": float("inf")}, "init_std must be a positive finite number, got inf"),
        ({"conv_channels": 32}, "conv_channels must be a tuple"),
        ({"decoder_hidden": 64}, "decoder_hidden must be a tuple"),
    ],
)
def test_scales_and_tuples_of_the_wrong_kind_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        create_model("efficient-capsnet", "tiny", **overrides)


def test_depthwise_primary_capsules_name_what_they_cannot_take():
    """Public, but unchecked: float64 maps came out float64, integers were taken, and the wrong
    channels or sizes failed inside torch or einops."""
    layer = DepthwisePrimaryCapsules(16, 2, 8, kernel_size=5)
    assert layer(torch.rand(2, 16, 5, 5)).shape == (2, 2, 8)
    with pytest.raises(TypeError, match="features has dtype torch.float64"):
        layer(torch.rand(2, 16, 5, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="features must be a floating-point tensor"):
        layer(torch.ones(2, 16, 5, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"features must have shape \(batch, in_channels=16, height"):
        layer(torch.rand(16, 5, 5))
    with pytest.raises(ValueError, match="smaller than the kernel"):
        layer(torch.rand(2, 16, 3, 3))


def test_the_authors_preset_takes_their_keras_batch_norm_and_he_normal_convolutions():
    """The authors' code: Keras's BatchNormalization (momentum 0.99: each batch moves the running
    statistics by 0.01; epsilon 1e-3) and he_normal kernels (a normal of std sqrt(2 / fan_in),
    truncated at 2 std and rescaled to that variance) with zero biases. The default keeps
    PyTorch's: the CPU rows were measured with it."""
    torch.manual_seed(0)
    authors = create_model("efficient-capsnet", "authors")
    default = create_model("efficient-capsnet", "paper")
    norms = [m for m in authors.features if isinstance(m, torch.nn.BatchNorm2d)]
    assert [(n.momentum, n.eps) for n in norms] == [(0.01, 1e-3)] * 4
    pytorchs = {(n.momentum, n.eps) for n in default.features if isinstance(n, torch.nn.BatchNorm2d)}
    assert pytorchs == {(0.1, 1e-5)}
    convs = [m for m in authors.features if isinstance(m, torch.nn.Conv2d)]
    for conv in convs:
        fan_in = conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]
        weights, std = conv.weight.detach().flatten(), (2.0 / fan_in) ** 0.5
        assert bool((conv.bias == 0).all())
        assert float(weights.abs().max()) <= 2 * std / 0.87962566103423978  # truncated at 2 std
        if weights.numel() >= 10_000:  # the variance asked for, within sampling error (< 2%)
            assert abs(float(weights.std()) / std - 1) < 0.02
    # PyTorch's uniform kernels are bounded by sqrt(1 / fan_in): far narrower than He's
    first = [m for m in default.features if isinstance(m, torch.nn.Conv2d)][-1]
    assert float(first.weight.abs().max()) <= (1 / (64 * 9)) ** 0.5
    # drawn again by reset_parameters, as a module built on meta and emptied needs
    convs[0].weight.data.fill_(5.0)
    convs[0].reset_parameters()
    assert float(convs[0].weight.abs().max()) <= 2 * (2.0 / 25) ** 0.5 / 0.87962566103423978
    # a training step moves the running mean by 0.01 of the batch's mean
    norm, images = norms[0], torch.rand(8, 1, 28, 28)
    before = norm.running_mean.clone()
    authors.train()(images)
    batch_mean = authors.features[1](authors.features[0](images)).mean(dim=(0, 2, 3))
    torch.testing.assert_close(norm.running_mean, 0.99 * before + 0.01 * batch_mean.detach())
