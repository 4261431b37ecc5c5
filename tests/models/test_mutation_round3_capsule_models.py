"""Mutation review, round 3: the capsule models' layers against the papers' formulas, written out
with ``torch.nn.functional`` from the modules' own weights.

The earlier tests counted parameters and checked shapes, which an activation dropped from the
decoder or the stem, or a batch norm moved before its ReLU, leave as they were.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchvote.models import create_model
from torchvote.models.capsule_head import CapsuleDecoder


def test_the_decoder_is_relu_layers_then_a_sigmoid_as_in_sabour_et_al():
    """Mutants: the hidden layers' ReLU or the output's sigmoid dropped. Sabour et al. 2017,
    Fig. 2: the masked 16-D capsule goes through FC + ReLU (512), FC + ReLU (1024), FC + sigmoid
    (784); here with smaller widths, written out from the linear layers' weights."""
    torch.manual_seed(0)
    decoder = CapsuleDecoder(3, 4, (1, 5, 5), hidden=(6, 7))
    linears = [m for m in decoder.modules() if isinstance(m, nn.Linear)]
    assert [layer.out_features for layer in linears] == [6, 7, 25]
    with torch.no_grad():  # large weights: pre-activations of both signs, outputs far from 0.5
        for layer in linears:
            layer.weight.normal_(0.0, 2.0)
            layer.bias.normal_(0.0, 1.0)
    poses = torch.randn(2, 3, 4)
    classes = torch.tensor([[2], [0]])  # (b, k=1)
    masked = torch.zeros(2, 3, 4)
    masked[0, 2], masked[1, 0] = poses[0, 2], poses[1, 0]  # every other capsule zeroed
    x = masked.flatten(1)
    x = F.relu(F.linear(x, linears[0].weight, linears[0].bias))
    x = F.relu(F.linear(x, linears[1].weight, linears[1].bias))
    expected = torch.sigmoid(F.linear(x, linears[2].weight, linears[2].bias)).view(2, 1, 1, 5, 5)
    torch.testing.assert_close(decoder(poses, classes), expected)


def test_efficient_capsnet_convolutions_are_relu_then_batch_norm():
    """Mutant: the batch norm put before the ReLU. Mazzia et al. 2021's code (and the module's
    docstring): each convolution has a ReLU activation and is followed by a batch norm, so the
    features can be negative. In eval mode with moved running statistics, by hand."""
    torch.manual_seed(1)
    model = create_model("efficient-capsnet", "tiny").eval()
    convs = [m for m in model.features if isinstance(m, nn.Conv2d)]
    norms = [m for m in model.features if isinstance(m, nn.BatchNorm2d)]
    with torch.no_grad():
        for norm in norms:
            norm.running_mean.uniform_(0.0, 0.5)
            norm.running_var.uniform_(0.5, 2.0)
            norm.weight.normal_()
            norm.bias.normal_()
    images = torch.rand(2, 1, 28, 28)
    x = images
    for conv, norm in zip(convs, norms, strict=True):
        x = F.relu(F.conv2d(x, conv.weight, conv.bias, stride=conv.stride))
        x = F.batch_norm(x, norm.running_mean, norm.running_var, norm.weight, norm.bias, eps=norm.eps)
    torch.testing.assert_close(model.features(images), x, rtol=1e-4, atol=1e-5)
    assert bool((x < 0).any())  # a batch norm last: negative features, which a ReLU last never gives


def test_efficient_capsnet_class_layer_starts_at_hes_scale():
    """Mutant: the class layer's default initialisation at ``sqrt(1 / fan_in)``. The config's
    docstring: He's ``sqrt(2 / fan_in)`` with ``fan_in = num_classes * in_caps * primary_dim``,
    0.0395 on MNIST (He et al. 2015, eq. 10); measured on the 20,480 weights of the paper's layer."""
    torch.manual_seed(2)
    model = create_model("efficient-capsnet", "paper", decoder=False)
    config = model.config
    weight = model.head.class_capsules.weight
    fan_in = config.num_classes * config.num_primary_caps * config.primary_dim
    assert math.sqrt(2.0 / fan_in) == pytest.approx(0.0395, abs=1e-4)
    assert weight.std().item() == pytest.approx(math.sqrt(2.0 / fan_in), rel=0.03)
    assert abs(weight.mean().item()) < 0.002
