"""A CPU stand-in for ``deep_gemm``'s grouped FP8 GEMMs and SM budget, keeping their argument contracts.

DeepGEMM needs an SM90+ GPU. This module has the same functions (under the newest names, or only the oldest names
with ``install(old_names=True)``), computes in float32 from the dequantised FP8 inputs, and rejects what DeepGEMM
rejects: non-FP8 operands, scales of the wrong shape, an output of the wrong shape, or masked counts past capacity.
"""

from __future__ import annotations

import sys
import types

import torch

from tbo.experts.fp8 import dequantize_per_block, dequantize_per_token_group

__all__ = ["install", "DeepGemmContractError"]


class DeepGemmContractError(RuntimeError):
    """A call DeepGEMM would reject."""


def _check_fp8(name: str, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, s = pair
    if q.dtype != torch.float8_e4m3fn:
        raise DeepGemmContractError(f"{name} must be float8_e4m3fn, got {q.dtype}")
    if s.dtype != torch.float32:
        raise DeepGemmContractError(f"{name} scales must be float32, got {s.dtype}")


def _lhs_rhs(lhs: tuple, rhs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    _check_fp8("lhs", lhs)
    _check_fp8("rhs", rhs)
    k = lhs[0].shape[-1]
    if lhs[1].shape[-1] != k // 128:
        raise DeepGemmContractError(f"lhs scales must be per token per 128 channels ([..., {k // 128}])")
    if rhs[0].shape[-1] != k or tuple(rhs[1].shape[-2:]) != (rhs[0].shape[-2] // 128, k // 128):
        raise DeepGemmContractError("rhs must be [groups, N, K] (NT) with [groups, N/128, K/128] block scales")
    return dequantize_per_token_group(*lhs), dequantize_per_block(*rhs)


def m_grouped_masked(lhs: tuple, rhs: tuple, out: torch.Tensor, masked_m: torch.Tensor, expected_m: int) -> None:
    a, b = _lhs_rhs(lhs, rhs)
    groups, capacity, _ = a.shape
    if tuple(out.shape) != (groups, capacity, b.shape[1]):
        raise DeepGemmContractError(f"out must be {(groups, capacity, b.shape[1])}, got {tuple(out.shape)}")
    if masked_m.dtype != torch.int32 or (masked_m.numel() and int(masked_m.max()) > capacity):
        raise DeepGemmContractError("masked_m must be int32 counts no larger than the capacity")
    for g in range(groups):
        m = int(masked_m[g])
        out[g, :m] = (a[g, :m] @ b[g].T).to(out.dtype)


def m_grouped_contiguous(lhs: tuple, rhs: tuple, out: torch.Tensor, m_indices: torch.Tensor) -> None:
    a, b = _lhs_rhs(lhs, rhs)
    if a.shape[0] % 128:
        raise DeepGemmContractError("contiguous lhs rows must be padded to a multiple of 128 per group")
    if tuple(out.shape) != (a.shape[0], b.shape[1]) or m_indices.shape[0] != a.shape[0]:
        raise DeepGemmContractError("out must be [M, N] and m_indices [M]")
    for g in range(b.shape[0]):
        rows = torch.nonzero(m_indices == g).flatten()
        if rows.numel():
            out[rows] = (a[rows] @ b[g].T).to(out.dtype)


def install(monkeypatch, old_names: bool = False) -> types.ModuleType:
    """Put the stand-in in ``sys.modules`` as ``deep_gemm`` for a test (through pytest's monkeypatch)."""
    mod = types.ModuleType("deep_gemm")
    mod.__version__ = "standin-old" if old_names else "standin"
    masked_name = "m_grouped_gemm_fp8_fp8_bf16_nt_masked" if old_names else "fp8_m_grouped_gemm_nt_masked"
    contiguous_name = "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous" if old_names else "m_grouped_fp8_gemm_nt_contiguous"
    setattr(mod, masked_name, m_grouped_masked)
    setattr(mod, contiguous_name, m_grouped_contiguous)
    state = {"sms": 132}
    mod.get_num_sms = lambda: state["sms"]
    mod.set_num_sms = lambda n: state.__setitem__("sms", n)
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)
    return mod
