"""A seed is an integer, whatever its type: a NumPy integer draws what the same Python int draws."""

import numpy as np
import pytest
import torch

from torchvote.data import (
    MultiMNISTSource,
    get_dataset,
    make_affnist_style,
    make_multimnist,
    make_sequence_task,
)


def _draws():
    images, labels = torch.rand(6, 1, 28, 28), torch.arange(6) % 3
    return {
        "make_sequence_task": lambda seed: make_sequence_task("copy", num_samples=4, seed=seed)[0],
        "make_multimnist": lambda seed: make_multimnist(images, labels, num_pairs=3, seed=seed).images,
        "MultiMNISTSource.draw": lambda seed: MultiMNISTSource(images, labels, num_pairs=3).draw(seed).images,
        "MultiMNISTSource(seed=...)": lambda seed: MultiMNISTSource(images, labels, num_pairs=3, seed=seed)
        .draw()
        .images,
        "make_affnist_style": lambda seed: make_affnist_style(images, labels, seed=seed)[0],
        "get_dataset reverse": lambda seed: get_dataset("reverse", "test", seed=seed, num_samples=4)[0],
    }


@pytest.mark.parametrize("name", list(_draws()))
def test_a_numpy_seed_draws_what_the_same_int_draws(name):
    """np.int64(3) passed the seed check and then failed inside torch ("an integer is required")."""
    draw = _draws()[name]
    assert torch.equal(draw(np.int64(3)), draw(3))
    assert torch.equal(draw(np.uint32(7)), draw(7))


def test_a_multimnist_source_keeps_its_seed_as_an_int():
    images, labels = torch.rand(4, 1, 28, 28), torch.tensor([0, 1, 0, 1])
    source = MultiMNISTSource(images, labels, num_pairs=2, seed=np.int64(5))
    assert type(source.seed) is int and source.seed == 5


def test_sequence_task_seeds_each_give_their_own_sets():
    """The split's seed 2 * seed + (0 train, 1 test) wrapped at 2**64: seed 2**63 gave seed 0's
    sets. Seeds from 2**63 are refused, and the last one taken differs from seed 0."""
    for split in ("train", "test"):
        last = get_dataset("reverse", split, seed=2**63 - 1, num_samples=5)[0]
        assert not torch.equal(last, get_dataset("reverse", split, seed=0, num_samples=5)[0])
        with pytest.raises(ValueError, match=r"seed of a sequence task must be an integer in \[0, 2\*\*63\)"):
            get_dataset("reverse", split, seed=2**63, num_samples=5)
