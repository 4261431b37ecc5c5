"""Bad input to the public functions of ``torchvote.functional`` is refused by name.

One sweep over the audit of the functional API: every case below used to be taken silently (a
flag read by its truthiness, an integer tensor computed in integers, a bias or mask that grew the
batch), give NaN, or fail deep inside PyTorch with a message naming none of our arguments. Each now
raises a ``ValueError`` or ``TypeError`` naming the argument, or (the half-precision squashes, the
1-D attention mask) gives the right numbers.
"""

from __future__ import annotations

import pytest
import torch

from torchvote.functional import (
    DotProductScores,
    LinearVotes,
    PairwiseVotes,
    SharedLinearVotes,
    SharedVotes,
    additive_score,
    as_routing_votes,
    attend,
    default_inverse_temperature,
    dot_score,
    dynamic_routing,
    efficient_squash,
    em_routing,
    general_score,
    inverted_dot_product_routing,
    is_causal_mask,
    masked_softmax,
    prepare_attention_mask,
    scaled_dot_product_attention,
    scaled_dot_score,
    self_attention,
    self_attention_routing,
    slot_attention,
    slot_routing,
    softmax_attention,
    squash,
    vote,
)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape) + len(shape)), dtype=dtype)


Q, K, V = randn(2, 3, 5, 4), randn(2, 3, 6, 4), randn(2, 3, 6, 4)  # (b, h, i|j, d)
U = randn(2, 3, 5, 4)  # routing votes (b, i, j, d)


def _update(means, previous):
    return means + previous


def _routing(**kwargs):
    return vote(PairwiseVotes(U), None, normalize_over="receivers", **kwargs)


CASES = {
    # --- attention: flags read by truthiness, scales, the unchecked softmax_attention ------------
    "sdpa need_weights='yes'": (
        lambda: scaled_dot_product_attention(Q, K, V, need_weights="yes"),
        TypeError, "need_weights must be True or False, got 'yes'"),
    "sdpa is_causal='no' with weights (was: causal)": (
        lambda: scaled_dot_product_attention(Q, K, V, is_causal="no", need_weights=True),
        TypeError, "is_causal must be True or False, got 'no'"),
    "sdpa scale=nan (was: NaN weights)": (
        lambda: scaled_dot_product_attention(Q, K, V, scale=float("nan"), need_weights=True),
        ValueError, "scale must be finite"),
    "sdpa scale='a' with weights": (
        lambda: scaled_dot_product_attention(Q, K, V, scale="a", need_weights=True),
        TypeError, "scale must be a real number"),
    "softmax_attention integer inputs": (
        lambda: softmax_attention(Q.int(), K.int(), V.int()), TypeError, "query must be floating point"),
    "softmax_attention 1-D query": (
        lambda: softmax_attention(randn(4), K, V), ValueError, r"query must have shape \(\.\.\., length"),
    "softmax_attention feature mismatch": (
        lambda: softmax_attention(Q, randn(2, 3, 6, 5), V), ValueError, "share their feature size"),
    "softmax_attention mixed dtypes": (
        lambda: softmax_attention(Q.double(), K, V), TypeError, "must have one dtype"),
    "softmax_attention mask of the wrong shape": (
        lambda: softmax_attention(Q, K, V, mask=torch.ones(5, 7, dtype=torch.bool)),
        ValueError, r"mask of shape \(5, 7\) does not broadcast"),
    "softmax_attention NaN mask (was: NaN output)": (
        lambda: softmax_attention(Q, K, V, mask=torch.full((5, 6), float("nan"))),
        ValueError, "mask contains NaN"),
    "softmax_attention is_causal='no'": (
        lambda: softmax_attention(Q, K, V, is_causal="no"), TypeError, "is_causal must be True or False"),
    "attend float64 scores, float32 values (was: float32 weights)": (
        lambda: attend(randn(2, 5, 6, dtype=torch.float64), randn(2, 6, 3)),
        TypeError, "value has dtype torch.float32 but the scores are torch.float64"),
    "self_attention need_weights='x'": (
        lambda: self_attention(randn(2, 3, 4), need_weights="x"), TypeError, "need_weights must be True"),
    "self_attention integer inputs": (
        lambda: self_attention(torch.ones(2, 3, 4, dtype=torch.int64)), TypeError,
        "inputs must be floating point"),
    # --- vote: votes, logits, sender weights, bias, masks, flags ----------------------------------
    "vote integer PairwiseVotes (was: softmax NotImplementedError)": (
        lambda: vote(PairwiseVotes(U.int()), None, normalize_over="receivers"),
        TypeError, "votes must be floating point, got dtype torch.int32"),
    "vote integer votes tensor (was: int32 outputs)": (
        lambda: vote(U.int(), randn(2, 3, 5), normalize_over="receivers"),
        TypeError, "votes must be floating point"),
    "vote integer logits": (
        lambda: vote(U, torch.zeros(2, 3, 5, dtype=torch.int64), normalize_over="receivers"),
        TypeError, "logits must be a floating-point tensor"),
    "vote boolean logits": (
        lambda: vote(U, torch.zeros(2, 3, 5, dtype=torch.bool), normalize_over="receivers"),
        TypeError, "logits must be a floating-point tensor"),
    "vote votes a list": (
        lambda: vote([1.0], randn(2, 3), normalize_over="senders"), TypeError, "votes must be a tensor"),
    "vote 1-D SharedVotes": (
        lambda: vote(SharedVotes(randn(3)), randn(2, 3), normalize_over="senders"),
        ValueError, r"SharedVotes.values must have shape \(\.\.\., j, d\)"),
    "vote sender_weights of the wrong size": (
        lambda: _routing(sender_weights=randn(2, 4)), ValueError,
        r"sender_weights must broadcast to \(\.\.\., j\)"),
    "vote sender_weights that grow the batch": (
        lambda: _routing(sender_weights=randn(4, 2, 5)), ValueError, r"sender_weights must broadcast to"),
    "vote integer sender_weights": (
        lambda: _routing(sender_weights=torch.ones(2, 5, dtype=torch.int64)), TypeError,
        "sender_weights must be a floating-point tensor"),
    "vote float64 sender_weights on float32 votes": (
        lambda: _routing(sender_weights=torch.ones(2, 5, dtype=torch.float64)), TypeError,
        "sender_weights has dtype torch.float64 but the votes are torch.float32"),
    "vote bias of the wrong size": (
        lambda: _routing(bias=randn(2, 3, 5)), ValueError,
        r"bias must broadcast to \(\.\.\., i, d\) = \(2, 3, 4\)"),
    "vote bias that grows the batch (was: 4x the outputs)": (
        lambda: _routing(bias=randn(4, 2, 3, 4)), ValueError, r"bias must broadcast to \(\.\.\., i, d\)"),
    "vote float64 bias (was: float64 outputs)": (
        lambda: _routing(bias=randn(3, 4, dtype=torch.float64)), TypeError, "bias has dtype torch.float64"),
    "vote mask that grows the batch": (
        lambda: _routing(mask=torch.ones(4, 2, 3, 5, dtype=torch.bool)), ValueError,
        r"mask of shape \(4, 2, 3, 5\) does not broadcast to the weights' shape"),
    "vote initial_outputs of the wrong shape": (
        lambda: _routing(initial_outputs=randn(7)), ValueError, "initial_outputs must broadcast"),
    "vote is_causal='no' (was: causal)": (
        lambda: _routing(is_causal="no"), TypeError, "is_causal must be True or False"),
    "vote record='no'": (lambda: _routing(record="no"), TypeError, "record must be True or False"),
    "vote detach_votes='no'": (lambda: _routing(detach_votes="no"), TypeError, "detach_votes must be True"),
    "vote scores of different feature sizes": (
        lambda: vote(SharedVotes(randn(2, 6, 4)), DotProductScores(randn(2, 5, 4), randn(2, 6, 3)),
                     normalize_over="senders"),
        ValueError, "DotProductScores queries and keys must share their feature size"),
    "vote keys not as many as the values": (
        lambda: vote(SharedVotes(randn(2, 7, 4)), DotProductScores(randn(2, 5, 4), randn(2, 6, 4)),
                     normalize_over="senders"),
        ValueError, "keys and values must have the same length"),
    "vote integer scores": (
        lambda: vote(SharedVotes(randn(2, 6, 4)),
                     DotProductScores(randn(2, 5, 4).int(), randn(2, 6, 4).int()), normalize_over="senders"),
        TypeError, "DotProductScores queries must be a floating-point tensor"),
    "vote float64 scores on float32 values": (
        lambda: vote(SharedVotes(randn(2, 6, 4)),
                     DotProductScores(randn(2, 5, 4).double(), randn(2, 6, 4).double()),
                     normalize_over="receivers"),
        TypeError, "values has dtype torch.float32 but the queries are torch.float64"),
    "masked_softmax boolean logits": (
        lambda: masked_softmax(torch.ones(3, 4, dtype=torch.bool), -1), TypeError,
        "logits must be a floating-point tensor"),
    "masked_softmax integer logits": (
        lambda: masked_softmax(torch.ones(3, 4, dtype=torch.int64), -1), TypeError,
        "logits must be a floating-point tensor"),
    "masked_softmax dim out of range": (
        lambda: masked_softmax(randn(3, 4), 5), ValueError, r"dim must be an axis of the 2-D input"),
    # --- masks ---------------------------------------------------------------------------------
    "prepare_attention_mask receiver_mask of the wrong shape": (
        lambda: prepare_attention_mask(None, None, (2, 3, 5, 6),
                                       receiver_mask=torch.ones(2, 6, dtype=torch.bool)),
        ValueError, r"receiver_mask must have shape \(batch, L\) = \(2, 5\)"),
    "prepare_attention_mask integer receiver_mask": (
        lambda: prepare_attention_mask(None, None, (2, 3, 5, 6),
                                       receiver_mask=torch.ones(2, 5, dtype=torch.int64)),
        TypeError, "receiver_mask must be a boolean tensor"),
    "prepare_attention_mask is_causal='no'": (
        lambda: prepare_attention_mask(None, None, (2, 3, 5, 6), is_causal="no"), TypeError,
        "is_causal must be True or False"),
    "is_causal_mask of a list": (lambda: is_causal_mask([[True]]), TypeError, "mask must be a tensor"),
    # --- scores --------------------------------------------------------------------------------
    "dot_score integer inputs (was: integer logits)": (
        lambda: dot_score(randn(2, 5, 4).int(), randn(2, 6, 4).int()), TypeError,
        "query must be a floating-point tensor"),
    "dot_score mixed dtypes": (
        lambda: dot_score(randn(2, 5, 4).double(), randn(2, 6, 4)), TypeError,
        "key has dtype torch.float32 but the queries are torch.float64"),
    "dot_score batches that do not broadcast": (
        lambda: dot_score(randn(3, 5, 4), randn(2, 6, 4)), ValueError, "batch axes that broadcast"),
    "scaled_dot_score scale='a'": (
        lambda: scaled_dot_score(randn(2, 5, 4), randn(2, 6, 4), scale="a"), TypeError,
        "scale must be a real number"),
    "general_score weight a list": (
        lambda: general_score(randn(2, 5, 4), randn(2, 6, 4), [[1.0]]), TypeError, "weight must be a tensor"),
    "general_score float64 weight": (
        lambda: general_score(randn(2, 5, 4), randn(2, 6, 4), randn(4, 4, dtype=torch.float64)), TypeError,
        "weight has dtype torch.float64"),
    "additive_score vector not 1-D": (
        lambda: additive_score(randn(2, 5, 4), randn(2, 6, 4), randn(3, 4), randn(3, 4), randn(1, 3)),
        ValueError, r"vector must have shape \(hidden,\)"),
    "additive_score float64 parameters": (
        lambda: additive_score(randn(2, 5, 4), randn(2, 6, 4), randn(3, 4).double(), randn(3, 4).double(),
                               randn(3).double()),
        TypeError, "has dtype torch.float64 but the queries are torch.float32"),
    "attend batch axes that do not broadcast (was: vote's 'logits ... do not fit values')": (
        lambda: attend(randn(2, 3, 5), randn(3, 5, 4)), ValueError,
        r"scores \(2, 3, 5\) and value \(3, 5, 4\) must have batch axes \(all but the last two\) that "
        "broadcast"),
    "vote negative sender_weights (was: taken, the sender's votes reversed)": (
        lambda: _routing(sender_weights=torch.tensor([0.5, -0.25, 1.0, 0.0, 1.0])), ValueError,
        r"sender_weights must be non-negative \(a sender's activation\), got smallest -0.25"),
    "vote NaN sender_weights": (
        lambda: _routing(sender_weights=torch.tensor([0.5, float("nan"), 1.0, 0.0, 1.0])), ValueError,
        "sender_weights must be non-negative"),
    # --- a user's callables: their results were used unchecked, and torch failed deep inside ------
    "vote nonlinearity returning another shape (was: an einsum RuntimeError)": (
        lambda: _routing(iterations=2, nonlinearity=lambda s, previous: s[..., :2]), ValueError,
        r"nonlinearity must return the outputs \(\.\.\., i, d\), a float tensor of shape \(2, 3, 4\); "
        r"got a torch.float32 tensor of shape \(2, 3, 2\)"),
    "vote agreement returning logits that do not broadcast (was: a size RuntimeError)": (
        lambda: _routing(iterations=2, agreement=lambda state: torch.zeros(3)), ValueError,
        r"agreement must return logits \(\.\.\., i, j\), a float tensor of shape \(2, 3, 5\)"),
    "vote agreement returning a number (was: an AttributeError)": (
        lambda: _routing(iterations=2, agreement=lambda state: 1), TypeError,
        "agreement must return logits .* got int"),
    "inverted_dot_product_routing normalization returning another shape": (
        lambda: inverted_dot_product_routing(U, normalization=lambda s: s.sum(-1)), ValueError,
        r"normalization must return the outputs \(batch\.\.\., out_caps, out_dim\)"),
    # --- squash --------------------------------------------------------------------------------
    "squash integer inputs (was: a float result)": (
        lambda: squash(torch.ones(2, 3, dtype=torch.int64)), TypeError,
        "inputs must be a floating-point tensor"),
    "squash dim out of range": (lambda: squash(randn(2, 3), dim=5), ValueError, "dim must be an axis"),
    "efficient_squash boolean inputs": (
        lambda: efficient_squash(torch.ones(2, 3, dtype=torch.bool)), TypeError,
        "inputs must be a floating-point tensor"),
    # --- routing -------------------------------------------------------------------------------
    "as_routing_votes of a list (was: returned as votes)": (
        lambda: as_routing_votes([1.0]), TypeError, "votes must be a tensor"),
    "dynamic_routing of a list": (lambda: dynamic_routing([1.0]), TypeError, "votes must be a tensor"),
    "dynamic_routing integer LinearVotes (was: int64 zeros)": (
        lambda: dynamic_routing(
            LinearVotes(torch.randint(-2, 3, (3, 4, 5, 2)), torch.randint(-2, 3, (2, 4, 2)))),
        TypeError, "weight must be floating point, got dtype torch.int64"),
    "LinearVotes integer inputs": (
        lambda: LinearVotes(randn(3, 4, 5, 2), torch.ones(2, 4, 2, dtype=torch.int64)), TypeError,
        "inputs must be floating point, got dtype torch.int64"),
    "LinearVotes weight a list (was: an AttributeError)": (
        lambda: LinearVotes([[1.0]], randn(2, 4, 2)), TypeError,
        "weight must be a floating-point tensor, got list"),
    "SharedLinearVotes weight a list (was: an AttributeError)": (
        lambda: SharedLinearVotes([[1.0]], randn(2, 4, 2)), TypeError,
        "weight must be a floating-point tensor, got list"),
    "SharedLinearVotes inputs a list": (
        lambda: SharedLinearVotes(randn(3, 5, 2), [[1.0, 2.0]]), TypeError,
        "inputs must be a floating-point tensor, got list"),
    "SharedLinearVotes boolean inputs": (
        lambda: SharedLinearVotes(randn(3, 5, 2), torch.ones(2, 4, 2, dtype=torch.bool)), TypeError,
        "inputs must be floating point, got dtype torch.bool"),
    "dynamic_routing all_passes='no'": (
        lambda: dynamic_routing(U, all_passes="no"), TypeError, "all_passes must be True or False"),
    "dynamic_routing detach_votes='no'": (
        lambda: dynamic_routing(U, detach_votes="no"), TypeError, "detach_votes must be True or False"),
    "inverted_dot_product_routing all_passes='x'": (
        lambda: inverted_dot_product_routing(U, all_passes="x"), TypeError, "all_passes must be True"),
    "self_attention_routing without features (was: NaN)": (
        lambda: self_attention_routing(U[..., :0]), ValueError, r"at least one feature \(out_dim > 0\)"),
    "slot_attention slots that grow the batch": (
        lambda: slot_attention(randn(2, 7, 4), randn(2, 7, 4), randn(4, 2, 3, 4), query=lambda s: s,
                               update=_update),
        ValueError, r"batch axes that broadcast to the keys' \(2,\)"),
    "slot_attention values of another size than the slots (was: a ValueError naming nonlinearity)": (
        lambda: slot_attention(randn(2, 7, 4), randn(2, 7, 6), randn(2, 3, 5), query=lambda s: s[..., :4],
                               update=lambda means, previous: previous),
        ValueError, r"values and slots must have the same features .* got value_dim=6 and slot_dim=5"),
    "slot_attention scale='a'": (
        lambda: slot_attention(randn(2, 7, 4), randn(2, 7, 4), randn(2, 3, 4), query=lambda s: s,
                               update=_update, scale="a"),
        TypeError, "scale must be a real number"),
    "slot_attention mask a list": (
        lambda: slot_attention(randn(2, 7, 4), randn(2, 7, 4), randn(2, 3, 4), query=lambda s: s,
                               update=_update, mask=[1]),
        TypeError, "mask must be a boolean tensor"),
    "slot_attention update=5 (was: a ValueError naming nonlinearity)": (
        lambda: slot_attention(randn(2, 7, 4), randn(2, 7, 4), randn(2, 3, 4), query=lambda s: s, update=5),
        TypeError, "update must be a callable, got 5"),
    "slot_attention update='squash' (not documented: refused)": (
        lambda: slot_attention(randn(2, 7, 4), randn(2, 7, 4), randn(2, 3, 4), query=lambda s: s,
                               update="squash"),
        TypeError, "update must be a callable, got 'squash'"),
    "slot_attention query=None (was: 'NoneType' object is not callable)": (
        lambda: slot_attention(randn(2, 7, 4), randn(2, 7, 4), randn(2, 3, 4), query=None, update=_update),
        TypeError, "query must be a callable, got None"),
    "slot_attention update of the wrong shape, one pass (was: returned as the slots)": (
        lambda: slot_attention(randn(2, 7, 4), randn(2, 7, 4), randn(2, 3, 4), query=lambda s: s,
                               update=lambda means, previous: means[..., :2], iterations=1),
        ValueError, r"update\(updates, slots\) must return shape \(batch\.\.\., num_slots, slot_dim=4\) = "
                    r"\(2, 3, 4\), got \(2, 3, 2\)"),
    "slot_attention update of the wrong shape, three passes (was: blamed on query)": (
        lambda: slot_attention(randn(2, 7, 4), randn(2, 7, 4), randn(2, 3, 4), query=lambda s: s,
                               update=lambda means, previous: means[..., :2], iterations=3),
        ValueError, r"update\(updates, slots\) must return shape"),
    "slot_attention query of the wrong shape": (
        lambda: slot_attention(randn(2, 7, 4), randn(2, 7, 4), randn(3, 4), query=lambda s: s[..., :2],
                               update=_update),
        ValueError, r"query\(slots\) must return shape \(batch\.\.\., num_slots, key_dim=4\) = \(3, 4\), "
                    r"got \(3, 2\)"),
    "slot_attention query that grows the batch": (
        lambda: slot_attention(randn(2, 7, 4), randn(2, 7, 4), randn(2, 3, 4),
                               query=lambda s: s.expand(5, 2, 3, 4), update=_update),
        ValueError, r"query\(slots\) must return shape .* = \(2, 3, 4\), got \(5, 2, 3, 4\)"),
    "slot_routing update=None": (
        lambda: slot_routing(U, randn(3, 4), query=lambda s: s, update=None), TypeError,
        "update must be a callable, got None"),
    "slot_routing query='x'": (
        lambda: slot_routing(U, randn(3, 4), query="x", update=_update), TypeError,
        "query must be a callable, got 'x'"),
    "slot_routing update of the wrong shape, one pass (was: returned as the slots)": (
        lambda: slot_routing(U, randn(3, 4), query=lambda s: s, update=lambda means, previous: means[..., :3],
                             iterations=1),
        ValueError, r"update\(updates, slots\) must return shape \(batch\.\.\., out_caps, out_dim=4\) = "
                    r"\(2, 3, 4\), got \(2, 3, 3\)"),
    "slot_routing query that returns no tensor": (
        lambda: slot_routing(U, randn(3, 4), query=lambda s: 3, update=_update), ValueError,
        r"query\(slots\) must return shape .* got int"),
    "slot_routing all_passes='x'": (
        lambda: slot_routing(U, randn(3, 4), query=lambda s: s, update=_update, all_passes="x"),
        TypeError, "all_passes must be True or False"),
    # --- EM routing ----------------------------------------------------------------------------
    "em_routing votes as a list (was a ValueError printing <class 'list'>)": (
        lambda: em_routing(U.tolist(), torch.rand(2, 5), 0.0, 0.0), TypeError,
        "votes must be a tensor or PerSenderVotes, got list"),
    "em_routing activations as a list": (
        lambda: em_routing(U, [[0.5] * 5] * 2, 0.0, 0.0), TypeError,
        "activations must be a tensor, got list"),
    "em_routing integer activations": (
        lambda: em_routing(U, torch.ones(2, 5, dtype=torch.int64), 0.0, 0.0), TypeError,
        "activations must be floating point"),
    "em_routing boolean activations": (
        lambda: em_routing(U, torch.ones(2, 5, dtype=torch.bool), 0.0, 0.0), TypeError,
        "activations must be floating point"),
    "em_routing return_assignments='x'": (
        lambda: em_routing(U, torch.rand(2, 5), 0.0, 0.0, return_assignments="x"), TypeError,
        "return_assignments must be True or False"),
    "em_routing inverse_temperature=True (was: a constant 1.0)": (
        lambda: em_routing(U, torch.rand(2, 5), 0.0, 0.0, inverse_temperature=True), TypeError,
        "inverse_temperature must be a callable of the iteration, a real number or a sequence"),
    "em_routing inverse_temperature a string": (
        lambda: em_routing(U, torch.rand(2, 5), 0.0, 0.0, inverse_temperature="abc"), TypeError,
        "inverse_temperature must be a callable"),
    "em_routing inverse_temperature callable returning a string (was: named the callable)": (
        lambda: em_routing(U, torch.rand(2, 5), 0.0, 0.0, inverse_temperature=lambda t: "x"), TypeError,
        "inverse_temperature\\(0\\) must return a real number, got 'x'"),
    "em_routing inverse_temperature callable returning a negative value": (
        lambda: em_routing(U, torch.rand(2, 5), 0.0, 0.0, inverse_temperature=lambda t: 1.0 - t), ValueError,
        r"finite and >= 0, got \[1.0, 0.0, -1.0\] \(the callable's values for iterations 0, 1, ...\)"),
    "default_inverse_temperature of a negative iteration": (
        lambda: default_inverse_temperature(-1), ValueError, "iteration must be an integer >= 0"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_refused_by_name(case):
    call, error, match = CASES[case]
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("function", [squash, efficient_squash])
def test_half_precision_squashes_of_long_vectors_are_finite_and_right(function):
    """In float16 ``sum s^2`` overflows once ``||s||`` passes 256: squash gave ``inf / inf`` = NaN
    and efficient_squash zero vectors. The lengths are now formed in float32 (bfloat16, of float32's
    range, was right and stays so)."""
    for dtype in (torch.float16, torch.bfloat16):
        inputs = torch.full((2, 3), 300.0).to(dtype)  # ||s|| = 520: squared 270000 > 65504
        got = function(inputs)
        assert got.dtype == dtype and torch.isfinite(got).all(), dtype
        torch.testing.assert_close(got.float(), function(inputs.float()), atol=1e-2, rtol=1e-2)
        assert torch.linalg.vector_norm(got.float(), dim=-1).min() > 0.99, dtype


def test_a_one_dimensional_attention_mask_broadcasts_as_it_does_in_two():
    """A ``(S,)`` mask broadcasts to the logits and passed the checks, but the fused kernel
    refused it with an IndexError; it now runs as the ``(1, S)`` mask it stands for (the path that
    forms the weights took it already)."""
    allowed = torch.tensor([True, False, True, True, False, True])
    for need_weights in (False, True):
        one_d = scaled_dot_product_attention(Q, K, V, attn_mask=allowed, need_weights=need_weights)
        two_d = scaled_dot_product_attention(Q, K, V, attn_mask=allowed[None], need_weights=need_weights)
        torch.testing.assert_close(one_d[0], two_d[0])
