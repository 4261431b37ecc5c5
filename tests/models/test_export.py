"""Deployment paths: ``torch.export``, ``torch.save`` of a whole model, ``copy.deepcopy``, pickle.

Every registered model (but the GRU seq2seq, which refuses by name) is exported once, non-strict
(what PyTorch recommends) with a dynamic batch dimension, and the exported program, run on batches
of other sizes with gradients on (as a caller runs it), must give the eager model's outputs, the
same output class included. Export is slow on a CPU: one program per model.
"""

from __future__ import annotations

import copy
import io
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from conftest import needs_one_graph_torch
from torchvote.models import ClassifierOutput, SequenceOutput, create_model, get_model_spec, list_models
from torchvote.nn import (
    ClassMatrixCapsules,
    ConvMatrixCapsules,
    MatrixCapsules,
    MultiHeadAttention,
    SlotAttention,
    TransformerConfig,
    TransformerEncoder,
)
from torchvote.pretrained.bert import BertConfig, BertEncoder, EncoderOutput
from torchvote.training.tasks import get_task_handler

sys.path.insert(0, str(Path(__file__).parents[1] / "nn"))
from test_factory_kwargs import ALL_CASES, _outputs  # noqa: E402  (torchvote.nn's construction table)

#: Models torch.export cannot trace, each refusing with a message that says why.
NOT_EXPORTABLE = {"rnn-attention-seq2seq": "pack_padded_sequence"}
EXPORTABLE = [name for name in list_models() if name not in NOT_EXPORTABLE]


def _inputs(name: str, model: nn.Module, batch: int) -> tuple[Tensor, ...]:
    """``forward``'s natural inputs, as the training loop passes them (a language model reads at
    most ``context_length`` tokens; a seq2seq model reads ``target_input``)."""
    spec = get_model_spec(name)
    example = get_task_handler(spec.task).example_batch(
        model.config, batch, torch.Generator().manual_seed(batch)
    )
    if spec.task == "image-classification":
        return (example["images"],)
    if spec.task == "language-model":
        return (example["tokens"][:, :-1],)
    return (example["source"], example["target"][:, :-1])


def _tiny(name: str) -> nn.Module:
    torch.manual_seed(0)
    return create_model(name, "tiny").eval()


def assert_same_outputs(got: Any, expected: Any) -> None:
    """Same pytree (classes, fields, which are ``None``, dict keys) and close tensors."""
    got_leaves, got_spec = pytree.tree_flatten(got)
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    assert got_spec == expected_spec
    for got_leaf, expected_leaf in zip(got_leaves, expected_leaves, strict=True):
        torch.testing.assert_close(got_leaf, expected_leaf)


def _batch_dims(inputs: tuple[Tensor, ...]) -> tuple[dict[int, Any], ...]:
    batch = torch.export.Dim("batch")
    return tuple({0: batch} for _ in inputs)


# --- torch.export ----------------------------------------------------------------------------------


@needs_one_graph_torch
@pytest.mark.slow  # about 20 s in all on a 2-core CPU (em-capsnet 8 s)
@pytest.mark.parametrize("name", EXPORTABLE)
def test_every_model_exports_with_a_dynamic_batch_and_gives_the_eager_outputs(name):
    model = _tiny(name)
    traced = _inputs(name, model, 3)
    exported = torch.export.export(model, traced, dynamic_shapes=_batch_dims(traced)).module()
    for batch in (3, 5):  # the traced size and another: no specialisation on the batch
        inputs = _inputs(name, model, batch)
        with torch.no_grad():
            expected = model(*inputs)
        got = exported(*inputs)  # gradients on, as a caller runs it
        assert type(got) is type(expected)
        assert_same_outputs(got, expected)


@needs_one_graph_torch
@pytest.mark.parametrize("name", sorted(NOT_EXPORTABLE))
def test_a_model_that_cannot_be_exported_says_why(name):
    model = _tiny(name)
    # was: "zeros(): argument 'size' failed to unpack the object at pos 2 ... FakeTensor"
    with pytest.raises(NotImplementedError, match=rf"{name} cannot be exported.*{NOT_EXPORTABLE[name]}"):
        torch.export.export(model, _inputs(name, model, 3))


@pytest.mark.parametrize("name", ["cnn-baseline", "transformer-lm"])  # one of each output class
def test_an_exported_program_saves_and_loads_with_its_output_class(name):
    """The outputs' serialized type names let ``torch.export.save`` write the output spec."""
    model = _tiny(name)
    inputs = _inputs(name, model, 2)
    buffer = io.BytesIO()
    torch.export.save(torch.export.export(model, inputs), buffer)
    buffer.seek(0)
    got = torch.export.load(buffer).module()(*inputs)
    with torch.no_grad():
        expected = model(*inputs)
    assert type(got) is type(expected)
    assert_same_outputs(got, expected)


def test_strict_export_works_too():
    model = _tiny("cnn-baseline")
    inputs = _inputs("cnn-baseline", model, 3)
    program = torch.export.export(model, inputs, dynamic_shapes=_batch_dims(inputs), strict=True)
    with torch.no_grad():
        expected = model(*inputs)
    assert_same_outputs(program.module()(*inputs), expected)


def test_a_half_precision_capsule_network_exports():
    """``model.half()`` then export; CapsNet routes with the streamed vote kernels on a CPU."""
    model = _tiny("capsnet").half()
    (images,) = _inputs("capsnet", model, 3)
    images = images.half()
    program = torch.export.export(model, (images,))
    with torch.no_grad():
        expected = model(images)
    assert_same_outputs(program.module()(images), expected)


def test_the_output_classes_are_pytrees_that_keep_none_fields():
    """``torch.export`` (and every pytree user) rebuilds the same class, ``None`` fields and all."""
    scores, poses = torch.randn(2, 3), torch.randn(2, 3, 4)
    outputs = [
        ClassifierOutput(scores=scores, poses=poses, intermediates={"a": scores}),
        SequenceOutput(logits=poses, attention=[scores]),
        EncoderOutput((poses, poses), (), torch.ones(2, 3, dtype=torch.bool)),
    ]
    for output in outputs:
        leaves, spec = pytree.tree_flatten(output)
        assert all(isinstance(leaf, Tensor) for leaf in leaves)
        rebuilt = pytree.tree_unflatten(leaves, spec)
        assert type(rebuilt) is type(output)
        assert rebuilt == output  # dataclass equality: the same tensors in the same fields
    assert pytree.tree_unflatten(*pytree.tree_flatten(outputs[0])).reconstructions is None


def _tiny_bert() -> BertEncoder:
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=20,
    )
    torch.manual_seed(0)
    return BertEncoder(config).eval()


def test_the_pretrained_encoder_exports_with_a_dynamic_batch():
    encoder = _tiny_bert()

    def batch(size: int) -> tuple[Tensor, Tensor]:
        ids = torch.randint(1, 50, (size, 7), generator=torch.Generator().manual_seed(size))
        mask = torch.ones(size, 7, dtype=torch.bool)
        mask[1, 5:] = False  # padding in one sentence
        return ids, mask

    program = torch.export.export(encoder, batch(3), dynamic_shapes=_batch_dims(batch(3)))
    for size in (3, 4):
        with torch.no_grad():
            expected = encoder(*batch(size))
        got = program.module()(*batch(size))
        assert type(got) is EncoderOutput
        assert_same_outputs(got, expected)


@pytest.mark.slow  # about 15 s in all on a 2-core CPU
@pytest.mark.parametrize("case", ALL_CASES)
def test_every_public_module_exports_and_gives_the_eager_outputs(case):
    torch.manual_seed(0)
    module = case.build().eval()
    args, kwargs = case.inputs(torch.float32)
    program = torch.export.export(module, args, kwargs)
    if isinstance(module, SlotAttention):  # it samples its initial slots: the same draws in both
        torch.manual_seed(1)
    with torch.no_grad():
        expected = module(*args, **kwargs)
    if isinstance(module, SlotAttention):
        torch.manual_seed(1)
    assert_same_outputs(program.module()(*args, **kwargs), expected)


def test_slot_attention_exports_with_a_dynamic_batch():
    """Its initial slots were drawn with ``torch.randn(shape)``: a symbolic batch failed inside
    ("SymIntArrayRef expected to contain only concrete integers"). The same draws as eager."""
    torch.manual_seed(0)
    module = SlotAttention(3, 5, slot_dim=8, iterations=2).eval()
    traced = (torch.randn(3, 7, 5),)
    program = torch.export.export(module, traced, dynamic_shapes=_batch_dims(traced)).module()
    for batch in (3, 4):
        inputs = torch.randn(batch, 7, 5)
        torch.manual_seed(1)
        with torch.no_grad():
            expected = module(inputs)
        torch.manual_seed(1)
        assert_same_outputs(program(inputs), expected)


@pytest.mark.parametrize("layer", ["conv", "class"])
def test_an_exported_matrix_capsule_layer_saves_and_loads(layer):
    """``MatrixCapsules`` (a named tuple) in and out had no serialized name: torch.export.save
    refused the program ("Can't serialize TreeSpec of namedtuple class")."""
    torch.manual_seed(0)
    module = (ConvMatrixCapsules(2, 3, kernel_size=3, pose_dim=4, iterations=2) if layer == "conv"
              else ClassMatrixCapsules(2, 4, pose_dim=4, iterations=2)).eval()
    capsules = MatrixCapsules(torch.randn(2, 5, 5, 2, 2, 2), torch.rand(2, 5, 5, 2))
    buffer = io.BytesIO()
    torch.export.save(torch.export.export(module, (capsules,)), buffer)
    buffer.seek(0)
    got = torch.export.load(buffer).module()(capsules)
    with torch.no_grad():
        expected = module(capsules)
    assert type(got) is MatrixCapsules
    assert_same_outputs(tuple(got), tuple(expected))


def test_a_transformer_stack_exports_its_recorded_attention():
    """``return_intermediates=True`` returns an ``AttentionIntermediates`` record."""
    torch.manual_seed(0)
    stack = TransformerEncoder(TransformerConfig(8, 2, dim_feedforward=16, dropout=0.0), 2).eval()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    program = torch.export.export(stack, (x,), {"return_intermediates": True})
    with torch.no_grad():
        expected = stack(x, return_intermediates=True)
    assert_same_outputs(program.module()(x, return_intermediates=True), expected)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attention_with_an_explicit_square_causal_mask_exports(kind):
    """Eagerly such a mask runs as ``is_causal`` (its values read: a data-dependent operator that
    export refused); traced, as the mask it is, the same numbers."""
    torch.manual_seed(0)
    attention = MultiHeadAttention(8, 2).eval()
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    mask = causal if kind == "bool" else nn.Transformer.generate_square_subsequent_mask(5)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    dynamic = (*_batch_dims((x,)), None)  # the batch of x; the mask as it is
    program = torch.export.export(attention, (x,), {"attn_mask": mask}, dynamic_shapes=dynamic)
    with torch.no_grad():
        expected = attention(x, attn_mask=mask)
    assert_same_outputs(program.module()(x, attn_mask=mask), expected)


# --- torch.save, copy.deepcopy, pickle ------------------------------------------------------------


@pytest.mark.parametrize("name", list_models())
def test_a_whole_model_saves_loads_and_deep_copies_after_a_forward_pass(name):
    model = _tiny(name)
    inputs = _inputs(name, model, 3)
    with torch.no_grad():
        expected = model(*inputs)  # any state a forward pass caches exists now
    buffer = io.BytesIO()
    torch.save(model, buffer)  # was: "Can't pickle local object 'rename_state_dict_keys.<locals>.hook'"
    buffer.seek(0)
    for copied in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        with torch.no_grad():
            assert_same_outputs(copied(*inputs), expected)
    assert_same_outputs(pickle.loads(pickle.dumps(expected)), expected)


def test_a_loaded_capsule_model_still_reads_checkpoints_from_before_the_head():
    """The key-renaming hook survives ``torch.save`` and ``torch.load`` of the whole model."""
    model = _tiny("capsnet")
    renames = {"head.class_capsules.": "class_capsules.", "head.decoder.": "decoder."}
    legacy = {}
    for key, value in model.state_dict().items():
        new = next((new for new in renames if key.startswith(new)), None)
        legacy[renames[new] + key[len(new) :] if new else key] = value
    assert not any(key.startswith("head.") for key in legacy)
    torch.manual_seed(1)
    buffer = io.BytesIO()
    torch.save(create_model("capsnet", "tiny").eval(), buffer)  # other weights
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded.load_state_dict(legacy, strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


@pytest.mark.parametrize("case", ALL_CASES)
def test_every_public_module_saves_loads_and_deep_copies_after_a_forward_pass(case):
    torch.manual_seed(0)
    module = case.build().eval()
    args, kwargs = case.inputs(torch.float32)
    with torch.no_grad():
        torch.manual_seed(1)  # SlotAttention samples its slots: the same draws each time
        expected = _outputs(module(*args, **kwargs))
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    for copied in (torch.load(buffer, weights_only=False), copy.deepcopy(module)):
        with torch.no_grad():
            torch.manual_seed(1)
            got = _outputs(copied(*args, **kwargs))
        assert len(got) == len(expected)
        for got_tensor, expected_tensor in zip(got, expected, strict=True):
            torch.testing.assert_close(got_tensor, expected_tensor)
