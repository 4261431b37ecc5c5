"""Mutation review, round 3: the task handlers' metrics against counts made by hand."""

from __future__ import annotations

import torch

from torchvote.models.registry import ClassifierOutput
from torchvote.training import get_task_handler


def test_two_digit_accuracy_takes_label_pairs_in_either_order():
    """Mutant: the label pairs compared unsorted with the sorted top-2 classes. MultiMNIST's pairs
    are (first digit, second digit), in no order of class: the earlier case had its right pairs
    sorted already. Reference: the set of the two longest capsules equals the set of labels."""
    handler = get_task_handler("image-classification")
    generator = torch.Generator().manual_seed(0)
    lengths = torch.rand(8, 10, generator=generator)
    targets = torch.tensor([[7, 3], [2, 9], [5, 1], [0, 4], [8, 6], [3, 7], [9, 2], [6, 1]])
    for row in range(6):  # the first six images: their two digits are the two longest capsules
        lengths[row, targets[row]] = torch.tensor([1.5, 1.2])
    expected = sum(
        set(lengths[b].topk(2).indices.tolist()) == set(targets[b].tolist()) for b in range(len(targets))
    )
    sums = handler.metric_sums(ClassifierOutput(scores=lengths), {"targets": targets})
    assert expected >= 6
    assert sums["correct"].item() == expected and sums["count"].item() == 8
