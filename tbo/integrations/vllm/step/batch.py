"""vLLM's side of a step, adapted in this one place: its private decision tuple (`VllmDecision`) and the
microbatch slices its runner builds from a `Step`'s plan (`ubatch_slices`).

vLLM 0.32's ``GPUModelRunner._determine_batch_execution_and_padding`` returns a 5-tuple ``(cudagraph_mode,
batch_descriptor, should_ubatch, num_tokens_across_dp, cudagraph_stats)``; tbo replaces ``should_ubatch`` with its
decision and, under data parallelism, the token counts with the agreement's. Nothing else of tbo unpacks it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tbo.split import SplitPlan

__all__ = ["VllmDecision", "ubatch_slices"]


@dataclass(frozen=True)
class VllmDecision:
    """vLLM's decision for one step (see the module docstring), field by field."""

    cudagraph_mode: Any
    batch_desc: Any  #: vLLM's ``BatchDescriptor``: the padded token and request counts
    should_ubatch: bool
    across_dp: Any  #: each DP rank's token count (a tensor), or None
    cudagraph_stats: Any

    @classmethod
    def of(cls, result: tuple[Any, ...]) -> VllmDecision:
        """vLLM's tuple as a `VllmDecision`."""
        cudagraph_mode, batch_desc, should_ubatch, across_dp, cudagraph_stats = result
        return cls(cudagraph_mode, batch_desc, should_ubatch, across_dp, cudagraph_stats)

    def as_tuple(self) -> tuple[Any, ...]:
        """The tuple vLLM's runner unpacks."""
        return self.cudagraph_mode, self.batch_desc, self.should_ubatch, self.across_dp, self.cudagraph_stats

    def split(self, should_ubatch: bool) -> tuple[Any, ...]:
        """vLLM's tuple with tbo's ``should_ubatch``."""
        return replace(self, should_ubatch=should_ubatch).as_tuple()

    @property
    def full_graph(self) -> bool:
        """vLLM dispatches the step to a FULL CUDA graph."""
        return getattr(self.cudagraph_mode, "name", "") == "FULL"


def ubatch_slices(plan: SplitPlan) -> list[Any]:
    """vLLM's ``UBatchSlice`` for each microbatch of ``plan``: its request range (a cut request in both) and its
    token range. What ``maybe_create_ubatch_slices(..., split_point=plan.split_token_index)`` returns for two
    microbatches, and the plan's own ranges for more (vLLM's helper spaces those evenly)."""
    from vllm.v1.worker.ubatch_utils import UBatchSlice

    return [UBatchSlice(slice(mb.requests_start, mb.requests_end), slice(mb.tokens_start, mb.tokens_end))
            for mb in plan.microbatches]
