"""The attention side of AFD: attention ops as usual, the FFN replaced by ``afd_send`` / ``afd_recv``.

``op_afd_send`` ships the post-attention normed hidden states with the microbatch's metadata (read from its pinned
State); ``op_afd_recv`` receives the FFN output of the same microbatch. The Yield between them in the
``afd_attention_dbo`` strategy is what lets the other microbatch compute while this one waits.
"""

from __future__ import annotations

from typing import Any

import torch

from tbo import strategies
from tbo.runtime.forward import model_forward_maybe_tbo
from tbo.models.cache import AttentionMetadata, KVCache
from tbo.split.plan import MicrobatchSlice, SplitPlan
from tbo.core.dataflow import declares
from tbo.core.state import State
from tbo.afd.connector import AFDMeta

__all__ = ["AFDAttentionLayer", "AFDAttentionModel"]


class AFDAttentionLayer:
    """A reference `DecoderLayer`'s attention, with its FFN on a remote FFN rank."""

    kind = "afd"

    def __init__(self, layer: Any, connector: Any) -> None:
        self.layer, self.connector = layer, connector
        self.layer_idx = layer.layer_idx
        # attention and the residual bookkeeping are the reference layer's own ops
        self.op_comm_prepare_attn = layer.op_comm_prepare_attn
        self.op_attn_prepare = layer.op_attn_prepare
        self.op_attn_core = layer.op_attn_core
        self.op_comm_prepare_mlp = layer.op_comm_prepare_mlp
        self.op_comm_postprocess_layer = layer.op_comm_postprocess_layer

    def __repr__(self) -> str:
        return f"AFDAttentionLayer({self.layer_idx})"

    def _meta(self, state: State, x: torch.Tensor) -> AFDMeta:
        return AFDMeta(self.layer_idx, state.get("microbatch_idx", 0), state.get("num_microbatches", 1), x.shape[0],
                       x.shape[1],
                       x.dtype)

    @declares(takes="mlp_in", writes="afd", pinned=("microbatch_idx", "num_microbatches"))
    def op_afd_send(self, state: State) -> None:
        x = state.pop("mlp_in")
        meta = self._meta(state, x)
        state.afd = (meta, self.connector.send_attn_output(x, meta))

    @declares(takes="afd", writes="ffn_out")
    def op_afd_recv(self, state: State) -> None:
        meta, _sent = state.pop("afd")
        state.ffn_out = self.connector.recv_ffn_output(meta)

    @declares(takes=("residual", "ffn_out"), writes="layer_out")
    def op_output(self, state: State) -> None:
        state.layer_out = state.pop("residual") + state.pop("ffn_out")


class AFDAttentionModel:
    """A reference model's embedding, attention layers and head on an attention rank; FFNs served remotely."""

    def __init__(self, model: Any, connector: Any) -> None:
        self.model, self.connector = model, connector
        self.layers = [AFDAttentionLayer(layer, connector) for layer in model.layers]
        self.strategy = strategies.bind_layers(self.layers, strategies.get("afd_attention_dbo"))

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: KVCache, plan: SplitPlan | None,
                **kwargs: Any) -> torch.Tensor:
        """Logits, with each layer's FFN on the FFN rank; two microbatches overlapped when ``plan`` splits the step."""

        def pinned(mb: MicrobatchSlice | None) -> dict[str, Any]:
            return {"attn": meta if mb is None else meta.for_microbatch(mb), "cache": cache}

        out = model_forward_maybe_tbo(self.layers, {"hidden_states": self.model.embed(input_ids)}, self.strategy,
                                      plan, pinned=pinned, backend=self.connector, **kwargs)
        return self.model.head(out["hidden_states"])
