"""Strategies for MoE layers without a shared expert (Qwen3-MoE, Mixtral, GPT-OSS, OLMoE, ...): the DeepSeek shapes
less that op. The vLLM plugin's ``strategy: "auto"`` picks them for a model whose MoE layers have no shared expert,
and the DeepSeek ones for a model whose layers have one (Qwen2-MoE, a Qwen3-MoE with
``shared_expert_intermediate_size``, Llama-4, GLM-4.x); a layer with a shared expert refuses these (its
``required_ops``).

Without a shared expert, decode has nothing of its own to run between ``dispatch_a`` and the Yield: the other
microbatch's stages are what hide the dispatch.
"""

from __future__ import annotations

from tbo.core.strategy import OperationsStrategy
from tbo.strategies.deepseek import deepseek_decode, deepseek_prefill

__all__ = ["qwen3_moe_decode", "qwen3_moe_prefill"]


def qwen3_moe_decode(comm_num_sms: int | None = None, device_sms: int | None = None) -> OperationsStrategy:
    """`deepseek_decode` without the shared expert; the SM budget arguments are the same."""
    return deepseek_decode(comm_num_sms, device_sms).without(["shared_experts"], name="qwen3_moe_decode")


def qwen3_moe_prefill(comm_num_sms: int | None = None, device_sms: int | None = None) -> OperationsStrategy:
    """`deepseek_prefill` without the shared expert; the SM budget arguments are the same."""
    return deepseek_prefill(comm_num_sms, device_sms).without(["shared_experts"], name="qwen3_moe_prefill")
