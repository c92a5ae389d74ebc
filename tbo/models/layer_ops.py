"""The op bodies a decoder layer shares with every other decoder layer, written once.

The reference `DecoderLayer` and the Hugging Face `TboDecoderLayer` differ in their modules (norms, attention,
router, experts), not in how ops move data through the microbatch's `State`. A layer inherits `DecoderLayerOps`,
provides the few hooks below, and gets the residual bookkeeping, the expert-parallel dispatch/combine (the
executor's contract, `tbo.ops`: `ExpertParallelOps`, `TensorParallelOps`) and the layer output as ops; it writes
only the ops that touch its own modules (``attn_prepare``, ``attn_core``, ``mlp``, ``gate``, ``select_experts``).

State keys (see ``STATE_FLOW`` in `tbo.models.decoder`): ``residual``, ``attn_in``, ``attn_out``, ``mlp_in``,
``topk``, ``dispatch``, ``dispatched``, ``expert_out``, ``combine``, ``routed_out``, ``shared_out``, ``mlp_out``,
``layer_out``; under tensor parallelism also the in-flight reductions ``attn_reduce``, ``mlp_reduce``,
``moe_reduce`` and ``shared_reduce`` (`tbo.ops.TensorParallelOps`).
"""

from __future__ import annotations

from typing import Any

from tbo.core.dataflow import OpFlow, declares
from tbo.core.state import State
from tbo.experts import run_experts
from tbo.ops import TP_REDUCE_OPS, ExpertParallelOps, TensorParallelOps  # re-exported: their old, documented home

__all__ = ["DecoderLayerOps", "ExpertParallelOps", "TensorParallelOps", "TP_REDUCE_OPS"]


class DecoderLayerOps(ExpertParallelOps, TensorParallelOps):
    """The residual stream, dispatch launch, shared experts and output of a pre-norm decoder layer, as ops.

    Hooks: ``kind`` (``"dense"`` or ``"moe"``), ``attn_norm(x)``, ``mlp_norm(x)``, ``has_shared_experts`` and
    ``shared_experts(x)``. Hidden states may be ``[tokens, H]`` or ``[..., H]``: the router and the backend see
    ``[tokens, H]``, and the routed output takes the residual's shape back.
    """

    kind: str
    has_shared_experts: bool

    def attn_norm(self, x: Any) -> Any:
        raise NotImplementedError

    def mlp_norm(self, x: Any) -> Any:
        raise NotImplementedError

    def shared_experts(self, x: Any) -> Any:
        raise NotImplementedError

    @declares(inputs="hidden_states", writes=("residual", "attn_in"))
    def op_comm_prepare_attn(self, state: State, hidden_states: Any) -> None:
        state.residual = hidden_states
        state.attn_in = self.attn_norm(hidden_states)

    @declares(takes=("residual", "attn_out"), writes=("residual", "mlp_in"))
    def op_comm_prepare_mlp(self, state: State) -> None:
        residual = state.pop("residual") + state.pop("attn_out")
        state.residual = residual
        state.mlp_in = self.mlp_norm(residual)

    @declares(lambda layer: OpFlow(reads=("mlp_in",) if layer.has_shared_experts else (),
                                   takes=("topk",) if layer.has_shared_experts else ("mlp_in", "topk"),
                                   writes=("dispatch",), pinned=("rows_per_rank",)))
    def op_dispatch_a(self, state: State) -> None:
        x = state.mlp_in if self.has_shared_experts else state.pop("mlp_in")
        # data parallel: the rows every rank agreed for this microbatch, when the step pinned them (no count exchange)
        rows = {"rows_per_rank": state.rows_per_rank} if "rows_per_rank" in state else {}
        state.dispatch = self.backend.dispatch_a(x.reshape(-1, x.shape[-1]), *state.pop("topk"), **rows)

    @declares(lambda layer: OpFlow(reads=("mlp_in",) if layer.has_shared_experts else (),
                                   takes=("topk",) if layer.has_shared_experts else ("mlp_in", "topk"),
                                   writes=("routed_out",), pinned=("rows_per_rank",)))
    def op_routed_experts(self, state: State) -> None:
        """Dispatch, the local experts and combine in one op, nothing yielded between: for experts sharded over
        the tensor-parallel ranks (each rank computes every expert's slice), where dispatch and combine move no row
        between ranks and there is no transfer to overlap; the routed output is then a partial sum
        (``moe_reduce_a``/``_b`` sum it). Over an expert-parallel backend it runs too, waiting in place."""
        x = state.mlp_in if self.has_shared_experts else state.pop("mlp_in")
        rows = {"rows_per_rank": state.rows_per_rank} if "rows_per_rank" in state else {}
        dispatched = self.backend.dispatch_b(self.backend.dispatch_a(x.reshape(-1, x.shape[-1]), *state.pop("topk"),
                                                                     **rows))
        out = run_experts(dispatched, self.local_expert, self.stacked_experts)
        state.routed_out = self.backend.combine_b(self.backend.combine_a(out, dispatched.handle))

    @declares(lambda layer: OpFlow(takes="mlp_in", writes="shared_out") if layer.has_shared_experts else OpFlow())
    def op_shared_experts(self, state: State) -> None:
        if self.has_shared_experts:
            state.shared_out = self.shared_experts(state.pop("mlp_in"))

    @declares(lambda layer: OpFlow(takes=("residual", "mlp_out") if layer.kind == "dense" else
                                   ("residual", "routed_out", "shared_out") if layer.has_shared_experts else
                                   ("residual", "routed_out"), writes="layer_out"))
    def op_output(self, state: State) -> None:
        residual = state.pop("residual")
        if self.kind == "dense":
            mlp = state.pop("mlp_out")
        else:
            mlp = state.pop("routed_out").view(residual.shape)
            if self.has_shared_experts:
                mlp = mlp + state.pop("shared_out")
        state.layer_out = residual + mlp

    @declares(takes="layer_out", returns="hidden_states", clears=True)
    def op_comm_postprocess_layer(self, state: State) -> dict[str, Any]:
        out = state.pop("layer_out")
        state.clear()  # every key a layer wrote was consumed: anything left is a leak
        return {"hidden_states": out}
