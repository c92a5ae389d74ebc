"""Qwen3-MoE strategies: the DeepSeek shapes without the shared expert, which Qwen3-MoE does not have.

Without a shared expert, decode has nothing of its own to run between ``dispatch_a`` and the Yield: the other
microbatch's stages are what hide the dispatch.
"""

from __future__ import annotations

from tbo.core.strategy import OperationsStrategy
from tbo.strategies.deepseek import deepseek_decode, deepseek_prefill

__all__ = ["qwen3_moe_decode", "qwen3_moe_prefill"]


def qwen3_moe_decode() -> OperationsStrategy:
    return deepseek_decode().without(["shared_experts"], name="qwen3_moe_decode")


def qwen3_moe_prefill() -> OperationsStrategy:
    return deepseek_prefill().without(["shared_experts"], name="qwen3_moe_prefill")
