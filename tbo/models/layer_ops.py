"""The op bodies a decoder layer shares with every other decoder layer, written once.

The reference `DecoderLayer` and the Hugging Face `TboDecoderLayer` differ in their modules (norms, attention,
router, experts), not in how ops move data through the microbatch's `State`. A layer inherits `DecoderLayerOps`,
provides the few hooks below, and gets the residual bookkeeping, the expert-parallel dispatch/combine and the layer
output as ops; it writes only the ops that touch its own modules (``attn_prepare``, ``attn_core``, ``mlp``,
``gate``, ``select_experts``).

State keys (see ``STATE_FLOW`` in `tbo.models.decoder`): ``residual``, ``attn_in``, ``attn_out``, ``mlp_in``,
``topk``, ``dispatch``, ``dispatched``, ``expert_out``, ``combine``, ``routed_out``, ``shared_out``, ``mlp_out``,
``layer_out``; under tensor parallelism also the in-flight reductions ``attn_reduce``, ``mlp_reduce``,
``moe_reduce`` and ``shared_reduce`` (`TensorParallelOps`).
"""

from __future__ import annotations

from typing import Any

from tbo.core.dataflow import OpFlow, declares
from tbo.core.state import State
from tbo.experts import run_experts

__all__ = ["DecoderLayerOps", "ExpertParallelOps", "TensorParallelOps", "TP_REDUCE_OPS"]

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
