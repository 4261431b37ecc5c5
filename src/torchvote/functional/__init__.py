"""Pure functions on tensors: the voting operator and everything built from it.

No parameters live here; the modules in :mod:`torchvote.nn` own them.
"""

from torchvote.functional import routing
from torchvote.functional.attention import (
    attend,
    scaled_dot_product_attention,
    self_attention,
    softmax_attention,
)
from torchvote.functional.em import default_inverse_temperature, em_routing
from torchvote.functional.masks import (
    check_attention_mask,
    is_causal_mask,
    merge_masks,
    prepare_attention_mask,
)
from torchvote.functional.nonlinearities import squash
from torchvote.functional.routing import as_routing_votes as as_routing_votes
from torchvote.functional.routing import dynamic_routing as dynamic_routing
from torchvote.functional.routing import efficient_squash as efficient_squash
from torchvote.functional.routing import inverted_dot_product_routing as inverted_dot_product_routing
from torchvote.functional.routing import list_routers as list_routers
from torchvote.functional.routing import self_attention_routing as self_attention_routing
from torchvote.functional.routing import slot_attention as slot_attention
from torchvote.functional.routing import slot_routing as slot_routing
from torchvote.functional.routing import uniform_routing as uniform_routing
from torchvote.functional.routing_votes import LinearVotes, SharedLinearVotes
from torchvote.functional.scores import (
    additive_score,
    concat_score,
    dot_score,
    general_score,
    scaled_dot_score,
)
from torchvote.functional.voting import (
    DotProductScores,
    PairwiseVotes,
    SharedVotes,
    VoteResult,
    VotingState,
    masked_softmax,
    vote,
)

__all__ = [
    *routing.__all__,  # every routing function, re-exported above
    "DotProductScores",
    "LinearVotes",
    "SharedLinearVotes",
    "default_inverse_temperature",
    "em_routing",
    "PairwiseVotes",
    "SharedVotes",
    "VoteResult",
    "VotingState",
    "additive_score",
    "attend",
    "check_attention_mask",
    "concat_score",
    "dot_score",
    "general_score",
    "is_causal_mask",
    "masked_softmax",
    "merge_masks",
    "prepare_attention_mask",
    "scaled_dot_product_attention",
    "scaled_dot_score",
    "self_attention",
    "softmax_attention",
    "squash",
    "vote",
]
