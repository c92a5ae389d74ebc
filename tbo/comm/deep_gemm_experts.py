"""SwiGLU experts as DeepGEMM FP8 grouped GEMMs: the GPU expert runner for the MASKED and EXPANDED layouts.

DeepGEMM multiplies FP8 activations (one scale per token per 128 channels) by FP8 weights (one scale per 128x128
tile) in "NT" layout: weights are ``[groups, N, K]``. The masked GEMM takes DeepEP low-latency's
``[experts, capacity, H]`` with per-expert valid counts; the contiguous GEMM takes rows grouped by expert, each group
padded to DeepGEMM's row alignment, with a per-row group index (-1 for padding). The kernels' names changed across
DeepGEMM versions; `resolve_deep_gemm` finds whichever the installed version has.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .experts import resolve_deep_gemm
from .fp8 import quantize_per_block, quantize_per_token_group
from .types import DispatchFormat, DispatchOutput

__all__ = ["DeepGemmSwiGLUExperts"]

#: DeepGEMM's row alignment for each group of the contiguous layout.
M_ALIGNMENT = 128


class DeepGemmSwiGLUExperts:
    """The local experts' SwiGLU MLPs, ``down(silu(gate(x)) * up(x))``, through DeepGEMM.

    ``w_gate``/``w_up`` are ``[L, H, I]`` and ``w_down`` ``[L, I, H]`` (the reference model's layout); they are
    transposed to NT layout and quantised once, here.
    """

    def __init__(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16) -> None:
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
        expected_m = max(1, int(masked_m.max())) if masked_m.numel() else 1
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
