"""CapsNet (Sabour et al. 2017): the paper's sizes, geometry from the config, every router, the
masked decoder, MultiMNIST targets, and a tiny training run through ``torchvote.training.train``."""

from __future__ import annotations

import pytest
import torch

from torchvote.functional.routing import list_routers
from torchvote.models import create_model, get_model_spec
from torchvote.models.capsnet import CapsNet, CapsNetConfig
from torchvote.training import make_objective, train
from torchvote.training.config import LossConfig, load_config, model_config_from

ROUTERS = sorted(list_routers())


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see the fixture


def _batch(model: CapsNet, size: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    c = model.config
    images = torch.rand(size, c.in_channels, c.image_size, c.image_size, generator=generator)
    return images, torch.randint(c.num_classes, (size,), generator=generator)


def test_paper_configuration_has_the_papers_parameter_counts():
    # Sabour et al. 2017, sec. 4-5: Conv1 256 @ 9x9; PrimaryCaps 32 x 6 x 6 capsules of 8-D
    # (9x9, stride 2); DigitCaps 10 x 16-D with W_ij 16x8 per pair; decoder 512-1024-784.
    # "8.2M parameters" with the reconstruction subnetwork, "6.8M" without.
    with torch.device("meta"):
        model = create_model("capsnet", "paper")
    config = model.config
    assert config.conv_grid == 20 and config.primary_grid == 6 and config.num_primary_caps == 32 * 6 * 6
    counts = {
        name: sum(p.numel() for p in part.parameters())
        for name, part in (
            ("conv", model.conv),
            ("primary", model.primary),
            ("class", model.head.class_capsules),
            ("decoder", model.head.decoder),
        )
    }
    assert counts["conv"] == 1 * 256 * 9 * 9 + 256 == 20_992
    assert counts["primary"] == 256 * (32 * 8) * 9 * 9 + 32 * 8 == 5_308_672
    assert counts["class"] == 1152 * 10 * 16 * 8 == 1_474_560
    assert counts["decoder"] == (160 * 512 + 512) + (512 * 1024 + 1024) + (1024 * 784 + 784) == 1_411_344
    total = sum(p.numel() for p in model.parameters())
    assert total == sum(counts.values()) == 8_215_568
    assert total - counts["decoder"] == 6_804_224
    assert model.conv.kernel_size == (9, 9) and model.primary.conv.stride == (2, 2)


@pytest.mark.parametrize(
    ("preset", "primary_caps", "class_dim"),
    [("tiny", 4 * 36, 8), ("small", 8 * 36, 16), ("paper", 32 * 36, 16)],
)
def test_shapes_per_preset(preset, primary_caps, class_dim):
    torch.manual_seed(0)
    model = create_model("capsnet", preset)
    assert model.config.num_primary_caps == primary_caps
    images, targets = _batch(model, 2)
    model.train()
    output = model(images, targets)
    assert output.scores.shape == (2, 10)
    assert output.reconstructions.shape == (2, 1, 28, 28)
    assert output.poses.shape == (2, 10, class_dim)
    assert output.couplings.shape == (2, 10, primary_caps)
    # Routing normalises over the receivers: each primary capsule's couplings sum to 1.
    torch.testing.assert_close(output.couplings.sum(dim=1), torch.ones(2, primary_caps))
    torch.testing.assert_close(output.scores, output.poses.norm(dim=-1))
    assert ((output.scores >= 0) & (output.scores < 1)).all()


@pytest.mark.parametrize(("image_size", "in_channels", "num_classes"), [(28, 1, 10), (36, 1, 10), (40, 3, 5)])
def test_geometry_is_derived_from_the_config(image_size, in_channels, num_classes):
    model = create_model(
        "capsnet", "tiny", image_size=image_size, in_channels=in_channels, num_classes=num_classes
    )
    grid = (image_size - 9 + 1 - 9) // 2 + 1
    assert model.head.class_capsules.in_caps == model.config.num_primary_caps == 4 * grid * grid
    images = torch.rand(2, in_channels, image_size, image_size)
    output = model(images, torch.tensor([0, num_classes - 1]))
    assert output.scores.shape == (2, num_classes)
    assert output.reconstructions.shape == (2, in_channels, image_size, image_size)
    assert model.head.decoder.layers[-2].out_features == in_channels * image_size**2


@pytest.mark.parametrize("router", ROUTERS)
def test_every_router_trains_a_step(router):
    torch.manual_seed(0)
    model = create_model("capsnet", "tiny", router=router)
    spec = get_model_spec("capsnet")
    images, targets = _batch(model)
    model.train()
    output = model(images, targets)
    assert output.scores.shape == (4, 10) and torch.isfinite(output.scores).all()
    if router == "em":  # EM's activations are the scores
        assert ((output.scores >= 0) & (output.scores <= 1)).all()
    batch = {"images": images, "targets": targets}
    loss, parts = make_objective(LossConfig(), spec, total_steps=10)(output, batch, 0)
    assert torch.isfinite(loss) and "reconstruction" in parts
    loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, f"router {router}: no gradient reaches {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(images).scores).all()


def test_em_router_learns_with_the_spread_loss():
    # EM's class activations are trained with the spread loss (Hinton et al. 2018); the margin
    # loss's absolute targets drive them all to zero (see the module docstring).
    from torchvote.data import load_small_digits

    images, labels = load_small_digits("train", size=320)
    torch.manual_seed(0)
    model = create_model("capsnet", "tiny", router="em")
    spread = LossConfig(name="spread", spread_margin_start=0.5, spread_margin_end=0.5)
    objective = make_objective(spread, get_model_spec("capsnet"), total_steps=40)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
    losses = []
    for step in range(40):
        rows = torch.arange(step * 32, step * 32 + 32) % len(images)
        batch = {"images": images[rows], "targets": labels[rows]}
        loss, _ = objective(model(batch["images"], batch["targets"]), batch, step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def _hand_decode(model: CapsNet, poses: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """Zero every class capsule but ``classes[b]``, flatten, run the decoder's layers."""
    masked = torch.zeros_like(poses)
    rows = torch.arange(len(poses))
    masked[rows, classes] = poses[rows, classes]
    pixels = model.head.decoder.layers(masked.flatten(1))  # (b, c*h*w)
    return pixels.view(len(poses), model.config.in_channels, model.config.image_size, model.config.image_size)


def test_decoder_masks_with_the_target_in_training_and_the_longest_capsule_at_eval():
    """In float64 with a tolerance far below the gap between decoding one capsule and another
    (an untrained model's capsules are ~1e-5 long: in float32 that gap, 3e-7, was inside the
    default tolerance, and decoding the shortest capsule passed)."""
    torch.manual_seed(0)
    model = create_model("capsnet", "tiny").double()
    images, _ = _batch(model)
    images = images.double()
    model.eval()
    close = {"rtol": 0.0, "atol": 1e-12}
    with torch.no_grad():
        probe = model(images)
        longest = probe.scores.argmax(dim=-1)
        targets = (longest + 1) % 10  # never the argmax, so the two masks differ
        gap = (_hand_decode(model, probe.poses, longest) - _hand_decode(model, probe.poses, targets)).abs()
        assert gap.max() > 1e-9  # a tolerance of 1e-12 tells them apart
        torch.testing.assert_close(probe.reconstructions, _hand_decode(model, probe.poses, longest), **close)
        with_targets = model(images, targets)
        expected = _hand_decode(model, probe.poses, targets)
        torch.testing.assert_close(with_targets.reconstructions, expected, **close)
    # The training loop passes targets only in training mode (ClassificationHandler.forward).
    from torchvote.training import get_task_handler

    handler = get_task_handler("image-classification")
    model.train()
    with torch.no_grad():
        trained = handler.forward(model, {"images": images, "targets": targets})
        expected = _hand_decode(model, trained.poses, targets)
        torch.testing.assert_close(trained.reconstructions, expected, **close)
        model.eval()
        evaluated = handler.forward(model, {"images": images, "targets": targets})
        torch.testing.assert_close(evaluated.reconstructions, _hand_decode(model, evaluated.poses, longest),
                                   **close)


def test_multilabel_targets_reconstruct_each_digit():
    torch.manual_seed(0)
    model = create_model("capsnet", "tiny", image_size=36)
    images = torch.rand(3, 1, 36, 36)
    targets = torch.tensor([[1, 7], [0, 2], [9, 4]])
    output = model(images, targets)
    assert output.reconstructions.shape == (3, 2, 1, 36, 36)
    for k in range(2):
        torch.testing.assert_close(
            output.reconstructions[:, k], _hand_decode(model, output.poses, targets[:, k])
        )
    # The margin and reconstruction losses take the two labels and the two digits.
    spec = get_model_spec("capsnet")
    batch = {"images": images, "targets": targets, "digits": torch.rand(3, 2, 1, 36, 36)}
    loss, parts = make_objective(LossConfig(), spec, total_steps=1)(output, batch, 0)
    assert torch.isfinite(loss) and parts["reconstruction"] > 0


@pytest.mark.parametrize("router", ROUTERS)
def test_zero_images_give_finite_outputs_and_gradients(router):
    torch.manual_seed(0)
    model = create_model("capsnet", "tiny", router=router)
    images = torch.zeros(2, 1, 28, 28, requires_grad=True)
    output = model(images, torch.tensor([3, 5]))
    assert torch.isfinite(output.scores).all() and torch.isfinite(output.reconstructions).all()
    (output.scores.sum() + output.reconstructions.sum()).backward()
    assert torch.isfinite(images.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_no_decoder_gives_no_reconstructions_and_the_margin_loss_alone():
    model = create_model("capsnet", "tiny", decoder=False)
    assert model.head.decoder is None
    images, targets = _batch(model)
    output = model(images, targets)
    assert output.reconstructions is None
    batch = {"images": images, "targets": targets}
    _, parts = make_objective(LossConfig(), get_model_spec("capsnet"), total_steps=1)(output, batch, 0)
    assert "reconstruction" not in parts


def test_router_options_reach_the_router():
    model = create_model("capsnet", "tiny", router_options={"bias": True, "agreement": "distance"})
    assert model.head.class_capsules.router.agreement == "distance"
    assert model.head.class_capsules.router.bias.shape == (10, 8)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"router": "nope"}, r"router must be one of \['dynamic', 'em', 'inverted_dot_product'"),
        ({"router_options": {"bogus": 1}}, "router_options=.*bogus.*router='dynamic'"),
        ({"router": "self_attention", "router_options": {"agreement": "dot"}}, "router_options"),
        ({"primary_kernel": 21}, "image_size=28 is too small"),
        ({"conv_kernel": 29}, "image_size=28 is too small"),
        ({"conv_channels": 0}, "conv_channels must be a positive integer"),
        ({"iterations": 0}, "iterations must be a positive integer"),
        ({"num_classes": 1}, "num_classes must be at least 2"),
        ({"decoder_hidden": (16, 0)}, "decoder_hidden must hold positive integers"),
        ({"init_std": 0.0}, "init_std must be a positive finite number"),
    ],
)
def test_bad_configs_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        create_model("capsnet", "tiny", **overrides)


def test_wrong_image_shape_is_a_clear_error():
    model = create_model("capsnet", "tiny")
    with pytest.raises(ValueError, match=r"images must have shape \(b, 1, 28, 28\), got \(2, 1, 36, 36\)"):
        model(torch.rand(2, 1, 36, 36))
    with pytest.raises(ValueError, match="targets must be"):
        model(torch.rand(2, 1, 28, 28), torch.zeros(3, dtype=torch.long))


def test_config_is_a_plain_dataclass_of_the_registry():
    spec = get_model_spec("capsnet")
    assert spec.config_cls is CapsNetConfig and spec.loss == "margin"
    assert {"paper", "small", "tiny"} <= set(spec.presets)


@pytest.mark.parametrize("preset", ["capsnet-mnist", "capsnet-paper", "capsnet-multimnist"])
def test_shipped_presets_load(preset):
    config = load_config(preset)
    assert config.model.name == "capsnet"
    image_size = 36 if config.data.name == "multimnist" else 28
    model_config = model_config_from(config, image_size=image_size, in_channels=1, num_classes=10)
    assert isinstance(model_config, CapsNetConfig) and model_config.image_size == image_size


def test_tiny_training_run_lowers_the_loss(tmp_path):
    # The shipped MNIST preset, shrunk: the tiny CapsNet on 480 small digits (real MNIST), 30 steps.
    losses: list[float] = []
    config = load_config(
        "capsnet-mnist",
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
    assert result.step == 30 and len(losses) == 30
    start, end = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert end < 0.75 * start, f"loss went from {start:.3f} to {end:.3f}"
    assert result.results["small-digits/test"]["accuracy"] > 0.2


def test_multimnist_preset_trains_through_the_loop(tmp_path):
    # Two digits per 36x36 image: (b, 2) targets, one reconstruction per digit against the
    # digits alone (the loop's batch["digits"]); a few steps to check the whole path.
    losses: list[float] = []
    config = load_config(
        "capsnet-multimnist",
        [
            "model.preset=tiny",
            "data.options.num_pairs=64",
            "data.options.limit=600",
            "batch_size=32",
            "eval_batch_size=64",
            "max_steps=2",
            "progress=false",
            "tensorboard=false",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    result = train(config, callbacks=[lambda info: losses.append(info.loss)], verbose=False)
    assert len(losses) == 2 and all(loss == loss for loss in losses)  # finite, not NaN
    assert result.model.config.image_size == 36
    assert 0.0 <= result.results["multimnist/test"]["accuracy"] <= 1.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # inf was blamed on router_options by the class layer; a string failed comparing with 0.
        ({"init_std": float("inf")}, "init_std must be a positive finite number, got inf"),
        ({"init_std": "0.01"}, "init_std must be a positive finite number, got '0.01'"),
        ({"decoder_hidden": 64}, "decoder_hidden must be a tuple"),  # was: 'int' object is not iterable
    ],
)
def test_scales_and_tuples_of_the_wrong_kind_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        create_model("capsnet", "tiny", **overrides)
