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
from torchvote.nn.routers import EMRouter, make_router

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


def patch_by_loop(layer, capsules, b, r, c):
    """Votes ``(out, in, P*P)`` (receivers first) and activations ``(in,)`` of one patch, by loops."""
    kernel, stride, types = layer.kernel_size, layer.stride, layer.in_types
    votes, acts = [], []
    for kh in range(kernel):
        for kw in range(kernel):
            for t in range(types):
                j = (kh * kernel + kw) * types + t
                pose = capsules.poses[b, r * stride + kh, c * stride + kw, t]
                vote = [(pose @ layer.weight[j, i]).flatten() for i in range(layer.out_types)]  # V = M W
                votes.append(torch.stack(vote))
                acts.append(capsules.activations[b, r * stride + kh, c * stride + kw, t])
    return rearrange(torch.stack(votes), "j i d -> i j d"), torch.stack(acts)


@pytest.mark.parametrize(("rows", "kernel", "stride"), [(5, 3, 2), (4, 3, 1), (3, 1, 1)])
def test_conv_matrix_capsules_route_each_patch_as_a_loop_would(rows, kernel, stride):
    """``normalization="per_patch"``: every patch routes on its own."""
    torch.manual_seed(1)
    layer = ConvMatrixCapsules(2, 3, kernel_size=kernel, stride=stride, normalization="per_patch").double()
    with torch.no_grad():
        layer.routing.beta_u.normal_()
        layer.routing.activation_bias.normal_()
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
                receivers_first, acts = patch_by_loop(layer, capsules, b, r, c)  # (out, in, P*P), (in,)
                mu, a_out = em_routing(receivers_first[None], acts[None],
                                       layer.routing.beta_u, layer.routing.beta_a)
                ref_poses[b, r, c] = mu[0].view(3, 4, 4)
                ref_acts[b, r, c] = a_out[0]
    torch.testing.assert_close(out.poses, ref_poses)
    torch.testing.assert_close(out.activations, ref_acts)
    ref_loss = ref_poses.pow(2).sum() + ref_acts.sum()
    ref_grads = torch.autograd.grad(ref_loss, [capsules.poses, capsules.activations, layer.weight])
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize(("rows", "cols", "stride"), [(4, 4, 1), (5, 4, 2)])
def test_conv_matrix_capsules_normalise_jointly_as_the_paper(rows, cols, stride, conv_procedure1):
    """The default ``normalization="joint"`` against Procedure 1 looped over every input capsule
    and all its parents (every output capsule of every patch holding it), in the paper's space."""
    torch.manual_seed(5)
    schedule = [0.5, 1.0]
    layer = ConvMatrixCapsules(2, 2, kernel_size=3, stride=stride, iterations=2,
                               inverse_temperature=schedule).double()
    assert layer.normalization == "joint"
    with torch.no_grad():
        layer.routing.beta_u.normal_()
        layer.routing.activation_bias.normal_()
    capsules = grid(2, rows, cols, 2, seed=6)
    out = layer(capsules)
    out_rows, out_cols = layer.output_size(rows, cols)
    ref_poses, ref_acts = [], []
    for b in range(2):
        patches = [patch_by_loop(layer, capsules, b, r, c) for r in range(out_rows) for c in range(out_cols)]
        votes = torch.stack([v for v, _ in patches])  # (L, out, in, P*P)
        acts = torch.stack([a for _, a in patches])  # (L, in)
        mu, a_out, _ = conv_procedure1(votes, acts, layer.routing.beta_u, layer.routing.beta_a, (rows, cols),
                                       2, 3, stride, schedule)
        ref_poses.append(mu.view(out_rows, out_cols, 2, 4, 4))
        ref_acts.append(a_out.view(out_rows, out_cols, 2))
    ref_poses, ref_acts = torch.stack(ref_poses), torch.stack(ref_acts)
    torch.testing.assert_close(out.poses, ref_poses, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.activations, ref_acts, rtol=1e-10, atol=1e-12)
    leaves = [capsules.poses, capsules.activations, layer.weight, layer.routing.beta_u]
    grads = torch.autograd.grad(out.poses.pow(2).sum() + out.activations.sum(), leaves)
    ref_grads = torch.autograd.grad(ref_poses.pow(2).sum() + ref_acts.sum(), leaves)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10)
    per_patch = ConvMatrixCapsules(2, 2, kernel_size=3, stride=stride, iterations=2,
                                   inverse_temperature=schedule, normalization="per_patch").double()
    per_patch.load_state_dict(layer.state_dict())
    assert not torch.allclose(per_patch(capsules).activations, out.activations)


def test_conv_matrix_capsules_build_sender_groups_once_per_grid():
    layer = ConvMatrixCapsules(2, 3, kernel_size=3, stride=2)
    assert layer.sender_groups(5, 5).shape == (4, 18)
    assert layer.sender_groups(7, 5).shape == (6, 18)
    cpu = torch.device("cpu")
    first = layer._routing_groups(5, 5, cpu)  # prepared (checked, compacted) once per grid
    assert layer._routing_groups(5, 5, cpu) is first and first.ids.shape == (4, 18)
    assert layer._routing_groups(7, 5, cpu) is not first
    assert ConvMatrixCapsules(2, 3, normalization="per_patch")._routing_groups(5, 5, cpu) is None
    assert ConvMatrixCapsules(2, 3, normalization="per_patch").sender_groups(5, 5) is None


def test_conv_matrix_capsules_keep_a_bounded_number_of_grids():
    # was: one prepared entry per grid for the layer's life (ten grids: ~47 MiB at 32 types), so a
    # long-running process fed variable resolutions grew without end
    from torchvote.nn import em_capsules

    torch.manual_seed(0)
    layer = ConvMatrixCapsules(2, 3, kernel_size=3, stride=1).double()
    sides = list(range(3, 13))  # ten distinct grids
    kept = []
    for side in sides:
        layer(grid(1, side, side, 2, seed=side))
        kept.append(len(layer._prepared_groups))
    assert kept[-1] == kept[-2] < len(sides)  # it plateaus instead of growing with every grid
    assert max(kept) <= em_capsules._KEPT_GRIDS
    assert (sides[-1], sides[-1], torch.device("cpu")) in layer._prepared_groups  # the newest kept
    assert (sides[0], sides[0], torch.device("cpu")) not in layer._prepared_groups  # the oldest not
    fresh = ConvMatrixCapsules(2, 3, kernel_size=3, stride=1).double()
    fresh.load_state_dict(layer.state_dict())
    for side in (sides[0], sides[-1]):  # an evicted grid prepared again, and a kept one
        capsules = grid(2, side, side, 2, seed=100 + side)
        out, expected = layer(capsules), fresh(capsules)
        torch.testing.assert_close(out.poses, expected.poses)
        torch.testing.assert_close(out.activations, expected.activations)
    assert len(layer._prepared_groups) <= em_capsules._KEPT_GRIDS


@pytest.mark.parametrize("normalization", ["joint", "per_patch"])
def test_conv_layer_gradients_after_a_partial_gradient(normalization):
    """Issue 8's bug: ``autograd.grad`` for the activations alone (retain_graph), then the
    weights' and poses' gradient, must equal a fresh full gradient."""
    torch.manual_seed(7)
    layer = ConvMatrixCapsules(2, 3, kernel_size=3, stride=1, normalization=normalization).double()
    capsules = grid(2, 4, 4, 2, seed=8)
    out = layer(capsules)
    loss = (out.poses * torch.randn_like(out.poses)).sum() + (out.activations * torch.randn_like(
        out.activations)).sum()
    leaves = [layer.weight, capsules.poses]
    fresh = torch.autograd.grad(loss, [capsules.activations, *leaves], retain_graph=True)
    (partial,) = torch.autograd.grad(loss, [capsules.activations], retain_graph=True)
    then = torch.autograd.grad(loss, leaves)
    torch.testing.assert_close(partial, fresh[0], rtol=1e-10, atol=1e-12)
    for g, r in zip(then, fresh[1:], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("strategy", ["vectorized", "blocked"])
def test_conv_and_class_layers_pass_their_strategy_on(strategy):
    conv = ConvMatrixCapsules(2, 3, kernel_size=3, strategy=strategy).double()
    classes = ClassMatrixCapsules(2, 3, strategy=strategy).double()
    assert conv.routing.strategy == strategy and classes.routing.strategy == strategy
    capsules = grid(1, 4, 4, 2, seed=9)
    votes, activations, _ = conv.votes(capsules)
    groups = conv.sender_groups(4, 4)
    other = "blocked" if strategy == "vectorized" else "vectorized"
    poses, acts = em_routing(votes, activations, conv.routing.beta_u, conv.routing.beta_a,
                             sender_groups=groups, strategy=other)
    out = conv(capsules)
    torch.testing.assert_close(out.poses.flatten(-2), poses.view(out.poses.shape[:4] + (16,)))
    torch.testing.assert_close(out.activations, acts.view(out.activations.shape))
    class_out = classes(capsules)
    class_votes, class_acts = classes.votes(capsules)
    reference = em_routing(class_votes, class_acts, classes.routing.beta_u, classes.routing.beta_a,
                           strategy=other)
    torch.testing.assert_close(class_out.activations, reference[1])
    for layer, result in ((conv, conv(capsules).activations), (classes, class_out.activations)):
        if strategy == "vectorized":  # the strategy in use shows: only it is twice differentiable
            first = torch.autograd.grad(result.sum(), layer.weight, create_graph=True)[0]
            assert first.requires_grad
        else:
            with pytest.raises(RuntimeError, match="differentiated once only"):
                torch.autograd.grad(result.sum(), layer.weight, create_graph=True)


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


@pytest.mark.parametrize("normalization", ["joint", "per_patch"])
def test_conv_layer_under_autocast_routes_its_formed_votes(normalization):
    """On a CPU the layer hands EM unformed per-sender votes (formed a block at a time); under
    bfloat16 autocast it must still give what em_routing gives on its formed votes."""
    torch.manual_seed(12)
    layer = ConvMatrixCapsules(2, 3, kernel_size=3, stride=1, normalization=normalization)
    capsules = MatrixCapsules(*(x.detach().float() for x in grid(2, 4, 5, 2, seed=13)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(capsules)
        votes, activations, _ = layer.votes(capsules)
        poses, acts = em_routing(votes, activations, layer.routing.beta_u, layer.routing.beta_a,
                                 sender_groups=layer.sender_groups(4, 5))
    torch.testing.assert_close(out.poses.flatten(-2), poses.view(out.poses.shape[:4] + (16,)))
    torch.testing.assert_close(out.activations, acts.view(out.activations.shape))


def test_an_empty_batch_gives_empty_outputs():
    capsules = grid(2, 5, 5, 3)
    empty = MatrixCapsules(capsules.poses[:0], capsules.activations[:0])
    for normalization in ("joint", "per_patch"):
        out = ConvMatrixCapsules(3, 5, normalization=normalization).double()(empty)
        assert out.poses.shape == (0, 3, 3, 5, 4, 4) and out.activations.shape == (0, 3, 3, 5)
    out = ClassMatrixCapsules(3, 10).double()(empty)
    assert out.poses.shape == (0, 10, 4, 4) and out.activations.shape == (0, 10)
    out.poses.sum().backward()


def test_class_capsules_refuse_a_router_built_for_other_sizes():
    with pytest.raises(ValueError, match="routing was built for out_caps=4, but the layer has out_caps=10"):
        ClassMatrixCapsules(3, 10, routing=EMRouter(out_caps=4))
    with pytest.raises(ValueError, match="out_dim=8"):
        ClassMatrixCapsules(3, 10, routing=make_router("slot", in_caps=1, out_caps=10, out_dim=8))
    assert ClassMatrixCapsules(3, 10, routing=make_router("slot", in_caps=1, out_caps=10, out_dim=16))


def test_a_plain_pair_of_poses_and_activations_is_taken_as_matrix_capsules():
    """The checks take a (poses, activations) tuple or list, and ClassMatrixCapsules routed one,
    but ConvMatrixCapsules failed deep inside: 'tuple' object has no attribute 'poses'."""
    from torchvote.nn import ConvMatrixCapsules, MatrixCapsules

    torch.manual_seed(0)
    layer = ConvMatrixCapsules(2, 3, kernel_size=3, stride=1)
    poses, activations = torch.randn(2, 5, 5, 2, 4, 4), torch.rand(2, 5, 5, 2)
    expected = layer(MatrixCapsules(poses, activations))
    for pair in ((poses, activations), [poses, activations]):
        result = layer(pair)
        torch.testing.assert_close(result.poses, expected.poses)
        torch.testing.assert_close(result.activations, expected.activations)
