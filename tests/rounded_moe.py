"""`rounded_moe`: the MoE output of an expert-parallel BF16 combine, rounded exactly where the ranks round it.

DeepEP's combines take BF16: each rank sums its share of a token's experts in float32 and sends that partial sum as
BF16, and the receiving rank adds the ranks' partial sums in float32 (in rank order) and rounds once more. A single
rank's reference rounds once, so it differs from the path by up to a few BF16 ulps, and a tolerance wide enough for
that also passes an output off by 2-4%. This oracle rounds as the path does, so the tests compare bit for bit.
"""

from __future__ import annotations

from typing import Callable

import torch


def rounded_moe(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, fn: Callable, num_experts: int,
                world: int, *, weigh_in_bf16: bool = False) -> torch.Tensor:
    """``sum_k w_k * fn(e_k, x)`` per token (BF16), as ``world`` ranks of ``num_experts / world`` experts each give it.

    ``fn(e, rows)`` sees each expert's rows in token order, as a dispatch delivers them, so its float bits match.
    A rank adds its terms in order of expert id (NORMAL: `run_experts` loops over local experts), or in slot order
    with each weighted row rounded to BF16 first (``weigh_in_bf16``: DeepEP V2's EXPANDED combine, which gets the
    rows tbo weighted and only sums).
    """
    local = num_experts // world
    terms: dict[int, list[tuple[int, torch.Tensor]]] = {}  # token -> (order key, weighted float32 row)
    for e in range(num_experts):
        tokens, slots = torch.nonzero(idx == e, as_tuple=True)
        if not tokens.numel():
            continue
        rows = fn(e, x[tokens]).float() * weights[tokens, slots].float().unsqueeze(1)
        if weigh_in_bf16:
            rows = rows.to(torch.bfloat16).float()
        for t, slot, row in zip(tokens.tolist(), slots.tolist(), rows):
            terms.setdefault(t, []).append((slot if weigh_in_bf16 else e, e // local, row))
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t, mine in terms.items():
        total = torch.zeros(x.shape[1], dtype=torch.float32)
        for rank in range(world):
            partial = torch.zeros(x.shape[1], dtype=torch.float32)
            for _, _, row in sorted((m for m in mine if m[1] == rank), key=lambda m: m[0]):
                partial += row
            if any(m[1] == rank for m in mine):
                total += partial.to(torch.bfloat16).float()
        out[t] = total
    return out.to(torch.bfloat16)
