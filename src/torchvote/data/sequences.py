"""Generated algorithmic sequence tasks: copy, reverse, sort and multi-digit addition.

These are the standard small problems for attention and sequence-to-sequence models (copy and
reverse: Graves et al. 2014, "Neural Turing Machines"; sort: Vinyals et al. 2015, "Pointer
Networks"; addition: Zaremba and Sutskever 2014, "Learning to Execute"). Everything is drawn
from a private generator, so a seed fixes the data set exactly.

One small vocabulary serves all tasks (:data:`SEQ_SYMBOLS`)::

    0 <pad>   1 <bos>   2 <eos>   3..12 digits 0..9   13 +   14 =

Layout of every example (then ``<pad>`` up to a fixed width, so shapes depend only on
``max_len``)::

    src: x_1 ... x_n <eos>                 copy / reverse / sort, n in [min_len, max_len]
    src: a_1 ... a_p + b_1 ... b_q = <eos> addition, p and q in [min_len, max_len] (digits)
    tgt: <bos> y_1 ... y_m <eos>

A decoder is fed ``tgt[:, :-1]`` and trained to predict ``tgt[:, 1:]``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Literal, overload

import torch
from torch import Tensor

from torchvote.data.transforms import _check_int, _check_seed

__all__ = [
    "BOS",
    "EOS",
    "EQUALS",
    "PAD",
    "PLUS",
    "SEQ_SYMBOLS",
    "SEQUENCE_TASKS",
    "addition_task",
    "copy_task",
    "decode_sequence",
    "digit_token",
    "make_sequence_task",
    "reverse_task",
    "sort_task",
]

SEQ_SYMBOLS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", *"0123456789", "+", "=")
PAD, BOS, EOS = 0, 1, 2
_DIGIT0 = 3
PLUS, EQUALS = 13, 14
SEQUENCE_TASKS: tuple[str, ...] = ("copy", "reverse", "sort", "addition")
_MAX_ADDITION_DIGITS = 18  # sums stay exact in int64

Task = Literal["copy", "reverse", "sort", "addition"]


@overload
def digit_token(digits: Tensor) -> Tensor: ...
@overload
def digit_token(digits: int) -> int: ...
def digit_token(digits: Tensor | int) -> Tensor | int:
    """Map digit values 0..9 to their token ids (a tensor to a tensor, an int to an int)."""
    return digits + _DIGIT0


def decode_sequence(ids: Tensor | Sequence[int], *, keep_special: bool = False) -> str:
    """Render one sequence of ids as text, e.g. ``"12+34="``.

    Args:
        ids: 1-D ids.
        keep_special: Also show ``<pad>``, ``<bos>`` and ``<eos>``.

    Returns:
        The symbols joined without separators.

    Raises:
        ValueError: If ``ids`` is not one-dimensional or holds a value that is not an id of
            :data:`SEQ_SYMBOLS` (an int in ``[0, len(SEQ_SYMBOLS))``).
    """
    if isinstance(ids, Tensor) and ids.ndim != 1:
        raise ValueError(f"ids: expected one sequence (a 1-D tensor), got shape {tuple(ids.shape)}")
    values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    bad = [
        i
        for i in values
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < len(SEQ_SYMBOLS)
    ]
    if bad:
        raise ValueError(f"ids: expected ids in [0, {len(SEQ_SYMBOLS)}), got {bad[:5]}")
    return "".join(SEQ_SYMBOLS[i] for i in values if keep_special or i not in (PAD, BOS, EOS))


def _reverse_prefix(values: Tensor, lengths: Tensor) -> Tensor:
    """Reverse the first ``lengths[i]`` entries of each row; later entries are unspecified."""
    position = torch.arange(values.shape[1])
    index = (lengths[:, None] - 1 - position).clamp(min=0)
    return values.gather(1, index)


def _pack(segments: Sequence[tuple[Tensor, Tensor]], width: int) -> Tensor:
    """Concatenate variable-length segments row by row and pad with ``PAD``.

    Args:
        segments: ``(tokens (N, W_k), lengths (N,))`` pairs; row i of segment k contributes
            ``tokens[i, :lengths[i]]``.
        width: Output width, at least the longest row.

    Returns:
        int64 (N, width).
    """
    num = segments[0][0].shape[0]
    out = torch.full((num, width), PAD, dtype=torch.long)
    offset = torch.zeros(num, dtype=torch.long)
    rows = torch.arange(num)[:, None]
    for tokens, lengths in segments:  # a handful of segments, never a loop over examples
        position = torch.arange(tokens.shape[1])
        valid = position[None, :] < lengths[:, None]  # (N, W_k)
        target = offset[:, None] + position  # (N, W_k)
        out[rows.expand_as(target)[valid], target[valid]] = tokens[valid]
        offset = offset + lengths
    assert num == 0 or int(offset.max()) <= width, "width too small for the packed rows"
    return out


def _ones(num: int, token: int) -> tuple[Tensor, Tensor]:
    return torch.full((num, 1), token), torch.ones(num, dtype=torch.long)


def _digit_strings(
    num: int, min_len: int, max_len: int, generator: torch.Generator, *, numbers: bool
) -> tuple[Tensor, Tensor]:
    """Random digit strings (N, max_len) and lengths (N,); ``numbers`` bars leading zeros."""
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=generator)
    digits = torch.randint(0, 10, (num, max_len), generator=generator)
    if numbers:  # a multi-digit number starts with 1..9
        leading = torch.randint(1, 10, (num,), generator=generator)
        digits[:, 0] = torch.where(lengths > 1, leading, digits[:, 0])
    position = torch.arange(max_len)
    return digits.masked_fill(position >= lengths[:, None], 0), lengths


def _to_int(digits: Tensor, lengths: Tensor) -> Tensor:
    """Value of most-significant-first digit strings."""
    max_len = digits.shape[1]
    power = lengths[:, None] - 1 - torch.arange(max_len)  # (N, L); negative past the end
    weights = torch.where(power >= 0, 10 ** power.clamp(min=0), 0)
    return (digits * weights).sum(dim=1)


def _from_int(values: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Most-significant-first digits (N, width) and lengths (N,) of non-negative ints."""
    powers = 10 ** torch.arange(width)  # (width,)
    lsb_first = (values[:, None] // powers) % 10
    lengths = (values[:, None] >= powers).sum(dim=1).clamp(min=1)
    return _reverse_prefix(lsb_first, lengths), lengths


def make_sequence_task(
    task: Task,
    *,
    num_samples: int,
    min_len: int = 1,
    max_len: int = 8,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """Generate one algorithmic task as padded source/target id tensors.

    Args:
        task: ``"copy"`` (y = x), ``"reverse"`` (y = x reversed), ``"sort"`` (y = x in
            ascending order) or ``"addition"`` (y = the decimal digits of a + b).
        num_samples: Number of examples N.
        min_len: Shortest sequence (for addition: fewest digits of an operand), >= 1.
        max_len: Longest sequence (for addition: most digits, at most 18), >= min_len.
        seed: Seed of the private generator; equal seeds give equal tensors.

    Returns:
        ``(src, tgt)`` int64 tensors: for copy/reverse/sort of shapes (N, max_len + 1) and
        (N, max_len + 2); for addition (N, 2 * max_len + 3) and (N, max_len + 3). Layout as in
        the module docstring.

    Raises:
        ValueError: If ``task`` is unknown, a length is out of range, or ``seed`` is not an int
            in ``[0, 2**64)``.
        TypeError: If a count or length is not an int.
    """
    if task not in SEQUENCE_TASKS:
        raise ValueError(f"task: expected one of {SEQUENCE_TASKS}, got {task!r}")
    _check_int(num_samples, "num_samples")
    _check_int(min_len, "min_len", minimum=1)
    _check_int(max_len, "max_len", minimum=1)
    if max_len < min_len:
        raise ValueError(f"max_len: expected an int >= min_len={min_len}, got {max_len}")
    _check_seed(seed)
    if task == "addition" and max_len > _MAX_ADDITION_DIGITS:
        raise ValueError(f"max_len: addition supports at most {_MAX_ADDITION_DIGITS} digits")
    generator = torch.Generator().manual_seed(seed)
    eos, bos = _ones(num_samples, EOS), _ones(num_samples, BOS)

    if task == "addition":
        a, a_len = _digit_strings(num_samples, min_len, max_len, generator, numbers=True)
        b, b_len = _digit_strings(num_samples, min_len, max_len, generator, numbers=True)
        total, total_len = _from_int(_to_int(a, a_len) + _to_int(b, b_len), max_len + 1)
        plus, equals = _ones(num_samples, PLUS), _ones(num_samples, EQUALS)
        src = _pack(
            [(digit_token(a), a_len), plus, (digit_token(b), b_len), equals, eos],
            2 * max_len + 3,
        )
        tgt = _pack([bos, (digit_token(total), total_len), eos], max_len + 3)
        return src, tgt

    x, lengths = _digit_strings(num_samples, min_len, max_len, generator, numbers=False)
    if task == "copy":
        y = x
    elif task == "reverse":
        y = _reverse_prefix(x, lengths)
    else:  # sort: push the padding past every digit, sort, keep the prefix
        padding = torch.arange(max_len) >= lengths[:, None]
        y = x.masked_fill(padding, 10).sort(dim=1).values
    src = _pack([(digit_token(x), lengths), eos], max_len + 1)
    tgt = _pack([bos, (digit_token(y), lengths), eos], max_len + 2)
    return src, tgt


def copy_task(
    num_samples: int, *, min_len: int = 1, max_len: int = 8, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``make_sequence_task("copy", ...)``: the target repeats the source.

    Args:
        num_samples: Number of examples N.
        min_len: Shortest sequence, >= 1.
        max_len: Longest sequence, >= min_len.
        seed: Seed of the private generator; equal seeds give equal tensors.

    Returns:
        ``(src, tgt)`` int64 tensors of shapes (N, max_len + 1) and (N, max_len + 2).

    Raises:
        ValueError: If a length is out of range or ``seed`` is not an int in ``[0, 2**64)``.
        TypeError: If ``num_samples`` or a length is not an int.
    """
    return make_sequence_task("copy", num_samples=num_samples, min_len=min_len, max_len=max_len, seed=seed)


def reverse_task(
    num_samples: int, *, min_len: int = 1, max_len: int = 8, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``make_sequence_task("reverse", ...)``: the target is the source reversed.

    Args:
        num_samples: Number of examples N.
        min_len: Shortest sequence, >= 1.
        max_len: Longest sequence, >= min_len.
        seed: Seed of the private generator; equal seeds give equal tensors.

    Returns:
        ``(src, tgt)`` int64 tensors of shapes (N, max_len + 1) and (N, max_len + 2).

    Raises:
        ValueError: If a length is out of range or ``seed`` is not an int in ``[0, 2**64)``.
        TypeError: If ``num_samples`` or a length is not an int.
    """
    return make_sequence_task("reverse", num_samples=num_samples, min_len=min_len, max_len=max_len, seed=seed)


def sort_task(
    num_samples: int, *, min_len: int = 1, max_len: int = 8, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``make_sequence_task("sort", ...)``: the target is the source in ascending order.

    Args:
        num_samples: Number of examples N.
        min_len: Shortest sequence, >= 1.
        max_len: Longest sequence, >= min_len.
        seed: Seed of the private generator; equal seeds give equal tensors.

    Returns:
        ``(src, tgt)`` int64 tensors of shapes (N, max_len + 1) and (N, max_len + 2).

    Raises:
        ValueError: If a length is out of range or ``seed`` is not an int in ``[0, 2**64)``.
        TypeError: If ``num_samples`` or a length is not an int.
    """
    return make_sequence_task("sort", num_samples=num_samples, min_len=min_len, max_len=max_len, seed=seed)


def addition_task(
    num_samples: int, *, min_len: int = 1, max_len: int = 8, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``make_sequence_task("addition", ...)``: ``a+b=`` maps to the digits of ``a + b``.

    Args:
        num_samples: Number of examples N.
        min_len: Shortest sequence (fewest digits of an operand), >= 1.
        max_len: Longest sequence (most digits of an operand, at most 18), >= min_len.
        seed: Seed of the private generator; equal seeds give equal tensors.

    Returns:
        ``(src, tgt)`` int64 tensors of shapes (N, 2 * max_len + 3) and (N, max_len + 3).

    Raises:
        ValueError: If a length is out of range (``max_len`` over 18 included) or ``seed`` is not
            an int in ``[0, 2**64)``.
        TypeError: If ``num_samples`` or a length is not an int.
    """
    return make_sequence_task(
        "addition", num_samples=num_samples, min_len=min_len, max_len=max_len, seed=seed
    )
