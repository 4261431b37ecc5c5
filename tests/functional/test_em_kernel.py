"""The strategies of ``em_routing`` (``functional/em_kernel.py``) against independent references.

- EM routing as a configuration of :func:`torchvote.functional.voting.vote` (``vote_em`` below:
  ``PairwiseVotes`` of the statistics ``(1, c, c^2)``, the E-step as the agreement, the softmax
  over the receivers, ``sender_weights`` the input activations): outputs, assignments and
  gradients at 1e-10 in float64, for every strategy; the library runs a fused kernel, and this
  test is what says it is the same routing as the voting operator;
- a literal loop of Hinton et al. 2018, Procedure 1, in the paper's (not log) space, for a tiny
  convolutional layer, which loops over the input capsules and their parent sets (every output
  capsule of every patch that holds them): the joint normalisation of ``sender_groups``;
- gradients for every order and subset of autograd calls, twice-run backward, gradcheck, and
  double backward (works for "vectorized", raises for "blocked").

Reference letters follow the paper: ``i`` input capsule, ``j`` output capsule; the routing's own
layout is receivers first ``(n, i out, j in, h)``.
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from torch.utils.checkpoint import checkpoint

import torchvote.functional.em_kernel as kernel_module
from torchvote.functional.em import default_inverse_temperature, em_routing
from torchvote.functional.em_kernel import PerSenderVotes, conv_sender_groups, prepare_sender_groups
from torchvote.functional.voting import PairwiseVotes, VotingState, vote

DOUBLE = torch.float64
EPS = 1e-6
STRATEGIES = ["blocked", "vectorized"]
TIGHT = {"rtol": 1e-10, "atol": 1e-12}


def steep(t):
    return 0.5 * (t + 1)  # activations that vary in a small test


def sample(seed, rows=6, receivers=3, senders=5, pose_dim=4, dtype=DOUBLE):
    """Receivers-first votes ``(n, i, j, h)``, activations ``(n, j)``, offsets ``(i,)``."""
    generator = torch.Generator().manual_seed(seed)
    votes = torch.randn(rows, receivers, senders, pose_dim, generator=generator, dtype=dtype)
    activations = torch.rand(rows, senders, generator=generator, dtype=dtype) * 0.9 + 0.1
    beta_u = torch.randn(receivers, generator=generator, dtype=dtype)
    beta_a = torch.randn(receivers, generator=generator, dtype=dtype)
    return [t.requires_grad_(True) for t in (votes, activations, beta_u, beta_a)]


def em_routing_kernel(votes, activations, beta_u, beta_a, *, inverse_temperatures, **options):
    """``em_routing`` with its schedule as one value per iteration (their count the iterations)."""
    return em_routing(votes, activations, beta_u, beta_a, iterations=len(inverse_temperatures),
                      inverse_temperature=list(inverse_temperatures), **options)


def m_step(sums, pose_dim, beta_u, beta_a, inverse_temperature, eps=EPS):
    """Procedure 1's M-step from ``(sum R, sum R c, sum R c^2)`` ``(n, i, 1 + 2h)``."""
    total = sums[..., :1]
    divisor = torch.where(total > 0, total, 1.0)  # a receiver no vote reaches: pose 0 (below)
    mean = sums[..., 1 : 1 + pose_dim] / divisor
    variance = (sums[..., 1 + pose_dim :] / divisor - mean.pow(2)).clamp_min(0.0) + eps
    cost = (beta_u.unsqueeze(-1) + 0.5 * torch.log(variance)) * total  # (beta_u + log sigma) sum R
    return mean, variance, inverse_temperature * (beta_a - cost.sum(-1))  # logit of a_i


def vote_em(votes, activations, beta_u, beta_a, schedule, return_assignments=False, all_passes=False):
    """EM routing as one call of ``vote``, per row (per patch): plain autograd throughout."""
    pose_dim = votes.shape[-1]
    shift = votes.detach().mean(dim=2, keepdim=True)  # (n, i, 1, h): a constant, shift-invariance
    centred = votes - shift
    statistics = torch.cat([torch.ones_like(centred[..., :1]), centred, centred.square()], dim=-1)

    def e_step(state: VotingState):
        """log a_i + log N(V_ij | mu_i, s2_i) as one dot product with (const, mu/s2, -1/(2 s2))."""
        mean, variance, logit = m_step(state.aggregated, pose_dim, beta_u, beta_a, schedule[state.iteration])
        constant = -0.5 * (mean.pow(2) / variance + math.log(2 * math.pi) + variance.log()).sum(-1)
        constant = constant + F.logsigmoid(logit)  # (n, i)
        query = torch.cat([constant.unsqueeze(-1), mean / variance, -0.5 / variance], dim=-1)
        return state.votes.dot(query)  # (n, i, j)

    result = vote(PairwiseVotes(statistics), votes.new_zeros(votes.shape[:-1]), normalize_over="receivers",
                  iterations=len(schedule), agreement=e_step, update="replace", aggregation="sum",
                  sender_weights=activations, record=True)
    mean, _, logit = m_step(result.outputs, pose_dim, beta_u, beta_a, schedule[-1])
    outputs = (mean + shift.squeeze(2), torch.sigmoid(logit))
    if not return_assignments:
        return outputs
    return (*outputs, torch.stack(result.weights) if all_passes else result.weights[-1])


def loss_of(poses, activations, assignments=None, seed=0):
    """A loss that weighs every output differently, so that no gradient hides in a symmetry."""
    generator = torch.Generator().manual_seed(seed)
    total = (poses * torch.randn(poses.shape, generator=generator, dtype=poses.dtype)).sum()
    probe = torch.randn(activations.shape, generator=generator, dtype=poses.dtype)
    total = total + (activations * probe).sum()
    if assignments is not None:
        total = total + (assignments * torch.randn(assignments.shape, generator=generator,
                                                   dtype=poses.dtype)).sum()
    return total


def assert_same_routing(ours, ref, inputs):
    """Outputs (and assignments) and the gradients of :func:`loss_of` for ``inputs`` agree tightly."""
    for x, y in zip(ours, ref, strict=True):
        torch.testing.assert_close(x, y, **TIGHT)
    grads = torch.autograd.grad(loss_of(*ours), inputs)
    ref_grads = torch.autograd.grad(loss_of(*ref), inputs)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, **TIGHT)


@pytest.fixture(params=[None, 1], ids=["default-blocks", "one-row-blocks"])
def block_size(request, monkeypatch):
    if request.param is not None:  # force many blocks: one row each
        monkeypatch.setattr(kernel_module, "_BLOCK_ELEMENTS", request.param)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("iterations", [1, 2, 3])
@pytest.mark.parametrize("schedule_of", [default_inverse_temperature, steep])
def test_matches_em_as_a_vote_configuration(strategy, iterations, schedule_of, block_size):
    schedule = [schedule_of(t) for t in range(iterations)]
    inputs = sample(iterations)
    ours = em_routing_kernel(*inputs, inverse_temperatures=schedule, strategy=strategy,
                             return_assignments=True, all_passes=True)
    ref = vote_em(*inputs, schedule, return_assignments=True, all_passes=True)
    assert_same_routing(ours, ref, inputs)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_final_assignments_sum_to_one_over_receivers(strategy):
    inputs = sample(1)
    _, _, assignments = em_routing_kernel(*inputs, inverse_temperatures=[0.1, 0.2, 0.3], strategy=strategy,
                                          return_assignments=True)
    assert assignments.shape == (6, 3, 5)
    torch.testing.assert_close(assignments.sum(1), torch.ones(6, 5, dtype=DOUBLE))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_gradient_alone_and_in_any_order(strategy, block_size):
    """The bug of the old store: a partial gradient first, then another one, must not leak."""
    inputs = sample(2)
    outputs = em_routing_kernel(*inputs, inverse_temperatures=[0.5, 1.0, 1.5], strategy=strategy,
                                return_assignments=True)
    loss = loss_of(*outputs)
    joint = torch.autograd.grad(loss, inputs, retain_graph=True)
    for index in range(4):  # each input alone
        (alone,) = torch.autograd.grad(loss, [inputs[index]], retain_graph=True)
        torch.testing.assert_close(alone, joint[index], **TIGHT)
    for order in ([1, 0], [3, 2, 1, 0], [0, 3], [2, 0, 1]):  # subsets in different orders
        for index in order:
            (piece,) = torch.autograd.grad(loss, [inputs[index]], retain_graph=True)
            torch.testing.assert_close(piece, joint[index], **TIGHT)
    loss.backward(retain_graph=True)
    loss.backward()  # twice: gradients accumulate exactly
    for leaf, once in zip(inputs, joint, strict=True):
        torch.testing.assert_close(leaf.grad, 2 * once, **TIGHT)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("grouped", [False, True])
def test_gradcheck(strategy, grouped):
    inputs = sample(3, rows=2, receivers=2, senders=3, pose_dim=2)
    groups = torch.tensor([[0, 1, 2], [2, 3, 0]]) if grouped else None  # two rows share ids 0 and 2
    assert torch.autograd.gradcheck(
        lambda *args: em_routing_kernel(*args, inverse_temperatures=[0.5, 1.0], strategy=strategy,
                                        sender_groups=groups, return_assignments=True),
        inputs)


def test_vectorized_double_backward():
    inputs = sample(4, rows=2, receivers=2, senders=3, pose_dim=2)
    assert torch.autograd.gradgradcheck(
        lambda *args: em_routing_kernel(*args, inverse_temperatures=[0.5, 1.0], strategy="vectorized"),
        inputs)


def test_blocked_double_backward_raises_clearly():
    inputs = sample(4)
    poses, activations = em_routing_kernel(*inputs, inverse_temperatures=[0.5, 1.0], strategy="blocked")
    with pytest.raises(RuntimeError, match="differentiated once only.*vectorized"):
        torch.autograd.grad(loss_of(poses, activations), inputs, create_graph=True)


def test_blocked_batched_gradients_raise_clearly_and_vectorized_gives_them():
    """A batched backward (is_grads_batched: the backward alone under vmap) failed inside blocked's
    out= products ("Batching rule not implemented for aten::bmm.out"); vectorized's rows equal
    one backward each."""
    votes, activations, beta_u, beta_a = sample(4)
    votes = votes.detach().requires_grad_()

    def batched(strategy):
        _, out = em_routing_kernel(votes, activations, beta_u, beta_a, inverse_temperatures=[0.5, 1.0],
                                   strategy=strategy)
        out = out.flatten()
        rows = torch.stack([torch.autograd.grad(value, votes, retain_graph=True)[0] for value in out])
        eye = torch.eye(out.numel(), dtype=out.dtype)
        return torch.autograd.grad(out, votes, eye, is_grads_batched=True)[0], rows

    with pytest.raises(RuntimeError, match="one gradient at a time.*vectorized.*is_grads_batched"):
        batched("blocked")
    gradients, rows = batched("vectorized")
    torch.testing.assert_close(gradients, rows, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("wanted", [slice(None), slice(1, 2)])  # every gradient, one gradient
def test_blocked_frees_every_block_after_backward(monkeypatch, wanted):
    """A training step must not leak: each block's statistics (and the workspace they view) are
    gone once the step's tensors are. Before the fix the backward recomputation's block stayed
    alive in a reference cycle through autograd's nodes, about 100 MB per step of
    em-capsnet-mnist (21 GB by the end of a 156-step run)."""
    blocks = []
    original = kernel_module._BlockStatistics.__init__

    def tracked(self, *args, **kwargs):
        original(self, *args, **kwargs)
        blocks.append(weakref.ref(self))

    monkeypatch.setattr(kernel_module._BlockStatistics, "__init__", tracked)
    inputs = sample(5)
    for _ in range(2):  # two steps
        loss = loss_of(*em_routing_kernel(*inputs, inverse_temperatures=[0.5, 1.0, 1.5], strategy="blocked"))
        torch.autograd.grad(loss, inputs[wanted])
        del loss
    gc.collect()
    assert len(blocks) >= 4  # forward and backward blocks of both steps were made
    assert [ref() for ref in blocks if ref() is not None] == []


# --- joint normalisation over the parents of every input capsule (convolutional EM) -------------


def conv_sample(seed, batch=2, grid=(4, 4), in_types=2, kernel=3, stride=1, out_types=2, pose_dim=3):
    positions = ((grid[0] - kernel) // stride + 1) * ((grid[1] - kernel) // stride + 1)
    slots = kernel * kernel * in_types
    generator = torch.Generator().manual_seed(seed)
    votes = torch.randn(batch * positions, out_types, slots, pose_dim, generator=generator, dtype=DOUBLE)
    activations = torch.rand(batch * positions, slots, generator=generator, dtype=DOUBLE) * 0.9 + 0.1
    beta_u = torch.randn(out_types, generator=generator, dtype=DOUBLE)
    beta_a = torch.randn(out_types, generator=generator, dtype=DOUBLE)
    return [t.requires_grad_(True) for t in (votes, activations, beta_u, beta_a)], positions


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("grid", "stride"), [((4, 4), 1), ((5, 4), 2)])
@pytest.mark.parametrize("prepared", [False, True], ids=["ids", "prepared"])
def test_joint_normalisation_matches_paper_loop(
    strategy, grid, stride, prepared, block_size, conv_procedure1
):
    in_types, kernel, schedule = 2, 3, [0.5, 1.0]
    inputs, positions = conv_sample(5, grid=grid, stride=stride)
    groups = conv_sender_groups(*grid, in_types, kernel, stride)  # (5, 4) with stride 2: row 4 unused
    if prepared:  # what a layer does once per grid
        groups = prepare_sender_groups(groups)
    ours = em_routing_kernel(*inputs, inverse_temperatures=schedule, sender_groups=groups,
                             strategy=strategy, return_assignments=True)
    votes, activations, beta_u, beta_a = inputs
    per_image = [conv_procedure1(votes[b * positions:(b + 1) * positions],
                                 activations[b * positions:(b + 1) * positions],
                                 beta_u, beta_a, grid, in_types, kernel, stride, schedule)
                 for b in range(2)]
    ref = [torch.cat(parts) for parts in zip(*per_image, strict=True)]
    assert_same_routing(ours, ref, inputs)


def test_joint_normalisation_differs_from_per_patch_and_sums_to_one_per_input():
    inputs, positions = conv_sample(6)
    groups = conv_sender_groups(4, 4, 2, 3, 1)
    schedule = [0.5, 1.0, 1.5]
    _, _, joint = em_routing_kernel(*inputs, inverse_temperatures=schedule, sender_groups=groups,
                                    return_assignments=True)
    _, _, patch = em_routing_kernel(*inputs, inverse_temperatures=schedule, return_assignments=True)
    assert not torch.allclose(joint, patch)
    for b in range(2):  # every input capsule's assignments sum to 1 over all its parents
        image = joint[b * positions:(b + 1) * positions].sum(1)  # (L, j)
        totals = torch.zeros(groups.max() + 1, dtype=DOUBLE)
        totals = totals.index_add(0, groups.reshape(-1), image.reshape(-1))
        torch.testing.assert_close(totals, torch.ones_like(totals))


@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_group_log_softmax_matches_a_loop_over_groups(scale):
    """The two-level joint softmax against a loop: per group, one softmax over every (n, i) entry
    of its sender; logits up to 1e4 (exp overflows without the shift) stay finite in float32."""
    generator = torch.Generator().manual_seed(3)
    groups = conv_sender_groups(5, 5, 2, 3, 1)  # (9, 18), ids shared by up to 9 patches
    num_groups = int(groups.max()) + 1
    logits = scale * torch.randn(9, 4, 18, generator=generator, dtype=DOUBLE)
    expected = torch.empty_like(logits)
    for group in range(num_groups):
        rows, senders = (groups == group).nonzero(as_tuple=True)
        expected[rows, :, senders] = torch.log_softmax(logits[rows, :, senders].reshape(-1), 0).view(-1, 4)
    ours = kernel_module._group_log_softmax(logits, groups, num_groups)
    torch.testing.assert_close(ours, expected, **TIGHT)
    single = kernel_module._group_log_softmax(logits.float(), groups, num_groups)
    assert torch.isfinite(single).all()
    torch.testing.assert_close(single.exp(), expected.exp().float(), rtol=1e-4, atol=1e-6)


def test_group_log_softmax_gradcheck():
    groups = conv_sender_groups(4, 4, 1, 3, 1)
    logits = torch.randn(4, 3, 9, dtype=DOUBLE, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: kernel_module._group_log_softmax(x, groups, 16), (logits,))


def test_groups_of_distinct_ids_are_per_row_normalisation():
    inputs = sample(7)
    distinct = torch.arange(5).unsqueeze(0)  # period of one row: every sender its own capsule
    grouped = em_routing_kernel(*inputs, inverse_temperatures=[0.5, 1.0, 1.5], sender_groups=distinct,
                                return_assignments=True)
    plain = em_routing_kernel(*inputs, inverse_temperatures=[0.5, 1.0, 1.5], return_assignments=True)
    for x, y in zip(grouped, plain, strict=True):
        torch.testing.assert_close(x, y, **TIGHT)


def test_conv_sender_groups_by_hand():
    groups = conv_sender_groups(4, 4, 1, 3, 1)  # 2x2 patches of a 4x4 grid, one type
    assert groups.tolist() == [
        [0, 1, 2, 4, 5, 6, 8, 9, 10],
        [1, 2, 3, 5, 6, 7, 9, 10, 11],
        [4, 5, 6, 8, 9, 10, 12, 13, 14],
        [5, 6, 7, 9, 10, 11, 13, 14, 15],
    ]
    two_types = conv_sender_groups(3, 5, 2, 3, 2)  # one row of two patches, stride 2
    assert two_types[1, :4].tolist() == [2 * 2, 2 * 2 + 1, 3 * 2, 3 * 2 + 1]  # cells (0, 2), (0, 3)
    assert two_types[1, -2:].tolist() == [14 * 2, 14 * 2 + 1]  # cell (2, 4)


def test_conv_sender_groups_follow_conv_matrix_capsules_patch_order():
    """Unfold a grid of ids exactly as ConvMatrixCapsules.votes unfolds the activations."""
    rows, cols, types, k, stride = 6, 5, 3, 3, 2
    ids = torch.arange(rows * cols * types, dtype=DOUBLE).view(1, rows, cols, types)  # (b, h, w, t)
    patches = F.unfold(rearrange(ids, "b h w t -> b t h w"), k, stride=stride)
    patches = rearrange(patches, "b (t kh kw) l -> b l (kh kw t)", t=types, kh=k, kw=k)[0]
    assert torch.equal(conv_sender_groups(rows, cols, types, k, stride), patches.long())


# --- "compiled" on a CPU: the compiled loop, block by block --------------------------------------


@pytest.fixture
def compiled_blocks(monkeypatch):
    """The compiled strategy's blocks on a CPU with the loop run eagerly (what is compiled is
    :func:`test_compiled_strategy_matches_reference`'s; compiling every shape here would take
    minutes): the rows of each block are recorded, and a block is 4 rows of the default sample
    (a 6-row call runs as blocks of 4 and 2 rows, the shorter last block included)."""
    rows = []

    def eager_loop(*args):
        rows.append(args[-1])
        return kernel_module._fused_loop(*args)

    monkeypatch.setattr(kernel_module, "_compiled_loop", lambda: eager_loop)
    monkeypatch.setattr(kernel_module, "_COMPILED_BLOCK_ELEMENTS", 4 * 3 * 5 * 4)
    return rows


@pytest.mark.parametrize("grouped", [False, True])
def test_compiled_strategy_matches_reference(grouped, compiler):
    """Compiled (on a CPU one compiled block here, as ``_compiled_blocks`` runs it) against
    the vote configuration, or (with groups) against the vectorized strategy, itself checked
    against the paper loop above; double backward raises torch's error, as documented."""
    inputs = sample(8, rows=2, receivers=2, senders=3, pose_dim=2)
    groups = torch.tensor([[0, 1, 2], [2, 3, 0]]) if grouped else None
    ours = em_routing_kernel(*inputs, inverse_temperatures=[0.5, 1.0], strategy="compiled",
                             sender_groups=groups, return_assignments=True)
    if grouped:
        ref = em_routing_kernel(*inputs, inverse_temperatures=[0.5, 1.0], strategy="vectorized",
                                sender_groups=groups, return_assignments=True)
    else:
        ref = vote_em(*inputs, [0.5, 1.0], return_assignments=True)
    for x, y in zip(ours, ref, strict=True):
        torch.testing.assert_close(x, y, **TIGHT)
    loss, ref_loss = loss_of(*ours), loss_of(*ref)
    for index in (2, 0, 3, 1):  # each input alone, the graph kept (retain_graph) between them
        (piece,) = torch.autograd.grad(loss, [inputs[index]], retain_graph=True)
        (expected,) = torch.autograd.grad(ref_loss, [inputs[index]], retain_graph=True)
        torch.testing.assert_close(piece, expected, **TIGHT)
    (first,) = torch.autograd.grad(loss, [inputs[0]], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):  # torch's own, as the docstring says
        torch.autograd.grad(first.square().sum(), inputs[0])


@pytest.mark.parametrize("grouped", [False, True])
def test_compiled_blocks_on_cpu_match_the_vectorized_strategy(grouped, compiled_blocks):
    """On a CPU "compiled" runs the compiled loop per block of rows, differentiated by autograd
    through each block's compiled graph: outputs, every pass's assignments and the gradients of
    every input equal the vectorized strategy's, itself checked against the vote configuration
    and the paper's loop."""
    inputs = sample(12)
    groups = torch.tensor([[0, 1, 2, 3, 4], [2, 5, 0, 6, 1]]) if grouped else None  # period 2 rows
    options = {"inverse_temperatures": [0.5, 1.0, 1.5], "sender_groups": groups, "return_assignments": True,
               "all_passes": True}
    ours = em_routing_kernel(*inputs, strategy="compiled", **options)
    assert compiled_blocks == [4, 2]
    ref = em_routing_kernel(*inputs, strategy="vectorized", **options)
    assert_same_routing(ours, ref, inputs)


def test_compiled_blocks_gradients_alone_and_in_any_order(compiled_blocks):
    inputs = sample(13)
    outputs = em_routing_kernel(*inputs, inverse_temperatures=[0.5, 1.0, 1.5], strategy="compiled",
                                return_assignments=True)
    assert compiled_blocks == [4, 2]
    ref = em_routing_kernel(*inputs, inverse_temperatures=[0.5, 1.0, 1.5], strategy="vectorized",
                            return_assignments=True)
    loss, ref_loss = loss_of(*outputs), loss_of(*ref)
    for order in ([1], [3, 0], [2, 1, 0, 3]):
        for index in order:
            (piece,) = torch.autograd.grad(loss, [inputs[index]], retain_graph=True)
            (expected,) = torch.autograd.grad(ref_loss, [inputs[index]], retain_graph=True)
            torch.testing.assert_close(piece, expected, **TIGHT)


def per_sender_sample(seed, batch=2, positions=4, senders=6, receivers=3, pose_dim=4, features=4,
                      dtype=DOUBLE):
    """:class:`PerSenderVotes` leaves ``[left, right, activations, beta_u, beta_a]`` (all requiring
    gradients) and the votes they stand for, formed first with einsum ``(b, l, i, j, h)``."""
    generator = torch.Generator().manual_seed(seed)
    left = torch.randn(senders, batch * positions, features, generator=generator, dtype=dtype)
    right = torch.randn(senders, features, receivers * pose_dim, generator=generator, dtype=dtype)
    activations = torch.rand(batch, positions, senders, generator=generator, dtype=dtype)
    beta_u, beta_a = torch.randn(2, receivers, generator=generator, dtype=dtype)
    leaves = [t.requires_grad_(True) for t in (left, right, activations, beta_u, beta_a)]
    formed = rearrange(torch.einsum("jnk,jkc->njc", left, right), "(b l) j (i h) -> b l i j h",
                       b=batch, i=receivers)
    return leaves, PerSenderVotes(left, right, (batch, positions), receivers), formed


@pytest.fixture
def formed_blocks(monkeypatch):
    """Every block of votes ``_compiled_blocks`` forms from :class:`PerSenderVotes` (forward, and
    again in backward), as weak references; no block's votes kept as they are (a budget of 0)."""
    monkeypatch.setattr(kernel_module, "_KEPT_VOTES_BYTES", 0)
    formed = []

    def spy(*args, **kwargs):
        block = original(*args, **kwargs)
        formed.append(weakref.ref(block))
        return block

    original = kernel_module._formed_block
    monkeypatch.setattr(kernel_module, "_formed_block", spy)
    return formed


# Per-sender votes whose one block is the votes of test_compiled_strategy_matches_reference (the
# same compiled graph: compiled once per process), routed by the compiled strategy's CPU blocks.
SCHEDULE = {"inverse_temperatures": [0.5, 1.0, 1.5], "return_assignments": True}
COMPILED_SHAPES = {"batch": 1, "positions": 2, "senders": 3, "receivers": 2, "pose_dim": 2, "features": 3}
SHORT = {"inverse_temperatures": [0.5, 1.0], "return_assignments": True}


def assert_gradients_of_formed_votes(outputs, leaves, formed):
    """The gradients of every leaf through ``outputs`` equal those through the votes formed first
    (routed by the vectorized strategy)."""
    ref = em_routing_kernel(formed, *leaves[2:], strategy="vectorized", **SHORT)
    grads = torch.autograd.grad(loss_of(*outputs), leaves)
    for g, r in zip(grads, torch.autograd.grad(loss_of(*ref), leaves), strict=True):
        torch.testing.assert_close(g, r, **TIGHT)


# The compiled strategy forms a block's votes again in backward only where torch tells whether a
# caller's saved-tensor hooks are active (torch 2.7.1 and older cannot: every saved tensor is kept
# there, the formed votes included, and a factor changed in place after forward changes nothing)
FORMED_AGAIN = pytest.mark.skipif(
    not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"),
    reason="this torch cannot tell whether a caller's saved-tensor hooks are active: the votes are kept",
)


@FORMED_AGAIN
def test_compiled_blocks_keep_formed_votes_as_their_product(formed_blocks, compiler):
    """A block's votes formed from :class:`PerSenderVotes` are not kept for backward (they would
    be the whole votes, block after block): backward forms them again, once per use (here two,
    through ``retain_graph``), and the gradients are those of the votes formed first."""
    leaves, votes, formed = per_sender_sample(21, **COMPILED_SHAPES)
    ours = em_routing_kernel(votes, *leaves[2:], strategy="compiled", **SHORT)
    gc.collect()
    assert len(formed_blocks) == 1 and formed_blocks[0]() is None  # formed, then freed
    torch.autograd.grad(loss_of(*ours), leaves[2], retain_graph=True)
    assert len(formed_blocks) == 2
    assert_gradients_of_formed_votes(ours, leaves, formed)  # the second use: right again
    assert len(formed_blocks) == 3


@pytest.mark.parametrize("modified", [pytest.param("left", marks=FORMED_AGAIN), "activations"])
def test_compiled_blocks_refuse_saved_tensors_modified_in_place(modified, monkeypatch, compiler):
    """Votes formed again in backward from a factor changed since forward would give a wrong
    gradient silently (autograd itself keeps no copy of ``left`` when only ``left`` needs a
    gradient), and so would any other tensor the block's graph saved, which autograd does not check
    under saved-tensor hooks: both raise, as autograd does for a tensor it saved."""
    monkeypatch.setattr(kernel_module, "_KEPT_VOTES_BYTES", 0)
    leaves, votes, _ = per_sender_sample(22, **COMPILED_SHAPES)
    right = leaves[1].detach()
    ours = em_routing_kernel(PerSenderVotes(leaves[0], right, votes.batch_shape, votes.receivers),
                             *leaves[2:], strategy="compiled", **SHORT)
    with torch.no_grad():
        leaves[0 if modified == "left" else 2].mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss_of(*ours), leaves[0])


def test_compiled_blocks_formed_again_under_autocast_as_in_forward(monkeypatch, compiler):
    """A backward run inside ``torch.autocast`` forms the blocks again in float32, as forward did
    (formed in bfloat16 they were read as float32: NaN): the gradients equal those of kept votes."""
    leaves, votes, _ = per_sender_sample(25, **COMPILED_SHAPES, dtype=torch.float32)
    grads = {}
    for budget in (1 << 62, 0):  # every block kept, every block formed again
        monkeypatch.setattr(kernel_module, "_KEPT_VOTES_BYTES", budget)
        ours = em_routing_kernel(votes, *leaves[2:], strategy="compiled", **SHORT)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            grads[budget] = torch.autograd.grad(loss_of(*ours), leaves)
    for kept, formed in zip(grads[1 << 62], grads[0], strict=True):
        torch.testing.assert_close(formed, kept, rtol=0, atol=0)


def test_compiled_blocks_dropped_without_backward_leave_nothing_alive(compiled_blocks, monkeypatch):
    """A forward pass whose graph is dropped without backward (evaluation with gradients on) frees
    everything, also with the blocks' votes kept as their product: tensors the hooks keep hold no
    reference cycle through their own graph (an eager loop saves outputs of its own operations)."""
    monkeypatch.setattr(kernel_module, "_KEPT_VOTES_BYTES", 0)
    leaves, votes, _ = per_sender_sample(26)

    def live_tensors():
        gc.collect()
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    em_routing_kernel(votes, *leaves[2:], strategy="compiled", **SCHEDULE)  # warm-up, dropped
    before = live_tensors()
    for _ in range(3):
        outputs = em_routing_kernel(votes, *leaves[2:], strategy="compiled", **SCHEDULE)
        del outputs
    assert live_tensors() <= before  # (a cycle would keep dozens per call)


@pytest.mark.parametrize("votes_kind", ["per_sender", "strided", "contiguous"])
def test_compiled_blocks_keep_votes_up_to_the_budget(votes_kind, compiled_blocks, monkeypatch):
    """The votes a block forms from :class:`PerSenderVotes` are kept as they are until the call's
    budget is spent; later blocks are formed again in backward. Blocks of dense votes are never
    formed again: views of contiguous votes cost nothing to keep, and a recipe for copies of
    strided ones would keep the caller's whole votes (and their base) instead."""
    recipes = []
    original = kernel_module._saved_as_recipe

    def spy(tensor, *args):
        recipes.append(tensor.shape[0])
        return original(tensor, *args)

    monkeypatch.setattr(kernel_module, "_saved_as_recipe", spy)
    leaves, votes, formed = per_sender_sample(24)  # 8 rows of (3, 6, 4) votes: blocks of 3, 3, 2 rows
    monkeypatch.setattr(kernel_module, "_KEPT_VOTES_BYTES", 3 * 3 * 6 * 4 * 8)  # one block, in float64
    if votes_kind == "strided":
        votes = formed.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_(True)
    elif votes_kind == "contiguous":
        votes = formed.detach().contiguous().requires_grad_(True)
    ours = em_routing_kernel(votes, *leaves[2:], strategy="compiled", **SCHEDULE)
    assert compiled_blocks == [3, 3, 2]
    assert recipes == ([3, 2] if votes_kind == "per_sender" else [])
    sources = leaves if votes_kind == "per_sender" else [votes, *leaves[2:]]
    ref = em_routing_kernel(formed if votes_kind == "per_sender" else votes, *leaves[2:],
                            strategy="vectorized", **SCHEDULE)
    grads = torch.autograd.grad(loss_of(*ours), sources)
    for g, r in zip(grads, torch.autograd.grad(loss_of(*ref), sources), strict=True):
        torch.testing.assert_close(g, r, **TIGHT)


@pytest.mark.parametrize("caller", ["saved_tensors_hooks", "checkpoint"])
def test_compiled_blocks_leave_a_callers_saved_tensor_hooks_alone(caller, formed_blocks, compiler):
    """Under the caller's saved-tensor hooks (offloading, activation checkpointing) theirs decide
    what is kept: the blocks are not formed again by this strategy, and the gradients are right."""
    leaves, votes, formed = per_sender_sample(23, **COMPILED_SHAPES)
    seen = []

    def route(*args):
        return em_routing_kernel(votes, *args, strategy="compiled", **SHORT)

    if caller == "checkpoint":
        ours = checkpoint(route, *leaves[2:], use_reentrant=False)
    else:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
            ours = route(*leaves[2:])
        assert any(t.shape == (2, 2, 3, 2) for t in seen)  # the block's votes, given to the caller's hook
    assert_gradients_of_formed_votes(ours, leaves, formed)
    assert len(formed_blocks) == (2 if caller == "checkpoint" else 1)  # checkpoint's own recomputation


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bfloat16_votes_route_with_float32_statistics(strategy):
    votes, activations, beta_u, beta_a = sample(9, rows=4, receivers=4, senders=12, dtype=torch.float32)
    low = votes.detach().bfloat16().requires_grad_(True)
    low_activations = activations.detach().bfloat16()  # of the votes' dtype, as em_routing requires
    poses, acts = em_routing_kernel(low, low_activations, beta_u, beta_a, inverse_temperatures=[0.5, 1.0],
                                    strategy=strategy)
    assert poses.dtype == torch.bfloat16 and acts.dtype == torch.bfloat16
    exact = em_routing_kernel(low.detach().float(), low_activations.float(), beta_u, beta_a,
                              inverse_temperatures=[0.5, 1.0], strategy=strategy)
    torch.testing.assert_close(poses.float(), exact[0].bfloat16().float(), rtol=0, atol=0)
    (poses.float().sum() + acts.float().sum()).backward()
    assert low.grad.dtype == torch.bfloat16 and torch.isfinite(low.grad.float()).all()


# --- votes cast by per-sender linear maps, formed block by block ---------------------------------


@pytest.mark.parametrize("strategy", [*STRATEGIES, "compiled"])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("wanted", [[0, 1, 2, 3, 4], [1], [2, 0]])  # all, the weights alone, a subset
def test_per_sender_votes_route_as_their_formed_votes(strategy, grouped, wanted, block_size, request):
    """Unformed votes (formed per block by ``"blocked"`` and by ``"compiled"``'s CPU blocks, here
    with the loop run eagerly, materialised by ``"vectorized"``) give the outputs and, through the
    formation, the gradients of the votes formed first with einsum."""
    compiled_rows = request.getfixturevalue("compiled_blocks") if strategy == "compiled" else None
    leaves, votes, formed = per_sender_sample(11, pose_dim=4)
    groups = torch.randint(0, 9, (4, 6), generator=torch.Generator().manual_seed(12)) if grouped else None
    options = {"inverse_temperatures": [0.5, 1.0, 1.5], "sender_groups": groups, "return_assignments": True}
    assert votes.shape == (2, 4, 3, 6, 4)
    ours = em_routing_kernel(votes, *leaves[2:], strategy=strategy, **options)
    if compiled_rows is not None:  # blocks of whole periods (4 rows) with groups, else of 3 rows
        assert compiled_rows == ([4, 4] if grouped else [3, 3, 2])
    ref = em_routing_kernel(formed, *leaves[2:], strategy="vectorized", **options)
    for x, y in zip(ours, ref, strict=True):
        torch.testing.assert_close(x, y, **TIGHT)
    chosen = [leaves[k] for k in wanted]
    grads = torch.autograd.grad(loss_of(*ours), chosen)
    ref_grads = torch.autograd.grad(loss_of(*ref), chosen)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, **TIGHT)


def test_strategies_agree_in_float32():
    """Each float32 strategy within float32's rounding of the float64 result (poses of order 1,
    20 senders, 3 passes: errors of a few 1e-6; the two strategies sum in other orders)."""
    exact = [t.detach() for t in sample(10, rows=8, receivers=4, senders=20, pose_dim=16)]
    truth = em_routing_kernel(*exact, inverse_temperatures=[0.5, 1.0, 1.5], strategy="vectorized")
    inputs = [t.float() for t in exact]
    for strategy in ("blocked", "vectorized"):
        result = em_routing_kernel(*inputs, inverse_temperatures=[0.5, 1.0, 1.5], strategy=strategy)
        for x, y in zip(result, truth, strict=True):
            torch.testing.assert_close(x.double(), y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"votes": torch.zeros(2, 3)}, "votes"),
        ({"votes": torch.zeros(2, 3, 5, 4, dtype=torch.long)}, "votes"),
        ({"activations": torch.zeros(2, 4)}, "activations"),
        ({"beta_u": torch.zeros(4)}, "beta_u"),
        ({"beta_a": torch.zeros(2, 2)}, "beta_a"),
        ({"inverse_temperature": []}, "inverse_temperature"),
        ({"inverse_temperature": [0.1, -1.0], "iterations": 2}, "inverse_temperature"),
        ({"eps": 0.0}, "eps"),
        ({"strategy": "fast"}, "strategy"),
        ({"sender_groups": torch.zeros(3, 5, dtype=torch.long)}, "sender_groups"),  # 3 does not divide 2
        ({"sender_groups": torch.zeros(1, 4, dtype=torch.long)}, "sender_groups"),
        ({"sender_groups": torch.zeros(1, 5)}, "sender_groups"),
        ({"sender_groups": -torch.ones(1, 5, dtype=torch.long)}, "sender_groups"),
    ],
)
def test_bad_arguments_name_themselves(change, match):
    arguments = {"votes": torch.zeros(2, 3, 5, 4), "activations": torch.zeros(2, 5), "beta_u": 0.0,
                 "beta_a": 0.0, "iterations": 1, "inverse_temperature": [0.1]}
    arguments.update(change)
    with pytest.raises(ValueError, match=match):
        em_routing(**arguments)


def test_prepared_sender_groups_are_compact_and_checked_against_the_votes():
    ids = torch.tensor([[7, 3], [3, 9]])
    prepared = prepare_sender_groups(ids)
    assert prepared.ids.tolist() == [[1, 0], [0, 2]] and prepared.count == 3
    assert prepared.patches.tolist() == [[1.0, 2.0], [2.0, 1.0]]  # id 3 is in both patches
    with pytest.raises(ValueError, match="non-negative"):
        prepare_sender_groups(torch.tensor([[0, -1]]))
    with pytest.raises(ValueError, match="sender_groups must be a 2-D integer tensor"):
        prepare_sender_groups(torch.zeros(2, 2))
    votes, activations = torch.zeros(2, 3, 5, 4), torch.zeros(2, 5)  # 5 senders, not 2
    with pytest.raises(ValueError, match=r"sender_groups must be .* \(L, in_caps=5\)"):
        em_routing(votes, activations, 0.0, 0.0, iterations=1, sender_groups=prepared)


@pytest.mark.parametrize(
    ("change", "match"),
    [({"rows": 0}, "rows"), ({"in_types": 1.5}, "in_types"), ({"kernel_size": 5}, "kernel_size")],
)
def test_conv_sender_groups_rejects_bad_sizes(change, match):
    arguments = {"rows": 4, "cols": 4, "in_types": 2, "kernel_size": 3, "stride": 1}
    arguments.update(change)
    with pytest.raises(ValueError, match=match):
        conv_sender_groups(**arguments)
