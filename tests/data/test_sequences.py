from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchvote.data import (
    BOS,
    EOS,
    PAD,
    SEQ_SYMBOLS,
    SEQUENCE_TASKS,
    decode_sequence,
    make_sequence_task,
    reverse_task,
)


def body(row: torch.Tensor, *, starts_with_bos: bool) -> list[int]:
    """Check the row layout (optional BOS, content, EOS, PAD...) and return the content ids."""
    ids = row.tolist()
    if starts_with_bos:
        assert ids[0] == BOS
        ids = ids[1:]
    end = ids.index(EOS)
    assert all(i == PAD for i in ids[end + 1 :])
    content = ids[:end]
    assert BOS not in content and PAD not in content and EOS not in content
    return content


def text(ids: list[int]) -> str:
    return "".join(SEQ_SYMBOLS[i] for i in ids)


lengths = st.integers(1, 9).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, 12)))


@settings(max_examples=30, deadline=None)
@given(task=st.sampled_from(["copy", "reverse", "sort"]), bounds=lengths, seed=st.integers(0, 2**31))
def test_digit_string_tasks(task: str, bounds: tuple[int, int], seed: int) -> None:
    min_len, max_len = bounds
    src, tgt = make_sequence_task(task, num_samples=64, min_len=min_len, max_len=max_len, seed=seed)
    assert src.shape == (64, max_len + 1) and tgt.shape == (64, max_len + 2)
    assert src.dtype == tgt.dtype == torch.int64
    for source_row, target_row in zip(src, tgt, strict=True):
        x = text(body(source_row, starts_with_bos=False))
        y = text(body(target_row, starts_with_bos=True))
        assert x.isdigit() and min_len <= len(x) <= max_len
        expected = {"copy": x, "reverse": x[::-1], "sort": "".join(sorted(x))}[task]
        assert y == expected


@settings(max_examples=30, deadline=None)
@given(bounds=lengths, seed=st.integers(0, 2**31))
def test_addition_is_correct_arithmetic(bounds: tuple[int, int], seed: int) -> None:
    min_len, max_len = bounds
    src, tgt = make_sequence_task("addition", num_samples=64, min_len=min_len, max_len=max_len, seed=seed)
    assert src.shape == (64, 2 * max_len + 3) and tgt.shape == (64, max_len + 3)
    for source_row, target_row in zip(src, tgt, strict=True):
        question = text(body(source_row, starts_with_bos=False))
        answer = text(body(target_row, starts_with_bos=True))
        assert question.endswith("=") and question.count("+") == 1
        left, right = question[:-1].split("+")
        for operand in (left, right):
            assert min_len <= len(operand) <= max_len
            assert operand == str(int(operand))  # no leading zeros
        assert answer == str(int(left) + int(right))


def test_lengths_cover_the_range_and_seed_determines_data() -> None:
    src, _ = make_sequence_task("copy", num_samples=2000, min_len=2, max_len=6, seed=0)
    seen = ((src != PAD).sum(dim=1) - 1).unique().tolist()  # minus the EOS
    assert seen == [2, 3, 4, 5, 6]
    first = make_sequence_task("sort", num_samples=10, seed=5)
    again = make_sequence_task("sort", num_samples=10, seed=5)
    other = make_sequence_task("sort", num_samples=10, seed=6)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])
    assert torch.equal(reverse_task(10, seed=5)[0], first[0])  # same inputs, other target


def test_addition_handles_carries_into_a_new_digit() -> None:
    src, tgt = make_sequence_task("addition", num_samples=500, min_len=1, max_len=1, seed=0)
    answers = [decode_sequence(row) for row in tgt]
    assert any(len(a) == 2 for a in answers)  # e.g. 9+7=16
    big_src, big_tgt = make_sequence_task("addition", num_samples=50, min_len=18, max_len=18)
    for question, answer in zip(big_src, big_tgt, strict=True):
        left, right = decode_sequence(question)[:-1].split("+")
        assert decode_sequence(answer) == str(int(left) + int(right))


def test_decode_sequence_special_tokens() -> None:
    ids = [BOS, 3 + 1, 13, 3 + 2, 14, EOS, PAD]
    assert decode_sequence(ids) == "1+2="
    assert decode_sequence(torch.tensor(ids), keep_special=True) == "<bos>1+2=<eos><pad>"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"task": "multiply"}, ValueError, "task"),
        ({"min_len": 0}, ValueError, "min_len"),
        ({"min_len": 5, "max_len": 4}, ValueError, "max_len"),
        ({"task": "addition", "max_len": 19}, ValueError, "max_len"),
        ({"num_samples": -1}, ValueError, "num_samples"),
        ({"num_samples": 1.5}, TypeError, "num_samples"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    arguments = {"task": "copy", "num_samples": 4} | kwargs
    with pytest.raises(error, match=match):
        make_sequence_task(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize("task", SEQUENCE_TASKS)
def test_empty_sets(task: str) -> None:
    src, tgt = make_sequence_task(task, num_samples=0)
    assert src.shape[0] == tgt.shape[0] == 0


@pytest.mark.parametrize("seed", [1.5, None, "3", -1, 2**64])
def test_seed_must_be_an_int_that_seeds_a_generator(seed: object) -> None:
    with pytest.raises(ValueError, match="seed"):
        make_sequence_task("copy", num_samples=2, seed=seed)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        reverse_task(2, seed=seed)  # type: ignore[arg-type]


def test_the_largest_seed_a_generator_takes_is_accepted() -> None:
    src, _ = make_sequence_task("copy", num_samples=3, seed=2**64 - 1)
    again, _ = make_sequence_task("copy", num_samples=3, seed=2**64 - 1)
    assert torch.equal(src, again)


@pytest.mark.parametrize(
    "ids",
    [
        [-1],  # would wrap round to the last symbol
        [len(SEQ_SYMBOLS)],
        [BOS, 3, 2.0],
        torch.zeros(2, 3, dtype=torch.long),  # a batch, not one sequence
    ],
)
def test_decode_sequence_refuses_what_is_not_one_sequence_of_ids(ids: object) -> None:
    with pytest.raises(ValueError, match="ids"):
        decode_sequence(ids)  # type: ignore[arg-type]


def test_min_len_above_max_len_names_both() -> None:
    with pytest.raises(ValueError, match="max_len: expected an int >= min_len=5, got 3"):
        make_sequence_task("copy", num_samples=2, min_len=5, max_len=3)
    with pytest.raises(ValueError, match="max_len"):
        reverse_task(2, min_len=1, max_len=0)


@pytest.mark.parametrize("task", SEQUENCE_TASKS)
def test_the_seed_alone_fixes_the_data(task: str) -> None:
    torch.manual_seed(1)
    first = make_sequence_task(task, num_samples=50, seed=3)  # type: ignore[arg-type]
    state = torch.get_rng_state()
    torch.manual_seed(12345)
    torch.rand(7)
    again = make_sequence_task(task, num_samples=50, seed=3)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    torch.manual_seed(1)
    make_sequence_task(task, num_samples=50, seed=3)  # type: ignore[arg-type]
    assert torch.equal(torch.get_rng_state(), state)  # the global generator was not touched
