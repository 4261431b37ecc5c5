"""Gaps a mutation review of ``models/transformer_backbone.py`` found: ``check_token_ids`` must
refuse empty ids and count the positions a key/value cache already holds against ``max_len``."""

from __future__ import annotations

import pytest
import torch

from torchvote.models.transformer_backbone import check_token_ids


def test_cached_positions_count_against_the_length_limit():
    """With ``cached`` positions held, only ``max_length - cached`` new tokens fit: one more is a
    ValueError naming the argument, exactly that many pass."""
    fits = torch.zeros(2, 3, dtype=torch.long)
    check_token_ids(fits, "tokens", 5, cached=2)  # 3 + 2 = 5: fits
    too_long = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"tokens has 4 tokens, more than max_len - 2 cached=3"):
        check_token_ids(too_long, "tokens", 5, cached=2)
    check_token_ids(too_long, "tokens", 5)  # without a cache, 4 <= 5 fits


@pytest.mark.parametrize("shape", [(2, 0), (0, 3)])
def test_no_sequence_or_no_token_is_refused(shape):
    """A ``(b, 0)`` or ``(0, t)`` id tensor is refused by name (documented ValueError)."""
    with pytest.raises(ValueError, match="at least one sequence of at least one token"):
        check_token_ids(torch.zeros(shape, dtype=torch.long), "tokens", 5)
