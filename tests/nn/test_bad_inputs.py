"""Bad input to the public modules of ``torchvote.nn`` is refused by name.

One sweep over the audit of the modules' constructors and ``forward``: every case below used to
be taken silently (``batch_first="no"``, ``norm_first="no"`` or ``shared_weights="no"`` switched
the option *on*; float16 inputs to a float32 positional embedding came back float32; integer or
boolean activations weighed the votes by 0 and 1), or fail deep inside PyTorch (a convolution, a
layer norm, an einsum, einops) with a message naming none of the layer's arguments. Each now raises
a ``ValueError`` or ``TypeError`` naming the argument, or (the 1-D attention mask) runs.
"""

from __future__ import annotations

import pytest
import torch

from torchvote.functional import LinearVotes
from torchvote.nn import (
    CapsuleLinear,
    ClassMatrixCapsules,
    ConvMatrixCapsules,
    DynamicRouter,
    EMRouter,
    InvertedDotProductRouter,
    LearnedPositionalEmbedding,
    MatrixCapsules,
    MultiHeadAttention,
    NadarayaWatson,
    PrimaryCapsules,
    PrimaryMatrixCapsules,
    RoutingAttention,
    ScaledDotAgreement,
    SelfAttentionRouter,
    SlotAttention,
    SlotRouter,
    TransformerConfig,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
    UniformRouter,
    make_router,
)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=dtype)


X = randn(3, 5, 8)  # (b, T, E)
U = randn(2, 3, 5, 6)  # routing votes (b, out_caps, in_caps, out_dim)


def _grid(dtype=torch.float32):
    """Matrix capsules on a 5x5 grid: 2 types of 2x2 poses."""
    poses = randn(2, 5, 5, 2, 2, 2, dtype=dtype)
    return MatrixCapsules(poses, torch.rand(2, 5, 5, 2, generator=torch.Generator().manual_seed(0)).to(dtype))


def _conv_capsules():
    return ConvMatrixCapsules(2, 3, kernel_size=3, pose_dim=4)


def _class_capsules(**kwargs):
    return ClassMatrixCapsules(2, 4, pose_dim=4, **kwargs)


CASES = {
    # --- attention -----------------------------------------------------------------------------
    "MultiHeadAttention batch_first='no' (was: batch first)": (
        lambda: MultiHeadAttention(8, 2, batch_first="no"), TypeError, "batch_first must be True or False"),
    "MultiHeadAttention bias='no' (was: biases)": (
        lambda: MultiHeadAttention(8, 2, bias="no"), TypeError, "bias must be True or False"),
    "MultiHeadAttention shared_qkv='no' (was: shared)": (
        lambda: MultiHeadAttention(8, 2, shared_qkv="no"), TypeError, "shared_qkv must be True or False"),
    "MultiHeadAttention need_weights='no' (was: weights)": (
        lambda: MultiHeadAttention(8, 2)(X, need_weights="no"),
        TypeError, "need_weights must be True or False"),
    "MultiHeadAttention average_weights='no' (was: averaged)": (
        lambda: MultiHeadAttention(8, 2)(X, need_weights=True, average_weights="no"), TypeError,
        "average_weights must be True or False"),
    "MultiHeadAttention is_causal='no' with weights (was: causal)": (
        lambda: MultiHeadAttention(8, 2)(X, is_causal="no", need_weights=True), TypeError,
        "is_causal must be True or False"),
    "MultiHeadAttention unbatched key_mask (1, S) (was: named as (1, 1, S))": (
        lambda: MultiHeadAttention(8, 2)(X[0], key_mask=torch.ones(1, 5, dtype=torch.bool)), ValueError,
        r"key_mask must have shape \(S,\) = \(5,\) for unbatched inputs, got \(1, 5\)"),
    "MultiHeadAttention unbatched attn_mask (4, 5) (was: logits shown as (1, 2, 5, 5))": (
        lambda: MultiHeadAttention(8, 2)(X[0], attn_mask=torch.ones(4, 5, dtype=torch.bool)), ValueError,
        r"attn_mask of shape \(4, 5\) does not broadcast to the attention logits' shape \(2, 5, 5\) "
        r"\(heads, L, S\) for unbatched inputs"),
    "MultiHeadAttention unbatched attn_mask of 3 heads for 2 (was: logits shown as (1, 2, 5, 5))": (
        lambda: MultiHeadAttention(8, 2)(X[0], attn_mask=torch.ones(3, 5, 5, dtype=torch.bool)), ValueError,
        r"attn_mask of shape \(3, 5, 5\) does not broadcast to the attention logits' shape \(2, 5, 5\)"),
    "ScaledDotAgreement scale='a'": (
        lambda: ScaledDotAgreement("a"), TypeError, "scale must be a real number"),
    "NadarayaWatson bandwidth=True (was: 1.0)": (
        lambda: NadarayaWatson(bandwidth=True), ValueError, "bandwidth must be a positive finite number"),
    "NadarayaWatson learnable='no' (was: learnable)": (
        lambda: NadarayaWatson(learnable="no"), TypeError, "learnable must be True or False"),
    "NadarayaWatson float64 queries, float32 keys (was: float32 result)": (
        lambda: NadarayaWatson()(randn(2, 5, dtype=torch.float64), randn(2, 6), randn(2, 6)), TypeError,
        "keys has dtype torch.float32 but the queries are torch.float64"),
    "NadarayaWatson float64 values (was: float64 result)": (
        lambda: NadarayaWatson()(randn(2, 5), randn(2, 6), randn(2, 6, dtype=torch.float64)), TypeError,
        "values has dtype torch.float64 but the queries are torch.float32"),
    "LearnedPositionalEmbedding float16 inputs (was: float32 result)": (
        lambda: LearnedPositionalEmbedding(10, 8)(X.half()), TypeError,
        "inputs has dtype torch.float16 but the module's parameters are torch.float32"),
    # --- transformer ---------------------------------------------------------------------------
    "TransformerEncoderLayer norm_first='no' (was: pre-norm)": (
        lambda: TransformerEncoderLayer(8, 2, norm_first="no"),
        TypeError, "norm_first must be True or False"),
    "TransformerEncoderLayer shared_qkv='no' (was: shared)": (
        lambda: TransformerEncoderLayer(8, 2, shared_qkv="no"),
        TypeError, "shared_qkv must be True or False"),
    "TransformerConfig norm_first='no' through a stack": (
        lambda: TransformerEncoder(TransformerConfig(8, 2, norm_first="no"), 2), TypeError,
        "norm_first must be True or False"),
    "TransformerEncoderLayer return_intermediates='no' (was: a record)": (
        lambda: TransformerEncoderLayer(8, 2)(X, return_intermediates="no"), TypeError,
        "return_intermediates must be True or False"),
    "TransformerEncoderLayer is_causal='no'": (
        lambda: TransformerEncoderLayer(8, 2)(X, is_causal="no"),
        TypeError, "is_causal must be True or False"),
    "TransformerDecoderLayer is_causal=None": (
        lambda: TransformerDecoderLayer(8, 2)(X, randn(3, 6, 8), is_causal=None), TypeError,
        "is_causal must be True or False"),
    "TransformerEncoder final_norm='no' (was: a final norm)": (
        lambda: TransformerEncoder(TransformerConfig(8, 2), 2, final_norm="no"), TypeError,
        "final_norm must be True or False"),
    "TransformerEncoder layer_norm_eps=0 (was: taken)": (
        lambda: TransformerEncoder(TransformerConfig(8, 2, norm_first=True), 2, layer_norm_eps=0.0),
        ValueError,
        "layer_norm_eps must be a positive finite number"),
    "TransformerEncoder return_intermediates='x'": (
        lambda: TransformerEncoder(TransformerConfig(8, 2), 2)(X, return_intermediates="x"), TypeError,
        "return_intermediates must be True or False"),
    # --- vector capsules -----------------------------------------------------------------------
    "PrimaryCapsules unbatched maps (was: an einops error)": (
        lambda: PrimaryCapsules(3, 4, 2, kernel_size=3, stride=1)(randn(3, 6, 6)), ValueError,
        r"features must have shape \(batch, in_channels=3, height, width\), got \(3, 6, 6\)"),
    "PrimaryCapsules wrong channels": (
        lambda: PrimaryCapsules(3, 4, 2, kernel_size=3, stride=1)(randn(2, 4, 6, 6)), ValueError,
        r"in_channels=3"),
    "PrimaryCapsules maps smaller than the kernel": (
        lambda: PrimaryCapsules(3, 4, 2, kernel_size=3, stride=1)(randn(2, 3, 2, 2)), ValueError,
        "is smaller than the kernel's extent 3x3"),
    "PrimaryCapsules integer maps": (
        lambda: PrimaryCapsules(3, 4, 2, kernel_size=3)(torch.ones(2, 3, 9, 9, dtype=torch.int64)), TypeError,
        "features must be a floating-point tensor"),
    "PrimaryCapsules float64 maps": (
        lambda: PrimaryCapsules(3, 4, 2, kernel_size=3)(randn(2, 3, 9, 9, dtype=torch.float64)), TypeError,
        "features has dtype torch.float64 but the module's parameters are torch.float32"),
    "CapsuleLinear shared_weights='no' (was: shared)": (
        lambda: CapsuleLinear(5, 4, 3, 6, shared_weights="no"),
        TypeError, "shared_weights must be True or False"),
    "CapsuleLinear router_options a list": (
        lambda: CapsuleLinear(5, 4, 3, 6, router_options=[1]), TypeError, "router_options must be a mapping"),
    **{
        f"CapsuleLinear router_options={{{key!r}: ...}} (was: 'got multiple values for keyword argument')": (
            lambda key=key, value=value: CapsuleLinear(5, 3, 4, 6, router_options={key: value}), ValueError,
            f"router_options must not set '{key}': the layer's own argument sets it")
        for key, value in (("iterations", 2), ("dtype", torch.float64), ("out_caps", 4), ("in_caps", 5),
                           ("out_dim", 6), ("device", "cpu"))
    },
    "CapsuleLinear iterations with a Router module (was: ignored)": (
        lambda: CapsuleLinear(5, 3, 4, 6, routing=DynamicRouter(iterations=2), iterations=7), ValueError,
        "iterations only applies when routing is given by name; the Router module has its own"),
    "CapsuleLinear return_routing='no' (was: the result)": (
        lambda: CapsuleLinear(5, 4, 3, 6)(randn(2, 5, 4), return_routing="no"), TypeError,
        "return_routing must be True or False"),
    "CapsuleLinear integer activations for EM (was: taken)": (
        lambda: CapsuleLinear(5, 4, 3, 4, routing="em")(randn(2, 5, 4), activations=torch.ones(2, 5).long()),
        TypeError, "activations must be floating point"),
    # --- routers -------------------------------------------------------------------------------
    "MultiHeadAttention value without key (was: blamed the key the user never gave)": (
        lambda: MultiHeadAttention(8, 2)(torch.randn(2, 4, 8), None, torch.randn(2, 5, 8)), ValueError,
        r"value of shape \(2, 5, 8\) was given without key, so key defaulted to query \(2, 4, 8\)"),
    "DynamicRouter unknown option (was: named BiasedRouter.__init__)": (
        lambda: DynamicRouter(foo=1), TypeError,
        "DynamicRouter got unexpected keyword argument\\(s\\) 'foo'; besides its own arguments it "
        "takes bias, out_caps, out_dim, device, dtype"),
    "UniformRouter unknown option (was: named BiasedRouter.__init__)": (
        lambda: UniformRouter(foo=1), TypeError,
        "UniformRouter got unexpected keyword argument"),
    "RoutingAttention unknown option (was: named MultiHeadAttention.__init__)": (
        lambda: RoutingAttention(8, 2, foo=1), TypeError,
        "RoutingAttention got unexpected keyword argument\\(s\\) 'foo'; besides its own arguments it takes "
        "kdim, vdim, bias, dropout, batch_first, shared_qkv, device, dtype"),
    "DynamicRouter detach_votes='no' (was: detached)": (
        lambda: DynamicRouter(detach_votes="no"), TypeError, "detach_votes must be True or False"),
    "DynamicRouter bias='no' (was: a bias)": (
        lambda: DynamicRouter(bias="no", out_caps=3, out_dim=6), TypeError, "bias must be True or False"),
    "DynamicRouter bias with out_caps=0 (was: an empty bias)": (
        lambda: DynamicRouter(bias=True, out_caps=0, out_dim=6),
        ValueError, "out_caps must be a positive integer"),
    "InvertedDotProductRouter elementwise_affine='no'": (
        lambda: InvertedDotProductRouter(out_dim=6, elementwise_affine="no"), TypeError,
        "elementwise_affine must be True or False"),
    "InvertedDotProductRouter votes of another out_dim (was: a layer_norm error)": (
        lambda: InvertedDotProductRouter(out_dim=5)(U), ValueError, "votes must have out_dim=5 features"),
    "InvertedDotProductRouter float64 votes (was: a layer_norm error)": (
        lambda: InvertedDotProductRouter(out_dim=6)(U.double()), TypeError,
        "votes have dtype torch.float64 but the router's parameters are torch.float32"),
    "SlotRouter votes of another out_dim (was: a layer_norm error)": (
        lambda: SlotRouter(out_caps=3, out_dim=5)(randn(1, 3, 4, 6)), ValueError,
        r"votes must have out_dim=5 .*got shape \(1, 3, 4, 6\)"),
    "SlotRouter float64 votes (was: a layer_norm 'mixed dtype' error)": (
        lambda: SlotRouter(out_caps=3, out_dim=6)(U.double()), TypeError,
        "votes have dtype torch.float64 but the router's parameters are torch.float32"),
    "SlotRouter float64 LinearVotes (was: a layer_norm 'mixed dtype' error)": (
        lambda: SlotRouter(out_caps=3, out_dim=6)(
            LinearVotes(randn(3, 5, 6, 2).double(), randn(2, 5, 2).double())),
        TypeError, "votes have dtype torch.float64 but the router's parameters are torch.float32"),
    "SelfAttentionRouter log_prior='no' (was: a prior)": (
        lambda: SelfAttentionRouter(in_caps=5, out_caps=3, log_prior="no"), TypeError,
        "log_prior must be True or False"),
    "EMRouter votes a list": (lambda: EMRouter(out_caps=3)([1.0]), TypeError, "votes must be a tensor"),
    "make_router iterations=0 for a one-pass router": (
        lambda: make_router("uniform", in_caps=5, out_caps=3, out_dim=6, iterations=0), ValueError,
        "iterations must be a positive integer"),
    "make_router options={'factory': ...}": (
        lambda: make_router("dynamic", in_caps=5, out_caps=3, out_dim=6, factory={}), ValueError,
        "options must not set 'factory'"),
    "make_router name a list": (
        lambda: make_router(["dynamic"], in_caps=5, out_caps=3, out_dim=6),
        ValueError, "routing must be one of"),
    "SlotAttention return_attention='no'": (
        lambda: SlotAttention(3, 6, slot_dim=4, hidden_dim=8)(randn(2, 7, 6), return_attention="no"),
        TypeError,
        "return_attention must be True or False"),
    "SlotAttention mask a list": (
        lambda: SlotAttention(3, 6, slot_dim=4, hidden_dim=8)(randn(2, 7, 6), mask=[1]), TypeError,
        "mask must be a boolean tensor"),
    # --- matrix capsules -----------------------------------------------------------------------
    "PrimaryMatrixCapsules unbatched maps (was: an einops error)": (
        lambda: PrimaryMatrixCapsules(3, 2, pose_dim=4)(randn(3, 5, 5)), ValueError,
        r"features must have shape \(batch, in_channels=3"),
    "PrimaryMatrixCapsules float64 maps": (
        lambda: PrimaryMatrixCapsules(3, 2, pose_dim=4)(randn(2, 3, 5, 5, dtype=torch.float64)), TypeError,
        "features has dtype torch.float64"),
    "ConvMatrixCapsules float64 poses (was: an em_kernel error)": (
        lambda: _conv_capsules()(_grid(torch.float64)), TypeError,
        "capsules.poses has dtype torch.float64 but the module's parameters are torch.float32"),
    "ConvMatrixCapsules integer activations (was: an unfold error)": (
        lambda: _conv_capsules()(MatrixCapsules(_grid().poses, torch.ones(2, 5, 5, 2, dtype=torch.int64))),
        TypeError, "capsules.activations must be a floating-point tensor"),
    "ConvMatrixCapsules boolean activations (was: taken as 0/1)": (
        lambda: _conv_capsules()(MatrixCapsules(_grid().poses, torch.ones(2, 5, 5, 2, dtype=torch.bool))),
        TypeError, "capsules.activations must be a floating-point tensor"),
    "ConvMatrixCapsules float64 activations": (
        lambda: _conv_capsules()(MatrixCapsules(_grid().poses, _grid().activations.double())), TypeError,
        "capsules.activations has dtype torch.float64 but the poses are torch.float32"),
    "ConvMatrixCapsules activations a list": (
        lambda: _conv_capsules()(MatrixCapsules(_grid().poses, [1.0])), TypeError,
        "capsules.activations must be a floating-point tensor"),
    "ClassMatrixCapsules float64 poses (was: an einsum error)": (
        lambda: _class_capsules()(_grid(torch.float64)), TypeError, "capsules.poses has dtype torch.float64"),
    "ClassMatrixCapsules empty grid (was: named the router's votes)": (
        lambda: _class_capsules()(MatrixCapsules(torch.randn(2, 0, 3, 2, 2, 2), torch.rand(2, 0, 3, 2))),
        ValueError, "capsules must hold at least one grid position, got a grid of 0 x 3"),
    "MultiHeadAttention unbatched key_mask of another length (was: shown as (1, 4))": (
        lambda: MultiHeadAttention(8, 2)(X[0], key_mask=torch.ones(4, dtype=torch.bool)), ValueError,
        r"key_mask must have shape \(S,\) = \(5,\) for unbatched inputs, got \(4,\)"),
    "ClassMatrixCapsules integer activations (was: taken)": (
        lambda: _class_capsules()(MatrixCapsules(_grid().poses, torch.ones(2, 5, 5, 2, dtype=torch.int64))),
        TypeError, "capsules.activations must be a floating-point tensor"),
    "ConvMatrixCapsules unknown routing option (was: EMRouter's TypeError)": (
        lambda: ConvMatrixCapsules(2, 2, foo=1), ValueError,
        r"bad option for routing='em': .*unexpected keyword argument 'foo'"),
    "ConvMatrixCapsules out_caps (was: 'got multiple values for keyword argument')": (
        lambda: ConvMatrixCapsules(2, 2, out_caps=3), ValueError,
        "routing_options must not set 'out_caps': the layer's own argument sets it"),
    "ClassMatrixCapsules unknown routing option (was: EMRouter's TypeError)": (
        lambda: _class_capsules(foo=1), ValueError, r"bad option for routing='em': .*'foo'"),
    "ClassMatrixCapsules out_caps (was: 'got multiple values for keyword argument')": (
        lambda: _class_capsules(out_caps=3), ValueError, "routing_options must not set 'out_caps'"),
    "ClassMatrixCapsules routing=3": (
        lambda: _class_capsules(routing=3), TypeError, "routing must be a Router module or None"),
    "ClassMatrixCapsules coordinate_addition='no' (was: added)": (
        lambda: _class_capsules(coordinate_addition="no"),
        TypeError, "coordinate_addition must be True or False"),
    "ClassMatrixCapsules return_routing='no' (was: the result)": (
        lambda: _class_capsules()(_grid(), return_routing="no"),
        TypeError, "return_routing must be True or False"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_refused_by_name(case):
    call, error, match = CASES[case]
    with pytest.raises(error, match=match):
        call()


def test_a_one_dimensional_attn_mask_runs_as_its_two_dimensional_form():
    """An ``(S,)`` attn_mask broadcasts to ``(b, h, L, S)`` and passed every check, then the fused
    kernel refused it with an IndexError (with ``need_weights`` it ran already)."""
    module = MultiHeadAttention(8, 2).eval()
    allowed = torch.tensor([True, False, True, True, False])
    for need_weights in (False, True):
        one_d = module(X, attn_mask=allowed, need_weights=need_weights)
        two_d = module(X, attn_mask=allowed[None], need_weights=need_weights)
        torch.testing.assert_close(one_d[0], two_d[0])
