"""A `Step`'s plan as vLLM's runner builds microbatches from it: its ``UBatchSlice`` list.
"""

from __future__ import annotations

from typing import Any

from tbo.split import SplitPlan

__all__ = ["ubatch_slices"]


def ubatch_slices(plan: SplitPlan) -> list[Any]:
    """vLLM's ``UBatchSlice`` for each microbatch of ``plan``: its request range (a cut request in both) and its
    token range. What ``maybe_create_ubatch_slices(..., split_point=plan.split_token_index)`` returns for two
    microbatches, and the plan's own ranges for more (vLLM's helper spaces those evenly)."""
    from vllm.v1.worker.ubatch_utils import UBatchSlice

    return [UBatchSlice(slice(mb.requests_start, mb.requests_end), slice(mb.tokens_start, mb.tokens_end))
            for mb in plan.microbatches]
