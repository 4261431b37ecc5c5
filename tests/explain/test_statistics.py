"""The numbers behind the pictures, against hand computations and properties."""

from __future__ import annotations

import math

import pytest
import torch

from torchvote.explain.statistics import (
    attention_rollout,
    coupling_entropy,
    patch_attention_map,
    perturbation_poses,
    project_votes,
    routing_agreement,
    top_attended,
)


def test_rollout_two_layers_by_hand():
    # layer 1: two heads averaging to [[1, 0], [.5, .5]]; layer 2: both heads [[0, 1], [0, 1]]
    layer1 = torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]])  # (h, i, j)
    layer2 = torch.tensor([[[0.0, 1.0], [0.0, 1.0]]] * 2)
    # A1 = .5 W1 + .5 I = [[1, 0], [.25, .75]]; A2 = [[.5, .5], [0, 1]]; rollout = A2 @ A1
    expected = torch.tensor([[0.625, 0.375], [0.25, 0.75]])
    torch.testing.assert_close(attention_rollout(torch.stack([layer1, layer2])), expected)
    torch.testing.assert_close(attention_rollout([layer1.mean(0), layer2.mean(0)]), expected)


def test_rollout_one_layer_and_residual_extremes():
    weights = torch.softmax(torch.randn(5, 5), dim=-1)
    torch.testing.assert_close(attention_rollout([weights], residual=0.0), weights)
    torch.testing.assert_close(attention_rollout([weights, weights], residual=1.0), torch.eye(5))


@pytest.mark.parametrize("layers, heads, length", [(1, 1, 3), (6, 12, 9), (3, 4, 17)])
def test_rollout_rows_sum_to_one(layers, heads, length):
    torch.manual_seed(layers)
    attentions = torch.softmax(torch.randn(layers, heads, length, length), dim=-1)
    rollout = attention_rollout(attentions)
    assert rollout.shape == (length, length)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(length))
    assert (rollout >= 0).all()


def test_rollout_rejects_bad_input():
    with pytest.raises(ValueError, match="residual"):
        attention_rollout(torch.ones(1, 2, 2), residual=1.5)
    with pytest.raises(ValueError, match="square"):
        attention_rollout(torch.ones(1, 2, 3))
    with pytest.raises(ValueError, match="at least one layer"):
        attention_rollout([])
    with pytest.raises(TypeError, match=r"attentions\[0\] must be a tensor"):
        attention_rollout([[[1.0]]])


def test_rollout_reads_nan_as_a_masked_position():
    """One NaN query row (a padded query, as the figures mark it) made every entry NaN."""
    torch.manual_seed(3)
    weights = torch.softmax(torch.randn(2, 4, 4), dim=-1)  # (layers, i, j)
    masked = weights.clone()
    masked[0, 3] = float("nan")  # query 3 of layer 0 takes no vote
    zeroed = weights.clone()
    zeroed[0, 3] = 0.0
    rollout = attention_rollout(masked)
    assert torch.isfinite(rollout).all()
    torch.testing.assert_close(rollout, attention_rollout(zeroed))
    torch.testing.assert_close(rollout.sum(-1), torch.ones(4))
    masked[1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"attentions\[1\] holds infinite weights"):
        attention_rollout(masked)


def test_coupling_entropy_by_hand():
    uniform = torch.full((2, 2), 0.5)  # pass 1: every input splits evenly: ln 2 each
    decided = torch.tensor([[1.0, 0.5], [0.0, 0.5]])  # pass 2: input 0 chose output 0 (entropy 0)
    couplings = torch.stack([uniform, decided])  # (t, i, j), columns sum to one
    torch.testing.assert_close(coupling_entropy(couplings), torch.tensor([math.log(2), math.log(2) / 2]))
    # batched (t, b, i, j): the mean over the batch
    batched = torch.stack([couplings, torch.stack([decided, decided])], dim=1)
    torch.testing.assert_close(coupling_entropy(batched), torch.tensor([0.75 * math.log(2), math.log(2) / 2]))
    # over the senders: the rows of decided^T are the distributions
    torch.testing.assert_close(
        coupling_entropy(couplings.transpose(-1, -2), normalize_over="senders"), coupling_entropy(couplings)
    )
    with pytest.raises(ValueError, match="normalize_over"):
        coupling_entropy(couplings, normalize_over="heads")


def test_routing_agreement_by_hand():
    votes = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]]])  # (b=1, i=1, j=2, d=2)
    outputs = torch.tensor([[[[1.0, 1.0]]], [[[0.0, 1.0]]]])  # (t=2, b=1, i=1, d=2)
    torch.testing.assert_close(routing_agreement(votes, outputs), torch.tensor([1.5, 1.0]))
    cosine = routing_agreement(votes[0], outputs[:, 0], cosine=True)  # unbatched shapes
    torch.testing.assert_close(cosine, torch.tensor([math.sqrt(0.5), 0.5]))
    with pytest.raises(ValueError, match="must match votes"):
        routing_agreement(votes, torch.ones(2, 1, 3, 2))


def test_project_votes_on_a_line():
    votes = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [2.0, 2.0, 0.0]])
    points, centres, explained = project_votes(votes, torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(points[:, 0].abs(), torch.tensor([math.sqrt(2), 0.0, math.sqrt(2)]))
    torch.testing.assert_close(points[:, 1], torch.zeros(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(centres[:, 0].abs(), torch.tensor([0.0, math.sqrt(2)]), atol=1e-6, rtol=0)
    torch.testing.assert_close(explained, torch.tensor([1.0, 0.0]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="consensus must have d=3"):
        project_votes(votes, torch.ones(2, 4))


def test_project_votes_explains_the_same_fractions_whatever_the_votes_scale():
    """The fractions are a ratio: an absolute floor of 1e-12 under the total gave votes of 1e-8
    (0.128, 0.019) instead of (0.843, 0.123). Identical votes explain nothing: (0, 0)."""
    generator = torch.Generator().manual_seed(1)
    votes = torch.randn(20, 4, generator=generator) * torch.tensor([3.0, 2.0, 1.0, 0.5])
    _, _, explained = project_votes(votes)
    for scale in (1e-4, 1e-8):
        torch.testing.assert_close(project_votes(votes * scale)[2], explained, rtol=1e-4, atol=0.0)
    assert project_votes(torch.ones(5, 3))[2].tolist() == [0.0, 0.0]


def test_perturbation_poses_follow_the_paper():
    pose = torch.randn(16)
    poses = perturbation_poses(pose)
    assert poses.shape == (16, 11, 16)
    deltas = poses - pose  # (d, s, d): only dimension k changes in row k
    torch.testing.assert_close(deltas[3, :, 3], torch.linspace(-0.25, 0.25, 11))
    torch.testing.assert_close(deltas[3, 1, 3] - deltas[3, 0, 3], torch.tensor(0.05))
    off = deltas.clone()
    off[torch.arange(16), :, torch.arange(16)] = 0
    assert off.abs().max() == 0
    torch.testing.assert_close(poses[:, 5], pose.expand(16, 16))  # the middle column is unperturbed
    with pytest.raises(ValueError, match="steps"):
        perturbation_poses(pose, steps=1)
    with pytest.raises(ValueError, match="pose must be a 1-D"):
        perturbation_poses(torch.ones(2, 16))


def test_patch_attention_map_and_top_attended():
    heat = patch_attention_map(torch.arange(4.0), (2, 2), (4, 6))
    assert heat.shape == (4, 6)
    assert heat[0, :3].eq(0).all() and heat[0, 3:].eq(1).all() and heat[3, 5] == 3
    with pytest.raises(ValueError, match="grid"):
        patch_attention_map(torch.ones(5), (2, 2), (4, 4))
    weights = torch.tensor([[[0.1, 0.7, 0.2], [1.0, 0.0, 0.0], [0.3, 0.3, 0.4]]])  # (h, i, j)
    top = top_attended(weights, ["a", "b", "c"], 0, k=2)
    assert [t for t, _ in top[0]] == ["b", "c"]
    assert top[0][0][1] == pytest.approx(0.7)
    with pytest.raises(ValueError, match="tokens must have 3"):
        top_attended(weights, ["a"], 0)


def test_every_statistic_refuses_tensors_without_values_by_name():
    with pytest.raises(ValueError, match="couplings is on the meta device"):
        coupling_entropy(torch.empty(2, 3, 4, device="meta"))  # NotImplementedError from .cpu()
    with pytest.raises(TypeError, match="votes must be real"):
        routing_agreement(torch.ones(1, 2, 3, dtype=torch.cfloat), torch.ones(1, 1, 2, 3))  # dropped .imag
    with pytest.raises(ValueError, match="attentions must be 3-D or 4-D"):
        attention_rollout(torch.eye(3))  # unbound into rows: "attentions[0] must be 2-D or 3-D"


def test_statistics_take_half_precision_gradients_and_sparse_tensors():
    couplings = torch.softmax(torch.randn(2, 3, 4), dim=-2)
    expected = coupling_entropy(couplings)
    torch.testing.assert_close(coupling_entropy(couplings.bfloat16()), expected, atol=2e-2, rtol=0)
    torch.testing.assert_close(coupling_entropy(couplings.clone().requires_grad_()), expected)
    torch.testing.assert_close(coupling_entropy(couplings.to_sparse()), expected)


def test_top_attended_checks_query_and_k_and_ranks_masked_keys_last():
    weights = torch.tensor([[float("nan"), 0.2, 0.8], [0.1, float("nan"), float("nan")]])  # (i, j)
    top = top_attended(weights, ["a", "b", "c"], 0, k=3)[0]
    assert [t for t, _ in top[:2]] == ["c", "b"] and top[2][0] == "a"  # NaN ranked above 0.8 before
    assert math.isnan(top[2][1])
    assert [t for t, _ in top_attended(weights, ["a", "b", "c"], -1, k=1)[0]] == ["a"]
    with pytest.raises(TypeError, match="query must be an integer index"):
        top_attended(weights, ["a", "b", "c"], 0.5)  # IndexError from torch
    with pytest.raises(TypeError, match="query must be an integer index"):
        top_attended(weights, ["a", "b", "c"], True)
    with pytest.raises(ValueError, match="k must be at least 1"):
        top_attended(weights, ["a", "b", "c"], 0, k=0)  # returned nothing
    with pytest.raises(ValueError, match="k must be at least 1"):
        top_attended(weights, ["a", "b", "c"], 0, k=-1)  # RuntimeError from topk


def test_perturbation_poses_of_an_integer_pose_move_by_the_deltas():
    pose = torch.tensor([1, 2, 3])
    poses = perturbation_poses(pose)  # linspace in int64: every delta rounded to 0
    assert poses.dtype == torch.get_default_dtype()
    torch.testing.assert_close(poses[0, :, 0] - 1, torch.linspace(-0.25, 0.25, 11))
    with pytest.raises(TypeError, match="pose must be a real tensor"):
        perturbation_poses([1.0, 2.0])


def test_patch_attention_map_checks_grid_and_size():
    with pytest.raises(ValueError, match="grid must be two positive integers"):
        patch_attention_map(torch.ones(0), (0, 2), (4, 4))  # ZeroDivisionError
    with pytest.raises(ValueError, match="grid must be two positive integers"):
        patch_attention_map(torch.ones(4), (2, 2, 1), (4, 4))  # "too many values to unpack"
    with pytest.raises(ValueError, match="size must be two positive integers"):
        patch_attention_map(torch.ones(4), (2, 2), (4,))
    strided = torch.arange(8.0)[::2]  # non-contiguous (patches,)
    expected = torch.tensor([[0.0, 2.0], [4.0, 6.0]])
    torch.testing.assert_close(patch_attention_map(strided, (2, 2), (2, 2)), expected)


def test_project_votes_refuses_non_finite_votes_by_name():
    votes = torch.tensor([[1.0, float("nan")], [0.0, 1.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match="votes must be finite"):
        project_votes(votes)  # torch.linalg.LinAlgError from the SVD
    with pytest.raises(ValueError, match="consensus must be finite"):
        project_votes(votes.nan_to_num(), torch.tensor([[float("inf"), 0.0]]))


def test_coupling_entropy_and_agreement_of_one_pass_by_hand():
    one = torch.tensor([[[0.25, 1.0], [0.75, 0.0]]])  # (t=1, i=2, j=2), columns sum to one
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))  # input 0; input 1 chose output 0: 0
    torch.testing.assert_close(coupling_entropy(one), torch.tensor([h / 2]))
    votes = torch.tensor([[[3.0, 4.0]]])  # (i=1, j=1, d=2)
    torch.testing.assert_close(routing_agreement(votes, torch.tensor([[[1.0, 0.0]]])), torch.tensor([3.0]))
    torch.testing.assert_close(routing_agreement(votes, torch.tensor([[[1.0, 0.0]]]), cosine=True),
                               torch.tensor([0.6]))


def test_rollout_and_coupling_entropy_refuse_what_gave_nonsense():
    """Review findings: a residual of "a" failed on '<=', negative weights gave entries of about
    -1e12, negative couplings a NaN entropy, unnormalised ones a negative entropy, an empty batch
    NaN, and normalize_over=["receivers"] "unhashable type: 'list'"."""
    from torchvote.explain.statistics import attention_rollout, coupling_entropy

    weights = torch.softmax(torch.randn(2, 4, 4), dim=-1)  # (layers, i, j)
    for residual, error in (("a", TypeError), (None, TypeError), (True, TypeError), (1.5, ValueError)):
        with pytest.raises(error, match="residual must be"):
            attention_rollout(weights, residual=residual)
    with pytest.raises(TypeError, match="attentions must be a tensor or a list of them, got NoneType"):
        attention_rollout(None)
    with pytest.raises(ValueError, match=r"attentions\[1\] holds negative weights"):
        attention_rollout(torch.stack([weights[0], -weights[1]]), residual=0.0)
    torch.testing.assert_close(attention_rollout(weights).sum(-1), torch.ones(4))

    couplings = torch.softmax(torch.randn(3, 2, 5, 4), dim=-2)  # (t, b, i, j), over the receivers
    assert torch.isfinite(coupling_entropy(couplings)).all()
    for bad in (-couplings, couplings * 10):
        with pytest.raises(ValueError, match=r"couplings must be probabilities in \[0, 1\]"):
            coupling_entropy(bad)
    with pytest.raises(ValueError, match="couplings must"):
        coupling_entropy(couplings[:, :0])
    with pytest.raises(ValueError, match="normalize_over must be one of"):
        coupling_entropy(couplings, normalize_over=["receivers"])
