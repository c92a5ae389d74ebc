"""FP8 (e4m3) per-token-group quantisation, the activation format DeepEP and DeepGEMM exchange.

Each token's hidden vector is cut into groups of 128 channels; each group is scaled so its largest magnitude maps to
448, the largest finite e4m3 value. Plain torch, so it runs (slowly) on CPU for tests and on GPU as a fallback.
It lives in `tbo.comm` because it is the wire format FP8 dispatch sends; the expert runners above comm read it.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MAX", "GROUP", "quantize_per_token_group", "dequantize_per_token_group", "quantize_per_block",
           "dequantize_per_block"]

FP8_MAX = 448.0
GROUP = 128


def quantize_per_token_group(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[..., H]`` to ``(q[..., H] float8_e4m3fn, scales[..., H // group] float32)``."""
    if x.shape[-1] % group:
        raise ValueError(f"hidden size {x.shape[-1]} is not a multiple of the FP8 group size {group}")
    g = x.float().unflatten(-1, (x.shape[-1] // group, group))
    scales = g.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    q = (g / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2)
    return q, scales


def dequantize_per_token_group(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
                               ) -> torch.Tensor:
    group = q.shape[-1] // scales.shape[-1]
    g = q.float().unflatten(-1, (scales.shape[-1], group)) * scales.float().unsqueeze(-1)
    return g.flatten(-2).to(dtype)


def quantize_per_block(w: torch.Tensor, block: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``w[..., N, K]`` to FP8 with one scale per ``block x block`` tile: ``scales[..., N / block, K / block]``."""
    *lead, n, k = w.shape
    if n % block or k % block:
        raise ValueError(f"weight shape {tuple(w.shape)} is not a multiple of the {block}x{block} FP8 block")
    tiles = w.float().reshape(*lead, n // block, block, k // block, block)
    scales = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-10) / FP8_MAX
    q = (tiles / scales.unsqueeze(-1).unsqueeze(-3)).to(torch.float8_e4m3fn).reshape(w.shape)
    return q, scales


def dequantize_per_block(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    *lead, n, k = q.shape
    bn, bk = n // scales.shape[-2], k // scales.shape[-1]
    tiles = q.float().reshape(*lead, n // bn, bn, k // bk, bk)
    return (tiles * scales.unsqueeze(-1).unsqueeze(-3)).reshape(q.shape)
