"""Qwen3-MoE strategies: the DeepSeek shapes without the shared expert, which Qwen3-MoE does not have.

Without a shared expert, decode has nothing to run between ``dispatch_a`` and the Yield: the other microbatch's
stages are what hide the dispatch.
"""

from __future__ import annotations

from ..operations import Yield
from ..strategy import OperationsStrategy
from .deepseek import prefill_deep_gemm_num_sms

__all__ = ["qwen3_moe_decode", "qwen3_moe_prefill"]


def qwen3_moe_decode() -> OperationsStrategy:
    return OperationsStrategy(
        name="qwen3_moe_decode",
        delta_stages=2,
        operations=[
            "comm_prepare_attn", "attn_prepare", Yield,
            "attn_core", "comm_prepare_mlp", "gate", "select_experts", Yield,
            "dispatch_a", Yield,
            "dispatch_b", "experts", "combine_a", Yield,
            "combine_b", Yield,
            "output", "comm_postprocess_layer",
        ],
    )


def qwen3_moe_prefill() -> OperationsStrategy:
    return OperationsStrategy(
        name="qwen3_moe_prefill",
        delta_stages=0,
        deep_gemm_num_sms=prefill_deep_gemm_num_sms(),
        operations=[
            "comm_prepare_attn", "attn_prepare", "attn_core", "comm_prepare_mlp", "gate", "select_experts",
            "dispatch_a", Yield,
            "dispatch_b", "experts", "combine_a", Yield,
            "combine_b", "output", "comm_postprocess_layer",
        ],
    )
