"""`LocalBackend` and `TorchDistributedBackend`: one all-to-all dispatch/combine over a pluggable transport.

``dispatch_a`` exchanges the per-expert row counts (small, blocking) and launches the payload; ``dispatch_b`` waits
and lays the rows out in the requested `DispatchFormat`. ``combine_a`` launches the results back along the reverse
route; ``combine_b`` waits and reduces over the top-k slots. The local backend is the same code with an identity
transport, which is why it is the reference for equivalence.

The count exchange waits for every peer to reach the same dispatch: it absorbs all the skew between the ranks, on
the host, before the payload even starts, twice as often when a step splits. NORMAL layout can skip it when the
ranks agreed beforehand on how many token rows each dispatches (``rows_per_rank``: `tbo.split.agree` carries them
in its once-per-step all-reduce). A token goes to a rank at most once, so those rows bound what any peer can send:
each peer's chunk is padded to the sender's row count (zero rows, every top-k slot -1), ``dispatch_a`` launches at
once, and ``dispatch_b`` drops the padding. Fixed receive sizes, as DeepEP's low-latency mode has, for the price of
the padding's bytes.

Inside a step that must not read the host (`tbo.comm.devices.no_host_reads`, a torch.compile trace, a capture) the
agreed-rows dispatch has fixed shapes end to end (`tbo.comm.layout.fixed_normal_route`): every token goes to every
rank (this one included) as one record, real or padding, so the split sizes are the agreed rows themselves and no
count is read; the padding is not dropped on arrival (its rows name no local expert, and the experts' output for
such a row must be zero, as NORMAL's contract already says for a token sent nowhere), and combine sums each token's
rows over the ranks, in rank order, as the counted combine does. The wire carries what the padded dispatch carries
(each peer's chunk already held every token); the receiver's experts see the padding rows too.

What a CUDA graph can capture (no host sync, no data-dependent shape), per backend and format:

* `LocalBackend`, MASKED with a fixed ``masked_capacity``: **capture-safe**. Routing is a stable sort and a
  scatter into ``[num_experts, tokens, H]`` slabs (a shape fixed by the step's size: no top-k routing can overflow
  them, since a token picks an expert at most once); combine is a gather and the slot sum. ``masked_capacity`` is
  the most tokens a *captured* step may carry: a bigger one is refused on the host while capturing, and runs with
  slabs of its own size eagerly (e.g. above a `GraphRunner`'s largest bucket). Expert ids are range-checked by a
  device-side assertion: a ValueError on the CPU, but on CUDA an asynchronous, sticky assert that ends the process
  (see `tbo.comm.layout.device_check`), so the capture-safe paths make it impossible for valid routing.
* `LocalBackend`, NORMAL on one rank: the identity route, no host read (inside `no_host_reads` the routing check
  is a device-side assertion too).
* `TorchDistributedBackend`, NORMAL by agreed rows inside `no_host_reads`: no host read (split sizes are the agreed
  rows, Python ints); the wait for the peers blocks the host, as a collective does.
* `LocalBackend`, MASKED without a capacity, EXPANDED and NORMAL: not capture-safe. Their outputs are sized by
  routed counts read on the host (``nonzero``, ``.tolist()``); eager use on a GPU works.
* `TorchDistributedBackend`, every format: not capture-safe (split sizes cross ranks on the host first).
* DeepEP low-latency (`tbo.comm.deepep.DeepEPLowLatencyBackend`): the multi-GPU capture-safe backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tbo.comm import devices
from tbo.comm.layout import (ExpandedRoute, FixedNormalRoute, NormalRoute, StaticMaskedRoute, check_routing,
                             count_per_expert, device_check, expanded_route, expert_major_perm, fixed_normal_route,
                             from_masked, normal_route, slot_sum, static_masked_route, to_masked, weighted_sum)
from tbo.comm.transport import LocalTransport, TorchDistributedTransport, Transport
from tbo.comm.types import CombineState, DispatchFormat, DispatchOutput, DispatchState
from tbo.comm.wait import DEFAULT_TIMEOUT_S

__all__ = ["AllToAllBackend", "LocalBackend", "TorchDistributedBackend"]


@dataclass(frozen=True)
class _ExpandedHandle:
    route: ExpandedRoute
    recv_counts: torch.Tensor  # [W, L]
    perm: torch.Tensor  # (source, expert) -> (expert, source)
    topk_weights: torch.Tensor
    tokens_per_expert: torch.Tensor


@dataclass(frozen=True)
class _StaticMaskedHandle:
    route: StaticMaskedRoute
    topk_weights: torch.Tensor


@dataclass(frozen=True)
class _FixedNormalHandle:
    route: FixedNormalRoute
    chunks: tuple[int, ...]  # rows received from each rank: the agreed rows
    num_tokens: int


@dataclass(frozen=True)
class _NormalHandle:
    route: NormalRoute
    recv_counts: torch.Tensor  # [W]
    num_tokens: int


def _sum_by_token(rows: torch.Tensor, route: NormalRoute, num_tokens: int) -> torch.Tensor:
    """NORMAL combine: each token's rows from every rank that computed for it, summed (zero for a token sent
    nowhere). Rows come back in (rank, token) order and a token appears at most once per rank, so the first rank's
    rows are copied into place and only the others are added: on one rank no ``index_add_`` runs at all (on the CPU
    it can take milliseconds where a copy takes microseconds), and when that rank has every token, in order, nothing
    moves at all (the combined output is the experts' output itself)."""
    if route.identity:  # one rank, every token there once, in order: its rows are the sum
        return rows
    out = rows.new_zeros((num_tokens, rows.shape[1]))
    start = 0
    for n in route.send_counts.tolist():
        if n:
            ids, part = route.token_ids[start:start + n], rows[start:start + n]
            if start == 0:
                out.index_copy_(0, ids, part)
            else:
                out.index_add_(0, ids, part)
        start += n
    return out


def _sum_over_ranks(rows: torch.Tensor, handle: _FixedNormalHandle) -> torch.Tensor:
    """Fixed-shape NORMAL combine: every rank sent back one row per token; each token's real rows summed in rank
    order (the order `_sum_by_token` adds them in), padding rows left out, with fixed shapes."""
    n, h = handle.num_tokens, rows.shape[1]
    per_rank = rows.view(handle.route.sends.shape[0], n, h)
    out = rows.new_zeros((n, h))
    for q in range(per_rank.shape[0]):
        out = out + torch.where(handle.route.sends[q].unsqueeze(1), per_rank[q], rows.new_zeros(()))
    return out


@dataclass(frozen=True)
class _Packing:
    """A NORMAL row as one byte record: the token's hidden row, its top-k local expert ids (int64), its top-k
    weights, each reinterpreted, never converted (bit-exact both ways, any dtype: float8 included)."""

    hidden_dtype: torch.dtype
    hidden_size: int
    idx_dtype: torch.dtype
    weights_dtype: torch.dtype
    top_k: int

    @classmethod
    def of(cls, hidden: torch.Tensor, route: NormalRoute) -> "_Packing":
        return cls(hidden.dtype, hidden.shape[1], route.local_idx.dtype, route.weights.dtype, route.local_idx.shape[1])

    @property
    def widths(self) -> tuple[int, int, int]:
        return (self.hidden_size * self.hidden_dtype.itemsize, self.top_k * self.idx_dtype.itemsize,
                self.top_k * self.weights_dtype.itemsize)

    def empty(self, rows: int, device: torch.device) -> torch.Tensor:
        """``rows`` padding records: zero hidden rows and weights, every expert id -1 (all bits set)."""
        h, i, _ = self.widths
        records = torch.zeros((rows, sum(self.widths)), dtype=torch.uint8, device=device)
        records[:, h:h + i] = 255
        return records

    def pack(self, rows: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.cat([_dense(t).view(torch.uint8).reshape(t.shape[0], width)
                          for t, width in zip((rows, idx, weights), self.widths)], dim=1)

    def unpack(self, records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three columns of ``records`` (any row count, zero and one included), each in a buffer of its own.

        Each column slice is copied into a fresh, densely strided buffer before it is reinterpreted: a slice keeps
        the record's row stride (and its byte offset), which ``.view`` to a wider dtype refuses unless both are
        multiples of the dtype's size, and ``.contiguous()`` is no copy for one row (a one-row slice already counts
        as contiguous). A record of 292 bytes (hidden 64 fp32, top-3 ids and fp32 weights) failed that way."""
        h, i, _ = self.widths
        return (_dense(records[:, :h]).view(self.hidden_dtype), _dense(records[:, h:h + i]).view(self.idx_dtype),
                _dense(records[:, h + i:]).view(self.weights_dtype))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is strided densely from the start of its storage, else its values in a new buffer that
    is: what ``.view`` to another element size needs. (``.contiguous()`` is not enough: it returns ``t`` itself
    whenever ``t`` merely counts as contiguous, as a one-row slice does with any row stride.)"""
    dense, step = [], 1
    for n in reversed(t.shape):
        dense.append(step)
        step *= n
    if t.storage_offset() == 0 and t.stride() == tuple(reversed(dense)):
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _drop_padding(rows: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                  chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows a padded NORMAL dispatch received, without the padding, and how many came from each rank. A rank's
    real rows come first in its chunk, each naming at least one of this rank's experts; padding names none."""
    real = (idx >= 0).any(dim=1)
    source = torch.repeat_interleave(torch.arange(len(chunks), device=idx.device),
                                     torch.tensor(chunks, device=idx.device))
    recv_counts = torch.bincount(source[real], minlength=len(chunks))
    keep = torch.nonzero(real).squeeze(1)
    return rows[keep], idx[keep], weights[keep], recv_counts


class AllToAllBackend:
    """Expert-parallel dispatch/combine over a `Transport`, in any `DispatchFormat`."""

    #: one tensor per token, of any dtype; no FP8 scales beside it (`tbo.comm.types.payload_refusal`)
    carries_fp8 = False
    hidden_dtypes = None

    def __init__(self, transport: Transport, num_experts: int, format: DispatchFormat = DispatchFormat.EXPANDED,
                 masked_capacity: int | None = None) -> None:
        if num_experts < 1 or num_experts % transport.num_ranks:
            raise ValueError(f"num_experts={num_experts} must be a positive multiple of num_ranks={transport.num_ranks}")
        if masked_capacity is not None and masked_capacity < 1:
            raise ValueError(f"masked_capacity={masked_capacity} must be a positive row count (or None: sized by "
                             "the largest expert's rows, read on the host)")
        self.transport = transport
        self.format = DispatchFormat(format)
        self.masked_capacity = masked_capacity
        self.rank = transport.rank
        self.num_ranks = transport.num_ranks
        self.num_experts = num_experts
        self.num_local_experts = num_experts // transport.num_ranks
        #: blocking row-count exchanges this backend's dispatches made (none where the rows were agreed)
        self.count_exchanges = 0

    @property
    def capture_safe(self) -> bool:
        """True when dispatch and combine do no host sync and have fixed shapes (a CUDA graph can capture them):
        MASKED with a fixed ``masked_capacity`` on one rank."""
        return (self.format is DispatchFormat.MASKED and self.masked_capacity is not None
                and isinstance(self.transport, LocalTransport) and self.num_ranks == 1)

    @property
    def in_flight(self) -> list[Any]:
        """Transfers launched and not yet waited (for the watchdog's report)."""
        return self.transport.in_flight

    def drain(self) -> int:
        """Wait out every transfer still in flight, e.g. after an op failed mid-step."""
        return self.transport.drain()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, num_ranks={self.num_ranks}, "
                f"num_experts={self.num_experts}, format={self.format.name})")

    # ---- dispatch -----------------------------------------------------------------------------------------------
    @property
    def accepts_rows_per_rank(self) -> bool:
        """Whether `dispatch_a` takes ``rows_per_rank`` (NORMAL layout): the agreed rows that replace the count
        exchange."""
        return self.format is DispatchFormat.NORMAL

    def dispatch_a(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                   rows_per_rank: Sequence[int] | None = None) -> DispatchState:
        """`EPBackend.dispatch_a`: exchange the row counts (small, blocking), then launch the rows; on the
        capture-safe path (MASKED, fixed capacity, one rank), scatter into fixed-shape slabs with no host read.
        ``topk_idx`` comes before ``topk_weights``, the reverse of ``torch.topk``'s ``(values, indices)``.

        ``rows_per_rank`` (NORMAL only): the token rows every rank passes to this same dispatch, indexed by rank and
        agreed by all of them beforehand (this rank's must be ``hidden``'s). Then nothing is exchanged and nothing
        waits here: each peer's chunk is padded to the sender's rows (see the module docstring)."""
        check_routing(hidden, topk_idx, topk_weights, self.num_experts, "dispatch_a", sync_free=self.capture_safe)
        if rows_per_rank is not None and not self.accepts_rows_per_rank:
            raise ValueError(f"dispatch_a: rows_per_rank needs the NORMAL layout, this backend's is {self.format.name}")
        if self.capture_safe:
            return self._dispatch_a_static(hidden, topk_idx, topk_weights)
        if self.format is DispatchFormat.NORMAL:
            return self._dispatch_a_normal(hidden, topk_idx, topk_weights, rows_per_rank)
        route = expanded_route(topk_idx, self.num_ranks, self.num_local_experts)
        self.count_exchanges += 1
        recv_counts = self.transport.exchange(route.send_counts.reshape(-1), "dispatch_a (row counts)")
        recv_counts = recv_counts.view(self.num_ranks, self.num_local_experts)
        rows = hidden[torch.div(route.pair_ids, route.top_k, rounding_mode="floor")]
        pending = self.transport.start(rows, route.send_counts.sum(1).tolist(), recv_counts.sum(1).tolist(),
                                       "dispatch_b (rows)")
        return DispatchState(pending, rows.nbytes, {"route": route, "recv_counts": recv_counts,
                                                    "topk_weights": topk_weights})

    def _dispatch_a_normal(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                           rows_per_rank: Sequence[int] | None) -> DispatchState:
        if rows_per_rank is not None and self.num_ranks > 1 and devices.host_reads_forbidden(hidden.device):
            return self._dispatch_a_fixed(hidden, topk_idx, topk_weights,
                                          self._checked_rows(rows_per_rank, hidden.shape[0]))
        route = normal_route(topk_idx, topk_weights, self.num_ranks, self.num_local_experts)
        if rows_per_rank is not None:
            bounds = self._checked_rows(rows_per_rank, hidden.shape[0])
            if not route.identity:
                return self._dispatch_a_padded(hidden, route, bounds)
        self.count_exchanges += 1
        recv_counts = self.transport.exchange(route.send_counts, "dispatch_a (token counts)")
        if route.identity:  # one rank: what is sent is what arrives, and its size needs no host read
            send = recv = [hidden.shape[0]]
        else:
            send, recv = route.send_counts.tolist(), recv_counts.tolist()
        rows = hidden if route.identity else hidden[route.token_ids]  # identity: one rank has every token, in order
        pending = (
            self.transport.start(rows, send, recv, "dispatch_b (tokens)"),
            self.transport.start(route.local_idx, send, recv, "dispatch_b (topk_idx)"),
            self.transport.start(route.weights, send, recv, "dispatch_b (topk_weights)"),
        )
        nbytes = rows.nbytes + route.local_idx.nbytes + route.weights.nbytes
        return DispatchState(pending, nbytes, {"route": route, "recv_counts": recv_counts,
                                               "num_tokens": hidden.shape[0]})

    def _checked_rows(self, rows_per_rank: Sequence[int], num_tokens: int) -> list[int]:
        """``rows_per_rank`` as a list, refused by name when it cannot be the agreed rows of this dispatch: a wrong
        count here would make the ranks' transfers disagree in size."""
        bounds = [int(n) for n in rows_per_rank]
        if len(bounds) != self.num_ranks or min(bounds) < 0:
            raise ValueError(f"dispatch_a: rows_per_rank must give {self.num_ranks} row counts >= 0 (one per rank), "
                             f"got {list(rows_per_rank)}")
        if bounds[self.rank] != num_tokens:
            raise ValueError(f"dispatch_a: rows_per_rank says rank {self.rank} dispatches {bounds[self.rank]} rows, "
                             f"but it was given {num_tokens}: the agreed rows are not this microbatch's")
        return bounds

    def _dispatch_a_padded(self, hidden: torch.Tensor, route: NormalRoute, bounds: list[int]) -> DispatchState:
        """NORMAL without the count exchange: the chunk for each peer padded to this rank's rows (the most it can
        send any rank), the peers' chunks received at their agreed rows; this rank's own chunk exact both ways.

        A row travels as one byte record (the token's row, its local expert ids, its weights: `_Packing`), so a
        dispatch is one transfer, not three: each is a collective, with its own fixed cost on every rank."""
        n, me, w = hidden.shape[0], self.rank, self.num_ranks
        counts = route.send_counts.tolist()
        send = [counts[q] if q == me else n for q in range(w)]
        recv = [counts[me] if p == me else bounds[p] for p in range(w)]
        dev = route.token_ids.device
        shift = (torch.tensor(send, device=dev).cumsum(0) - torch.tensor(send, device=dev)
                 - route.send_counts.cumsum(0) + route.send_counts)  # per destination: padded start - exact start
        at = torch.arange(route.token_ids.shape[0], device=dev) + torch.repeat_interleave(shift, route.send_counts)
        packing = _Packing.of(hidden, route)
        records = packing.empty(sum(send), dev)
        records[at] = packing.pack(hidden[route.token_ids], route.local_idx, route.weights)
        pending = self.transport.start(records, send, recv, "dispatch_b (tokens, topk_idx, topk_weights)")
        return DispatchState(pending, records.nbytes, {"route": route, "padded_recv": recv, "num_tokens": n,
                                                       "packing": packing})

    def _dispatch_a_fixed(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                          bounds: list[int]) -> DispatchState:
        """NORMAL by agreed rows with fixed shapes (see the module docstring): ``n`` records to every rank, this one
        included, padding rows zero with every id -1; the peers' chunks received at their agreed rows."""
        n, w = hidden.shape[0], self.num_ranks
        route = fixed_normal_route(topk_idx, w, self.num_local_experts)
        k = route.local_idx.shape[2]
        packing = _Packing(hidden.dtype, hidden.shape[1], route.local_idx.dtype, topk_weights.dtype, k)
        keep = route.sends.unsqueeze(2)  # [W, T, 1]
        rows = torch.where(keep, hidden.unsqueeze(0), hidden.new_zeros(())).reshape(w * n, hidden.shape[1])
        weights = torch.where(keep, topk_weights.unsqueeze(0), topk_weights.new_zeros(())).reshape(w * n, k)
        records = packing.pack(rows, route.local_idx.reshape(w * n, k), weights)
        pending = self.transport.start(records, [n] * w, bounds, "dispatch_b (tokens, topk_idx, topk_weights)")
        return DispatchState(pending, records.nbytes, {"route": route, "fixed_recv": tuple(bounds), "num_tokens": n,
                                                       "packing": packing})

    def _slab_rows(self, tokens: int, device: torch.device) -> int:
        """Rows per expert slab: the step's tokens, which no routing can overflow (top-k picks distinct experts).

        A shape fixed by the step's size, never by the counts. Eager, a step of any size gets slabs of its own size
        (a step above the largest captured bucket included). While a graph is captured, a step of more tokens than
        ``masked_capacity`` is refused here, on the host: a capacity below the tokens could overflow, and on CUDA an
        overflow is a device-side assert baked into the graph, which ends the CUDA context at replay.
        """
        limit = int(self.masked_capacity)  # type: ignore[arg-type]
        if tokens > limit and devices.capturing(device):
            raise ValueError(f"dispatch_a: capturing a step of {tokens} tokens with masked_capacity={limit}: an expert "
                             f"can receive up to {tokens} rows, and an overflow inside a CUDA graph is a device-side "
                             f"assert that ends the process; capture steps of at most {limit} tokens, or raise "
                             f"masked_capacity to {tokens}")
        return tokens

    def _dispatch_a_static(self, hidden: torch.Tensor, topk_idx: torch.Tensor,
                           topk_weights: torch.Tensor) -> DispatchState:
        """MASKED on one rank with fixed shapes: scatter each (token, slot) pair's row into its expert's slab."""
        cap, e = self._slab_rows(hidden.shape[0], hidden.device), self.num_local_experts
        route = static_masked_route(topk_idx, e, cap)
        # cannot fail for top-k routing (distinct experts per token); a row naming one expert twice could. On CUDA
        # this is a sticky device-side assert, not a ValueError (see device_check)
        device_check(route.counts.max() <= cap, f"dispatch_a: an expert received more than the masked capacity {cap} "
                     "rows (a token names the same expert in two of its top-k slots)")
        t, k = topk_idx.shape
        pair_rows = hidden.unsqueeze(1).expand(t, k, hidden.shape[1]).reshape(t * k, hidden.shape[1])
        buf = hidden.new_zeros((route.scratch + 1, hidden.shape[1]))
        buf.index_put_((route.dest,), pair_rows)  # unrouted and overflowing pairs land on the scratch row
        masked = buf[: route.scratch].view(e, cap, hidden.shape[1])
        return DispatchState(masked, pair_rows.nbytes, {"route": route, "topk_weights": topk_weights})

    def dispatch_b(self, state: DispatchState) -> DispatchOutput:
        """`EPBackend.dispatch_b`: wait for the rows (with the transport's deadline) and lay them out."""
        info = state.info
        if isinstance(info.get("route"), StaticMaskedRoute):
            route = info["route"]
            return DispatchOutput(DispatchFormat.MASKED, state.pending, route.counts,
                                  _StaticMaskedHandle(route, info["topk_weights"]))
        if self.format is DispatchFormat.NORMAL:
            if "fixed_recv" in info:  # fixed shapes: the padding stays (its rows name no expert here)
                rows, idx, weights = info["packing"].unpack(self.transport.finish(state.pending))
                handle = _FixedNormalHandle(info["route"], info["fixed_recv"], info["num_tokens"])
                return DispatchOutput(DispatchFormat.NORMAL, rows, count_per_expert(idx, self.num_local_experts),
                                      handle, topk_idx=idx, topk_weights=weights)
            recv_counts = info.get("recv_counts")
            if recv_counts is None:  # padded records (agreed rows): a real row names a local expert, padding none
                rows, idx, weights = info["packing"].unpack(self.transport.finish(state.pending))
                rows, idx, weights, recv_counts = _drop_padding(rows, idx, weights, info["padded_recv"])
            else:
                rows, idx, weights = (self.transport.finish(p) for p in state.pending)
            counts = count_per_expert(idx, self.num_local_experts)
            handle = _NormalHandle(info["route"], recv_counts, info["num_tokens"])
            return DispatchOutput(DispatchFormat.NORMAL, rows, counts, handle, topk_idx=idx, topk_weights=weights)
        rows = self.transport.finish(state.pending)
        perm = expert_major_perm(info["recv_counts"])
        rows = rows[perm]
        counts = info["recv_counts"].sum(0)
        handle = _ExpandedHandle(info["route"], info["recv_counts"], perm, info["topk_weights"], counts)
        if self.format is DispatchFormat.MASKED:
            rows = to_masked(rows, counts, self.masked_capacity)
        return DispatchOutput(self.format, rows, counts, handle)

    # ---- combine ------------------------------------------------------------------------------------------------
    def combine_a(self, expert_out: torch.Tensor, handle: Any) -> CombineState:
        """`EPBackend.combine_a`: launch the results back along the dispatch's route, reversed."""
        if isinstance(handle, _NormalHandle):
            return self._combine_a_normal(expert_out, handle)
        if isinstance(handle, _StaticMaskedHandle):
            return self._combine_a_static(expert_out, handle)
        if isinstance(handle, _FixedNormalHandle):
            expected = sum(handle.chunks)
            if expert_out.dim() != 2 or expert_out.shape[0] != expected:
                raise ValueError(f"combine_a: NORMAL expert output must be [{expected}, H], got "
                                 f"{tuple(expert_out.shape)}")
            pending = self.transport.start(expert_out, list(handle.chunks), [handle.num_tokens] * self.num_ranks,
                                           "combine_b (tokens)")
            return CombineState(pending, expert_out.nbytes, {"handle": handle})
        if not isinstance(handle, _ExpandedHandle):
            raise TypeError(f"combine_a: handle must come from this backend's dispatch_b, got {type(handle).__name__}")
        if self.format is DispatchFormat.MASKED:
            if expert_out.dim() != 3 or expert_out.shape[0] != self.num_local_experts:
                raise ValueError(f"combine_a: MASKED expert output must be [{self.num_local_experts}, capacity, H], "
                                 f"got {tuple(expert_out.shape)}")
            expert_out = from_masked(expert_out, handle.tokens_per_expert)
        if expert_out.dim() != 2 or expert_out.shape[0] != handle.perm.shape[0]:
            raise ValueError(f"combine_a: expert output must be [{handle.perm.shape[0]}, H] (one row per dispatched "
                             f"row), got {tuple(expert_out.shape)}")
        rows = torch.empty_like(expert_out)
        rows[handle.perm] = expert_out  # back to (source, expert) order
        pending = self.transport.start(rows, handle.recv_counts.sum(1).tolist(),
                                       handle.route.send_counts.sum(1).tolist(), "combine_b (rows)")
        return CombineState(pending, rows.nbytes, {"handle": handle})

    def _combine_a_static(self, expert_out: torch.Tensor, handle: _StaticMaskedHandle) -> CombineState:
        route = handle.route
        want = (self.num_local_experts, route.capacity)
        if expert_out.dim() != 3 or tuple(expert_out.shape[:2]) != want:
            raise ValueError(f"combine_a: MASKED expert output must be [{want[0]}, {want[1]}, H] (experts, capacity, "
                             f"hidden), got {tuple(expert_out.shape)}")
        flat = expert_out.reshape(route.scratch, expert_out.shape[2])
        flat = torch.cat([flat, flat.new_zeros((1, flat.shape[1]))])  # the scratch row reads back as zeros
        pair_rows = flat[route.dest]
        return CombineState(pair_rows, pair_rows.nbytes, {"handle": handle})

    def _combine_a_normal(self, expert_out: torch.Tensor, handle: _NormalHandle) -> CombineState:
        identity = handle.route.identity
        expected = handle.num_tokens if identity else int(handle.recv_counts.sum())
        if expert_out.dim() != 2 or expert_out.shape[0] != expected:
            raise ValueError(f"combine_a: NORMAL expert output must be [{expected}, H], got {tuple(expert_out.shape)}")
        send = [expected] if identity else handle.recv_counts.tolist()
        recv = [expected] if identity else handle.route.send_counts.tolist()
        pending = self.transport.start(expert_out, send, recv, "combine_b (tokens)")
        return CombineState(pending, expert_out.nbytes, {"handle": handle})

    def combine_b(self, state: CombineState) -> torch.Tensor:
        """`EPBackend.combine_b`: wait for the results and reduce each token's top-k slots by their weights."""
        handle = state.info["handle"]
        if isinstance(handle, _StaticMaskedHandle):
            return slot_sum(state.pending, handle.topk_weights)
        rows = self.transport.finish(state.pending)
        if isinstance(handle, _FixedNormalHandle):
            return _sum_over_ranks(rows, handle)
        if isinstance(handle, _NormalHandle):
            return _sum_by_token(rows, handle.route, handle.num_tokens)
        return weighted_sum(rows, handle.route.pair_ids, handle.topk_weights)


class LocalBackend(AllToAllBackend):
    """One process, every expert local, no communication: the equivalence reference.

    With ``format=MASKED`` and a fixed ``masked_capacity`` its dispatch and combine are capture-safe (see the
    module docstring): the decode step a `tbo.runtime.cuda_graph.GraphRunner` captures on one GPU.
    """

    def __init__(self, num_experts: int, format: DispatchFormat = DispatchFormat.EXPANDED,
                 masked_capacity: int | None = None) -> None:
        super().__init__(LocalTransport(), num_experts, format, masked_capacity)


class TorchDistributedBackend(AllToAllBackend):
    """All-to-all over a torch.distributed group; every wait has a deadline (`CommTimeoutError`)."""

    def __init__(self, num_experts: int, format: DispatchFormat = DispatchFormat.EXPANDED, group: Any = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, masked_capacity: int | None = None) -> None:
        super().__init__(TorchDistributedTransport(group, timeout_s), num_experts, format, masked_capacity)
