"""Expert compute for each dispatch format, in plain torch: the reference runner every backend's output feeds.

An expert is ``fn(local_expert, rows) -> rows``. The runners group rows by local expert and call it once per expert
with that expert's rows, in arrival order, so every backend feeds every expert the very same matrix.

MASKED off the CPU is capture-safe: each expert runs on its whole ``[capacity, H]`` slab and rows beyond its count
are zeroed (what a masked grouped GEMM does), so no count is read on the host. On the CPU, where reading the counts
costs no device sync, each expert runs on exactly its rows; for a batch-invariant expert both give the same rows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import torch

from tbo.comm.fp8 import dequantize_per_token_group
from tbo.comm.types import DispatchFormat, DispatchOutput

__all__ = ["ExpertFn", "run_experts"]

ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def _run_grouped(rows: torch.Tensor, counts: Sequence[int], fn: ExpertFn) -> torch.Tensor:
    out = torch.empty_like(rows)
    offset = 0
    for e, n in enumerate(counts):
        if n:
            out[offset : offset + n] = fn(e, rows[offset : offset + n])
        offset += n
    return out


def _run_masked(hidden: torch.Tensor, counts: Sequence[int], fn: ExpertFn) -> torch.Tensor:
    out = torch.zeros_like(hidden)
    for e, n in enumerate(counts):
        if n:
            out[e, :n] = fn(e, hidden[e, :n])
    return out


def _run_masked_static(hidden: torch.Tensor, counts: torch.Tensor, fn: ExpertFn) -> torch.Tensor:
    """Every expert on its whole slab, rows at or beyond its count zeroed: fixed shapes, no host read."""
    num_experts, capacity = hidden.shape[0], hidden.shape[1]
    valid = (torch.arange(capacity, device=hidden.device) < counts.to(hidden.device).unsqueeze(1)).unsqueeze(-1)
    zero = hidden.new_zeros(())
    return torch.stack([torch.where(valid[e], fn(e, hidden[e]).to(hidden.dtype), zero) for e in range(num_experts)])


def _run_normal(d: DispatchOutput, fn: ExpertFn) -> torch.Tensor:
    assert d.topk_idx is not None and d.topk_weights is not None
    out = torch.zeros(d.hidden.shape, dtype=torch.float32, device=d.hidden.device)
    for e in range(d.num_local_experts):
        token, slot = torch.nonzero(d.topk_idx == e, as_tuple=True)
        if token.numel():
            y = fn(e, d.hidden[token]).float() * d.topk_weights[token, slot].float().unsqueeze(1)
            out.index_add_(0, token, y)
    return out.to(d.hidden.dtype)


def run_experts(dispatched: DispatchOutput, fn: ExpertFn) -> torch.Tensor:
    """Apply each local expert to its rows; the result has the layout ``combine_a`` expects for that format.

    NORMAL output is already weighted by ``topk_weights`` (DeepEP normal combine only adds); EXPANDED and MASKED
    outputs are not (their combine applies the weights).
    """
    if dispatched.scales is not None:  # FP8 rows: the plain-torch runner computes in float32
        dispatched = replace(dispatched, hidden=dequantize_per_token_group(dispatched.hidden, dispatched.scales),
                             scales=None)
    if dispatched.format is DispatchFormat.MASKED:
        if dispatched.hidden.device.type != "cpu":
            return _run_masked_static(dispatched.hidden, dispatched.tokens_per_expert, fn)
        return _run_masked(dispatched.hidden, dispatched.tokens_per_expert.tolist(), fn)
    if dispatched.format is DispatchFormat.EXPANDED:
        return _run_grouped(dispatched.hidden, dispatched.tokens_per_expert.tolist(), fn)
    return _run_normal(dispatched, fn)
