"""FP8 (e4m3) per-token-group quantisation, the activation format DeepEP and DeepGEMM exchange.

Each token's hidden vector is cut into groups of 128 channels; each group is scaled so its largest magnitude maps to
448, the largest finite e4m3 value. Plain torch, so it runs (slowly) on CPU for tests and on GPU as a fallback.
It lives in `tbo.comm` because it is the wire format FP8 dispatch sends; the expert runners above comm read it.

On SM100 (compute capability 10.x) DeepGEMM reads scales as UE8M0, a bare power-of-two exponent: it truncates
float32 scales to their exponent bits (DeepGEMM ``csrc/apis/layout.hpp:49-53``, ``smxx_layout.hpp:159``), which
changes the values unless the scales already are powers of two. So there the scales are rounded up to a power of two
(``round_scale=True``, as DeepEP's ``round_scale`` does) and DeepEP low-latency ships them packed, four exponents per
int32 (``use_ue8m0``); `ue8m0_wanted` says when, from the device.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MAX", "GROUP", "quantize_per_token_group", "dequantize_per_token_group", "quantize_per_block",
           "dequantize_per_block", "pack_ue8m0", "unpack_ue8m0", "ue8m0_wanted"]

FP8_MAX = 448.0
GROUP = 128


def _scales(amax: torch.Tensor, round_scale: bool) -> torch.Tensor:
    scales = amax.clamp(min=1e-10) / FP8_MAX
    return torch.exp2(torch.ceil(torch.log2(scales))) if round_scale else scales


def quantize_per_token_group(x: torch.Tensor, group: int = GROUP, round_scale: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[..., H]`` to ``(q[..., H] float8_e4m3fn, scales[..., H // group] float32)``; ``round_scale`` rounds each
    scale up to a power of two (what UE8M0 can hold)."""
    if x.shape[-1] % group:
        raise ValueError(f"hidden size {x.shape[-1]} is not a multiple of the FP8 group size {group}")
    g = x.float().unflatten(-1, (x.shape[-1] // group, group))
    scales = _scales(g.abs().amax(dim=-1), round_scale)
    q = (g / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2)
    return q, scales


def dequantize_per_token_group(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
                               ) -> torch.Tensor:
    """The inverse of `quantize_per_token_group`; ``scales`` float32, or UE8M0 packed in int32 (`pack_ue8m0`)."""
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales, q.shape[-1] // GROUP)
    group = q.shape[-1] // scales.shape[-1]
    g = q.float().unflatten(-1, (scales.shape[-1], group)) * scales.float().unsqueeze(-1)
    return g.flatten(-2).to(dtype)


def quantize_per_block(w: torch.Tensor, block: int = GROUP, round_scale: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``w[..., N, K]`` to FP8 with one scale per ``block x block`` tile: ``scales[..., N / block, K / block]``;
    ``round_scale`` as for `quantize_per_token_group`."""
    *lead, n, k = w.shape
    if n % block or k % block:
        raise ValueError(f"weight shape {tuple(w.shape)} is not a multiple of the {block}x{block} FP8 block")
    tiles = w.float().reshape(*lead, n // block, block, k // block, block)
    scales = _scales(tiles.abs().amax(dim=(-3, -1)), round_scale)
    q = (tiles / scales.unsqueeze(-1).unsqueeze(-3)).to(torch.float8_e4m3fn).reshape(w.shape)
    return q, scales


def dequantize_per_block(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    *lead, n, k = q.shape
    bn, bk = n // scales.shape[-2], k // scales.shape[-1]
    tiles = q.float().reshape(*lead, n // bn, bn, k // bk, bk)
    return (tiles * scales.unsqueeze(-1).unsqueeze(-3)).reshape(q.shape)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``[..., G]`` as UE8M0 exponents (the float's exponent bits), four per int32,
    little-endian, padded to a multiple of four: ``[..., ceil(G / 4)]`` int32, the layout DeepEP low-latency returns
    with ``use_ue8m0`` (``hidden // 512`` per token). Scales that are not powers of two are refused: UE8M0 would
    silently change them."""
    if scales.dtype != torch.float32:
        raise TypeError(f"pack_ue8m0 takes float32 scales, got {scales.dtype}")
    bits = scales.contiguous().view(torch.int32)
    if bool(((bits & 0x7FFFFF) != 0).any()) or bool((scales <= 0).any()):
        raise ValueError("pack_ue8m0: scales must be positive powers of two (quantize with round_scale=True)")
    exps = (bits >> 23).to(torch.uint8)
    pad = -exps.shape[-1] % 4
    if pad:
        exps = torch.cat([exps, exps.new_zeros((*exps.shape[:-1], pad))], dim=-1)
    return exps.contiguous().view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """`pack_ue8m0`'s inverse: int32 ``[..., P]`` to float32 scales ``[..., groups]`` (``2 ** (exponent - 127)``)."""
    if packed.dtype != torch.int32:
        raise TypeError(f"unpack_ue8m0 takes int32 packed exponents, got {packed.dtype}")
    exps = packed.contiguous().view(torch.uint8)[..., :groups].to(torch.int32)
    return (exps << 23).view(torch.float32)


def ue8m0_wanted(device: torch.device | int | None = None) -> bool:
    """True on SM100 (compute capability 10.x), where DeepGEMM takes UE8M0 scales (packed int32, or float32 it
    truncates to the exponent: DeepGEMM ``gemm.hpp:286-293``, ``layout.hpp:49-58``); False on SM90, which takes
    float32 scales, and without CUDA."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] == 10
