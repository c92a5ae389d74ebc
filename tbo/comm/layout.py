"""Routing math shared by every backend: who sends which rows where, and how results come back together.

Keeping this in one place is what makes the distributed backends bit-identical to the local reference: every
backend orders an expert's rows the same way, by (source rank, token, top-k slot), and every combine reduces over
the top-k slots in the same order.

`static_masked_route` is the one route computed with fixed shapes only (sort, scatter, gather; no ``nonzero``, no
host read): what a CUDA graph can capture. The others read counts on the host to size their outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tbo.comm import devices

__all__ = [
    "ExpandedRoute",
    "NormalRoute",
    "expanded_route",
    "normal_route",
    "expert_major_perm",
    "to_masked",
    "from_masked",
    "weighted_sum",
    "slot_sum",
    "check_routing",
    "device_check",
    "StaticMaskedRoute",
    "static_masked_route",
    "FixedNormalRoute",
    "fixed_normal_route",
]


def device_check(ok: torch.Tensor, message: str) -> None:
    """Check that the boolean scalar ``ok`` holds, without a host sync off the CPU.

    On the CPU the value is read (no device to wait for) and a failure is an ordinary, catchable
    ``ValueError(message)``. On CUDA it is *not*: the check is a device-side assertion (``torch._assert_async``)
    that never blocks the host and that a CUDA graph can capture, so a failure is asynchronous (a
    ``RuntimeError: device-side assert triggered`` at some later synchronisation, in whatever call happens to sync)
    and sticky: the CUDA context is unusable from then on, and only a new process recovers. Treat it as a guard
    against bugs, never as input validation a caller could catch: paths that use it must make the failure
    impossible (e.g. `AllToAllBackend` sizes the MASKED slabs so that top-k routing cannot overflow them).

    Inside a step that must not read the host (`tbo.comm.devices.host_reads_forbidden`: `no_host_reads`, a
    torch.compile trace, a capture) the CPU too gets the assertion op (``torch._assert_async``, which raises a
    RuntimeError there, at once), so that no Python code reads the value.
    """
    if ok.device.type == "cpu" and not devices.host_reads_forbidden(ok.device):
        if not bool(ok):
            raise ValueError(message)
    else:
        torch._assert_async(ok, message)


def check_routing(hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                  op: str, sync_free: bool = False) -> None:
    """Reject inputs that would silently misroute, naming the tensor and what was expected.

    Shapes, dtypes and devices are checked on the host (they are metadata, free to read). The expert ids' range is
    a value: with ``sync_free`` it is checked by `device_check` (a device-side assertion off the CPU), so that
    capture-safe backends never read a device tensor on the host; otherwise it is read and reported exactly (on the
    CPU that read costs nothing; eager on a GPU it is the one host read a dispatch keeps, for a catchable error).
    """
    if hidden.dim() != 2:
        raise ValueError(f"{op}: hidden must be [num_tokens, hidden], got shape {tuple(hidden.shape)}")
    t = hidden.shape[0]
    if topk_idx.dim() != 2 or topk_idx.shape[0] != t:
        raise ValueError(f"{op}: topk_idx must be [{t}, top_k], got shape {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"{op}: topk_weights shape {tuple(topk_weights.shape)} differs from topk_idx {tuple(topk_idx.shape)}"
        )
    if topk_idx.dtype not in (torch.int64, torch.int32):
        swapped = topk_idx.is_floating_point() and not topk_weights.is_floating_point()
        raise TypeError(f"{op}: topk_idx must be an integer tensor, got {topk_idx.dtype}" + (
            "; topk_idx and topk_weights look swapped: the order is (hidden, topk_idx, topk_weights), while "
            "torch.topk returns (values, indices)" if swapped else ""))
    if not topk_weights.is_floating_point():
        raise TypeError(f"{op}: topk_weights must be floating point, got {topk_weights.dtype}")
    if len({hidden.device, topk_idx.device, topk_weights.device}) > 1:
        raise ValueError(
            f"{op}: hidden, topk_idx and topk_weights are on different devices "
            f"({hidden.device}, {topk_idx.device}, {topk_weights.device})"
        )
    if not topk_idx.numel():
        return
    if (sync_free and topk_idx.device.type != "cpu") or devices.host_reads_forbidden(topk_idx.device):
        device_check(((topk_idx >= -1) & (topk_idx < num_experts)).all(),
                     f"{op}: topk_idx values must be in [-1, {num_experts})")
        return
    lo, hi = (int(v) for v in topk_idx.aminmax())
    if lo < -1 or hi >= num_experts:
        raise ValueError(f"{op}: topk_idx values must be in [-1, {num_experts}), got [{lo}, {hi}]")


@dataclass(frozen=True)
class ExpandedRoute:
    """One row per valid (token, slot) pair, sent in (destination rank, local expert, token, slot) order."""

    pair_ids: torch.Tensor  #: [S] flat ``token * top_k + slot`` of each sent row
    send_counts: torch.Tensor  #: [num_ranks, num_local_experts] rows per destination expert
    num_tokens: int
    top_k: int


def expanded_route(topk_idx: torch.Tensor, num_ranks: int, num_local_experts: int) -> ExpandedRoute:
    t, k = topk_idx.shape
    flat = topk_idx.reshape(-1).long()
    pair_ids = torch.nonzero(flat >= 0).flatten()
    experts = flat[pair_ids]
    order = torch.argsort(experts * max(t * k, 1) + pair_ids)  # expert-major, then (token, slot)
    pair_ids = pair_ids[order]
    counts = torch.bincount(experts, minlength=num_ranks * num_local_experts)
    return ExpandedRoute(pair_ids, counts.view(num_ranks, num_local_experts), t, k)


@dataclass(frozen=True)
class NormalRoute:
    """Each token once per destination rank that hosts any of its experts, in (destination, token) order."""

    token_ids: torch.Tensor  #: [S] source token of each sent row
    local_idx: torch.Tensor  #: [S, top_k] the destination's local expert ids, -1 for experts elsewhere
    weights: torch.Tensor  #: [S, top_k]
    send_counts: torch.Tensor  #: [num_ranks]
    #: one rank and every slot routed: rows go in token order, unchanged (no gather on dispatch, no scatter back),
    #: and ``local_idx`` names an expert in every slot
    identity: bool = False


def normal_route(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_ranks: int,
                 num_local_experts: int) -> NormalRoute:
    """On one rank the route is the identity: every token, in order, with its ids as they are (a -1 slot names no
    expert; a token with none comes back as the experts' zero row). Deciding it reads nothing on the host."""
    t = topk_idx.shape[0]
    idx = topk_idx.long()
    if num_ranks == 1:
        return NormalRoute(torch.arange(t, device=idx.device), idx, topk_weights,
                           torch.tensor([t], device=idx.device), identity=True)
    dest = torch.where(idx >= 0, idx // num_local_experts, torch.full_like(idx, -1))
    in_rank = torch.stack([(dest == r).any(dim=1) for r in range(num_ranks)]) if t else torch.zeros(
        num_ranks, 0, dtype=torch.bool, device=idx.device)  # [W, T]
    dest_ids, token_ids = torch.nonzero(in_rank, as_tuple=True)  # row-major: destination, then token
    local = idx[token_ids] - (dest_ids * num_local_experts).unsqueeze(1)
    mine = dest[token_ids] == dest_ids.unsqueeze(1)
    local_idx = torch.where(mine, local, torch.full_like(local, -1))
    return NormalRoute(token_ids, local_idx, topk_weights[token_ids], in_rank.sum(dim=1))


def expert_major_perm(recv_counts: torch.Tensor) -> torch.Tensor:
    """Rows arrive as (source, local expert); this index reorders them to (local expert, source)."""
    w, l = recv_counts.shape
    starts = (torch.cumsum(recv_counts.reshape(-1), 0) - recv_counts.reshape(-1)).view(w, l)
    dev = recv_counts.device
    pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + recv_counts[s, e]), device=dev)
              for e in range(l) for s in range(w)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=dev)


def to_masked(rows: torch.Tensor, counts: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """Expert-major rows into ``[num_local_experts, capacity, H]``, zero beyond each expert's count."""
    cap = int(counts.max()) if capacity is None and counts.numel() else (capacity or 0)
    if counts.numel() and int(counts.max()) > cap:
        raise ValueError(f"an expert received {int(counts.max())} rows, more than the masked capacity {cap}")
    out = rows.new_zeros((counts.shape[0], cap, rows.shape[1]))
    offset = 0
    for e, n in enumerate(counts.tolist()):
        out[e, :n] = rows[offset : offset + n]
        offset += n
    return out


def from_masked(masked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The valid rows of a masked tensor, expert-major: the inverse of `to_masked`."""
    return torch.cat([masked[e, :n] for e, n in enumerate(counts.tolist())]) if counts.numel() else masked[:0, 0]


def weighted_sum(rows: torch.Tensor, pair_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * y[t, k]``, summed in slot order, in float32, cast back to the rows' dtype."""
    t, k = topk_weights.shape
    y = rows.new_zeros((t * k, rows.shape[1]))
    y[pair_ids] = rows
    return slot_sum(y, topk_weights)


def slot_sum(pair_rows: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * y[t * top_k + k]`` for ``pair_rows[T * top_k, H]`` (zero rows for unrouted
    slots): summed in slot order, in float32, cast back. Every combine ends here, which keeps them bit-identical."""
    t, k = topk_weights.shape
    y = pair_rows.view(t, k, pair_rows.shape[1]).float()
    w = topk_weights.float()
    out = y[:, 0] * w[:, 0:1]
    for slot in range(1, k):
        out = out + y[:, slot] * w[:, slot : slot + 1]
    return out.to(pair_rows.dtype)


@dataclass(frozen=True)
class StaticMaskedRoute:
    """Where each (token, slot) pair goes in a ``[num_experts, capacity, H]`` masked buffer, all of fixed shape.

    ``dest[p]`` is pair ``p``'s row in the flattened buffer, or ``num_experts * capacity`` (a scratch row past the
    end) for an unrouted slot or a row beyond its expert's capacity. Within an expert, rows keep (token, slot)
    order: the same layout `expanded_route` + `to_masked` produce, so both paths feed the experts the same matrices.
    """

    dest: torch.Tensor  #: [T * top_k] flat row in the buffer, or the scratch row
    counts: torch.Tensor  #: [num_experts] rows routed to each expert (before the capacity cut)
    capacity: int
    num_tokens: int
    top_k: int

    @property
    def scratch(self) -> int:
        return self.counts.shape[0] * self.capacity


def _expert_keys(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's expert, with unrouted slots (-1) as one more key past the last expert, and the count per key:
    fixed shapes, no host read."""
    flat = topk_idx.reshape(-1).long()
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))  # unrouted slots sort last
    per_key = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device).scatter_add_(
        0, key, torch.ones_like(key))
    return key, per_key


def count_per_expert(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Slots per expert, -1 slots not counted: what ``torch.bincount`` of the valid ids gives, without its host
    syncs on a GPU (selecting the valid ids has a data-dependent shape, and bincount sizes its output from the ids'
    maximum)."""
    return _expert_keys(topk_idx, num_experts)[1][:num_experts]


def static_masked_route(topk_idx: torch.Tensor, num_experts: int, capacity: int) -> StaticMaskedRoute:
    """The masked layout of one rank's routing, computed with fixed shapes only (capture-safe).

    A stable sort by expert gives each pair its rank among the pairs of its expert; no count is read on the host.
    """
    t, k = topk_idx.shape
    key, per_key = _expert_keys(topk_idx, num_experts)
    starts = torch.cumsum(per_key, 0) - per_key
    sorted_key, order = torch.sort(key, stable=True)
    rank_sorted = torch.arange(key.shape[0], device=key.device) - starts[sorted_key]
    pos = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    fits = (key < num_experts) & (pos < capacity)
    dest = torch.where(fits, key * capacity + pos, torch.full_like(pos, num_experts * capacity))
    return StaticMaskedRoute(dest, per_key[:num_experts], capacity, t, k)


@dataclass(frozen=True)
class FixedNormalRoute:
    """A NORMAL route of fixed shape: every token goes to every rank, in token order, with that rank's local expert
    ids (-1 for experts elsewhere); ``sends[q, t]`` says whether token ``t`` names any expert on rank ``q`` (a row
    that does not is padding: its ids are all -1). No ``nonzero``, no host read: what a step that must not read the
    host dispatches by agreed rows (`tbo.comm.alltoall`)."""

    local_idx: torch.Tensor  #: [num_ranks, T, top_k]
    sends: torch.Tensor  #: [num_ranks, T] bool

    @property
    def send_counts(self) -> torch.Tensor:
        """[num_ranks] real rows per destination (a device tensor: count it, never read it inside the step)."""
        return self.sends.sum(dim=1)


def fixed_normal_route(topk_idx: torch.Tensor, num_ranks: int, num_local_experts: int) -> FixedNormalRoute:
    """The `FixedNormalRoute` of ``topk_idx`` over ``num_ranks`` ranks of ``num_local_experts`` experts each."""
    idx = topk_idx.long()
    dest = torch.where(idx >= 0, torch.div(idx, num_local_experts, rounding_mode="floor"), torch.full_like(idx, -1))
    ranks = torch.arange(num_ranks, device=idx.device).view(num_ranks, 1, 1)
    mine = dest.unsqueeze(0) == ranks  # [W, T, K]
    local = torch.where(mine, idx.unsqueeze(0) - ranks * num_local_experts, torch.full_like(mine, -1, dtype=idx.dtype))
    return FixedNormalRoute(local, mine.any(dim=2))
