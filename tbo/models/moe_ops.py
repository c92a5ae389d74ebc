"""The expert-parallel half of an MoE layer as ops: dispatch, run the local experts, combine.

Any layer with a ``backend`` (an `EPBackend`) and a ``local_expert(e, rows)`` gets these four ops by inheriting
this mixin; the reference model and the Hugging Face adapter both do. State keys: ``dispatch`` (from
``op_dispatch_a``) in, ``routed_out`` out.
"""

from __future__ import annotations

from ..comm.experts import run_experts
from ..state import State

__all__ = ["ExpertParallelOps"]


class ExpertParallelOps:
    backend: object

    def local_expert(self, e: int, rows):  # type: ignore[no-untyped-def]  # provided by the layer
        raise NotImplementedError

    def op_dispatch_b(self, state: State) -> None:
        state.dispatched = self.backend.dispatch_b(state.pop("dispatch"))  # type: ignore[attr-defined]

    def op_experts(self, state: State) -> None:
        dispatched = state.pop("dispatched")  # dropped here: DeepEP low-latency holds at most two results
        state.expert_out = (run_experts(dispatched, self.local_expert), dispatched.handle)

    def op_combine_a(self, state: State) -> None:
        state.combine = self.backend.combine_a(*state.pop("expert_out"))  # type: ignore[attr-defined]

    def op_combine_b(self, state: State) -> None:
        state.routed_out = self.backend.combine_b(state.pop("combine"))  # type: ignore[attr-defined]
