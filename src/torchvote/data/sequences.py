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

Held-out splits: ``split="train"`` and ``split="test"`` draw from two disjoint parts of the task's
inputs, so no test source is ever a training source. Without it, a test set of short strings is
mostly memorised: 10,000 reversals of 1 to 8 digits contain every string of up to 3 digits, 3/8
of all test examples. The part a source belongs to is a hash of its tokens alone (not of the
seed, the padding or ``max_len``), a fraction ``test_fraction`` of all sources; each split keeps
the draws of its own part, so it follows the task's distribution restricted to that part. The
short lengths then have few test sources (of the 10 one-digit strings, about one) and appear in
the test set in proportion.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Literal, overload

import torch
from torch import Tensor

from torchvote.data.transforms import _check_int
from torchvote.validation import check_choice, check_in_range, check_integer_tensor, check_seed

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
    "encode_source",
    "in_test_part",
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
Split = Literal["train", "test"]
_SPLITS: tuple[str, ...] = ("train", "test")
# The partition's hash: a polynomial in the tokens modulo a Mersenne prime (every product of two
# residues fits in int64), then an integer mixer so that near-equal strings fall independently.
_HASH_MODULUS = 2**31 - 1
_HASH_BASE = 48_271
_MIN_DRAWS = 1024  # a round of this many draws that keeps none: the split's part is (nearly) empty


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
        TypeError: If ``ids`` is a tensor that is not of integers.
    """
    if isinstance(ids, Tensor) and ids.ndim != 1:
        raise ValueError(f"ids: expected one sequence (a 1-D tensor), got shape {tuple(ids.shape)}")
    if isinstance(ids, Tensor):  # 3.0 was refused as an id out of range
        check_integer_tensor(ids, "ids", "a 1-D integer tensor of ids")
    values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    bad = [
        i
        for i in values
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < len(SEQ_SYMBOLS)
    ]
    if bad:
        raise ValueError(f"ids: expected ids in [0, {len(SEQ_SYMBOLS)}), got {bad[:5]}")
    return "".join(SEQ_SYMBOLS[i] for i in values if keep_special or i not in (PAD, BOS, EOS))


def encode_source(text: str) -> Tensor:
    """The source ids of ``text`` as the tasks lay them out: its symbols, then ``<eos>``
    (``"12+34="`` -> ``4 5 13 6 7 14 2``); the inverse of :func:`decode_sequence` on a source.

    Args:
        text: digits, ``+`` and ``=`` (an addition's source is ``"12+34="``), at least one.

    Returns:
        ``(len(text) + 1,)`` int64 ids, unpadded.

    Raises:
        TypeError: ``text`` is not a string.
        ValueError: ``text`` is empty or holds another character (the first few are named).
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected a string of digits, '+' and '=', got {type(text).__name__}")
    ids = {symbol: index for index, symbol in enumerate(SEQ_SYMBOLS) if len(symbol) == 1}
    unknown = sorted({c for c in text if c not in ids})
    if unknown:
        raise ValueError(f"text: expected digits, '+' and '=' only, got {unknown[:5]!r}")
    if not text:
        raise ValueError("text: expected at least one symbol, got an empty string")
    return torch.tensor([*(ids[c] for c in text), EOS], dtype=torch.long)


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
    split: Split | None = None,
    test_fraction: float = 0.1,
) -> tuple[Tensor, Tensor]:
    """Generate one algorithmic task as padded source/target id tensors.

    Args:
        task: ``"copy"`` (y = x), ``"reverse"`` (y = x reversed), ``"sort"`` (y = x in
            ascending order) or ``"addition"`` (y = the decimal digits of a + b).
        num_samples: Number of examples N.
        min_len: Shortest sequence (for addition: fewest digits of an operand), >= 1.
        max_len: Longest sequence (for addition: most digits, at most 18), >= min_len.
        seed: Seed of the private generator; equal seeds give equal tensors.
        split: ``"train"`` or ``"test"``: only sources of that part of the task's inputs (the
            two never share a source; :func:`in_test_part` tells them apart); ``None``: any.
        test_fraction: Share of all sources in the test part, in (0, 1); both splits of one
            data set must use the same.

    Returns:
        ``(src, tgt)`` int64 tensors: for copy/reverse/sort of shapes (N, max_len + 1) and
        (N, max_len + 2); for addition (N, 2 * max_len + 3) and (N, max_len + 3). Layout as in
        the module docstring.

    Raises:
        ValueError: If ``task`` or ``split`` is unknown, a length is out of range, ``seed`` is not
            an int in ``[0, 2**64)``, ``test_fraction`` is not in (0, 1), or ``split``'s part holds
            (nearly) no source of these lengths (1-digit strings with a ``test_fraction`` of 0.01).
        TypeError: If a count or length is not an int.
    """
    if task not in SEQUENCE_TASKS:
        raise ValueError(f"task: expected one of {SEQUENCE_TASKS}, got {task!r}")
    _check_int(num_samples, "num_samples")
    _check_int(min_len, "min_len", minimum=1)
    _check_int(max_len, "max_len", minimum=1)
    if max_len < min_len:
        raise ValueError(f"max_len: expected an int >= min_len={min_len}, got {max_len}")
    seed = check_seed(seed)
    if task == "addition" and max_len > _MAX_ADDITION_DIGITS:
        raise ValueError(f"max_len: addition supports at most {_MAX_ADDITION_DIGITS} digits")
    if split is not None:
        check_choice(split, _SPLITS, "split")
    fraction = _check_test_fraction(test_fraction)
    generator = torch.Generator().manual_seed(seed)
    if split is None:
        return _draw(task, num_samples, min_len, max_len, generator)
    return _draw_held_out(task, num_samples, min_len, max_len, generator, split == "test", fraction)


def in_test_part(src: Tensor, test_fraction: float = 0.1) -> Tensor:
    """Which sources belong to the held-out (test) part of their task's inputs.

    The answer depends on the tokens before the first ``<pad>`` only, so a source is in the same
    part whatever the padding width, ``max_len`` or seed that drew it.

    Args:
        src: int64 (N, W) sources laid out as :func:`make_sequence_task` returns them.
        test_fraction: Share of all possible sources in the test part, in (0, 1).

    Returns:
        bool (N,): True where the source is in the test part.

    Raises:
        TypeError: If ``src`` is not an integer tensor.
        ValueError: If ``src`` is not 2-D or ``test_fraction`` is not in (0, 1).
    """
    check_integer_tensor(src, "src", "a 2-D integer tensor of token ids")
    if src.ndim != 2:
        raise ValueError(f"src must be a 2-D integer tensor of token ids, got shape {tuple(src.shape)}")
    fraction = _check_test_fraction(test_fraction)
    tokens = src.long()
    value = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)  # (N,)
    ended = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)  # (N,) past the first <pad>
    for column in tokens.T:  # a few dozen columns, never a loop over examples
        ended |= column == PAD
        value = torch.where(ended, value, (value * _HASH_BASE + column + 1) % _HASH_MODULUS)
    for _ in range(2):  # mix: xor-shift and multiply by an odd constant, 32 bits at a time
        value = ((value ^ (value >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    value = value ^ (value >> 16)
    return value < round(fraction * 2**32)


def _check_test_fraction(value: object) -> float:
    """``test_fraction`` as a float in the open interval (0, 1): each part holds some sources."""
    return check_in_range(value, "test_fraction", 0.0, 1.0, include_low=False, include_high=False)


def _draw_held_out(
    task: Task,
    num_samples: int,
    min_len: int,
    max_len: int,
    generator: torch.Generator,
    test: bool,
    fraction: float,
) -> tuple[Tensor, Tensor]:
    """Draw until ``num_samples`` examples of one part (test or train) are kept, in draw order."""
    share = fraction if test else 1.0 - fraction
    empty_src, empty_tgt = _draw(task, 0, min_len, max_len, generator)  # the shapes of N = 0
    sources: list[Tensor] = [empty_src]
    targets: list[Tensor] = [empty_tgt]
    kept = 0
    while kept < num_samples:
        draws = max(_MIN_DRAWS, int(1.2 * (num_samples - kept) / share))
        src, tgt = _draw(task, draws, min_len, max_len, generator)
        keep = in_test_part(src, fraction) == test  # (draws,)
        if not keep.any():
            part = "test" if test else "train"
            raise ValueError(
                f"split={part!r}: none of {draws} {task} examples with min_len={min_len}, max_len={max_len} "
                f"falls in the {part} part of test_fraction={fraction} (so few sources exist that this part "
                "is empty or nearly so); expected longer sequences or another test_fraction"
            )
        sources.append(src[keep])
        targets.append(tgt[keep])
        kept += int(keep.sum())
    return torch.cat(sources)[:num_samples], torch.cat(targets)[:num_samples]


def _draw(
    task: Task, num_samples: int, min_len: int, max_len: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """``num_samples`` examples of ``task`` from ``generator``, every part of the inputs."""
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


def _task_function(task: Task, summary: str, shapes: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """:func:`make_sequence_task` with ``task`` fixed, under its own name and docstring."""

    def generate(
        num_samples: int,
        *,
        min_len: int = 1,
        max_len: int = 8,
        seed: int = 0,
        split: Split | None = None,
        test_fraction: float = 0.1,
    ) -> tuple[Tensor, Tensor]:
        return make_sequence_task(
            task,
            num_samples=num_samples,
            min_len=min_len,
            max_len=max_len,
            seed=seed,
            split=split,
            test_fraction=test_fraction,
        )

    lengths = "most digits of an operand, at most 18" if task == "addition" else "longest sequence"
    generate.__name__ = generate.__qualname__ = f"{task}_task"
    generate.__doc__ = f"""``make_sequence_task("{task}", ...)``: {summary}

    Args:
        num_samples: Number of examples N.
        min_len: Shortest sequence{" (fewest digits of an operand)" if task == "addition" else ""}, >= 1.
        max_len: {lengths.capitalize()}, >= min_len.
        seed: Seed of the private generator; equal seeds give equal tensors.
        split: ``"train"`` / ``"test"``: that part of the inputs only; ``None``: any (as in
            :func:`make_sequence_task`).
        test_fraction: Share of all sources in the test part, in (0, 1).

    Returns:
        ``(src, tgt)`` int64 tensors of shapes {shapes}.

    Raises:
        ValueError: If a length is out of range, ``seed`` is not an int in ``[0, 2**64)``, or
            ``split`` / ``test_fraction`` is refused as by :func:`make_sequence_task`.
        TypeError: If ``num_samples`` or a length is not an int.
    """
    return generate


_DIGIT_SHAPES = "(N, max_len + 1) and (N, max_len + 2)"
copy_task = _task_function("copy", "the target repeats the source.", _DIGIT_SHAPES)
reverse_task = _task_function("reverse", "the target is the source reversed.", _DIGIT_SHAPES)
sort_task = _task_function("sort", "the target is the source in ascending order.", _DIGIT_SHAPES)
addition_task = _task_function(
    "addition", "``a+b=`` maps to the digits of ``a + b``.", "(N, 2 * max_len + 3) and (N, max_len + 3)"
)
