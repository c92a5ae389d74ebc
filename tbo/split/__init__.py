"""Microbatch splitting: where to cut a step's batch, when not to, and the same decision on every rank.

The policy and the index rules need no torch; `split_inputs`, `merge_outputs` and `agree_to_split` touch tensors and
process groups, and are imported on first use.
"""

from tbo.split.index import (DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD, ForwardMode, boundary_cuts,
                             compute_split_seq_index, compute_split_token_index)
from tbo.split.kinds import Slot, StepKind
from tbo.split.plan import MicrobatchSlice, SplitPlan, SplitPolicy
from tbo.util.lazy import lazy_attributes

__getattr__ = lazy_attributes(__name__, {
    "REQUEST_KINDS": "tbo.split.tensors",
    "RequestRule": "tbo.split.tensors",
    "agree_to_split": "tbo.split.agree",
    "merge_outputs": "tbo.split.tensors",
    "split_inputs": "tbo.split.tensors",
})

__all__ = [
    "DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD",
    "ForwardMode",
    "MicrobatchSlice",
    "REQUEST_KINDS",
    "RequestRule",
    "Slot",
    "SplitPlan",
    "SplitPolicy",
    "StepKind",
    "agree_to_split",
    "boundary_cuts",
    "compute_split_seq_index",
    "compute_split_token_index",
    "merge_outputs",
    "split_inputs",
]
