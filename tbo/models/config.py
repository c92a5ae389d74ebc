"""`ModelConfig`: the shape of the reference DeepSeek-V3-style (or Qwen3-MoE-style) decoder."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, model_validator

__all__ = ["ModelConfig"]


class ModelConfig(BaseModel):
    """Sizes and switches of the reference model. Every rank building it from the same config gets the same weights.

    ``batch_invariant`` computes every matmul row by row (and attention per query over exactly its visible keys), so
    a token's result does not depend on which other tokens share its batch: the overlapped run then equals the
    plain forward bit for bit. Off, it is faster and agrees within float rounding.

    ``fast_attention`` picks the attention of that faster mode over a growing `KVCache`: ``"padded"``, every sequence
    of a step in one padded, length-masked call (one kernel instead of one per sequence: what a GPU needs);
    ``"per_sequence"``, a loop over sequences reading each cache in place (no copy of the cache: what a CPU runs
    fastest); ``"auto"``, padded off the CPU and per sequence on it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = 256
    hidden_size: int = 64
    num_heads: int = 4
    head_dim: int = 16
    num_layers: int = 4
    first_k_dense: int = 1
    dense_intermediate: int = 128
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 64
    num_shared_experts: int = 1
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0
    dtype: str = "float32"
    batch_invariant: bool = True
    fast_attention: Literal["auto", "padded", "per_sequence"] = "auto"

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise ValueError(f"first_k_dense={self.first_k_dense} must be in [0, num_layers={self.num_layers}]")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if not hasattr(torch, self.dtype) or not isinstance(getattr(torch, self.dtype), torch.dtype):
            raise ValueError(f"dtype={self.dtype!r} is not a torch dtype name")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @classmethod
    def scaled(cls, family: str, hidden_size: int, num_layers: int, *, head_dim: int = 16, ffn_multiple: int = 1,
               **overrides: object) -> "ModelConfig":
        """A ``family`` ("deepseek" or "qwen3_moe") model whose widths follow ``hidden_size``: heads of about
        ``head_dim``, experts ``ffn_multiple`` x hidden wide, dense MLPs twice that. What workloads and benchmarks
        build."""
        make = {"deepseek": cls.deepseek_v3_tiny, "qwen3_moe": cls.qwen3_moe_tiny}[family]
        heads = max(1, hidden_size // head_dim)
        return make(**{"hidden_size": hidden_size, "num_heads": heads, "head_dim": hidden_size // heads,
                       "num_layers": num_layers, "moe_intermediate": ffn_multiple * hidden_size,
                       "dense_intermediate": 2 * ffn_multiple * hidden_size, **overrides})

    @classmethod
    def deepseek_v3_tiny(cls, **overrides: object) -> "ModelConfig":
        """DeepSeek-V3-shaped: dense first layer, shared expert, sigmoid scoring with normalised top-k."""
        return cls(**{"scoring": "sigmoid", "num_shared_experts": 1, "first_k_dense": 1, **overrides})

    @classmethod
    def qwen3_moe_tiny(cls, **overrides: object) -> "ModelConfig":
        """Qwen3-MoE-shaped: every layer MoE, no shared expert, softmax scoring with normalised top-k."""
        return cls(**{"scoring": "softmax", "num_shared_experts": 0, "first_k_dense": 0, **overrides})
