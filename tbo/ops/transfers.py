"""The executor's contract for a layer's transfers: the ``_a``/``_b`` op mixins every engine's layer inherits.

Why a room of its own: these ops are what any layer (the reference `tbo.models.DecoderLayer`, the Hugging Face
layer, vLLM's and SGLang's adapters, a third engine's) needs to run communication as tbo's transfers, and none of it
is a model. `ExpertParallelOps` runs dispatch, the local experts and combine over a layer's ``backend`` (an
`EPBackend`); `TensorParallelOps` runs the tensor-parallel all-reduces over its ``reducer``. Each ``X_a`` launches
and returns, each ``X_b`` waits, so a strategy's Yield between them lets the other microbatch's compute hide the
transfer. They used to live in the reference model's package (`tbo.models.layer_ops`, which still re-exports them),
so both engines detoured through a model to reach them; here they sit just above what they use (`tbo.experts`,
`tbo.core`) and below every layer that inherits them.

State keys: ``dispatch``, ``dispatched``, ``expert_out``, ``combine``, ``routed_out``; under tensor parallelism the
in-flight reductions ``attn_reduce``, ``mlp_reduce``, ``moe_reduce`` and ``shared_reduce``.
"""

from __future__ import annotations

from typing import Any

from tbo.core.dataflow import OpFlow, declares
from tbo.core.state import State
from tbo.experts import run_experts

__all__ = ["ExpertParallelOps", "TensorParallelOps", "TP_REDUCE_OPS"]

#: The tensor-parallel reductions as transfers: each ``X_a`` launches the all-reduce of a row-parallel output's
#: partial sum, ``X_b`` waits and puts the sum back under the key it came from.
TP_REDUCE_OPS = ("attn_reduce_a", "attn_reduce_b", "mlp_reduce_a", "mlp_reduce_b", "moe_reduce_a", "moe_reduce_b",
                 "shared_reduce_a", "shared_reduce_b")


class ExpertParallelOps:
    """Dispatch, the local experts and combine as ops, for any layer with a ``backend`` (an `EPBackend`) and a
    ``local_expert(e, rows)``."""

    backend: Any
    #: the local experts as stacked SwiGLU weights (`tbo.experts.StackedSwiGLU`), when the layer can give them: lets
    #: MASKED rows on a GPU run in one GEMM chain or a grouped GEMM instead of one chain per expert
    stacked_experts: Any = None

    def local_expert(self, e: int, rows: Any) -> Any:  # provided by the layer
        raise NotImplementedError

    @declares(takes="dispatch", writes="dispatched")
    def op_dispatch_b(self, state: State) -> None:
        state.dispatched = self.backend.dispatch_b(state.pop("dispatch"))

    @declares(takes="dispatched", writes="expert_out")
    def op_experts(self, state: State) -> None:
        dispatched = state.pop("dispatched")  # dropped here: nothing reads the received rows after the experts
        state.expert_out = (run_experts(dispatched, self.local_expert, self.stacked_experts), dispatched.handle)

    @declares(takes="expert_out", writes="combine")
    def op_combine_a(self, state: State) -> None:
        state.combine = self.backend.combine_a(*state.pop("expert_out"))

    @declares(takes="combine", writes="routed_out")
    def op_combine_b(self, state: State) -> None:
        state.routed_out = self.backend.combine_b(state.pop("combine"))


class TensorParallelOps:
    """The tensor-parallel all-reduces of a layer as transfers, for any layer with a ``reducer`` (a
    `tbo.comm.allreduce.TPAllReduce`, or a wrapper of one such as an `EmulatedLink`).

    Under TP a layer's row-parallel projections leave partial sums: attention's ``o_proj`` (``attn_out``), the dense
    MLP's ``down_proj`` (``mlp_out``), an MoE layer's routed experts (``routed_out``, after combine) and its shared
    expert (``shared_out``). Each pair sums one of them over the TP group: ``X_reduce_a`` takes the partial sum and
    launches (``attn_reduce``, ... in flight), ``X_reduce_b`` waits and writes the sum back under the same key, so
    the ops after it (``comm_prepare_mlp``, ``output``) are those of a layer without TP. A strategy places a Yield
    between the two, and the other microbatch's compute hides the reduction.

    The shared expert's pair declares nothing on a layer without one (as ``shared_experts`` does), so one MoE
    strategy serves both. A layer whose outputs are partial sums lists these ops in its ``required_ops``, so that a
    strategy without them (whose output would be one rank's part) is refused when it is bound.
    """

    reducer: Any = None
    has_shared_experts: bool

    def _reducer(self, op: str) -> Any:
        if self.reducer is None:
            raise RuntimeError(f"{self!r}: op {op} needs the layer's tensor-parallel reducer (layer.reducer, a "
                               "tbo.comm.TPAllReduce); this layer has none: use a strategy without reduce ops")
        return self.reducer

    @declares(takes="attn_out", writes="attn_reduce")
    def op_attn_reduce_a(self, state: State) -> None:
        state.attn_reduce = self._reducer("attn_reduce_a").reduce_a(state.pop("attn_out"), "attn_reduce")

    @declares(takes="attn_reduce", writes="attn_out")
    def op_attn_reduce_b(self, state: State) -> None:
        state.attn_out = self._reducer("attn_reduce_b").reduce_b(state.pop("attn_reduce"))

    @declares(takes="mlp_out", writes="mlp_reduce")
    def op_mlp_reduce_a(self, state: State) -> None:
        state.mlp_reduce = self._reducer("mlp_reduce_a").reduce_a(state.pop("mlp_out"), "mlp_reduce")

    @declares(takes="mlp_reduce", writes="mlp_out")
    def op_mlp_reduce_b(self, state: State) -> None:
        state.mlp_out = self._reducer("mlp_reduce_b").reduce_b(state.pop("mlp_reduce"))

    @declares(takes="routed_out", writes="moe_reduce")
    def op_moe_reduce_a(self, state: State) -> None:
        state.moe_reduce = self._reducer("moe_reduce_a").reduce_a(state.pop("routed_out"), "moe_reduce")

    @declares(takes="moe_reduce", writes="routed_out")
    def op_moe_reduce_b(self, state: State) -> None:
        state.routed_out = self._reducer("moe_reduce_b").reduce_b(state.pop("moe_reduce"))

    @declares(lambda layer: OpFlow(takes="shared_out", writes="shared_reduce") if layer.has_shared_experts
              else OpFlow())
    def op_shared_reduce_a(self, state: State) -> None:
        if self.has_shared_experts:
            state.shared_reduce = self._reducer("shared_reduce_a").reduce_a(state.pop("shared_out"),
                                                                             "shared_reduce")

    @declares(lambda layer: OpFlow(takes="shared_reduce", writes="shared_out") if layer.has_shared_experts
              else OpFlow())
    def op_shared_reduce_b(self, state: State) -> None:
        if self.has_shared_experts:
            state.shared_out = self._reducer("shared_reduce_b").reduce_b(state.pop("shared_reduce"))
