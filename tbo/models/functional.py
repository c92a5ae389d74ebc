"""The reference model's math: linear, RMSNorm, RoPE, SwiGLU and causal attention over a per-sequence cache.

Each has a batch-invariant form, in which one token's result never depends on the other tokens in the batch
(per-row matmuls, attention per query over exactly its visible keys); that is what lets an overlapped run of two
microbatches equal the single-batch forward bit for bit.

Everything is created on the input's device. Attention has three forms: `attend` (one sequence, the reference),
`attend_padded` (all sequences of a step in one padded, length-masked call: the fast mode over the growing cache),
and `attend_static` (keys from a preallocated cache over a fixed ``max_len`` with a position mask: fixed shapes, no
host reads, what a CUDA graph can capture).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["linear", "pointwise", "rms_norm", "rope", "swiglu", "attend", "attend_padded", "attend_static"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)

#: Rows are padded to a multiple of this many elements for pointwise math in batch-invariant mode (see `pointwise`).
_LANES = 64
#: Batch-invariant products pad their output rows to a multiple of this many elements (64 bytes in float32; see
#: `linear`).
_ROW_ALIGN = 16


def linear(x: torch.Tensor, w: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """``x @ w`` for ``x[T, I]`` and ``w[I, O]``; batch-invariant: one M=1 product per row, whatever T is
    (a plain ``x @ w`` picks its kernel by T, and a gemv row differs from a gemm row in the last bit). The output
    width is padded to a multiple of `_ROW_ALIGN` elements (zero columns, sliced off): a batched product's kernel
    may take another path for an output row that does not start on a 64-byte boundary, so with an odd width (a
    tensor-parallel shard of 33 columns, say) a row's last bit depended on its place in the batch (seen on an AMD
    EPYC CPU: rows 1 and 2 of 3 differed from the same rows alone)."""
    if not batch_invariant:
        return x @ w
    width = w.shape[-1]
    if width % _ROW_ALIGN:
        w = F.pad(w, (0, _ROW_ALIGN - width % _ROW_ALIGN))
    out = torch.bmm(x.unsqueeze(1), w.unsqueeze(0).expand(x.shape[0], *w.shape)).squeeze(1)
    return out[:, :width] if out.shape[-1] != width else out


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
    """RMSNorm; bf16/fp16 inputs are normalised in float32 (their mean of squares would lose most of its bits)."""
    if x.dtype in _LOW_PRECISION:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, batch_invariant: bool = True) -> torch.Tensor:
    """Rotary embedding of ``x[T, heads, dim]`` at absolute ``positions[T]`` (rotate-half convention)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    # angles in float32 at least: a bf16 angle at position 2000 is off by up to 8 radians
    angle_dtype = torch.float32 if x.dtype in _LOW_PRECISION else x.dtype
    angles = (positions.to(x.device).double().unsqueeze(1) * inv_freq).to(angle_dtype)  # [T, half]
    cos = pointwise(torch.cos, angles, batch_invariant).to(x.dtype).unsqueeze(1)
    sin = pointwise(torch.sin, angles, batch_invariant).to(x.dtype).unsqueeze(1)
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
        mask = torch.ones(n, k.shape[0], dtype=torch.bool, device=q.device).tril(prefix_len)
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


def attend_padded(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], extend_lens: list[int],
                  prefix_lens: list[int]) -> torch.Tensor:
    """Causal attention of every sequence of a step in one call: the fast (not batch-invariant) mode's path.

    ``q[T, h, d]`` holds the sequences' new tokens back to back (``extend_lens``, none empty); ``keys[s]`` and
    ``values[s]`` are sequence ``s``'s whole cache (``prefix_lens[s] + extend_lens[s]`` rows). Queries and keys are
    padded to the longest sequence and masked by position, so a step of S sequences is one attention call, not S.
    """
    device, num = q.device, len(extend_lens)
    nq, nk = max(extend_lens), max(k.shape[0] for k in keys)
    seq_of = torch.repeat_interleave(torch.arange(num), torch.tensor(extend_lens))
    row_of = torch.cat([torch.arange(n) for n in extend_lens])
    seq_of, row_of = seq_of.to(device), row_of.to(device)
    q_pad = q.new_zeros((num, nq, *q.shape[1:])).index_put_((seq_of, row_of), q)
    k_pad = torch.nn.utils.rnn.pad_sequence(keys, batch_first=True)  # [S, nk, h, d]
    v_pad = torch.nn.utils.rnn.pad_sequence(values, batch_first=True)
    # query i of sequence s sits at position prefix_s + i and sees keys [0, prefix_s + i]; padded keys lie beyond
    query_pos = torch.tensor(prefix_lens, device=device).unsqueeze(1) + torch.arange(nq, device=device)
    mask = torch.arange(nk, device=device) <= query_pos.unsqueeze(-1)  # [S, nq, nk]
    out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k_pad.transpose(1, 2), v_pad.transpose(1, 2),
                                         attn_mask=mask.unsqueeze(1), scale=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)[seq_of, row_of]


def attend_static(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_pos: torch.Tensor,
                  batch_invariant: bool) -> torch.Tensor:
    """Attention of queries ``q[S, n, h, d]`` over a fixed ``max_len`` of cached keys ``[S, max_len, h, d]``.

    Query ``(s, i)`` at position ``query_pos[s, i]`` sees keys ``[0, query_pos]`` (the length mask); every shape is
    fixed by the cache, not by the data. Batch-invariant: each query's scores are an elementwise product summed
    over ``d`` and a softmax over the fixed ``max_len``, the same arithmetic whatever else is in the batch.
    """
    max_len = k_cache.shape[1]
    visible = torch.arange(max_len, device=q.device) <= query_pos.unsqueeze(-1)  # [S, n, max_len]
    scale = q.shape[-1] ** -0.5
    if not batch_invariant:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                             attn_mask=visible.unsqueeze(1), scale=scale)
        return out.transpose(1, 2)
    k = k_cache.transpose(1, 2).unsqueeze(2)  # [S, h, 1, L, d]
    scores = (q.transpose(1, 2).unsqueeze(3) * k).sum(-1) * scale  # [S, h, n, L]
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = scores.softmax(-1)
    out = (probs.unsqueeze(-1) * v_cache.transpose(1, 2).unsqueeze(2)).sum(3)  # [S, h, n, d]
    return out.transpose(1, 2)
