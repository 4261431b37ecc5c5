"""Word-piece tokenisation from a Hugging Face ``tokenizer.json`` through the ``tokenizers`` package.

The file's own truncation and padding settings are replaced: inputs are truncated to the model's
limit with a warning (never silently), and a batch is padded to its longest sentence.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from torchvote.validation import as_path, caller_stacklevel, check_positive_int

__all__ = ["TokenBatch", "WordPieceTokenizer", "check_sentences"]


@dataclass
class TokenBatch:
    """A padded batch.

    Attributes:
        input_ids: ``(b, L)`` int64.
        token_type_ids: ``(b, L)`` int64.
        key_mask: ``(b, L)`` bool, True for a real token.
        tokens: word pieces per sentence, unpadded.
        truncated: per sentence, True if it was cut to ``max_length``.
    """

    input_ids: Tensor
    token_type_ids: Tensor
    key_mask: Tensor
    tokens: list[list[str]]
    truncated: list[bool]


def check_sentences(sentences: str | Sequence[str]) -> list[str]:
    """Validate user sentences.

    Args:
        sentences: a string or a non-empty sequence of strings.

    Returns:
        The sentences as a list.

    Raises:
        TypeError: ``sentences`` or one of them is not a string (``bytes`` included: decode them).
        ValueError: no sentences, or a sentence that is empty or only whitespace (named by index).
    """
    if isinstance(sentences, str):
        sentences = [sentences]
    if isinstance(sentences, (bytes, bytearray)):
        raise TypeError(
            f"sentences must be a string or a list of strings, got {type(sentences).__name__}; "
            "decode it first (e.g. sentences.decode('utf-8'))"
        )
    if not isinstance(sentences, Sequence):
        raise TypeError(f"sentences must be a string or a list of strings, got {type(sentences).__name__}")
    sentences = list(sentences)
    if not sentences:
        raise ValueError("sentences must hold at least one sentence, got an empty list")
    for index, sentence in enumerate(sentences):
        if not isinstance(sentence, str):
            raise TypeError(f"sentences[{index}] must be a string, got {type(sentence).__name__}")
        if not sentence.strip():
            raise ValueError(f"sentences[{index}] is empty: {sentence!r}; give at least one word")
    return sentences


class WordPieceTokenizer:
    """Turns sentences into a padded :class:`TokenBatch`.

    Args:
        path: a ``tokenizer.json`` file.
        max_length: the longest input in tokens, ``[CLS]`` and ``[SEP]`` included.
        pad_id: id used for padding.

    Raises:
        TypeError: ``path`` neither a ``str`` nor an ``os.PathLike`` (``''`` is a ValueError).
        ModuleNotFoundError: ``tokenizers`` is not installed (names the extra).
        FileNotFoundError: ``path`` is not a file.
        ValueError: ``max_length`` not an integer of at least 3, ``pad_id`` not an integer of
            at least 0, or a file that ``tokenizers`` cannot read (named).
    """

    def __init__(self, path: str | Path, *, max_length: int, pad_id: int = 0) -> None:
        try:
            from tokenizers import Tokenizer
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(
                'the pretrained encoder needs the "tokenizers" package: pip install "torchvote[pretrained]"',
                name="tokenizers",
            ) from error
        self.max_length = check_positive_int(max_length, "max_length", minimum=3)
        self.pad_id = check_positive_int(pad_id, "pad_id", minimum=0)
        path = as_path(path, "path")
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception for every parse error
            raise ValueError(f"{path} is not a tokenizer.json that tokenizers can read: {error}") from error
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length=max_length)

    def __call__(self, sentences: str | Sequence[str]) -> TokenBatch:
        """Tokenise, truncate (with a warning) and pad.

        Args:
            sentences: one sentence or a list.

        Returns:
            A :class:`TokenBatch`.

        Raises:
            TypeError, ValueError: as :func:`check_sentences`; ValueError too for a sentence with
                no word piece at all (only characters the tokenizer drops: zero-width spaces,
                control characters), which every such sentence would share one embedding of.
        """
        sentences = check_sentences(sentences)
        encodings = self._tokenizer.encode_batch(sentences)
        for index, encoding in enumerate(encodings):
            if sum(encoding.special_tokens_mask) == len(encoding.ids):  # [CLS] [SEP] only
                raise ValueError(
                    f"sentences[{index}] has no word piece: {sentences[index]!r} holds only "
                    "characters the tokenizer drops (zero-width spaces, control characters)"
                )
        truncated = [bool(encoding.overflowing) for encoding in encodings]
        for index, cut in enumerate(truncated):
            if cut:
                warnings.warn(
                    f"sentence {index + 1} = sentences[{index}] is longer than the model's limit of "
                    f"{self.max_length} tokens; "
                    f"it was truncated to its first {self.max_length} tokens",
                    UserWarning,
                    stacklevel=caller_stacklevel(),
                )
        length = max(len(encoding.ids) for encoding in encodings)
        batch = len(encodings)
        input_ids = torch.full((batch, length), self.pad_id, dtype=torch.long)  # (b, L)
        token_type_ids = torch.zeros((batch, length), dtype=torch.long)  # (b, L)
        key_mask = torch.zeros((batch, length), dtype=torch.bool)  # (b, L)
        for row, encoding in enumerate(encodings):
            count = len(encoding.ids)
            input_ids[row, :count] = torch.tensor(encoding.ids, dtype=torch.long)
            token_type_ids[row, :count] = torch.tensor(encoding.type_ids, dtype=torch.long)
            key_mask[row, :count] = True
        tokens = [list(encoding.tokens) for encoding in encodings]
        return TokenBatch(input_ids, token_type_ids, key_mask, tokens, truncated)
