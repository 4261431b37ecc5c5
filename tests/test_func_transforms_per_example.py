"""``torch.func`` transforms with a per-example mask or target among the vmapped arguments.

The argument checks that read a tensor's values (a float mask's NaN, a token id's range, a class
index's range, the reads that turn a causal mask into ``is_causal=True``) cannot run inside
``vmap``, where a value is one per example: they are skipped there, as under ``torch.compile``
(``torchvote.validation.values_are_traced``), and ``F.one_hot`` (which reads the largest index)
gives way to a comparison with ``arange``. Each check here holds a transform against an
independent reference: ``vmap`` against a Python loop of the unbatched calls, ``vmap(grad)``
(per-sample gradients) against a loop of ``torch.autograd.grad`` per example, in float64. The
rnn-attention-seq2seq model runs its GRUs as plain operations under a transform (no packing),
so its loop, which packs, checks those too.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.func import functional_call, grad, vmap

import torchvote.functional as TF
from conftest import padded_source
from torchvote import losses
from torchvote.models import create_model, get_model_spec
from torchvote.models.capsule_head import CapsuleDecoder
from torchvote.nn import MultiHeadAttention, RoutingAttention
from torchvote.training.tasks import get_task_handler

DOUBLE = torch.float64
BATCH, LENGTH, EMBED = 3, 4, 8


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bool_masks() -> torch.Tensor:
    """``(3, L, L)``: causal (which the eager call turns into ``is_causal=True``), one key
    padded, random (with key 0 open to every query, so no row is empty)."""
    causal = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
    padded = torch.ones(LENGTH, LENGTH, dtype=torch.bool)
    padded[:, -1] = False
    scattered = torch.rand(LENGTH, LENGTH, generator=_generator(1)) > 0.5
    scattered[:, 0] = True
    return torch.stack([causal, padded, scattered])


def _float_masks() -> torch.Tensor:
    """``(3, L, L)`` float64 biases, ``-inf`` at the forbidden pairs of :func:`_bool_masks`."""
    bias = torch.randn(BATCH, LENGTH, LENGTH, dtype=DOUBLE, generator=_generator(2))
    return bias.masked_fill(~_bool_masks(), float("-inf"))


def _inputs() -> torch.Tensor:
    return torch.randn(BATCH, LENGTH, EMBED, dtype=DOUBLE, generator=_generator(3))


def _assert_vmap_equals_loop(call, *batched: torch.Tensor) -> None:
    """``vmap(call)`` over the leading axis of every argument against a loop of ``call``."""
    got = vmap(call)(*batched)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager calls may warn about a mask; vmap cannot read it
        expected = torch.stack([call(*(x[k] for x in batched)) for k in range(BATCH)])
    torch.testing.assert_close(got, expected)


# --- per-example attention masks under vmap ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_multi_head_attention_vmapped_over_per_example_masks_equals_the_loop(kind):
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, 2, dtype=DOUBLE).eval()
    masks = _bool_masks() if kind == "bool" else _float_masks()
    _assert_vmap_equals_loop(lambda x, mask: module(x, attn_mask=mask)[0], _inputs(), masks)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_scaled_dot_product_attention_vmapped_over_per_example_masks_equals_the_loop(kind):
    masks = _bool_masks() if kind == "bool" else _float_masks()

    def call(q, mask):
        return TF.scaled_dot_product_attention(q, q, q, attn_mask=mask)[0]

    _assert_vmap_equals_loop(call, _inputs(), masks)


@pytest.mark.parametrize("normalize_over", ["senders", "receivers"])
def test_routing_attention_vmapped_over_per_example_masks_equals_the_loop(normalize_over):
    torch.manual_seed(0)
    module = RoutingAttention(EMBED, 2, normalize_over=normalize_over, dtype=DOUBLE).eval()
    masks = _bool_masks()
    if normalize_over == "receivers":  # a causal mask is refused there (eagerly): pad a key instead
        masks[0] = masks[1].roll(1, dims=-1)
    _assert_vmap_equals_loop(lambda x, mask: module(x, attn_mask=mask)[0], _inputs(), masks)


def test_mask_gradients_per_example_equal_the_loop():
    """``vmap(grad)`` with respect to a per-example float mask (a learned bias)."""
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, 2, dtype=DOUBLE).eval()
    x, masks = _inputs(), _float_masks().nan_to_num(neginf=-1e4)

    def loss(mask, xi):
        return module(xi, attn_mask=mask)[0].square().sum()

    got = vmap(grad(loss))(masks, x)
    for k in range(BATCH):
        mask = masks[k].clone().requires_grad_()
        (expected,) = torch.autograd.grad(loss(mask, x[k]), [mask])
        torch.testing.assert_close(got[k], expected)


# --- per-sample gradients of models -----------------------------------------------------------------


def _model_inputs(name: str, model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """``forward``'s inputs as the training loop passes them (tests/models/test_export.py); the
    rnn model's sources padded to different lengths, which its packing reads."""
    spec = get_model_spec(name)
    if name == "rnn-attention-seq2seq":
        example = get_task_handler(spec.task).example_batch(model.config, BATCH, _generator(BATCH))
        return padded_source([5, 8, 3], 8), example["target"][:, :4]  # 4 decoder steps: fast enough
    example = get_task_handler(spec.task).example_batch(model.config, BATCH, _generator(BATCH))
    if spec.task == "image-classification":
        return (example["images"].to(DOUBLE),)
    if spec.task == "language-model":
        return (example["tokens"][:, :8],)
    return example["source"], example["target"][:, :-1]


def _scalar(output) -> torch.Tensor:
    """A loss through every output the model computes (the decoder's reconstructions included)."""
    if hasattr(output, "logits"):
        return output.logits.square().sum()
    total = output.scores.square().sum()
    return total if output.reconstructions is None else total + output.reconstructions.square().sum()


MODELS = [
    ("capsnet", {}),
    ("efficient-capsnet", {}),
    ("transformer-lm", {}),
    ("transformer-seq2seq", {}),
    ("rnn-attention-seq2seq", {}),
    ("rnn-attention-seq2seq", {"attention": "general", "bidirectional": False}),
]


@pytest.mark.parametrize(
    ("name", "overrides"), MODELS, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values()))
)
def test_model_per_sample_gradients_equal_the_loop(name, overrides):
    torch.manual_seed(0)
    model = create_model(name, "tiny", **overrides).to(DOUBLE).eval()
    inputs = _model_inputs(name, model)
    trained = dict(model.named_parameters())
    expected = [  # the eager model, example by example (packed GRUs, the fused kernels)
        torch.autograd.grad(
            _scalar(model(*(x[k : k + 1] for x in inputs))), list(trained.values()), allow_unused=True
        )
        for k in range(BATCH)
    ]
    # functional_call on a copy: on a module registered under two names (transformer-seq2seq's
    # shared embedding) it leaves a plain tensor in place of the parameter (torch 2.13)
    transformed = copy.deepcopy(model)
    params = {key: p.detach() for key, p in transformed.named_parameters()}

    def loss(p, *one):
        return _scalar(functional_call(transformed, p, tuple(x[None] for x in one)))

    got = vmap(grad(loss), in_dims=(None, *[0] * len(inputs)))(params, *inputs)
    assert list(got) == list(trained)
    for k in range(BATCH):
        for (key, value), want in zip(got.items(), expected[k], strict=True):
            want = torch.zeros_like(value[k]) if want is None else want
            torch.testing.assert_close(value[k], want, msg=lambda m, key=key: f"{key}: {m}")


def test_rnn_seq2seq_vmapped_over_padded_sources_equals_the_packed_batch():
    """The plain GRUs (no packing) under vmap against the eager batch, which packs its rows."""
    torch.manual_seed(0)
    model = create_model("rnn-attention-seq2seq", "tiny", num_layers=2).to(DOUBLE).eval()
    source, target = _model_inputs("rnn-attention-seq2seq", model)
    source[1] = 0  # an all-padding row: packing reads one (padding) token of it
    got = vmap(lambda s, t: model(s[None], t[None]).logits[0])(source, target)
    torch.testing.assert_close(got, model(source, target).logits)


# --- losses vmapped over their targets --------------------------------------------------------------


def _class_scores() -> torch.Tensor:
    return torch.rand(BATCH, 5, dtype=DOUBLE, generator=_generator(4))


LOSSES = {
    "margin": (lambda s, y: losses.margin_loss(s, y), torch.tensor([0, 4, 2])),
    "margin-multi-hot": (
        lambda s, y: losses.margin_loss(s, y),
        torch.tensor([[1, 0, 0, 1, 0], [0, 0, 0, 0, 1], [0, 1, 1, 0, 0]]),
    ),
    "spread": (lambda s, y: losses.spread_loss(s, y, margin=0.5), torch.tensor([0, 4, 2])),
    "cross-entropy": (lambda s, y: losses.cross_entropy(s, y), torch.tensor([0, 4, 2])),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_and_its_gradient_vmapped_over_targets_equal_the_loop(name):
    function, targets = LOSSES[name]
    scores = _class_scores()

    def one(s, y):
        return function(s[None], y[None])

    got, got_grad = vmap(one)(scores, targets), vmap(grad(one))(scores, targets)
    for k in range(BATCH):
        row = scores[k].clone().requires_grad_()
        value = one(row, targets[k])
        torch.testing.assert_close(got[k], value.detach())
        torch.testing.assert_close(got_grad[k], torch.autograd.grad(value, [row])[0])


def test_sequence_cross_entropy_vmapped_over_targets_with_ignored_positions_equals_the_loop():
    logits = torch.randn(BATCH, 6, 5, dtype=DOUBLE, generator=_generator(5))
    targets = torch.randint(0, 5, (BATCH, 6), generator=_generator(6))
    targets[0, 3:] = -100
    targets[2] = -100  # nothing counted: the loss is 0

    def one(s, y):
        return losses.cross_entropy(s[None], y[None])

    got = vmap(grad(one))(logits, targets)
    for k in range(BATCH):
        row = logits[k].clone().requires_grad_()
        torch.testing.assert_close(got[k], torch.autograd.grad(one(row, targets[k]), [row])[0])


# --- the eager checks stay --------------------------------------------------------------------------


def test_eager_out_of_range_classes_still_get_the_checks_errors():
    """``F.one_hot`` gave way to a comparison, which would silently zero an out-of-range class:
    the range checks before it still refuse one eagerly."""
    poses = torch.rand(2, 4, 3)
    with pytest.raises(ValueError, match=r"classes must be capsule indices in \[0, 4\)"):
        CapsuleDecoder.mask(poses, torch.tensor([[1], [4]]))
    with pytest.raises(ValueError, match=r"class indices must be in \[0, 5\)"):
        losses.margin_loss(_class_scores(), torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match=r"class indices must be in \[0, 5\)"):
        losses.spread_loss(_class_scores(), torch.tensor([-1, 4, 1]), margin=0.5)
    model = create_model("capsnet", "tiny").eval()
    with pytest.raises(ValueError, match="targets holds class indices outside"):
        model(torch.rand(2, 1, 28, 28), torch.tensor([1, 10]))


def test_eager_mask_and_token_checks_still_raise():
    nan_mask = torch.zeros(LENGTH, LENGTH)
    nan_mask[1, 2] = float("nan")
    with pytest.raises(ValueError, match="attn_mask contains NaN or \\+inf"):
        MultiHeadAttention(EMBED, 2)(torch.randn(LENGTH, EMBED), attn_mask=nan_mask)
    model = create_model("transformer-lm", "tiny")
    with pytest.raises(ValueError, match="ids outside the vocabulary"):
        model(torch.tensor([[1, model.config.vocab_size]]))
