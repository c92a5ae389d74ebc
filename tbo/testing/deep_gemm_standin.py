"""A CPU stand-in for ``deep_gemm``'s grouped GEMMs (FP8 and BF16) and SM budget, keeping their argument contracts.

DeepGEMM needs an SM90+ GPU. This module has the same functions under the names of a chosen DeepGEMM generation,
computes in float32 from the (dequantised) inputs, and rejects what DeepGEMM rejects:

* FP8 GEMMs: non-FP8 operands, scales of the wrong dtype or shape, an output that is not bfloat16 (the FP8
  grouped GEMMs write BF16 only: DeepGEMM 54e22612 ``csrc/apis/gemm.hpp:193`` contiguous, ``:275`` masked);
  the scales the device takes (``install(arch=...)``): float32 on SM90 (``arch=9``, the default; packed int32
  UE8M0 is SM100's, ``gemm.hpp:286-295``), and on SM100 (``arch=10``) packed int32 UE8M0 or float32 scales that are
  powers of two: SM100 truncates float scales to their exponent (``layout.hpp:49-53``, ``smxx_layout.hpp:159``),
  which silently changes any other value, so here it raises;
* BF16 GEMMs: operands or output that are not bfloat16;
* both: an output of the wrong shape, weights that are not ``[groups, N, K]`` (NT) for the ``K`` of the rows;
  masked counts that are not int32, negative, or past the capacity, an ``expected_m`` that is not a positive int;
  contiguous rows not padded to the alignment (``get_mk_alignment_for_contiguous_layout()``, 128), an aligned block
  of rows that mixes groups, or ``m_indices`` that is not int32 ``[M]`` in ``[-1, groups)``.

Generations (``install(generation=...)``):

* ``"fp8_fp4"`` (DeepGEMM 2.x, ``sgl-deep-gemm`` 0.2.x): ``m_grouped_fp8_fp4_gemm_nt_masked`` /
  ``_contiguous`` with the aliases ``m_grouped_fp8_gemm_nt_*`` and ``fp8_m_grouped_gemm_nt_masked``, the BF16
  grouped GEMMs ``m_grouped_bf16_gemm_nt_masked`` (alias ``bf16_m_grouped_gemm_nt_masked``) and
  ``m_grouped_bf16_gemm_nt_contiguous``, and ``get_mk_alignment_for_contiguous_layout``;
* ``"fp8"``: the same before FP4, ``m_grouped_fp8_gemm_nt_*`` first;
* ``"legacy"`` (``old_names=True``): the first release's ``m_grouped_gemm_fp8_fp8_bf16_nt_*`` only, no BF16.

Each GEMM call is logged by its canonical name in the module's ``calls`` list, so a test can see which kernels ran.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

import torch

from tbo.comm.fp8 import dequantize_per_block, dequantize_per_token_group

__all__ = ["install", "DeepGemmContractError", "GENERATIONS", "ALIGNMENT"]

#: rows per group of the contiguous layout, as ``get_mk_alignment_for_contiguous_layout()`` says on SM90
ALIGNMENT = 128

#: the device's compute-capability major the stand-in plays (``install(arch=...)``): 9 (SM90) or 10 (SM100)
_DEVICE = {"arch": 9}


class DeepGemmContractError(RuntimeError):
    """A call DeepGEMM would reject."""


def _check_fp8(name: str, pair: Any) -> None:
    if not isinstance(pair, tuple) or len(pair) != 2:
        raise DeepGemmContractError(f"{name} of an FP8 GEMM must be an (FP8 tensor, scales) pair, got "
                                    f"{type(pair).__name__}")
    q, s = pair
    arch = _DEVICE["arch"]
    if q.dtype != torch.float8_e4m3fn:
        raise DeepGemmContractError(f"{name} must be float8_e4m3fn, got {q.dtype}")
    if s.dtype == torch.int32 and name == "lhs" and arch == 10:
        return  # packed UE8M0, four exponents per int32
    if s.dtype != torch.float32:
        raise DeepGemmContractError(f"{name} scales must be float32 on SM{arch}0 (Unsupported architecture or scaling "
                                    f"factor types), got {s.dtype}")


def _check_ue8m0_castable(name: str, scales: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """On SM100, float32 scales of the rows the GEMM reads (``rows``: a mask over the leading dims) must be powers
    of two: DeepGEMM keeps only their exponent."""
    if _DEVICE["arch"] != 10 or scales.dtype != torch.float32:
        return
    used = scales if rows is None else scales[rows]
    if bool(((used.contiguous().view(torch.int32) & 0x7FFFFF) != 0).any()):
        raise DeepGemmContractError(
            f"{name} scales are not powers of two: SM100 casts float32 scales to UE8M0 by keeping only their "
            "exponent, which changes these values; quantise with power-of-two scales (round_scale)")


def _fp8_operands(lhs: Any, rhs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    _check_fp8("lhs", lhs)
    _check_fp8("rhs", rhs)
    k = lhs[0].shape[-1]
    groups = -(-k // 512) if lhs[1].dtype == torch.int32 else k // 128
    if lhs[1].shape[-1] != groups:
        raise DeepGemmContractError(f"lhs scales must be per token per 128 channels ([..., {groups}]"
                                    f"{' int32, four per int' if lhs[1].dtype == torch.int32 else ''})")
    if rhs[0].shape[-1] != k or tuple(rhs[1].shape[-2:]) != (rhs[0].shape[-2] // 128, k // 128):
        raise DeepGemmContractError("rhs must be [groups, N, K] (NT) with [groups, N/128, K/128] block scales")
    return dequantize_per_token_group(*lhs), dequantize_per_block(*rhs)


def _bf16_operands(a: Any, b: Any, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    for name, t in (("a", a), ("b", b), ("d", d)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise DeepGemmContractError(f"{name} of a BF16 GEMM must be a bfloat16 tensor, got {got}")
    if b.dim() != 3 or b.shape[-1] != a.shape[-1]:
        raise DeepGemmContractError(f"b must be [groups, N, K] (NT) with K={a.shape[-1]}, got {tuple(b.shape)}")
    return a.float(), b.float()


def _check_masked(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, masked_m: torch.Tensor,
                  expected_m: Any) -> None:
    if a.dim() != 3 or b.dim() != 3 or b.shape[0] != a.shape[0]:
        raise DeepGemmContractError(f"masked: a must be [groups, capacity, K] and b [groups, N, K] with the same "
                                    f"groups, got {tuple(a.shape)} and {tuple(b.shape)}")
    groups, capacity = a.shape[0], a.shape[1]
    if tuple(out.shape) != (groups, capacity, b.shape[1]):
        raise DeepGemmContractError(f"out must be {(groups, capacity, b.shape[1])}, got {tuple(out.shape)}")
    if masked_m.dtype != torch.int32 or tuple(masked_m.shape) != (groups,):
        raise DeepGemmContractError(f"masked_m must be int32 [{groups}], got {masked_m.dtype} {tuple(masked_m.shape)}")
    if masked_m.numel() and (int(masked_m.min()) < 0 or int(masked_m.max()) > capacity):
        raise DeepGemmContractError(f"masked_m must be counts in [0, {capacity}] (the capacity), got "
                                    f"{masked_m.tolist()}")
    if isinstance(expected_m, bool) or not isinstance(expected_m, int) or expected_m < 1:
        raise DeepGemmContractError(f"expected_m must be a positive int (the expected rows per group), got "
                                    f"{expected_m!r}")


def _masked(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, masked_m: torch.Tensor) -> None:
    for g in range(a.shape[0]):
        m = int(masked_m[g])
        out[g, :m] = (a[g, :m] @ b[g].T).to(out.dtype)


def _check_contiguous(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, m_indices: torch.Tensor) -> None:
    m = a.shape[0]
    if m % ALIGNMENT:
        raise DeepGemmContractError(f"contiguous: {m} rows; each group must be padded to a multiple of {ALIGNMENT}")
    if tuple(out.shape) != (m, b.shape[1]):
        raise DeepGemmContractError(f"out must be [{m}, {b.shape[1]}], got {tuple(out.shape)}")
    if m_indices.dtype != torch.int32 or tuple(m_indices.shape) != (m,):
        raise DeepGemmContractError(f"m_indices must be int32 [{m}], got {m_indices.dtype} {tuple(m_indices.shape)}")
    if m and (int(m_indices.min()) < -1 or int(m_indices.max()) >= b.shape[0]):
        raise DeepGemmContractError(f"m_indices must be in [-1, {b.shape[0]}), got [{int(m_indices.min())}, "
                                    f"{int(m_indices.max())}]")
    for block, ids in enumerate(m_indices.view(-1, ALIGNMENT)):
        groups = set(ids[ids >= 0].tolist())
        if len(groups) > 1:
            raise DeepGemmContractError(f"contiguous: rows {block * ALIGNMENT}..{(block + 1) * ALIGNMENT - 1} mix "
                                        f"groups {sorted(groups)}; a group must start on a {ALIGNMENT}-row boundary")


def _contiguous(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, m_indices: torch.Tensor) -> None:
    for g in range(b.shape[0]):
        rows = torch.nonzero(m_indices == g).flatten()
        if rows.numel():
            out[rows] = (a[rows] @ b[g].T).to(out.dtype)


def _check_fp8_out(out: torch.Tensor) -> None:
    if out.dtype != torch.bfloat16:
        raise DeepGemmContractError(f"the output of an FP8 grouped GEMM must be bfloat16, got {out.dtype}")


def m_grouped_fp8_masked(lhs: Any, rhs: Any, out: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
                         **_options: Any) -> None:
    a, b = _fp8_operands(lhs, rhs)
    _check_fp8_out(out)
    _check_masked(a, b, out, masked_m, expected_m)
    _check_ue8m0_castable("lhs", lhs[1], torch.arange(a.shape[1]) < masked_m.unsqueeze(1))
    _check_ue8m0_castable("rhs", rhs[1])
    _masked(a, b, out, masked_m)


def m_grouped_fp8_contiguous(lhs: Any, rhs: Any, out: torch.Tensor, m_indices: torch.Tensor,
                             **_options: Any) -> None:
    a, b = _fp8_operands(lhs, rhs)
    _check_fp8_out(out)
    _check_contiguous(a, b, out, m_indices)
    _check_ue8m0_castable("lhs", lhs[1], m_indices >= 0)
    _check_ue8m0_castable("rhs", rhs[1])
    _contiguous(a, b, out, m_indices)


def m_grouped_bf16_masked(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, masked_m: torch.Tensor,
                          expected_m: int, **_options: Any) -> None:
    fa, fb = _bf16_operands(a, b, out)
    _check_masked(fa, fb, out, masked_m, expected_m)
    _masked(fa, fb, out, masked_m)


def m_grouped_bf16_contiguous(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, m_indices: torch.Tensor,
                              **_options: Any) -> None:
    fa, fb = _bf16_operands(a, b, out)
    _check_contiguous(fa, fb, out, m_indices)
    _contiguous(fa, fb, out, m_indices)


#: generation -> {canonical name: (implementation, aliases)}
GENERATIONS: dict[str, dict[str, tuple[Callable, tuple[str, ...]]]] = {
    "fp8_fp4": {
        "m_grouped_fp8_fp4_gemm_nt_masked": (m_grouped_fp8_masked, ("m_grouped_fp8_gemm_nt_masked",
                                                                     "fp8_m_grouped_gemm_nt_masked")),
        "m_grouped_fp8_fp4_gemm_nt_contiguous": (m_grouped_fp8_contiguous, ("m_grouped_fp8_gemm_nt_contiguous",)),
        "m_grouped_bf16_gemm_nt_masked": (m_grouped_bf16_masked, ("bf16_m_grouped_gemm_nt_masked",)),
        "m_grouped_bf16_gemm_nt_contiguous": (m_grouped_bf16_contiguous, ()),
        "get_mk_alignment_for_contiguous_layout": (lambda: ALIGNMENT, ()),
    },
    "fp8": {
        "m_grouped_fp8_gemm_nt_masked": (m_grouped_fp8_masked, ("fp8_m_grouped_gemm_nt_masked",)),
        "m_grouped_fp8_gemm_nt_contiguous": (m_grouped_fp8_contiguous, ()),
        "m_grouped_bf16_gemm_nt_masked": (m_grouped_bf16_masked, ("bf16_m_grouped_gemm_nt_masked",)),
        "m_grouped_bf16_gemm_nt_contiguous": (m_grouped_bf16_contiguous, ()),
        "get_mk_alignment_for_contiguous_layout": (lambda: ALIGNMENT, ()),
    },
    "legacy": {
        "m_grouped_gemm_fp8_fp8_bf16_nt_masked": (m_grouped_fp8_masked, ()),
        "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous": (m_grouped_fp8_contiguous, ()),
        "get_m_alignment_for_contiguous_layout": (lambda: ALIGNMENT, ()),
    },
}


def install(monkeypatch: Any, old_names: bool = False, generation: str | None = None,
            arch: int = 9) -> types.ModuleType:
    """Put the stand-in in ``sys.modules`` as ``deep_gemm`` for a test (through pytest's monkeypatch).

    ``generation`` picks the names (default ``"fp8_fp4"``, today's); ``old_names=True`` means ``"legacy"``.
    ``arch`` is the device played: 9 (SM90, float32 scales) or 10 (SM100, UE8M0 scales).
    """
    generation = generation or ("legacy" if old_names else "fp8_fp4")
    if generation not in GENERATIONS:
        raise ValueError(f"unknown DeepGEMM generation {generation!r}; expected one of {', '.join(GENERATIONS)}")
    if arch not in (9, 10):
        raise ValueError(f"arch must be 9 (SM90) or 10 (SM100), got {arch}")
    monkeypatch.setitem(_DEVICE, "arch", arch)
    mod = types.ModuleType("deep_gemm")
    mod.__version__ = f"standin-{generation}"
    mod.calls = []

    def logged(name: str, impl: Callable) -> Callable:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            mod.calls.append(name)
            return impl(*args, **kwargs)

        kernel.__name__ = kernel.__qualname__ = name
        return kernel

    for name, (impl, aliases) in GENERATIONS[generation].items():
        fn = logged(name, impl) if "gemm" in name else impl  # GEMMs are logged, layout queries are not
        for exported in (name, *aliases):
            setattr(mod, exported, fn)
    state = {"sms": 132}
    mod.get_num_sms = lambda: state["sms"]
    mod.set_num_sms = lambda n: state.__setitem__("sms", n)
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)
    return mod
