"""``greedy_decode`` reads whether every sequence ended only every ``check_every`` tokens (each
read stalls an accelerator's queue); the ids must not depend on how often it reads."""

from __future__ import annotations

import pytest
import torch

from torchvote.models.transformer_backbone import greedy_decode

PAD, BOS, EOS, VOCAB = 0, 1, 2, 7


def _scripted(ends: list[int]):
    """Row ``r`` writes ``3, 4, 5, 6, 3, ...`` and ``<eos>`` as its ``ends[r]``-th token; the logits
    also favour pad and bos, which greedy decoding must never pick."""

    def next_logits(tokens: torch.Tensor) -> torch.Tensor:
        position = tokens.shape[1]  # the token to choose is the position-th after <bos>
        logits = torch.zeros(tokens.shape[0], VOCAB)
        logits[:, PAD] = logits[:, BOS] = 10.0
        for row, end in enumerate(ends):
            logits[row, EOS if position == end else 3 + (position - 1) % 4] = 5.0
        return logits

    return next_logits


def _loop(ends: list[int], limit: int) -> torch.Tensor:
    """The greedy ids written out by hand: each row's tokens, ``<eos>``, then padding to the longest."""
    rows = []
    for end in ends:
        row = [BOS] + [3 + (p - 1) % 4 for p in range(1, min(end, limit + 1))]
        if end <= limit:
            row.append(EOS)
        rows.append(row)
    width = max(len(row) for row in rows)
    return torch.tensor([row + [PAD] * (width - len(row)) for row in rows])


@pytest.mark.parametrize("check_every", [1, 2, 3, 8, 50])
@pytest.mark.parametrize("ends, limit", [([3, 5, 4], 10), ([1, 1], 6), ([4, 9], 6), ([2, 6], 6)])
def test_the_ids_do_not_depend_on_how_often_the_end_is_read(check_every, ends, limit):
    ids = greedy_decode(_scripted(ends), len(ends), limit, bos_id=BOS, eos_id=EOS, pad_id=PAD,
                        device=torch.device("cpu"), check_every=check_every)
    torch.testing.assert_close(ids, _loop(ends, limit), rtol=0, atol=0)


@pytest.mark.parametrize("check_every", [0, -1, 2.0])
def test_check_every_must_be_a_positive_integer(check_every):
    """0 failed with ZeroDivisionError, and -1 read every token in silence."""
    with pytest.raises(ValueError, match="check_every"):
        greedy_decode(_scripted([2]), 1, 4, bos_id=BOS, eos_id=EOS, pad_id=PAD, device=torch.device("cpu"),
                      check_every=check_every)


def test_the_default_reads_every_token_on_a_cpu():
    """On a CPU a read is free and a token decoded after the end is wasted: no token past it."""
    calls = []
    script = _scripted([2, 2])

    def counted(tokens):
        calls.append(tokens.shape[1])
        return script(tokens)

    greedy_decode(counted, 2, 20, bos_id=BOS, eos_id=EOS, pad_id=PAD, device=torch.device("cpu"))
    assert calls == [1, 2]
