"""`SglangDecoderLayer`: an SGLang decoder layer (Qwen3-MoE's, Mixtral's, ...) as the ops tbo's strategies name.

Every op calls the layer's own modules, so the math is SGLang's: the layer-boundary stages (``attn_boundary``,
``ffn_boundary``: the residual adds and norms, on the microbatch's own residual stream), the attention module
(Qwen3-MoE's as two ops: ``forward_prepare`` with its projections, q/k norms and rotary in ``attn_prepare``,
``forward_core`` with SGLang's attention backend and KV cache in ``attn_core``; any other whole in ``attn_core``),
the router gate, SGLang's ``TopK`` and the ``experts`` module (its own MoE runner, unquantized or not). What tbo
changes is where the tokens go between routing and the experts: through an `EPBackend` (dispatch, combine), in the
NORMAL layout SGLang's experts take (each token once with its top-k ids and weights).

Each microbatch carries its own ForwardBatch (pinned in its State as ``forward_batch``, with its ``positions``): the
attention reads that microbatch's requests and KV slots, and the residual stream lives on it. The last layer ends
the stack as SGLang's model does (``residual_batch.final_norm``), per microbatch: the final RMSNorm is per token, so
merging normed microbatches equals norming the merged step.
"""

from __future__ import annotations

from typing import Any

import torch

from tbo.core.dataflow import OpFlow, declares
from tbo.core.state import State
from tbo.integrations.sglang.model.structure import LayerStructure
from tbo.models.layer_ops import ExpertParallelOps

__all__ = ["SglangDecoderLayer"]


class SglangDecoderLayer(ExpertParallelOps):
    """An SGLang decoder layer as ops; its experts' tokens dispatched through ``backend``."""

    #: the engine's `StepStats` (counts local_ffn_calls); None: not counted
    stats: Any = None

    def __init__(self, layer: Any, structure: LayerStructure, backend: Any, layer_idx: int,
                 final_norm: Any = None) -> None:
        self.layer, self.backend, self.layer_idx, self.structure = layer, backend, layer_idx, structure
        self.attn, self.ffn, self.kind = structure.attn, structure.ffn, structure.kind
        self.split_attention = structure.split_attention
        #: the model's final norm, on the last layer only: it ends each microbatch's stack as SGLang's model does
        self.final_norm = final_norm
        self.has_shared_experts = False
        self.required_ops = ()
        self._ids_dtype = torch.int32
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        self._residual, self._topk_output = residual_batch, StandardTopKOutput

    def __repr__(self) -> str:
        return f"SglangDecoderLayer({self.layer_idx}, {type(self.layer).__name__}, {self.kind})"

    # ---- attention ---------------------------------------------------------------------------------------------
    @declares(inputs="hidden_states", writes="attn_in", pinned="forward_batch")
    def op_comm_prepare_attn(self, state: State, hidden_states: torch.Tensor) -> None:
        state.attn_in = self.layer.attn_boundary.prepare(hidden_states, state.forward_batch)

    @declares(lambda layer: OpFlow(takes="attn_in", writes="qkv", pinned=("positions", "forward_batch"))
              if layer.split_attention else OpFlow())
    def op_attn_prepare(self, state: State) -> None:
        """Qwen3-MoE: projections, q/k norms and rotary (``forward_prepare``), so that the other microbatch's
        dispatch has that compute to hide behind; other attention modules are one call in ``attn_core``."""
        if self.split_attention:
            state.qkv = self.attn.forward_prepare(positions=state.positions, hidden_states=state.pop("attn_in"),
                                                  forward_batch=state.forward_batch)

    @declares(lambda layer: OpFlow(takes="qkv" if layer.split_attention else "attn_in", writes="attn_out",
                                   pinned=() if layer.split_attention else ("positions", "forward_batch")))
    def op_attn_core(self, state: State) -> None:
        if self.split_attention:
            state.attn_out = self.attn.forward_core(state.pop("qkv"))
            return
        x = state.pop("attn_in")
        state.attn_out = x if x.shape[0] == 0 else self.attn(positions=state.positions, hidden_states=x,
                                                             forward_batch=state.forward_batch)

    @declares(takes="attn_out", writes="mlp_in", pinned="forward_batch")
    def op_comm_prepare_mlp(self, state: State) -> None:
        fb = state.forward_batch
        hidden = self.layer.attn_boundary.finish(state.pop("attn_out"), fb)
        state.mlp_in = self.layer.ffn_boundary.prepare(hidden, fb)

    # ---- dense layers ------------------------------------------------------------------------------------------
    @declares(takes="mlp_in", writes="mlp_out", pinned="forward_batch")
    def op_mlp(self, state: State) -> None:
        self._count_ffn()
        x = state.pop("mlp_in")
        state.mlp_out = self.ffn(x, state.forward_batch) if self.structure.ffn_takes_batch else self.ffn(x)

    def _count_ffn(self) -> None:
        if self.stats is not None:
            self.stats.local_ffn_calls += 1

    # ---- MoE: router, dispatch, experts, combine ---------------------------------------------------------------
    @declares(reads="mlp_in", writes="router_logits")
    def op_gate(self, state: State) -> None:
        logits = self.ffn.gate(state.mlp_in.view(-1, state.mlp_in.shape[-1]))
        state.router_logits = logits[0] if isinstance(logits, tuple) else logits

    @declares(reads="mlp_in", takes="router_logits", writes="topk")
    def op_select_experts(self, state: State) -> None:
        x = state.mlp_in.view(-1, state.mlp_in.shape[-1])
        logits = state.pop("router_logits")
        if x.shape[0] == 0:
            out = self.ffn.topk.empty_topk_output(x.device)
        else:
            out = self.ffn.topk(x, logits)
        self._ids_dtype = out.topk_ids.dtype  # the experts take them back in their own dtype
        state.topk = (out.topk_ids, out.topk_weights)

    @declares(takes=("mlp_in", "topk"), writes=("dispatch", "mlp_shape"))
    def op_dispatch_a(self, state: State) -> None:
        x = state.pop("mlp_in")
        state.mlp_shape = x.shape
        state.dispatch = self.backend.dispatch_a(x.view(-1, x.shape[-1]), *state.pop("topk"))

    def op_shared_experts(self, state: State) -> None:
        """No shared expert here (a layer with one is refused at load: `structure`)."""

    @declares(takes="dispatched", writes="expert_out")
    def op_experts(self, state: State) -> None:
        """SGLang's experts module on the tokens dispatched here: per token, the weighted sum over its experts."""
        d = state.pop("dispatched")
        self._count_ffn()
        ids = d.topk_idx.to(self._ids_dtype)
        logits = d.hidden.new_empty((d.hidden.shape[0], 0))  # the runner reads ids and weights, not the logits
        out = self.ffn.experts(d.hidden, self._topk_output(d.topk_weights.to(torch.float32), ids, logits))
        state.expert_out = (out, d.handle)

    # ---- output ------------------------------------------------------------------------------------------------
    @declares(lambda layer: OpFlow(takes="mlp_out" if layer.kind == "dense" else ("routed_out", "mlp_shape"),
                                   writes="layer_out"))
    def op_output(self, state: State) -> None:
        if self.kind == "dense":
            state.layer_out = state.pop("mlp_out")
            return
        state.layer_out = state.pop("routed_out").view(state.pop("mlp_shape"))

    @declares(takes="layer_out", clears=True, returns="hidden_states", pinned="forward_batch")
    def op_comm_postprocess_layer(self, state: State) -> dict[str, Any]:
        fb = state.forward_batch
        hidden = self.layer.ffn_boundary.finish(state.pop("layer_out"), fb)
        if self.final_norm is not None:  # the stack's end, per microbatch (as the model's forward ends it)
            hidden = self._residual.final_norm(hidden, fb, self.final_norm, skip_empty=True)
        state.clear()
        return {"hidden_states": hidden}
