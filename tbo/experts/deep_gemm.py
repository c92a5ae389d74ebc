"""SwiGLU experts as DeepGEMM grouped GEMMs (FP8 or BF16): the GPU expert runner for the MASKED and EXPANDED layouts.

DeepGEMM multiplies FP8 activations (one scale per token per 128 channels) by FP8 weights (one scale per 128x128
tile), or BF16 by BF16, in "NT" layout: weights are ``[groups, N, K]``. The masked GEMM takes DeepEP low-latency's
``[experts, capacity, H]`` with per-expert valid counts; the contiguous GEMM takes rows grouped by expert, each group
padded to DeepGEMM's row alignment, with a per-row group index (-1 for padding). The kernels' names changed across
DeepGEMM versions; `resolve_deep_gemm` finds whichever the installed version has. Written against DeepGEMM 2.x
(``sgl-deep-gemm`` 0.2.5: ``m_grouped_fp8_fp4_gemm_nt_*``, ``m_grouped_bf16_gemm_nt_*``), back to the first
release's ``m_grouped_gemm_fp8_fp8_bf16_nt_*`` for FP8.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from tbo.util.optional import require
from tbo.comm.fp8 import dequantize_per_token_group, quantize_per_block, quantize_per_token_group, ue8m0_wanted
from tbo.comm.types import DispatchFormat, DispatchOutput

__all__ = ["DEEP_GEMM_NAMES", "DeepGemmSwiGLUExperts", "contiguous_alignment", "resolve_deep_gemm"]

#: DeepGEMM renamed its grouped GEMMs across versions; newest first. Today's (DeepGEMM 2.x, ``sgl-deep-gemm``
#: 0.2.x) FP8 kernels are ``m_grouped_fp8_fp4_gemm_nt_*`` (FP8 or FP4 operands), with the older names as aliases;
#: the first releases called them ``m_grouped_gemm_fp8_fp8_bf16_nt_*``. The BF16 grouped GEMMs came with 2.0.
DEEP_GEMM_NAMES = {
    "masked": ("m_grouped_fp8_fp4_gemm_nt_masked", "m_grouped_fp8_gemm_nt_masked", "fp8_m_grouped_gemm_nt_masked",
               "m_grouped_gemm_fp8_fp8_bf16_nt_masked"),
    "contiguous": ("m_grouped_fp8_fp4_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_contiguous",
                   "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous"),
    "bf16_masked": ("m_grouped_bf16_gemm_nt_masked", "bf16_m_grouped_gemm_nt_masked"),
    "bf16_contiguous": ("m_grouped_bf16_gemm_nt_contiguous",),
    "alignment": ("get_mk_alignment_for_contiguous_layout", "get_m_alignment_for_contiguous_layout"),
}

#: DeepGEMM's row alignment for each group of the contiguous layout, when it cannot be asked.
M_ALIGNMENT = 128


def resolve_deep_gemm(kind: str) -> Callable:
    """The installed deep_gemm's function for ``kind`` (a key of `DEEP_GEMM_NAMES`), whatever its version calls it."""
    if kind not in DEEP_GEMM_NAMES:
        raise ValueError(f"unknown DeepGEMM layout {kind!r}; expected one of {sorted(DEEP_GEMM_NAMES)}")
    deep_gemm = require("deep_gemm", f"the DeepGEMM {kind} expert runner")
    for name in DEEP_GEMM_NAMES[kind]:
        fn = getattr(deep_gemm, name, None)
        if fn is not None:  # some versions set a retired alias to None
            return fn
    hint = " (the BF16 grouped GEMMs need DeepGEMM >= 2.0; precision='fp8' runs on older ones)" if (
        kind.startswith("bf16")) else ""
    raise ImportError(f"deep_gemm {getattr(deep_gemm, '__version__', '?')} has none of "
                      f"{', '.join(DEEP_GEMM_NAMES[kind])}{hint}")


def contiguous_alignment() -> int:
    """The row alignment DeepGEMM's contiguous layout needs per group, asked of deep_gemm when it can say."""
    try:
        return int(resolve_deep_gemm("alignment")())
    except ImportError:
        return M_ALIGNMENT


class DeepGemmSwiGLUExperts:
    """The local experts' SwiGLU MLPs, ``down(silu(gate(x)) * up(x))``, through DeepGEMM grouped GEMMs.

    ``w_gate``/``w_up`` are ``[L, H, I]`` and ``w_down`` ``[L, I, H]`` (the reference model's layout); they are
    transposed to NT layout once, here. ``precision="fp8"`` quantises them (128x128 blocks) and runs the FP8 GEMMs,
    quantising activations per token group; ``precision="bf16"`` keeps the weights BF16 and runs the BF16 grouped
    GEMMs with no FP8 quantisation anywhere (FP8-dispatched rows are dequantised to BF16 first). DeepGEMM's grouped
    GEMMs, FP8 and BF16, write BF16 only (FP8: ``csrc/apis/gemm.hpp:193`` contiguous, ``:275`` masked), so
    ``out_dtype`` must be bfloat16; cast the result if you need another dtype.

    ``ue8m0``: power-of-two scales for everything this runner quantises (weights, activations), which SM100's
    DeepGEMM needs (it truncates float scales to UE8M0, ``layout.hpp:49-53``); None asks the device
    (`tbo.comm.fp8.ue8m0_wanted`). Dispatched FP8 rows bring their own scales: on SM100 they must be UE8M0 too
    (DeepEP low-latency's ``use_ue8m0``, V2's ``round_scale``, both chosen the same way).

    ``expected_m`` is the masked GEMM's hint of rows per expert (it picks tile sizes). It is a host integer, so it
    is never read from the device counts: that would block the CPU and break CUDA-graph capture of the DeepEP
    low-latency path. None uses the capacity (the worst case); pass e.g. ``ceil(tokens * top_k / experts)``.
    """

    def __init__(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16, expected_m: int | None = None, *,
                 precision: str = "fp8", ue8m0: bool | None = None) -> None:
        if precision not in ("fp8", "bf16"):
            raise ValueError(f"precision must be 'fp8' or 'bf16', got {precision!r}")
        if out_dtype != torch.bfloat16:
            raise ValueError(f"out_dtype={out_dtype}: DeepGEMM's {precision.upper()} grouped GEMMs write bfloat16 "
                             "only; cast the result if you need another dtype")
        self.precision, self.out_dtype, self.expected_m = precision, out_dtype, expected_m
        self.ue8m0 = precision == "fp8" and (ue8m0_wanted() if ue8m0 is None else bool(ue8m0))
        self.intermediate = w_gate.shape[-1]
        w13 = torch.cat([w_gate, w_up], dim=-1).transpose(1, 2).contiguous()  # [L, 2I, H]
        w2 = w_down.transpose(1, 2).contiguous()  # [L, H, I]
        if precision == "fp8":
            self.w13: Any = quantize_per_block(w13, round_scale=self.ue8m0)
            self.w2: Any = quantize_per_block(w2, round_scale=self.ue8m0)
        else:
            self.w13, self.w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
        self._masked: Any = None
        self._contiguous: Any = None

    def _kernels(self) -> tuple[Any, Any]:
        if self._masked is None:
            prefix = "bf16_" if self.precision == "bf16" else ""
            self._masked = resolve_deep_gemm(f"{prefix}masked")
            self._contiguous = resolve_deep_gemm(f"{prefix}contiguous")
        return self._masked, self._contiguous

    def _act(self, gate_up: torch.Tensor) -> Any:
        """SiLU(gate) * up in float32, as the next GEMM's input: FP8 with scales, or BF16."""
        i = self.intermediate
        y = F.silu(gate_up[..., :i].float()) * gate_up[..., i:].float()
        return quantize_per_token_group(y, round_scale=self.ue8m0) if self.precision == "fp8" else y.to(torch.bfloat16)

    def __call__(self, dispatched: DispatchOutput) -> torch.Tensor:
        if dispatched.format is DispatchFormat.MASKED:
            return self._masked_path(dispatched)
        if dispatched.format is DispatchFormat.EXPANDED:
            return self._contiguous_path(dispatched)
        raise ValueError("DeepGEMM grouped GEMMs take the MASKED or EXPANDED layout; NORMAL needs run_experts")

    def _lhs(self, d: DispatchOutput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The dispatched rows as the first GEMM takes them: (FP8, scales), or (BF16, None)."""
        if self.precision == "fp8":
            return (d.hidden, d.scales) if d.scales is not None else quantize_per_token_group(
                d.hidden, round_scale=self.ue8m0)
        x = dequantize_per_token_group(d.hidden, d.scales) if d.scales is not None else d.hidden
        return x.to(torch.bfloat16), None

    @staticmethod
    def _operand(x: torch.Tensor, scales: torch.Tensor | None) -> Any:
        return x if scales is None else (x, scales)

    def _masked_path(self, d: DispatchOutput) -> torch.Tensor:
        masked, _ = self._kernels()
        groups, capacity, hidden = d.hidden.shape
        masked_m = d.tokens_per_expert.to(torch.int32)
        expected_m = max(1, self.expected_m if self.expected_m is not None else capacity)
        gate_up = torch.empty(groups, capacity, 2 * self.intermediate, dtype=self.out_dtype, device=d.hidden.device)
        masked(self._operand(*self._lhs(d)), self.w13, gate_up, masked_m, expected_m)
        out = torch.empty(groups, capacity, hidden, dtype=self.out_dtype, device=d.hidden.device)
        masked(self._act(gate_up), self.w2, out, masked_m, expected_m)
        return out

    def _contiguous_path(self, d: DispatchOutput) -> torch.Tensor:
        _, contiguous = self._kernels()
        align = contiguous_alignment()
        counts = d.tokens_per_expert.tolist()
        padded = [-(-n // align) * align for n in counts]
        x, scales = self._lhs(d)
        rows = x.new_zeros((sum(padded), x.shape[1]))
        row_scales = scales.new_ones((sum(padded), scales.shape[1])) if scales is not None else None
        m_indices = torch.full((sum(padded),), -1, dtype=torch.int32, device=x.device)
        src, dst, keep = 0, 0, []
        for e, (n, p) in enumerate(zip(counts, padded)):
            rows[dst : dst + n] = x[src : src + n]
            if row_scales is not None:
                row_scales[dst : dst + n] = scales[src : src + n]
            m_indices[dst : dst + n] = e
            keep.append(torch.arange(dst, dst + n, device=x.device))
            src, dst = src + n, dst + p
        gate_up = torch.empty(rows.shape[0], 2 * self.intermediate, dtype=self.out_dtype, device=x.device)
        contiguous(self._operand(rows, row_scales), self.w13, gate_up, m_indices)
        out = torch.empty(rows.shape[0], d.hidden.shape[1], dtype=self.out_dtype, device=x.device)
        contiguous(self._act(gate_up), self.w2, out, m_indices)
        return out[torch.cat(keep)] if keep else out[:0]
