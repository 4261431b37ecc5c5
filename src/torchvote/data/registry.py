"""A name -> data set table: one place to list and build every data set torchvote knows.

``get_dataset(name, split, **kwargs)`` returns what the underlying function returns for that
split (see each entry's description); keyword arguments go to that function. Train and test
splits of generated sets use different default seeds (0 and 1), the sequence tasks' splits draw
from disjoint parts of their inputs (no test source is a training source), and the image sets are
built from the MNIST split of the same name, except the test split of ``affnist``: the real affNIST
files (:mod:`torchvote.data.affnist`; ``affnist-style`` is the generated stand-in).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchvote.data.affnist import load_affnist
from torchvote.data.affnist_style import make_affnist_style, pad_and_translate_train
from torchvote.data.digits import load_small_digits
from torchvote.data.mnist import load_mnist, validate_split
from torchvote.data.multimnist import MultiMNISTSource, make_multimnist
from torchvote.data.sequences import SEQUENCE_TASKS, make_sequence_task
from torchvote.data.text import CharVocab, load_shakespeare, train_val_split
from torchvote.validation import check_seed

__all__ = [
    "DatasetEntry",
    "dataset_options",
    "dataset_reads_files",
    "dataset_splits",
    "get_dataset",
    "list_datasets",
]

_DEFAULT_SEED = {"train": 0, "test": 1}


def _keywords(function: Callable[..., Any], *, drop: tuple[str, ...] = ()) -> frozenset[str]:
    """The names ``function`` takes as keyword arguments, less ``drop`` (those the registry
    passes itself): read from its signature, so the registry's option lists follow the code."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds}
    return frozenset(names - set(drop))


_MNIST_OPTIONS = _keywords(load_mnist, drop=("split",))  # what the MNIST-derived sets pass on


@dataclass(frozen=True)
class DatasetEntry:
    """One registered data set.

    Attributes:
        name: Registry name.
        description: One line shown by :func:`list_datasets`.
        splits: Allowed split names.
        build: ``build(split, **kwargs)`` returning the data.
        reads_files: The data come from files, whose folder ``root=`` names; a generated set
            takes no ``root``.
        options: ``{split: the keyword arguments build takes for it}``; :func:`get_dataset`
            refuses any other (a split not listed is not checked).
    """

    name: str
    description: str
    splits: tuple[str, ...]
    build: Callable[..., Any]
    reads_files: bool = True
    options: Mapping[str, frozenset[str]] = field(default_factory=dict)


def _split_kwargs(kwargs: dict[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    return {k: kwargs.pop(k) for k in keys if k in kwargs}


def _multimnist(split: str, **kwargs: Any) -> Any:
    images, labels = load_mnist(split, **_split_kwargs(kwargs, _MNIST_OPTIONS))
    kwargs.setdefault("num_pairs", len(images))
    kwargs.setdefault("seed", _DEFAULT_SEED[split])
    return (MultiMNISTSource if split == "train" else make_multimnist)(images, labels, **kwargs)


def _translated_mnist(split: str, **kwargs: Any) -> Any:
    """MNIST of ``split`` placed at random on a 40x40 canvas (the affNIST training side)."""
    seed = check_seed(kwargs.pop("seed", _DEFAULT_SEED[split]))
    images, labels = load_mnist(split, **_split_kwargs(kwargs, _MNIST_OPTIONS))
    generator = torch.Generator().manual_seed(seed)
    return pad_and_translate_train(images, generator=generator, **kwargs), labels


def _affnist(split: str, **kwargs: Any) -> Any:
    if split == "train":
        return _translated_mnist(split, **kwargs)
    return load_affnist(**kwargs)  # the real files: ``root`` names their folder, ``limit`` applies


def _affnist_style(split: str, **kwargs: Any) -> Any:
    if split == "train":
        return _translated_mnist(split, **kwargs)
    images, labels = load_mnist(split, **_split_kwargs(kwargs, _MNIST_OPTIONS))
    kwargs.setdefault("seed", _DEFAULT_SEED[split])
    warped, labels, _ = make_affnist_style(images, labels, **kwargs)
    return warped, labels


def _shakespeare(split: str, *, val_fraction: float = 0.1, root: str | None = None, **kwargs: Any) -> Any:
    if root is not None:  # like the image sets, ``root`` names the folder of the data file
        if kwargs.get("archive") is not None:  # one of them would be dropped in silence
            raise ValueError(
                f"shakespeare: give root ({root!r}) or archive ({kwargs['archive']!r}), not both"
            )
        kwargs["archive"] = root
    text = load_shakespeare(**kwargs)
    vocab = CharVocab.from_text(text)
    train, val = train_val_split(vocab.encode(text), val_fraction)
    return (train if split == "train" else val), vocab


def _sequence(task: str) -> Callable[..., Any]:
    def build(split: str, **kwargs: Any) -> Any:
        kwargs.setdefault("num_samples", 10_000 if split == "train" else 1_000)
        # The split's own seed, 2 * seed + (0 train, 1 test): seed 0 gives the default 0 and 1. A
        # seed given as an option went to both splits as it was (data.options reach both), and
        # the evaluation set was the training set.
        # Below 2**63, so that each seed has its own pair (s and s + 2**63 gave the same sets).
        seed = check_seed(kwargs.pop("seed", 0))
        if seed >= 2**63:
            raise ValueError(
                f"seed of a sequence task must be an integer in [0, 2**63) (each split draws from "
                f"its own seed, 2 * seed + 0 or 1), got {seed}"
            )
        seed = 2 * seed + _DEFAULT_SEED[split]
        # Each split draws from its own part of the task's inputs: no test source is a training
        # source (10,000 reversals of 1-8 digits hold every string of up to 3, 3/8 of the tests).
        return make_sequence_task(task, seed=seed, split=split, **kwargs)

    return build


_IMAGE_SPLITS = ("train", "test")
_SHAKESPEARE_OPTIONS = _keywords(_shakespeare, drop=("split",)) | _keywords(load_shakespeare)
# MNIST of the split placed at random on a canvas: the training side of affnist and affnist-style
_TRANSLATED_OPTIONS = (
    _MNIST_OPTIONS | {"seed"} | _keywords(pad_and_translate_train, drop=("images", "generator"))
)


def _same(options: frozenset[str], splits: tuple[str, ...] = _IMAGE_SPLITS) -> dict[str, frozenset[str]]:
    return dict.fromkeys(splits, options)


_REGISTRY: dict[str, DatasetEntry] = {
    entry.name: entry
    for entry in [
        DatasetEntry(
            "mnist",
            "MNIST 28x28 digits, 60k train / 10k test -> (images, labels)",
            _IMAGE_SPLITS,
            lambda split, **kw: load_mnist(split, **kw),
            options=_same(_MNIST_OPTIONS),
        ),
        DatasetEntry(
            "small-digits",
            "class-balanced MNIST subset, 2000 train / 500 test -> (images, labels)",
            _IMAGE_SPLITS,
            lambda split, **kw: load_small_digits(split, **kw),
            options=_same(_keywords(load_small_digits, drop=("split",))),
        ),
        DatasetEntry(
            "multimnist",
            "two overlapping MNIST digits of different classes on 36x36 (Sabour et al. 2017) "
            "-> test: (images, labels (N, 2), digits); train: a MultiMNISTSource, drawn afresh",
            _IMAGE_SPLITS,
            _multimnist,
            options={
                "train": _MNIST_OPTIONS | _keywords(MultiMNISTSource, drop=("images", "labels")),
                "test": _MNIST_OPTIONS | _keywords(make_multimnist, drop=("images", "labels")),
            },
        ),
        DatasetEntry(
            "affnist",
            "real affNIST test set, 320,000 40x40 images (torchvote data affnist --download); "
            "train: MNIST placed at random on 40x40 -> (images, labels)",
            _IMAGE_SPLITS,
            _affnist,
            options={"train": _TRANSLATED_OPTIONS, "test": _keywords(load_affnist)},
        ),
        DatasetEntry(
            "affnist-style",
            "generated stand-in for affNIST: MNIST test digits under affNIST-range affine warps on "
            "40x40 (canvas=); train: MNIST placed at random on 40x40 -> (images, labels)",
            _IMAGE_SPLITS,
            _affnist_style,
            options={
                "train": _TRANSLATED_OPTIONS,
                "test": _MNIST_OPTIONS | _keywords(make_affnist_style, drop=("images", "labels")),
            },
        ),
        DatasetEntry(
            "shakespeare",
            "character-level Shakespeare (42 Gutenberg texts), 90/10 split -> (ids, CharVocab)",
            ("train", "val"),
            _shakespeare,
            options=_same(_SHAKESPEARE_OPTIONS, ("train", "val")),
        ),
        *[
            DatasetEntry(
                task,
                f"generated {task} task over digit strings -> (src, tgt) padded ids",
                _IMAGE_SPLITS,
                _sequence(task),
                reads_files=False,
                options=_same(_keywords(make_sequence_task, drop=("task", "split"))),
            )
            for task in SEQUENCE_TASKS
        ],
    ]
}


def list_datasets() -> dict[str, str]:
    """Return ``{name: one-line description}`` of every registered data set, sorted by name."""
    return {name: _REGISTRY[name].description for name in sorted(_REGISTRY)}


def get_dataset(name: str, split: str = "train", **kwargs: Any) -> Any:
    """Build a registered data set.

    Args:
        name: A name from :func:`list_datasets`.
        split: One of the data set's splits (``"train"``/``"test"``; Shakespeare has
            ``"train"``/``"val"``).
        **kwargs: Passed to the underlying loader or generator (e.g. ``limit=``, ``seed=``,
            ``num_pairs=``, ``max_len=``). Image sets derived from MNIST also accept MNIST's
            ``source``, ``root`` and ``limit`` (``small-digits`` takes ``size`` instead of
            ``limit``: :func:`dataset_options` lists each set's); the test split of ``affnist``
            (the real files) takes ``root`` (their folder or file) and ``limit``; Shakespeare
            takes ``archive`` or ``root`` (the folder holding the archive) and
            ``val_fraction``. For a generated set (``affnist-style``, ``multimnist``, the
            MNIST-derived translations) ``limit`` limits the MNIST digits it is drawn from, and
            the draws depend on their number: ``limit=500`` is another set, not the first 500 of
            the full one (the training option ``data.eval_limit`` keeps the first examples of
            the full set).

    Returns:
        The data, as described in :func:`list_datasets`.

    Raises:
        ValueError: If ``name`` is unknown (the message lists the known names) or ``split`` is
            not one of the data set's splits; if ``seed`` is not an int in ``[0, 2**64)``
            (``[0, 2**63)`` for the sequence tasks: each split draws from ``2 * seed + 0 or 1``).
        TypeError: If ``name`` is not a string, or a keyword argument the data set does not take
            for ``split`` (the message names it and lists those it takes, :func:`dataset_options`).
        TypeError, ValueError: From the underlying loader or generator, for a bad value.
    """
    entry = _entry(name)
    validate_split(split, entry.splits)
    accepted = entry.options.get(split)
    unknown = sorted(set(kwargs) - accepted) if accepted is not None else []
    if unknown:
        raise TypeError(
            f"data set {name!r} ({split} split) takes no option {', '.join(map(repr, unknown))}; "
            f"it takes {', '.join(sorted(accepted)) or 'none'}"
        )
    return entry.build(split, **kwargs)


def dataset_options(name: str, split: str = "train") -> tuple[str, ...]:
    """The keyword arguments :func:`get_dataset` takes for data set ``name``'s ``split``, sorted.

    Args:
        name: A name from :func:`list_datasets`.
        split: One of the data set's splits (the two splits of a set may take different options:
            the MultiMNIST training side is drawn afresh each epoch, the real affNIST test set is
            read from files).

    Returns:
        The option names, e.g. ``("limit", "root", "source")`` for ``mnist``.

    Raises:
        ValueError: If ``name`` is unknown or ``split`` is not one of its splits.
        TypeError: If ``name`` is not a string.
    """
    entry = _entry(name)
    validate_split(split, entry.splits)
    return tuple(sorted(entry.options.get(split, ())))


def dataset_splits(name: str) -> tuple[str, ...]:
    """The splits of data set ``name`` (``("train", "test")``; Shakespeare's ``("train", "val")``).

    Args:
        name: A name from :func:`list_datasets`.

    Returns:
        The split names.

    Raises:
        ValueError: If ``name`` is unknown.
        TypeError: If ``name`` is not a string.
    """
    return _entry(name).splits


def dataset_reads_files(name: str) -> bool:
    """Whether data set ``name`` is read from files (so a ``root=`` folder applies to it).

    Args:
        name: A name from :func:`list_datasets`.

    Returns:
        True for a data set read from files, False for a generated one.

    Raises:
        ValueError: If ``name`` is unknown.
        TypeError: If ``name`` is not a string.
    """
    return _entry(name).reads_files


def _entry(name: str) -> DatasetEntry:
    if not isinstance(name, str):
        raise TypeError(f"name: expected a data set name (a str) from {sorted(_REGISTRY)}, got {name!r}")
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"name: unknown data set {name!r}; known: {sorted(_REGISTRY)}")
    return entry
