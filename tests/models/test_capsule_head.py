"""The capsule classifier head every capsule model shares, and old checkpoints' keys."""

from __future__ import annotations

import pytest
import torch

from torchvote.functional.routing import dynamic_routing
from torchvote.models.capsule_head import CapsuleHead
from torchvote.models.registry import create_model
from torchvote.nn import ClassMatrixCapsules, DynamicRouter, MatrixCapsules

DOUBLE = torch.float64

#: old top-level prefix -> where the head keeps it now
LEGACY = {
    "capsnet": {"head.class_capsules.": "class_capsules.", "head.decoder.": "decoder."},
    "efficient-capsnet": {"head.class_capsules.": "class_capsules.", "head.decoder.": "decoder."},
    "em-capsnet": {"head.class_capsules.routing.": "router.", "head.class_capsules.": "class_votes."},
}


def legacy_state_dict(state: dict, renames: dict[str, str]) -> dict:
    old = {}
    for key, value in state.items():
        for new, before in renames.items():
            if key.startswith(new):
                key = before + key[len(new):]
                break
        old[key] = value
    return old


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_every_capsule_model_is_stem_primary_and_the_shared_head(name):
    model = create_model(name, "tiny")
    assert isinstance(model.head, CapsuleHead)
    assert set(dict(model.named_children())) <= {"conv", "features", "primary", "conv_capsules", "head"}


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_checkpoints_from_before_the_head_still_load(name):
    torch.manual_seed(0)
    model = create_model(name, "tiny").eval()
    old = legacy_state_dict(model.state_dict(), LEGACY[name])
    assert not any(key.startswith("head.") for key in old)
    torch.manual_seed(1)
    fresh = create_model(name, "tiny").eval()
    fresh.load_state_dict(old, strict=True)
    images = torch.rand(2, 1, 28, 28)
    torch.testing.assert_close(fresh(images).scores, model(images).scores)


def test_vector_head_hands_capsule_lengths_to_a_router_that_uses_activations():
    torch.manual_seed(2)
    model = create_model("capsnet", "tiny", router="em").double().eval()
    images = torch.rand(2, 1, 28, 28, dtype=DOUBLE)
    output = model(images)
    primary = model.primary(torch.relu(model.conv(images)))
    lengths = primary.norm(dim=-1)  # (b, j)
    routed = model.head.class_capsules(primary, activations=lengths, return_routing=True)
    torch.testing.assert_close(output.scores, routed.activations)
    ones = model.head.class_capsules(primary, return_routing=True)  # CapsuleLinear's default: ones
    assert not torch.allclose(output.scores, ones.activations)


@pytest.mark.parametrize("router", ["dynamic", "em"])
def test_linear_scores_are_one_shared_map_of_each_class_capsule(router):
    """``scores="linear"`` (Tsai et al. 2020): logit ``i`` is ``w . v_i + b`` with one ``(w, b)``
    for every class capsule ``v_i``, written out here, also where EM gives activations."""
    torch.manual_seed(3)
    model = create_model("capsnet", "tiny", router=router, scores="linear").double().eval()
    output = model(torch.rand(3, 1, 28, 28, dtype=DOUBLE))
    weight, bias = model.head.scorer.weight[0], model.head.scorer.bias[0]  # (d,), ()
    expected = torch.stack([output.poses[:, i] @ weight + bias for i in range(output.poses.shape[1])], 1)
    torch.testing.assert_close(output.scores, expected)
    assert create_model("capsnet", "tiny").head.scorer is None
    with pytest.raises(ValueError, match="scores"):
        create_model("capsnet", "tiny", scores="logits")


def test_class_matrix_capsules_take_another_router():
    torch.manual_seed(3)
    router = DynamicRouter(iterations=2, bias=True, out_caps=3, out_dim=16).double()
    with torch.no_grad():
        router.bias.normal_()
    layer = ClassMatrixCapsules(2, 3, routing=router).double()
    generator = torch.Generator().manual_seed(4)
    capsules = MatrixCapsules(torch.randn(2, 3, 2, 2, 4, 4, generator=generator, dtype=DOUBLE),
                              torch.rand(2, 3, 2, 2, generator=generator, dtype=DOUBLE))
    result = layer(capsules, return_routing=True)
    votes, activations = layer.votes(capsules)  # (b, i, j, 16), (b, j)
    weighted = votes * activations[:, None, :, None]  # an absent part casts a weaker vote
    outputs, couplings = dynamic_routing(weighted, iterations=2, bias=router.bias)
    torch.testing.assert_close(result.outputs, outputs)
    torch.testing.assert_close(result.couplings, couplings)
    assert layer.router is router
    with pytest.raises(ValueError, match="return_routing"):
        layer(capsules)
    with pytest.raises(ValueError, match="routing"):
        ClassMatrixCapsules(2, 3, routing=router, iterations=2)


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_images_that_are_not_floats_of_the_models_dtype_are_named(name):
    model = create_model(name, "tiny")
    with pytest.raises(TypeError, match="images must be a floating-point tensor, got torch.uint8"):
        model(torch.randint(0, 255, (2, 1, 28, 28), dtype=torch.uint8))
    with pytest.raises(TypeError, match="images has dtype torch.float64 but the module's parameters are"):
        model(torch.rand(2, 1, 28, 28, dtype=DOUBLE))
    with pytest.raises(TypeError, match="images must be a floating-point tensor, got list"):
        model(torch.rand(2, 1, 28, 28).tolist())


@pytest.mark.parametrize("name", ["capsnet", "efficient-capsnet"])
def test_targets_that_are_not_class_indices_are_named(name):
    # Float targets were truncated to classes, one-hot ones read as (b, k) lists of classes 0 and 1.
    model = create_model(name, "tiny")
    images = torch.rand(2, 1, 28, 28)
    one_hot = torch.nn.functional.one_hot(torch.tensor([3, 7]), 10).float()
    with pytest.raises(TypeError, match="targets must be a tensor of integer class indices.*float32"):
        model(images, one_hot)
    with pytest.raises(TypeError, match="targets must be a tensor of integer class indices.*list"):
        model(images, [3, 7])
    assert model(images, torch.tensor([3, 7])).reconstructions.shape == (2, 1, 28, 28)
    # F.one_hot's own int64 rows reconstructed ten images an example, from capsules 0 and 1
    with pytest.raises(ValueError, match=r"targets \(b, 10\) of only 0 and 1 look one-hot.*argmax"):
        model(images, torch.nn.functional.one_hot(torch.tensor([3, 7]), 10))
    assert model(images, torch.tensor([[3, 7], [1, 0]])).reconstructions.shape == (2, 2, 1, 28, 28)


@pytest.mark.parametrize("name", ["capsnet", "efficient-capsnet"])
def test_class_indices_outside_the_classes_are_named(name):
    # F.one_hot in the decoder's mask raised "Class values must be smaller than num_classes",
    # naming no argument (on a GPU: a device-side assert of a scatter).
    model = create_model(name, "tiny")
    images = torch.rand(2, 1, 28, 28)
    for bad, ends in ((torch.tensor([3, 10]), "smallest 3, largest 10"),
                      (torch.tensor([-1, 3]), "smallest -1, largest 3"),
                      (torch.tensor([[3, 12], [1, 2]]), "smallest 1, largest 12")):
        message = rf"targets holds class indices outside \[0, num_classes=10\): {ends}"
        with pytest.raises(ValueError, match=message):
            model(images, bad)
    assert model(images, torch.tensor([[0, 9], [9, 0]])).reconstructions.shape == (2, 2, 1, 28, 28)


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_an_empty_batch_with_targets_gives_empty_outputs(name):
    # (0,) targets failed to reshape to (0, -1): "cannot reshape tensor of 0 elements".
    model = create_model(name, "tiny").train()
    output = model(torch.rand(0, 1, 28, 28), torch.zeros(0, dtype=torch.long))
    assert output.scores.shape == (0, 10)
    if output.reconstructions is not None:
        assert output.reconstructions.shape == (0, 1, 28, 28)
    output.scores.sum().backward()


@pytest.mark.parametrize(
    ("name", "options"),
    [("cnn-baseline", {}), ("em-capsnet", {}), ("capsnet", {"decoder": False}),
     ("transformer-classifier", {"image_size": 28, "in_channels": 1, "num_classes": 10})],
)
def test_models_that_do_not_read_targets_check_them_all_the_same(name, options):
    """A model without a decoder took float labels, a list, out-of-range classes and another batch
    size in silence, where a CapsNet with one refused each by name."""
    model = create_model(name, "tiny", **options).eval()
    images = torch.rand(2, 1, 28, 28)
    with pytest.raises(TypeError, match="targets must be a tensor of integer class indices.*float32"):
        model(images, torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="targets must be a tensor of integer class indices.*list"):
        model(images, [1, 2])
    with pytest.raises(ValueError, match=r"targets holds class indices outside \[0, num_classes=10\)"):
        model(images, torch.tensor([1, 10]))
    with pytest.raises(ValueError, match=r"targets must be \(b,\) class indices .* with b=2, got \(3,\)"):
        model(images, torch.tensor([1, 2, 3]))
    assert model(images, torch.tensor([1, 2])).scores.shape == (2, 10)
