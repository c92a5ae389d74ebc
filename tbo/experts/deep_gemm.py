"""SwiGLU experts as DeepGEMM FP8 grouped GEMMs: the GPU expert runner for the MASKED and EXPANDED layouts.

DeepGEMM multiplies FP8 activations (one scale per token per 128 channels) by FP8 weights (one scale per 128x128
tile) in "NT" layout: weights are ``[groups, N, K]``. The masked GEMM takes DeepEP low-latency's
``[experts, capacity, H]`` with per-expert valid counts; the contiguous GEMM takes rows grouped by expert, each group
padded to DeepGEMM's row alignment, with a per-row group index (-1 for padding). The kernels' names changed across
DeepGEMM versions; `resolve_deep_gemm` finds whichever the installed version has.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from tbo.util.optional import require
from tbo.experts.fp8 import quantize_per_block, quantize_per_token_group
from tbo.comm.types import DispatchFormat, DispatchOutput

__all__ = ["DEEP_GEMM_NAMES", "DeepGemmSwiGLUExperts", "resolve_deep_gemm"]

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


#: DeepGEMM's row alignment for each group of the contiguous layout.
M_ALIGNMENT = 128


class DeepGemmSwiGLUExperts:
    """The local experts' SwiGLU MLPs, ``down(silu(gate(x)) * up(x))``, through DeepGEMM.

    ``w_gate``/``w_up`` are ``[L, H, I]`` and ``w_down`` ``[L, I, H]`` (the reference model's layout); they are
    transposed to NT layout and quantised once, here.

    ``expected_m`` is the masked GEMM's hint of rows per expert (it picks tile sizes). It is a host integer, so it
    is never read from the device counts: that would block the CPU and break CUDA-graph capture of the DeepEP
    low-latency path. None uses the capacity (the worst case); pass e.g. ``ceil(tokens * top_k / experts)``.
    """

    def __init__(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16, expected_m: int | None = None) -> None:
        self.expected_m = expected_m
        self.intermediate = w_gate.shape[-1]
        self.w13 = quantize_per_block(torch.cat([w_gate, w_up], dim=-1).transpose(1, 2).contiguous())  # [L, 2I, H]
        self.w2 = quantize_per_block(w_down.transpose(1, 2).contiguous())  # [L, H, I]
        self.out_dtype = out_dtype
        self._masked: Any = None
        self._contiguous: Any = None

    def _kernels(self) -> tuple[Any, Any]:
        if self._masked is None:
            self._masked, self._contiguous = resolve_deep_gemm("masked"), resolve_deep_gemm("contiguous")
        return self._masked, self._contiguous

    def _act(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.intermediate
        return quantize_per_token_group(F.silu(gate_up[..., :i].float()) * gate_up[..., i:].float())

    def __call__(self, dispatched: DispatchOutput) -> torch.Tensor:
        if dispatched.format is DispatchFormat.MASKED:
            return self._masked_path(dispatched)
        if dispatched.format is DispatchFormat.EXPANDED:
            return self._contiguous_path(dispatched)
        raise ValueError("DeepGEMM grouped GEMMs take the MASKED or EXPANDED layout; NORMAL needs run_experts")

    def _lhs(self, d: DispatchOutput) -> tuple[torch.Tensor, torch.Tensor]:
        return (d.hidden, d.scales) if d.scales is not None else quantize_per_token_group(d.hidden)

    def _masked_path(self, d: DispatchOutput) -> torch.Tensor:
        masked, _ = self._kernels()
        groups, capacity, hidden = d.hidden.shape
        masked_m = d.tokens_per_expert.to(torch.int32)
        expected_m = max(1, self.expected_m if self.expected_m is not None else capacity)
        gate_up = torch.empty(groups, capacity, 2 * self.intermediate, dtype=self.out_dtype, device=d.hidden.device)
        masked(self._lhs(d), self.w13, gate_up, masked_m, expected_m)
        out = torch.empty(groups, capacity, hidden, dtype=self.out_dtype, device=d.hidden.device)
        masked(self._act(gate_up), self.w2, out, masked_m, expected_m)
        return out

    def _contiguous_path(self, d: DispatchOutput) -> torch.Tensor:
        _, contiguous = self._kernels()
        counts = d.tokens_per_expert.tolist()
        padded = [-(-n // M_ALIGNMENT) * M_ALIGNMENT for n in counts]
        x, scales = self._lhs(d)
        rows = x.new_zeros((sum(padded), x.shape[1]))
        row_scales = scales.new_ones((sum(padded), scales.shape[1]))
        m_indices = torch.full((sum(padded),), -1, dtype=torch.int32, device=x.device)
        src, dst, keep = 0, 0, []
        for e, (n, p) in enumerate(zip(counts, padded)):
            rows[dst : dst + n], row_scales[dst : dst + n] = x[src : src + n], scales[src : src + n]
            m_indices[dst : dst + n] = e
            keep.append(torch.arange(dst, dst + n, device=x.device))
            src, dst = src + n, dst + p
        gate_up = torch.empty(rows.shape[0], 2 * self.intermediate, dtype=self.out_dtype, device=x.device)
        contiguous((rows, row_scales), self.w13, gate_up, m_indices)
        out = torch.empty(rows.shape[0], d.hidden.shape[1], dtype=self.out_dtype, device=x.device)
        contiguous(self._act(gate_up), self.w2, out, m_indices)
        return out[torch.cat(keep)] if keep else out[:0]
