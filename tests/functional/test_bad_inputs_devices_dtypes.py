"""Bad input to ``torchvote.functional`` found by review, refused by name.

Each case was taken silently (``meta`` tensors beside CPU ones computed on uninitialised memory, a
boolean ``dtype`` flipped a float mask, NaN offsets gave NaN outputs, two float dtypes met in
their promotion, logits grew the batch), failed deep inside PyTorch naming no argument, or named
the wrong argument. Each now raises a ``ValueError`` or ``TypeError`` naming the argument (both
devices, both dtypes); a dtype that is wrong on the routing side is an ``ArgumentTypeError``, a
``TypeError`` as ``vote`` raises and the ``ValueError`` the routing functions raised before.
Only shapes, dtypes, devices and Python numbers are checked: no value is read from a tensor.
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
    concat_score,
    dynamic_routing,
    em_routing,
    merge_masks,
    prepare_attention_mask,
    scaled_dot_product_attention,
    self_attention_routing,
    slot_attention,
    slot_routing,
    softmax_attention,
    vote,
)
from torchvote.validation import ArgumentTypeError

META = "meta"


def randn(*shape, dtype=torch.float32, device=None):
    generator = torch.Generator().manual_seed(sum(shape) + len(shape))
    return torch.randn(*shape, generator=generator, dtype=dtype).to(device)


def meta(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=META)


def ones(*shape, device=None):
    return torch.ones(*shape, dtype=torch.bool, device=device)


Q, K, V = randn(2, 3, 5, 4), randn(2, 3, 6, 4), randn(2, 3, 6, 4)  # (b, h, i|j, d)
U = randn(2, 3, 5, 4)  # routing votes (b, i, j, d)
A = torch.rand(2, 5)  # EM's input activations (b, j)


def _update(means, previous):
    return means + previous


def _routing(**kwargs):
    return vote(PairwiseVotes(U), None, normalize_over="receivers", **kwargs)


def _slots(keys=None, values=None, slots=None, **kwargs):
    keys = randn(2, 7, 4) if keys is None else keys
    values = randn(2, 7, 4) if values is None else values
    slots = randn(2, 3, 4) if slots is None else slots
    return slot_attention(keys, values, slots, query=lambda s: s, update=_update, **kwargs)


CASES = {
    # --- 1. devices: a "meta" tensor beside CPU ones --------------------------------------------
    "vote logits on meta (was: CPU outputs of uninitialised memory)": (
        lambda: _routing_with_logits(meta(2, 3, 5)), ValueError,
        "logits is on meta but the votes are on cpu"),
    "vote mask on meta": (
        lambda: _routing(mask=ones(3, 5, device=META)), ValueError,
        "mask is on meta but the votes are on cpu"),
    "vote bias on meta": (
        lambda: _routing(bias=meta(3, 4)), ValueError, "bias is on meta but the votes are on cpu"),
    "vote sender_weights on meta": (
        lambda: _routing(sender_weights=meta(2, 5)), ValueError,
        "sender_weights is on meta but the votes are on cpu"),
    "vote initial_outputs on meta": (
        lambda: _routing(initial_outputs=meta(2, 3, 4), nonlinearity=lambda a, p: a + p), ValueError,
        "initial_outputs is on meta but the votes are on cpu"),
    "vote scores' keys on meta (the fused path)": (
        lambda: vote(SharedVotes(randn(2, 6, 4)), DotProductScores(randn(2, 5, 4), meta(2, 6, 4)),
                     normalize_over="senders"),
        ValueError, "DotProductScores keys is on meta but the votes are on cpu"),
    "sdpa key on meta": (
        lambda: scaled_dot_product_attention(Q, meta(2, 3, 6, 4), V), ValueError,
        "key is on meta but the queries are on cpu"),
    "sdpa attn_mask on meta": (
        lambda: scaled_dot_product_attention(Q, K, V, attn_mask=ones(5, 6, device=META)), ValueError,
        "attn_mask is on meta but the queries are on cpu"),
    "sdpa attn_mask on meta, with weights (was: taken)": (
        lambda: scaled_dot_product_attention(Q, K, V, attn_mask=ones(5, 6, device=META), need_weights=True),
        ValueError, "attn_mask is on meta but the queries are on cpu"),
    "softmax_attention value on meta (was: taken)": (
        lambda: softmax_attention(Q, K, meta(2, 3, 6, 4)), ValueError,
        "value is on meta but the queries are on cpu"),
    "softmax_attention mask on meta (was: taken)": (
        lambda: softmax_attention(Q, K, V, mask=ones(5, 6, device=META)), ValueError,
        "mask is on meta but the queries are on cpu"),
    "attend value on meta": (
        lambda: attend(randn(2, 5, 6), meta(2, 6, 3)), ValueError,
        "value is on meta but the scores are on cpu"),
    "dynamic_routing bias on meta": (
        lambda: dynamic_routing(U, bias=meta(3, 4)), ValueError, "bias is on meta but the votes are on cpu"),
    "dynamic_routing bias on meta, LinearVotes": (
        lambda: dynamic_routing(LinearVotes(randn(3, 5, 4, 2), randn(2, 5, 2)), bias=meta(3, 4)),
        ValueError, "bias is on meta but the votes are on cpu"),
    "self_attention_routing log_prior on meta (was: taken)": (
        lambda: self_attention_routing(U, log_prior=meta(3, 5)), ValueError,
        "log_prior is on meta but the votes are on cpu"),
    "slot_routing slots on meta": (
        lambda: slot_routing(U, meta(3, 4), query=lambda s: s, update=_update), ValueError,
        "slots is on meta but the votes are on cpu"),
    "em_routing activations on meta": (
        lambda: em_routing(U, meta(2, 5), 0.0, 0.0), ValueError,
        "activations is on meta but the votes are on cpu"),
    "slot_attention values on meta": (
        lambda: _slots(values=meta(2, 7, 4)), ValueError, "values is on meta but the keys are on cpu"),
    "slot_attention keys on meta (was: taken)": (
        lambda: _slots(keys=meta(2, 7, 4)), ValueError, "values is on cpu but the keys are on meta"),
    "slot_attention slots on meta": (
        lambda: _slots(slots=meta(2, 3, 4)), ValueError, "slots is on meta but the keys are on cpu"),
    "slot_attention mask on meta": (
        lambda: _slots(mask=ones(2, 7, device=META)), ValueError, "mask is on meta but the keys are on cpu"),
    "prepare_attention_mask key_mask on meta": (
        lambda: prepare_attention_mask(ones(5, 6), ones(2, 6, device=META), (2, 3, 5, 6)), ValueError,
        "key_mask is on meta but attn_mask's entries are on cpu"),
    "prepare_attention_mask receiver_mask on meta": (
        lambda: prepare_attention_mask(ones(5, 6), None, (2, 3, 5, 6), receiver_mask=ones(2, 5, device=META)),
        ValueError, "receiver_mask is on meta but the other masks are on cpu"),
    "merge_masks key_mask on meta": (
        lambda: merge_masks(ones(5, 6), ones(2, 6, device=META), (2, 3, 5, 6)), ValueError,
        "key_mask is on meta but attn_mask's entries are on cpu"),
    "LinearVotes weight on meta": (
        lambda: LinearVotes(meta(3, 5, 4, 2), randn(2, 5, 2)), ValueError,
        "weight is on meta but the inputs are on cpu"),
    # --- 2. prepare_attention_mask's dtype and logits_shape ----------------------------------------
    "prepare_attention_mask dtype=torch.bool (was: -inf read as True)": (
        lambda: prepare_attention_mask(_float_mask(), None, (2, 2, 3, 5), dtype=torch.bool), TypeError,
        "dtype must be a floating-point torch.dtype or None, got torch.bool"),
    "prepare_attention_mask dtype=torch.int64 (was: INT64_MIN)": (
        lambda: prepare_attention_mask(_float_mask(), None, (2, 2, 3, 5), dtype=torch.int64), TypeError,
        "dtype must be a floating-point torch.dtype or None, got torch.int64"),
    "prepare_attention_mask dtype='float16' (was: 'Invalid device string')": (
        lambda: prepare_attention_mask(_float_mask(), None, (2, 2, 3, 5), dtype="float16"), TypeError,
        "dtype must be a floating-point torch.dtype or None, got 'float16'"),
    "prepare_attention_mask logits_shape an int (was: not subscriptable)": (
        lambda: prepare_attention_mask(None, None, 5), TypeError, "logits_shape must be a tuple of sizes"),
    "prepare_attention_mask logits_shape () (was: IndexError)": (
        lambda: prepare_attention_mask(ones(2, 2), None, ()), ValueError,
        r"logits_shape must be \(\.\.\., L, S\): at least 2 sizes"),
    "prepare_attention_mask logits_shape of floats": (
        lambda: prepare_attention_mask(None, None, (2.0, 3.0)), TypeError, "logits_shape must be a tuple"),
    "prepare_attention_mask negative logits_shape": (
        lambda: prepare_attention_mask(None, None, (2, -3)), ValueError, "none negative, got"),
    "prepare_attention_mask receiver_mask with 2-D logits_shape": (
        lambda: prepare_attention_mask(None, None, (5, 6), receiver_mask=ones(5, 5)), ValueError,
        r"logits_shape must be \(b, \.\.\., L, S\): at least 3 sizes"),
    "merge_masks logits_shape an int (was: not subscriptable)": (
        lambda: merge_masks(None, None, 5), TypeError, "logits_shape must be a tuple of sizes"),
    # --- 3. EM routing: offsets, sender groups, activations -----------------------------------------
    "em_routing beta_u=nan (was: NaN outputs)": (
        lambda: em_routing(U, A, float("nan"), 0.0), ValueError, "beta_u must be finite, got nan"),
    "em_routing beta_u=inf (was: NaN outputs)": (
        lambda: em_routing(U, A, float("inf"), 0.0), ValueError, "beta_u must be finite, got inf"),
    "em_routing beta_a=-inf (was: NaN activations)": (
        lambda: em_routing(U, A, 0.0, float("-inf")), ValueError, "beta_a must be finite, got -inf"),
    "em_routing float sender_groups (message without the dtype)": (
        lambda: em_routing(U, A, 0.0, 0.0, sender_groups=torch.zeros(1, 5)), ArgumentTypeError,
        "sender_groups must be a 2-D integer tensor .* got dtype torch.float32"),
    "em_routing float64 activations on float32 votes (was: taken)": (
        lambda: em_routing(U, A.double(), 0.0, 0.0), TypeError,
        "activations has dtype torch.float64 but the votes are torch.float32"),
    # --- 4. slot_attention keys of the wrong type ---------------------------------------------------
    "slot_attention keys a list (was: AttributeError)": (
        lambda: _slots(keys=[[1.0]]), TypeError, "keys must be a floating-point tensor, got list"),
    # --- 5. messages that blamed the wrong thing ----------------------------------------------------
    "vote PairwiseVotes of a list (was: 'votes must be ..., got PairwiseVotes')": (
        lambda: vote(PairwiseVotes([[[[1.0]]]]), normalize_over="receivers"), TypeError,
        "PairwiseVotes.votes must be a tensor, got list"),
    "vote SharedVotes of a list": (
        lambda: vote(SharedVotes([[1.0]]), randn(2, 1), normalize_over="senders"), TypeError,
        "SharedVotes.values must be a tensor, got list"),
    "concat_score vector of the wrong size (was: blamed on weight)": (
        lambda: concat_score(randn(2, 5, 4), randn(2, 6, 4), randn(7, 8), randn(5)), ValueError,
        r"vector must have shape \(hidden,\) = \(7,\), the hidden size of weight \(7, 8\), got \(5,\)"),
    "additive_score vector of the wrong size (was: blamed on query_weight)": (
        lambda: additive_score(randn(2, 5, 4), randn(2, 6, 4), randn(7, 4), randn(7, 4), randn(5)),
        ValueError, r"vector must have shape \(hidden,\) = \(7,\), the hidden size of query_weight"),
    "additive_score key_weight of another hidden size": (
        lambda: additive_score(randn(2, 5, 4), randn(2, 6, 4), randn(7, 4), randn(5, 4), randn(7)),
        ValueError, r"key_weight must have shape \(hidden, Ek\) = \(7, 4\), the hidden size of query_weight"),
    # --- 6. logits that grow the batch ------------------------------------------------------------
    "vote logits that grow the batch of pairwise votes (was: (4, 2, ...) outputs)": (
        lambda: _routing_with_logits(torch.zeros(4, 2, 3, 5)), ValueError,
        r"logits of shape \(4, 2, 3, 5\) must broadcast to the votes' \(\.\.\., i, j\) = \(2, 3, 5\) "
        r"without growing it"),
    # --- 7. two float dtypes met silently in their promotion --------------------------------------
    "LinearVotes float16 weight, float32 inputs (was: routed in float32)": (
        lambda: LinearVotes(randn(3, 5, 4, 2).half(), randn(2, 5, 2)), TypeError,
        "weight has dtype torch.float16 but the inputs are torch.float32"),
    "LinearVotes float64 inputs (was: float64 outputs)": (
        lambda: LinearVotes(randn(3, 5, 4, 2), randn(2, 5, 2).double()), TypeError,
        "weight has dtype torch.float32 but the inputs are torch.float64"),
    "SharedLinearVotes float16 weight, float32 inputs": (
        lambda: SharedLinearVotes(randn(3, 4, 2).half(), randn(2, 5, 2)), TypeError,
        "weight has dtype torch.float16 but the inputs are torch.float32"),
    "vote integer initial_outputs (was: taken)": (
        lambda: _routing(initial_outputs=torch.zeros(2, 3, 4, dtype=torch.int64),
                         nonlinearity=lambda a, p: a + p),
        TypeError, "initial_outputs must be a floating-point tensor, got torch.int64"),
    "vote float64 initial_outputs on float32 votes": (
        lambda: _routing(initial_outputs=randn(2, 3, 4).double(), nonlinearity=lambda a, p: a + p),
        TypeError, "initial_outputs has dtype torch.float64 but the votes are torch.float32"),
    # --- 8. DotProductScores checked when made ------------------------------------------------------
    "DotProductScores of different feature sizes (was: an einsum error at materialize)": (
        lambda: DotProductScores(randn(2, 5, 4), randn(2, 6, 3)), ValueError,
        r"DotProductScores queries and keys must share their feature size, got shapes \(2, 5, 4\) and "
        r"\(2, 6, 3\)"),
    "DotProductScores of a list": (
        lambda: DotProductScores([[1.0]], randn(2, 6, 3)), TypeError,
        "DotProductScores queries must be a floating-point tensor, got list"),
    # --- 9. a wrong dtype on the routing side: TypeError and ValueError -----------------------------
    "as_routing_votes integer votes": (
        lambda: as_routing_votes(U.int()), ArgumentTypeError,
        "votes must be floating point, got dtype torch.int32"),
    "dynamic_routing integer votes": (
        lambda: dynamic_routing(U.int()), ArgumentTypeError,
        "votes must be floating point, got dtype torch.int32"),
    "em_routing integer votes": (
        lambda: em_routing(U.int(), A, 0.0, 0.0), ArgumentTypeError,
        "votes must be floating point, got dtype torch.int32"),
    "slot_attention float mask (was: a ValueError, key masks elsewhere a TypeError)": (
        lambda: _slots(mask=torch.ones(2, 7)), ArgumentTypeError,
        "mask must be a boolean tensor .*got dtype torch.float32"),
}


def _routing_with_logits(logits):
    return vote(PairwiseVotes(U), logits, normalize_over="receivers")


def _float_mask():
    mask = torch.zeros(3, 5)
    mask[:, 0] = float("-inf")  # not causal: stays a mask
    return mask


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_refused_by_name(case):
    call, error, match = CASES[case]
    with pytest.raises(error, match=match) as raised:
        call()
    if error is ArgumentTypeError:  # both kinds of callers are served
        assert isinstance(raised.value, TypeError) and isinstance(raised.value, ValueError)


def test_what_the_checks_leave_alone_still_runs():
    """The checks refuse only what was wrong: shared votes take the batch of their logits (as
    attention's values take the queries'), mixed dtypes pass under autocast, a tensor offset is
    not read, a floating dtype still casts a float mask."""
    outputs = vote(SharedVotes(randn(6, 4)), randn(2, 5, 6), normalize_over="senders").outputs
    assert outputs.shape == (2, 5, 4)
    outputs = _routing_with_logits(torch.zeros(3, 5)).outputs  # broadcast, not grown
    assert outputs.shape == (2, 3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        poses, _ = em_routing(U.bfloat16(), A, 0.0, 0.0)
        assert torch.isfinite(poses.float()).all()
        assert LinearVotes(randn(3, 5, 4, 2), randn(2, 5, 2).bfloat16()).dtype == torch.float32
    poses, _ = em_routing(U, A, torch.full((3,), float("nan")), 0.0)  # a tensor: never read back
    assert poses.isnan().all()
    mask, _ = prepare_attention_mask(_float_mask(), None, (2, 2, 3, 5), dtype=torch.float64)
    assert mask.dtype == torch.float64 and mask[0, 0] == float("-inf")
