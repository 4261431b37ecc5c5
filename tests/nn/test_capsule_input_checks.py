"""``CapsuleLinear``'s own check of the input capsule count (found untested by a mutation review):
every strategy refuses a wrong ``in_caps`` with the ValueError its docstring promises, naming the
layer's ``in_caps``, before the votes are formed (the einsum or the streamed products would fail
with errors that name none of the layer's arguments)."""

from __future__ import annotations

import pytest
import torch

from torchvote.nn import CapsuleLinear


@pytest.mark.parametrize("strategy", ["stream", "materialize"])
@pytest.mark.parametrize("in_caps", [5, 7])
def test_capsule_linear_refuses_another_number_of_input_capsules(in_caps, strategy):
    """Guards the ``inputs.shape[-2] != self.in_caps`` check of ``_check_inputs``."""
    layer = CapsuleLinear(6, 4, 3, 5, strategy=strategy)
    with pytest.raises(ValueError, match=r"inputs must have in_caps=6 capsules"):
        layer(torch.randn(2, in_caps, 4))
    with pytest.raises(ValueError, match=r"inputs must have in_caps=6 capsules"):
        layer.votes(torch.randn(2, in_caps, 4))
