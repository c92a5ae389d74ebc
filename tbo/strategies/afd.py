"""Attention-FFN disaggregation with dual-batch overlap: send, Yield, receive.

The attention side sends stage 0's hidden states, yields, computes stage 1's attention and sends it while the FFN
side computes stage 0, then receives stage 0's result. Layers chain: one stage runs ``afd_recv`` of layer l, the
layer's output, and layer l+1's attention up to its ``afd_send``.
"""

from __future__ import annotations

from tbo.core.operations import Yield
from tbo.core.strategy import OperationsStrategy

__all__ = ["afd_attention_dbo"]


def afd_attention_dbo() -> OperationsStrategy:
    return OperationsStrategy(
        name="afd_attention_dbo",
        delta_stages=0,
        operations=[
            "comm_prepare_attn", "attn_prepare", "attn_core", "comm_prepare_mlp", "afd_send", Yield,
            "afd_recv", "output", "comm_postprocess_layer",
        ],
    )
