"""Matrix capsule layers against loops over positions and the functional EM routing."""

from __future__ import annotations

import pytest
import torch
from einops import rearrange

from torchvote.functional.em import em_routing
from torchvote.nn.em_capsules import (
    ClassMatrixCapsules,
    ConvMatrixCapsules,
    MatrixCapsules,
    PrimaryMatrixCapsules,
)

DOUBLE = torch.float64


def grid(batch, rows, cols, types, seed=0, side=4):
    generator = torch.Generator().manual_seed(seed)
    poses = torch.randn(batch, rows, cols, types, side, side, generator=generator, dtype=DOUBLE)
    activations = torch.rand(batch, rows, cols, types, generator=generator, dtype=DOUBLE)
    return MatrixCapsules(poses.requires_grad_(True), activations.requires_grad_(True))


def test_primary_matrix_capsules_are_poses_and_sigmoid_activations_per_position():
    torch.manual_seed(0)
    layer = PrimaryMatrixCapsules(6, 3).double()
    features = torch.randn(2, 6, 5, 4, dtype=DOUBLE)
    capsules = layer(features)
    assert capsules.poses.shape == (2, 5, 4, 3, 4, 4) and capsules.activations.shape == (2, 5, 4, 3)
    pose_maps, act_maps = layer.pose(features), layer.activation(features)
    for t in range(3):
        for r in range(5):
            for c in range(4):
                torch.testing.assert_close(capsules.poses[1, r, c, t].flatten(),
                                           pose_maps[1, t * 16 : (t + 1) * 16, r, c])
                torch.testing.assert_close(capsules.activations[1, r, c, t],
                                           torch.sigmoid(act_maps[1, t, r, c]))


@pytest.mark.parametrize(("rows", "kernel", "stride"), [(5, 3, 2), (4, 3, 1), (3, 1, 1)])
def test_conv_matrix_capsules_route_each_patch_as_a_loop_would(rows, kernel, stride):
    torch.manual_seed(1)
    layer = ConvMatrixCapsules(2, 3, kernel_size=kernel, stride=stride).double()
    with torch.no_grad():
        layer.routing.beta_u.normal_()
        layer.routing.beta_a.normal_()
    capsules = grid(2, rows, rows + 1, 2)
    out = layer(capsules)
    out_rows, out_cols = layer.output_size(rows, rows + 1)
    assert out.poses.shape == (2, out_rows, out_cols, 3, 4, 4)
    loss = out.poses.pow(2).sum() + out.activations.sum()
    grads = torch.autograd.grad(loss, [capsules.poses, capsules.activations, layer.weight])
    ref_poses = torch.zeros_like(out.poses)
    ref_acts = torch.zeros_like(out.activations)
    for b in range(2):
        for r in range(out_rows):
            for c in range(out_cols):
                votes, acts = [], []
                for kh in range(kernel):
                    for kw in range(kernel):
                        for t in range(2):
                            j = (kh * kernel + kw) * 2 + t
                            pose = capsules.poses[b, r * stride + kh, c * stride + kw, t]
                            vote = [(pose @ layer.weight[j, i]).flatten() for i in range(3)]  # V = M W
                            votes.append(torch.stack(vote))
                            acts.append(capsules.activations[b, r * stride + kh, c * stride + kw, t])
                receivers_first = rearrange(torch.stack(votes), "j i d -> i j d")  # (out, in, P*P)
                mu, a_out = em_routing(receivers_first[None], torch.stack(acts)[None],
                                       layer.routing.beta_u, layer.routing.beta_a)
                ref_poses[b, r, c] = mu[0].view(3, 4, 4)
                ref_acts[b, r, c] = a_out[0]
    torch.testing.assert_close(out.poses, ref_poses)
    torch.testing.assert_close(out.activations, ref_acts)
    ref_loss = ref_poses.pow(2).sum() + ref_acts.sum()
    ref_grads = torch.autograd.grad(ref_loss, [capsules.poses, capsules.activations, layer.weight])
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_class_capsules_share_transforms_and_add_coordinates():
    torch.manual_seed(2)
    layer = ClassMatrixCapsules(2, 3).double()
    capsules = grid(2, 3, 2, 2, seed=3)
    out = layer(capsules)
    assert out.poses.shape == (2, 3, 4, 4) and out.activations.shape == (2, 3)
    votes, acts = [], []
    for r in range(3):
        for c in range(2):
            for t in range(2):
                per_class = []
                for i in range(3):
                    vote = capsules.poses[:, r, c, t] @ layer.weight[t, i]  # shared over positions
                    offset = torch.zeros(4, 4, dtype=DOUBLE)
                    offset[0, 3] = (r + 0.5) / 3  # scaled row of the centre: first row, last column
                    offset[1, 3] = (c + 0.5) / 2  # scaled column: second row, last column
                    per_class.append((vote + offset).flatten(-2))
                votes.append(torch.stack(per_class, dim=1))
                acts.append(capsules.activations[:, r, c, t])
    receivers_first = rearrange(torch.stack(votes, dim=1), "b j i d -> b i j d")  # (b, out, in, P*P)
    mu, a_out = em_routing(receivers_first, torch.stack(acts, dim=1), layer.routing.beta_u,
                           layer.routing.beta_a)
    torch.testing.assert_close(out.poses, mu.view(2, 3, 4, 4))
    torch.testing.assert_close(out.activations, a_out)
    plain = ClassMatrixCapsules(2, 3, coordinate_addition=False).double()
    with torch.no_grad():
        plain.weight.copy_(layer.weight)
    assert not torch.allclose(plain(capsules).poses, out.poses)


def test_the_small_smallnorb_stack_runs_and_trains():
    """A=64, B=8, C=D=16 on a 32x32 image (Hinton et al. 2018, sec. 5), batch 2."""
    torch.manual_seed(4)
    conv1 = torch.nn.Conv2d(1, 64, 5, stride=2)
    primary = PrimaryMatrixCapsules(64, 8)
    caps1 = ConvMatrixCapsules(8, 16, kernel_size=3, stride=2)
    caps2 = ConvMatrixCapsules(16, 16, kernel_size=3, stride=1)
    classes = ClassMatrixCapsules(16, 5)
    images = torch.randn(2, 1, 32, 32)
    x = primary(torch.relu(conv1(images)))
    x = caps1(x)
    assert x.poses.shape == (2, 6, 6, 16, 4, 4)
    x = caps2(x)
    assert x.poses.shape == (2, 4, 4, 16, 4, 4)
    out = classes(x)
    assert out.activations.shape == (2, 5)
    out.activations.sum().backward()
    for module in (conv1, primary, caps1, caps2, classes):
        for p in module.parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all()


def test_zero_capsules_give_finite_outputs_and_gradients():
    layer = ConvMatrixCapsules(2, 3, kernel_size=3, stride=1)
    poses = torch.zeros(1, 4, 4, 2, 4, 4, requires_grad=True)
    activations = torch.zeros(1, 4, 4, 2, requires_grad=True)
    out = layer(MatrixCapsules(poses, activations))
    assert torch.equal(out.poses, torch.zeros_like(out.poses))
    (out.poses.sum() + out.activations.sum()).backward()
    assert torch.isfinite(poses.grad).all() and torch.isfinite(activations.grad).all()


def test_bad_configuration_and_inputs_are_rejected():
    with pytest.raises(ValueError, match="pose_dim must be a perfect square"):
        ConvMatrixCapsules(2, 3, pose_dim=15)
    with pytest.raises(ValueError, match="pose_dim"):
        PrimaryMatrixCapsules(4, 2, pose_dim=8)
    with pytest.raises(ValueError, match="iterations"):
        ClassMatrixCapsules(2, 3, iterations=0)
    layer = ConvMatrixCapsules(2, 3, kernel_size=3)
    with pytest.raises(ValueError, match="types=2"):
        layer(MatrixCapsules(torch.randn(1, 4, 4, 3, 4, 4), torch.rand(1, 4, 4, 3)))
    with pytest.raises(ValueError, match="activations"):
        layer(MatrixCapsules(torch.randn(1, 4, 4, 2, 4, 4), torch.rand(1, 4, 4)))
    with pytest.raises(ValueError, match="smaller than kernel_size"):
        layer(MatrixCapsules(torch.randn(1, 2, 2, 2, 4, 4), torch.rand(1, 2, 2, 2)))
