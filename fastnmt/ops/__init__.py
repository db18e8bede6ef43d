"""The fused ops, each dispatched per call to the best backend (see ``fastnmt.ops.dispatch``)."""

from fastnmt.ops.add_layer_norm import add_layer_norm
from fastnmt.ops.attention import (
    attention,
    attention_probabilities,
    attention_varlen,
    gather_cache_rows,
)
from fastnmt.ops.feed_forward import feed_forward
from fastnmt.ops.linear_cross_entropy import CrossEntropyOutput, linear_cross_entropy
from fastnmt.ops.log_softmax_topk import log_softmax_topk
from fastnmt.ops.sample_token import sample_token
from fastnmt.ops.triton.common import dropout_seeds

__all__ = [
    "CrossEntropyOutput",
    "add_layer_norm",
    "attention",
    "attention_probabilities",
    "attention_varlen",
    "dropout_seeds",
    "feed_forward",
    "gather_cache_rows",
    "linear_cross_entropy",
    "log_softmax_topk",
    "sample_token",
]
