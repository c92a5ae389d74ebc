"""Microbatch splitting: where to cut a step's batch, when not to, and the same decision on every rank."""

from .agree import agree_to_split
from .index import (ForwardMode, compute_split_seq_index, compute_split_token_index,
                    DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD)
from .plan import MicrobatchSlice, SplitPlan, SplitPolicy
from .tensors import merge_outputs, split_inputs

__all__ = [
    "DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD",
    "ForwardMode",
    "MicrobatchSlice",
    "SplitPlan",
    "SplitPolicy",
    "agree_to_split",
    "compute_split_seq_index",
    "compute_split_token_index",
    "merge_outputs",
    "split_inputs",
]
