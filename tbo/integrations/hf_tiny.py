"""Tiny DeepseekV3 / Qwen3-MoE configurations with seeded random weights: no download, milliseconds on CPU."""

from __future__ import annotations

from typing import Any

import torch

from tbo.util.optional import extra_hint, require

__all__ = ["tiny_model", "MODELS"]

MODELS = ("deepseek_v3", "qwen3_moe")


def tiny_model(name: str, seed: int = 0, attn_implementation: str = "sdpa", num_experts: int = 8) -> Any:
    """A 3-layer, hidden-64 causal LM of the named family, in eval mode."""
    transformers = require("transformers", f"tbo.integrations.hf_tiny ({extra_hint('hf')})")
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_experts_per_tok=2,
                  attn_implementation=attn_implementation)
    if name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_key_value_heads=2, head_dim=16, num_experts=num_experts, **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif name == "deepseek_v3":
        config = transformers.DeepseekV3Config(num_key_value_heads=4, n_routed_experts=num_experts, n_group=2,
                                               topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **common)
        cls = transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.generation_config.eos_token_id = None  # random weights: generate exactly max_new_tokens, as HF would
    model.generation_config.pad_token_id = 0
    return model
