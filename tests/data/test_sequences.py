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
    encode_source,
    in_test_part,
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
    # float ids were reported as ids out of range ("expected ids in [0, 15), got [4.0, ...]")
    with pytest.raises(TypeError, match="ids must be a 1-D integer tensor of ids, got torch.float32"):
        decode_sequence(torch.tensor(ids, dtype=torch.float32))


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


@pytest.mark.parametrize("split", [None, "train", "test"])
@pytest.mark.parametrize("task", SEQUENCE_TASKS)
def test_empty_sets(task: str, split: str | None) -> None:
    src, tgt = make_sequence_task(task, num_samples=0, split=split)  # type: ignore[arg-type]
    full_src, full_tgt = make_sequence_task(task, num_samples=1)
    assert src.shape == (0, full_src.shape[1]) and tgt.shape == (0, full_tgt.shape[1])


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


# Held-out splits: disjoint parts of the task's inputs -------------------------------------------


def source_texts(src: torch.Tensor) -> list[str]:
    return [text(body(row, starts_with_bos=False)) for row in src]


@settings(max_examples=20, deadline=None)
@given(
    task=st.sampled_from(SEQUENCE_TASKS),
    bounds=st.integers(1, 4).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, 6))),
    seeds=st.tuples(st.integers(0, 2**31), st.integers(0, 2**31)),
    fraction=st.sampled_from([0.1, 0.25, 0.5]),
)
def test_train_and_test_splits_never_share_a_source(
    task: str, bounds: tuple[int, int], seeds: tuple[int, int], fraction: float
) -> None:
    """Whatever the seeds, a test source is never a training source, every example is still a
    right answer of the task, and a split keeps only its own part's sources."""
    min_len, max_len = bounds
    options = {"num_samples": 300, "min_len": min_len, "max_len": max_len, "test_fraction": fraction}
    train = make_sequence_task(task, seed=seeds[0], split="train", **options)
    test = make_sequence_task(task, seed=seeds[1], split="test", **options)
    assert train[0].shape == (300, train[0].shape[1]) and test[0].shape == train[0].shape
    assert not set(source_texts(train[0])) & set(source_texts(test[0]))
    assert not in_test_part(train[0], fraction).any() and in_test_part(test[0], fraction).all()
    reference = make_sequence_task(task, num_samples=1, min_len=min_len, max_len=max_len)
    assert train[0].shape[1] == reference[0].shape[1] and test[1].shape[1] == reference[1].shape[1]
    for source_row, target_row in zip(test[0][:40], test[1][:40], strict=True):
        x = text(body(source_row, starts_with_bos=False))
        y = text(body(target_row, starts_with_bos=True))
        if task == "addition":
            left, right = x[:-1].split("+")
            assert y == str(int(left) + int(right))
        else:
            assert y == {"copy": x, "reverse": x[::-1], "sort": "".join(sorted(x))}[task]


@pytest.mark.parametrize("fraction", [0.1, 0.3])
def test_the_test_part_holds_its_fraction_of_long_sources(fraction: float) -> None:
    """6-digit strings (10**6 of them) fall in the test part at the rate asked, within 5 sigma."""
    src, _ = make_sequence_task("copy", num_samples=100_000, min_len=6, max_len=6, seed=0)
    share = in_test_part(src, fraction).double().mean().item()
    sigma = (fraction * (1 - fraction) / len(src)) ** 0.5
    assert abs(share - fraction) < 5 * sigma


def test_the_part_depends_on_the_tokens_only() -> None:
    """The same strings drawn with another max_len (so another padding width) or seed fall in the
    same part: otherwise a split with other options could meet the training sources again."""
    short, _ = make_sequence_task("reverse", num_samples=500, min_len=3, max_len=3, seed=4)
    wide = torch.cat([short, torch.full((500, 6), PAD)], dim=1)
    assert torch.equal(in_test_part(short), in_test_part(wide))
    assert torch.equal(in_test_part(short.int()), in_test_part(short))
    # another seed's copy of the same strings, found by their text
    other, _ = make_sequence_task("reverse", num_samples=5000, min_len=3, max_len=3, seed=9)
    membership = dict(zip(source_texts(short), in_test_part(short).tolist(), strict=True))
    for key, member in zip(source_texts(other), in_test_part(other).tolist(), strict=True):
        assert membership.get(key, member) == member


def test_short_strings_appear_in_the_test_set_in_proportion() -> None:
    """Of the 10 one-digit strings only the test part's few are tested, as often as a length's
    share says (1/8 of the draws), never the 10 a model saw in training."""
    src, _ = make_sequence_task("reverse", num_samples=4000, seed=1, split="test")
    lengths = (src != PAD).sum(dim=1) - 1
    one_digit = set(source_texts(src[lengths == 1]))
    assert 0 < len(one_digit) <= 3
    assert abs((lengths == 1).double().mean().item() - 1 / 8) < 0.03
    train, _ = make_sequence_task("reverse", num_samples=4000, seed=0, split="train")
    assert not one_digit & set(source_texts(train))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split": "valid"}, "split"),
        ({"split": "test", "test_fraction": 0.0}, "test_fraction"),
        ({"split": "test", "test_fraction": 1.0}, "test_fraction"),
        ({"test_fraction": float("nan")}, "test_fraction"),
        ({"test_fraction": True}, "test_fraction"),
        # 10 one-digit strings, none of them in a test part of a millionth
        ({"split": "test", "min_len": 1, "max_len": 1, "test_fraction": 1e-6}, "split='test'.*max_len=1"),
    ],
)
def test_bad_split_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_sequence_task("copy", num_samples=4, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("src", "error"),
    [
        (torch.zeros(3, dtype=torch.long), ValueError),
        (torch.zeros(2, 3), TypeError),  # a value of the wrong type: TypeError, as elsewhere
        (torch.zeros(2, 3, dtype=torch.bool), TypeError),
        ([[1, 2]], TypeError),
    ],
)
def test_in_test_part_refuses_what_is_not_a_batch_of_sources(src: object, error: type) -> None:
    with pytest.raises(error, match="src must be a 2-D integer tensor of token ids, got"):
        in_test_part(src)  # type: ignore[arg-type]


def test_in_test_part_runs_where_the_sources_are(device: torch.device) -> None:
    """Its running hash was made on the CPU whatever the sources' device (a CUDA batch failed)."""
    src, _ = make_sequence_task("reverse", num_samples=64, seed=0)
    torch.testing.assert_close(in_test_part(src.to(device)).cpu(), in_test_part(src), rtol=0, atol=0)


def test_encode_source_lays_a_source_out_as_the_tasks_do():
    # "12+34=": digits 1 2 -> 4 5, '+' 13, digits 3 4 -> 6 7, '=' 14, then <eos>
    assert encode_source("12+34=").tolist() == [4, 5, 13, 6, 7, 14, EOS]
    src, _ = make_sequence_task("addition", num_samples=20, min_len=1, max_len=3, seed=4)
    for row in src:  # every generated source, rendered and encoded back, is the row itself
        ids = row[row != PAD]
        assert torch.equal(encode_source(decode_sequence(ids)), ids)


@given(text=st.text(alphabet="0123456789+=", min_size=1, max_size=30))
@settings(max_examples=50)
def test_encode_source_inverts_decode_sequence(text):
    ids = encode_source(text)
    assert ids.dtype == torch.long and ids[-1] == EOS
    assert decode_sequence(ids) == text


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [("", ValueError, "at least one symbol"), ("12a", ValueError, r"got \['a'\]"),
     ("<eos>", ValueError, "digits, '\\+' and '=' only"), (12, TypeError, "got int")],
)
def test_encode_source_refuses_what_is_not_a_source(text, error, match):
    with pytest.raises(error, match=match):
        encode_source(text)

