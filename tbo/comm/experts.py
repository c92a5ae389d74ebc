"""Expert compute for each dispatch format, in plain torch, with DeepGEMM grouped GEMMs where they exist.

An expert is ``fn(local_expert, rows) -> rows``. The runners group rows by local expert and call it once per expert
with that expert's rows, in arrival order, so every backend feeds every expert the very same matrix.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import torch

from .._optional import require
from .fp8 import dequantize_per_token_group
from .types import DispatchFormat, DispatchOutput

__all__ = ["ExpertFn", "run_experts", "resolve_deep_gemm", "DEEP_GEMM_NAMES"]

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
    counts = dispatched.tokens_per_expert.tolist()
    if dispatched.format is DispatchFormat.EXPANDED:
        return _run_grouped(dispatched.hidden, counts, fn)
    if dispatched.format is DispatchFormat.MASKED:
        return _run_masked(dispatched.hidden, counts, fn)
    return _run_normal(dispatched, fn)


#: DeepGEMM renamed its grouped GEMMs across versions; newest first.
DEEP_GEMM_NAMES = {
    "masked": ("fp8_m_grouped_gemm_nt_masked", "m_grouped_fp8_gemm_nt_masked", "m_grouped_gemm_fp8_fp8_bf16_nt_masked"),
    "contiguous": ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous"),
}


def resolve_deep_gemm(kind: str) -> Callable:
    """The installed deep_gemm's grouped GEMM for ``kind`` ("masked" or "contiguous"), whatever its version calls it."""
    if kind not in DEEP_GEMM_NAMES:
        raise ValueError(f"unknown DeepGEMM layout {kind!r}; expected one of {sorted(DEEP_GEMM_NAMES)}")
    deep_gemm = require("deep_gemm", f"the DeepGEMM {kind} expert runner")
    for name in DEEP_GEMM_NAMES[kind]:
        fn = getattr(deep_gemm, name, None)
        if fn is not None:
            return fn
    raise ImportError(f"deep_gemm {getattr(deep_gemm, '__version__', '?')} has none of {DEEP_GEMM_NAMES[kind]}")
