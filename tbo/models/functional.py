"""The reference model's math: linear, RMSNorm, RoPE, SwiGLU and causal attention over a per-sequence cache.

Each has a batch-invariant form, in which one token's result never depends on the other tokens in the batch
(per-row matmuls, attention per query over exactly its visible keys); that is what lets an overlapped run of two
microbatches equal the single-batch forward bit for bit.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["linear", "pointwise", "rms_norm", "rope", "swiglu", "attend"]

#: Rows are padded to a multiple of this many elements for pointwise math in batch-invariant mode (see `pointwise`).
_LANES = 64


def linear(x: torch.Tensor, w: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """``x @ w`` for ``x[T, I]`` and ``w[I, O]``; batch-invariant: one M=1 product per row, whatever T is
    (a plain ``x @ w`` picks its kernel by T, and a gemv row differs from a gemm row in the last bit)."""
    if not batch_invariant:
        return x @ w
    return torch.bmm(x.unsqueeze(1), w.unsqueeze(0).expand(x.shape[0], *w.shape)).squeeze(1)


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """``fn(x)`` for an elementwise transcendental (exp, sigmoid, silu, cos, ...).

    Vectorised kernels compute full SIMD chunks with one algorithm and the leftover tail with another (scalar libm),
    so an element's last bit depends on where the batch makes it fall. Batch-invariant: each row is padded to a
    multiple of 64 elements first, so there is never a tail and every element takes the vector path.
    """
    width = x.shape[-1]
    if not batch_invariant or width % _LANES == 0:
        return fn(x)
    padded = F.pad(x, (0, _LANES - width % _LANES))
    return fn(padded)[..., :width]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, batch_invariant: bool = True) -> torch.Tensor:
    """Rotary embedding of ``x[T, heads, dim]`` at absolute ``positions[T]`` (rotate-half convention)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = (positions.double().unsqueeze(1) * inv_freq).to(x.dtype)  # [T, half]
    cos = pointwise(torch.cos, angles, batch_invariant).unsqueeze(1)
    sin = pointwise(torch.sin, angles, batch_invariant).unsqueeze(1)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
           batch_invariant: bool) -> torch.Tensor:
    h = pointwise(F.silu, linear(x, w_gate, batch_invariant), batch_invariant) * linear(x, w_up, batch_invariant)
    return linear(h, w_down, batch_invariant)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, batch_invariant: bool
           ) -> torch.Tensor:
    """Causal attention of ``q[n, h, d]`` (positions ``prefix_len ..``) over ``k, v[prefix_len + n, h, d]``."""
    n, d = q.shape[0], q.shape[-1]
    scale = d**-0.5
    if not batch_invariant:
        mask = torch.ones(n, k.shape[0], dtype=torch.bool).tril(prefix_len)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask, scale=scale)
        return out.transpose(0, 1)
    rows = []
    for i in range(n):  # query i sees keys [0, prefix_len + i]: exactly those, whatever else is in the batch
        visible = prefix_len + i + 1
        scores = (q[i].unsqueeze(1) * k[:visible].transpose(0, 1)).sum(-1) * scale  # [h, visible]
        probs = scores.softmax(-1)
        rows.append((probs.unsqueeze(-1) * v[:visible].transpose(0, 1)).sum(1))  # [h, d]
    return torch.stack(rows) if rows else q.new_zeros(q.shape)
