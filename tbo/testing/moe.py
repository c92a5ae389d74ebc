"""Deterministic MoE pieces for tests and benchmarks: SwiGLU experts, skewed routing, and a dense reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tbo.experts import ExpertFn

__all__ = ["SwiGLUExperts", "make_routing", "dense_moe_reference"]


@dataclass
class SwiGLUExperts:
    """``num_experts`` SwiGLU MLPs with seeded weights; every rank builds the same ones and uses its slice."""

    w_gate: torch.Tensor  # [E, H, I]
    w_up: torch.Tensor  # [E, H, I]
    w_down: torch.Tensor  # [E, I, H]

    @classmethod
    def build(cls, num_experts: int, hidden: int, intermediate: int, seed: int = 0,
              dtype: torch.dtype = torch.float32) -> "SwiGLUExperts":
        g = torch.Generator().manual_seed(seed)
        scale_in, scale_out = hidden**-0.5, intermediate**-0.5
        return cls(
            (torch.randn(num_experts, hidden, intermediate, generator=g) * scale_in).to(dtype),
            (torch.randn(num_experts, hidden, intermediate, generator=g) * scale_in).to(dtype),
            (torch.randn(num_experts, intermediate, hidden, generator=g) * scale_out).to(dtype),
        )

    def __call__(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.silu(x @ self.w_gate[expert]) * (x @ self.w_up[expert])) @ self.w_down[expert]

    def local(self, rank: int, num_local_experts: int) -> ExpertFn:
        """The expert function of one rank: local expert ``e`` is global expert ``rank * L + e``."""
        base = rank * num_local_experts
        return lambda e, x: self(base + e, x)


def make_routing(num_tokens: int, num_experts: int, top_k: int, seed: int = 0, skew: float = 2.0,
                 drop: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert choices with a skewed popularity (uneven routing), distinct per token, softmax weights.

    ``drop`` is the probability that a slot is -1 (no expert), which routers with capacity limits produce.
    """
    g = torch.Generator().manual_seed(seed)
    popularity = torch.arange(num_experts, 0, -1, dtype=torch.float32) ** skew
    idx = torch.stack([torch.multinomial(popularity, top_k, replacement=False, generator=g)
                       for _ in range(num_tokens)]) if num_tokens else torch.zeros(0, top_k, dtype=torch.long)
    weights = torch.randn(num_tokens, top_k, generator=g).softmax(-1)
    if drop > 0 and num_tokens:
        idx = torch.where(torch.rand(idx.shape, generator=g) < drop, torch.full_like(idx, -1), idx)
    return idx.long(), weights


def dense_moe_reference(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, experts: SwiGLUExperts
                        ) -> torch.Tensor:
    """``sum_k w_k * expert_{e_k}(x)`` token by token: slow, obviously right, independent of any backend."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                out[t] += weights[t, k] * experts(e, x[t : t + 1])[0]
    return out
