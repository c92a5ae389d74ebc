"""DeepEP dispatch and combine from message sizes: which bytes cross which link, and how long that takes.

Low-latency kernels (V1) send one message per (token, expert) pair, to peers in the node over NVLink and to the
others over the NIC. Normal and V2 kernels send a token once per node it reaches over the NIC and forward it over
NVLink to each GPU in that node it reaches (hierarchical, as DeepSeek-V3's node-limited routing intends). A transfer
takes ``message_latency + max(NIC bytes / NIC rate, NVLink bytes / NVLink rate)``: the two links run at once, the
slower one sets the pace. How many ranks and nodes a token reaches follows from uniform routing, group-limited
where the model is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

from tbo.tools.predict.hardware import Efficiency, Hardware

__all__ = ["expected_reached", "Traffic", "traffic", "transfer_seconds", "CommRow", "fit_link_factors"]

Kernel = Literal["low_latency", "normal", "v2"]
Kind = Literal["dispatch", "combine"]


def _comb_ratio(n: int, m: int, k: int) -> float:
    """C(n - m, k) / C(n, k): the chance that k picks out of n avoid m given items."""
    if m <= 0:
        return 1.0
    if n - m < k:
        return 0.0
    return math.comb(n - m, k) / math.comb(n, k)


def _hypergeom(total: int, marked: int, draws: int, j: int) -> float:
    if j > marked or j > draws or draws - j > total - marked:
        return 0.0
    return math.comb(marked, j) * math.comb(total - marked, draws - j) / math.comb(total, draws)


def expected_reached(num_experts: int, units: int, topk: int, num_groups: int = 1, topk_groups: int = 1) -> float:
    """Expected number of distinct units (ranks or nodes, each holding an equal contiguous block of experts) that a
    token's top-k experts fall in, for routing uniform over experts, or over the experts of ``topk_groups`` groups
    drawn uniformly from ``num_groups`` (DeepSeek-V3's group-limited routing).

    >>> round(expected_reached(256, 32, 8), 3)   # 8 experts over 32 ranks of 8 experts
    7.267
    """
    if units <= 0 or num_experts % units:
        raise ValueError(f"{num_experts} experts do not split evenly over {units} units")
    if not 0 < topk <= num_experts:
        raise ValueError(f"topk={topk} must be in 1..{num_experts}")
    per_unit = num_experts // units
    group = num_experts // num_groups if num_groups and num_experts % num_groups == 0 else num_experts
    grouped = 1 < num_groups and topk_groups < num_groups and group * topk_groups >= topk
    if grouped and per_unit >= group and per_unit % group == 0:
        spans, per_group = per_unit // group, group       # a unit holds whole groups
    elif grouped and per_unit < group and group % per_unit == 0:
        spans, per_group = 1, per_unit                    # a unit is part of one group
    else:
        grouped = False
    if not grouped:
        return units * (1.0 - _comb_ratio(num_experts, per_unit, topk))
    pool = topk_groups * group
    untouched = sum(_hypergeom(num_groups, spans, topk_groups, j) * _comb_ratio(pool, j * per_group, topk)
                    for j in range(0, min(spans, topk_groups) + 1))
    return units * (1.0 - untouched)


@dataclass(frozen=True)
class Traffic:
    """Bytes one GPU puts on each link per token it sends, for one dispatch or combine."""

    nic_bytes: float
    nvlink_bytes: float

    def seconds_per_token(self, hw: Hardware, eff: Efficiency) -> float:
        return max(self.nic_bytes / (eff.nic_efficiency * hw.nic_bandwidth),
                   self.nvlink_bytes / (eff.nvlink_efficiency * hw.nvlink_bandwidth))


def message_bytes(kind: Kind, kernel: Kernel, hidden: int, dispatch_dtype: str = "fp8") -> float:
    """Bytes of one token's message. FP8 carries one float32 scale per 128 values; low-latency messages carry 16
    bytes of source metadata (DeepEP's layout); combine sends BF16."""
    if kind == "combine":
        return 2.0 * hidden
    body = hidden + hidden / 128 * 4 if dispatch_dtype == "fp8" else 2.0 * hidden
    return body + (16 if kernel == "low_latency" else 0)


def traffic(kind: Kind, kernel: Kernel, hidden: int, topk: int, ep: int, gpus_per_node: int = 8,
            num_experts: int = 256, num_groups: int = 1, topk_groups: int = 1,
            dispatch_dtype: str = "fp8") -> Traffic:
    """NIC and NVLink bytes per sent token (what a GPU sends equals, on average, what it receives)."""
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    msg = message_bytes(kind, kernel, hidden, dispatch_dtype)
    local = min(ep, gpus_per_node)
    if kernel == "low_latency":  # one message per (token, expert); uniform over ranks
        return Traffic(nic_bytes=topk * msg * (ep - local) / ep, nvlink_bytes=topk * msg * (local - 1) / ep)
    ranks = expected_reached(num_experts, ep, topk, num_groups, topk_groups)
    if ep <= gpus_per_node:
        return Traffic(nic_bytes=0.0, nvlink_bytes=ranks * msg * (ep - 1) / ep)
    if ep % gpus_per_node:
        raise ValueError(f"ep={ep} spans nodes but is not a multiple of gpus_per_node={gpus_per_node}")
    nodes = ep // gpus_per_node
    reached_nodes = expected_reached(num_experts, nodes, topk, num_groups, topk_groups)
    return Traffic(nic_bytes=reached_nodes * msg * (nodes - 1) / nodes,
                   nvlink_bytes=ranks * msg * (gpus_per_node - 1) / gpus_per_node)


def transfer_seconds(t: Traffic, tokens: float, hw: Hardware, eff: Efficiency) -> float:
    """One transfer of ``tokens`` tokens: the fixed latency plus the slower link's time."""
    return hw.message_latency_s + tokens * t.seconds_per_token(hw, eff)


@dataclass(frozen=True)
class CommRow:
    """A published transfer time, with the traffic that produced it (for fitting the link factors)."""

    label: str
    hardware: Hardware
    traffic: Traffic
    tokens: int
    seconds: float


def _loss(rows: Sequence[CommRow], nic: float, nvl: float, latency: float) -> float:
    total = 0.0
    for r in rows:
        per_token = max(r.traffic.nic_bytes / (nic * r.hardware.nic_bandwidth),
                        r.traffic.nvlink_bytes / (nvl * r.hardware.nvlink_bandwidth))
        total += math.log((latency + r.tokens * per_token) / r.seconds) ** 2
    return total


def _best_latency(rows: Sequence[CommRow], nic: float, nvl: float, hi: float) -> tuple[float, float]:
    lo, top = 0.0, hi
    for _ in range(30):  # golden-section search: the loss is convex in the latency for fixed link rates
        a, b = lo + 0.382 * (top - lo), lo + 0.618 * (top - lo)
        if _loss(rows, nic, nvl, a) <= _loss(rows, nic, nvl, b):
            top = b
        else:
            lo = a
    x = (lo + top) / 2
    return x, _loss(rows, nic, nvl, x)


def fit_link_factors(rows: Iterable[CommRow], max_latency_s: float = 100e-6) -> tuple[float, float, float]:
    """(nic_efficiency, nvlink_efficiency, message_latency_s) minimising the squared log error over ``rows``.

    A grid over both efficiencies (0.02 steps, then 0.001 around the best), the latency solved for each point.
    Deterministic, so the shipped defaults can be checked against a refit.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("fit_link_factors needs rows")

    def search(nics: Iterable[float], nvls: Sequence[float]) -> tuple[float, float, float, float]:
        best = (math.inf, 0.0, 0.0, 0.0)
        for nic in nics:
            for nvl in nvls:
                lat, loss = _best_latency(rows, nic, nvl, max_latency_s)
                if loss < best[0] - 1e-15:
                    best = (loss, nic, nvl, lat)
        return best

    coarse = [i / 50 for i in range(15, 51)]
    _, nic, nvl, _ = search(coarse, coarse)
    fine_nic = [x / 1000 for x in range(max(300, round(nic * 1000) - 20), min(1000, round(nic * 1000) + 20) + 1)]
    fine_nvl = [x / 1000 for x in range(max(300, round(nvl * 1000) - 20), min(1000, round(nvl * 1000) + 20) + 1)]
    _, nic, nvl, lat = search(fine_nic, fine_nvl)
    return nic, nvl, lat
