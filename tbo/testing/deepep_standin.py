"""A CPU stand-in for ``deep_ep.Buffer`` that keeps DeepEP's contract, backed by real gloo all-to-all.

DeepEP cannot run without GPUs and NVSHMEM, yet the DeepEP backends must be tested here. This stand-in has the same
methods, arguments and return shapes, and it enforces the rules real DeepEP asserts or silently depends on:

* ``allocate_on_comm_stream`` requires ``previous_event`` and ``async_finish``;
* ``async_finish`` and ``return_recv_hook`` together are rejected;
* at most two low-latency results may be alive at once: DeepEP double-buffers, and a call's data waits in its
  buffer until it is received (hook called, or event waited), so a third call would overwrite one of them;
* every receive hook must be called, exactly once, before its buffer is reused;
* every rank must make the same calls in the same order (each call exchanges a header and compares);
* received data is only there after the event is waited (``async_finish``) or the hook is called: until then the
  returned tensors hold NaN, so a backend that forgets to wait computes garbage instead of passing by luck.

Violations raise `DeepEPContractError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from tbo.comm.fp8 import quantize_per_token_group
from tbo.comm.layout import normal_route
from tbo.comm.transport import TorchDistributedTransport
from tbo.comm.wait import DEFAULT_TIMEOUT_S

__all__ = ["Buffer", "Config", "EventOverlap", "DeepEPContractError", "check_call_order", "contract_probe"]

_OPS = ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine")


class DeepEPContractError(RuntimeError):
    """A call broke a rule that real DeepEP asserts (or silently depends on)."""


def contract_probe(found: dict[str, str | None]) -> Callable[[str, Callable[[], Any]], None]:
    """``expect(rule, fn)``: run ``fn``, a call breaking ``rule`` on purpose, and record in ``found[rule]`` the
    `DeepEPContractError` message it raised (None if it raised none). The stand-ins' own tests break each rule."""

    def expect(rule: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            found[rule] = None
        except DeepEPContractError as exc:
            found[rule] = str(exc)

    return expect


class _Event:
    """A point on the 'communication stream': ``wait`` completes whatever was pending when it was recorded."""

    def __init__(self, complete: Callable[[], None] | None = None) -> None:
        self._complete = complete

    def wait(self) -> None:
        if self._complete is not None:
            complete, self._complete = self._complete, None
            complete()


class EventOverlap:
    """Same surface as DeepEP's: ``current_stream_wait()``, and usable as a context manager."""

    def __init__(self, event: _Event | None = None, extra_tensors: Any = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            self.event.wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.current_stream_wait()


def check_call_order(transport: TorchDistributedTransport, ops: Sequence[str], op: str, seq: int,
                     agreed: Sequence[tuple[str, int]] = ()) -> None:
    """Every rank must be making the same call: exchange (op, call number, ``agreed`` values) and compare.

    DeepEP's kernels pair each rank's call with its peers' calls of the same number; if one rank makes another call
    (or the same call with another ``num_experts``, say) the real library hangs or exchanges garbage. Raises
    `DeepEPContractError` on every rank, naming what differs.
    """
    w, rank = transport.num_ranks, transport.rank
    mine = [ops.index(op), seq, *(v for _, v in agreed)]
    peers = transport.exchange(torch.tensor(mine * w, dtype=torch.int64), f"deep_ep {op} (call order check)")
    for peer, theirs in enumerate(peers.view(w, len(mine)).tolist()):
        if theirs[:2] != mine[:2]:
            raise DeepEPContractError(
                f"call order differs across ranks: rank {rank} made call #{seq} {op} while rank {peer} "
                f"made call #{theirs[1]} {ops[theirs[0]]}")
        for (name, value), other in zip(agreed, theirs[2:]):
            if other != value:
                raise DeepEPContractError(f"call #{seq} {op}: rank {rank} passed {name}={value} while rank {peer} "
                                          f"passed {name}={other}; every rank must pass the same")


def _poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2**31))


@dataclass
class Config:
    """``deep_ep.Config``: normal-mode kernel settings, and the buffer sizes they need.

    The sizes are the stand-in's own (chunked receive queues of ``hidden_bytes`` rows per peer), not DeepEP's
    formula; what matters here is that a caller sizes its buffer through these calls, as with real DeepEP.
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 128

    def __post_init__(self) -> None:
        if self.num_sms % 2:
            raise DeepEPContractError(f"Config(num_sms={self.num_sms}): the SM count must be even")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        channels = self.num_sms // 2
        return channels * min(num_ranks, 8) * self.num_max_nvl_chunked_recv_tokens * hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= 8:  # one NVLink domain: no RDMA
            return 0
        return (self.num_sms // 2) * (num_ranks // 8) * self.num_max_rdma_chunked_recv_tokens * hidden_bytes * 2


@dataclass
class _NormalHandle:
    owner: int
    token_ids: torch.Tensor  # [S] source token of each row sent, (destination, token) order
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int


@dataclass
class _LLHandle:
    owner: int
    pair_ids: torch.Tensor  # [S] token * K + slot of each row sent, (expert, token) order
    send_counts: torch.Tensor  # [W, L]
    recv_counts: torch.Tensor  # [W, L]
    num_tokens: int
    top_k: int
    hidden: int


@dataclass
class _LLCall:
    what: str
    hook: bool = False  # received through a hook (else through an event)
    pending: bool = False  # issued, not yet received: its data still occupies a buffer


@dataclass
class _Calls:
    seq: int = 0
    ll: list[_LLCall] = field(default_factory=list)  # low-latency calls not yet received, and the newest


class Buffer:
    """``deep_ep.Buffer`` on CPU over a gloo process group."""

    num_sms: int = 20

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 12,
                 allow_nvlink_for_low_latency_mode: bool = True, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._t = TorchDistributedTransport(group, timeout_s)
        self.group = group
        self.rank, self.group_size = self._t.rank, self._t.num_ranks
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self._calls = _Calls()

    # ---- static API ---------------------------------------------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms % 2:
            raise DeepEPContractError(f"set_num_sms({new_num_sms}): the SM count must be even")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(_Event())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        return 2 * num_max_dispatch_tokens_per_rank * hidden * 2 * num_experts

    # ---- contract checks ----------------------------------------------------------------------------------------
    def _agree(self, op: str) -> int:
        """Every rank must be making the same call: exchange (op, call number) and compare."""
        seq = self._calls.seq
        self._calls.seq += 1
        check_call_order(self._t, _OPS, op, seq)
        return seq

    @staticmethod
    def _check_stream_flags(op: str, previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool) -> None:
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise DeepEPContractError(f"{op}: previous_event must be an EventOverlap, got {type(previous_event)}")
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise DeepEPContractError(
                f"{op}: allocate_on_comm_stream requires previous_event and async_finish")

    def _ll_begin(self, op: str, async_finish: bool, return_recv_hook: bool) -> _LLCall:
        if async_finish and return_recv_hook:
            raise DeepEPContractError(f"{op}: async_finish and return_recv_hook cannot both be set")
        in_flight = [c for c in self._calls.ll if c.pending]
        if len(in_flight) >= 2:
            oldest = in_flight[0]
            why = "its receive hook was never called" if oldest.hook else "its event was never waited"
            raise DeepEPContractError(
                f"{op}: {oldest.what} was not received ({why}) before its buffer is reused; 2 low-latency results "
                f"are alive ({', '.join(c.what for c in in_flight)}) and DeepEP double-buffers, so at most two may be")
        call = _LLCall(f"call #{self._agree(op)} {op}")
        self._calls.ll = [*in_flight, call]
        return call

    def pending_hooks(self) -> list[str]:
        """Low-latency calls whose receive hook was not called yet."""
        return [c.what for c in self._calls.ll if c.pending and c.hook]

    def _finish(self, call: _LLCall | None, complete: Callable[[], None], async_finish: bool,
                return_recv_hook: bool) -> tuple[EventOverlap, Callable[[], None] | None]:
        """Deliver now, at the event's wait, or at the hook, as the flags say."""

        def receive() -> None:
            complete()
            if call is not None:
                call.pending = False

        if return_recv_hook:
            assert call is not None
            call.pending = call.hook = True

            def hook() -> None:
                if not call.pending:
                    raise DeepEPContractError(f"the receive hook of {call.what} was called twice")
                receive()

            return EventOverlap(None), hook
        if async_finish:
            if call is not None:
                call.pending = True
            return EventOverlap(_Event(receive)), None
        receive()
        return EventOverlap(None), None

    # ---- normal mode --------------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        self._check_stream_flags("get_dispatch_layout", previous_event, async_finish, allocate_on_comm_stream)
        if topk_idx.dtype != torch.int64:
            raise DeepEPContractError(f"get_dispatch_layout: topk_idx must be int64, got {topk_idx.dtype}")
        w, local = self.group_size, num_experts // self.group_size
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // local, torch.full_like(topk_idx, -1))
        in_rank = torch.stack([(dest == r).any(1) for r in range(w)], dim=1) if topk_idx.shape[0] else (
            torch.zeros(0, w, dtype=torch.bool))
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, EventOverlap(_Event() if async_finish else None)

    def dispatch(self, x: Any, handle: Any = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None, is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, expert_alignment: int = 1, config: Any = None,
                 previous_event: Any = None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        self._check_stream_flags("dispatch", previous_event, async_finish, allocate_on_comm_stream)
        if handle is not None:
            raise DeepEPContractError("dispatch: cached-handle dispatch is not supported by the CPU stand-in")
        if None in (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights):
            raise DeepEPContractError("dispatch: num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, "
                                      "topk_idx and topk_weights are required without a handle")
        self._agree("dispatch")
        x, scales = x if isinstance(x, tuple) else (x, None)
        w = self.group_size
        num_experts = num_tokens_per_expert.shape[0]
        local = num_experts // w
        route = normal_route(topk_idx, topk_weights.float(), w, local)
        if not torch.equal(route.send_counts.int(), num_tokens_per_rank.int()):
            raise DeepEPContractError("dispatch: num_tokens_per_rank does not match topk_idx")
        send = route.send_counts.tolist()
        recv = self._t.exchange(route.send_counts.long(), "deep_ep dispatch (counts)").tolist()
        per_expert = self._t.exchange(num_tokens_per_expert.long(), "deep_ep dispatch (expert counts)")
        counts = per_expert.view(w, local).sum(0).tolist()
        counts = [-(-c // expert_alignment) * expert_alignment for c in counts]
        pend = [self._t.start(x[route.token_ids], send, recv, "deep_ep dispatch (x)"),
                self._t.start(route.local_idx, send, recv, "deep_ep dispatch (topk_idx)"),
                self._t.start(route.weights, send, recv, "deep_ep dispatch (topk_weights)")]
        if scales is not None:
            pend.append(self._t.start(scales[route.token_ids], send, recv, "deep_ep dispatch (scales)"))
        outs = [_poison(torch.empty_like(p.out)) for p in pend]

        def complete() -> None:
            for p, o in zip(pend, outs):
                o.copy_(self._t.finish(p))

        event, _ = self._finish(None, complete, async_finish, False)
        recv_x = (outs[0], outs[3]) if scales is not None else outs[0]
        h = _NormalHandle(id(self), route.token_ids, send, recv, x.shape[0])
        return recv_x, outs[1], outs[2], counts, h, event

    def combine(self, x: torch.Tensor, handle: Any, topk_weights: torch.Tensor | None = None, config: Any = None,
                previous_event: Any = None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        self._check_stream_flags("combine", previous_event, async_finish, allocate_on_comm_stream)
        if not isinstance(handle, _NormalHandle) or handle.owner != id(self):
            raise DeepEPContractError("combine: handle must come from this buffer's dispatch")
        if x.shape[0] != sum(handle.recv_counts):
            raise DeepEPContractError(f"combine: x has {x.shape[0]} rows, dispatch delivered {sum(handle.recv_counts)}")
        self._agree("combine")
        pend = self._t.start(x, handle.recv_counts, handle.send_counts, "deep_ep combine (x)")
        out = _poison(x.new_empty((handle.num_tokens, x.shape[1])))

        def complete() -> None:
            rows = self._t.finish(pend)
            out.zero_().index_add_(0, handle.token_ids, rows)

        event, _ = self._finish(None, complete, async_finish, False)
        return out, None, event

    # ---- low-latency mode ---------------------------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, use_fp8: bool = True, async_finish: bool = False,
                             return_recv_hook: bool = False):
        if not self.low_latency_mode:
            raise DeepEPContractError("low_latency_dispatch needs a Buffer built with low_latency_mode=True")
        if x.shape[0] > num_max_dispatch_tokens_per_rank:
            raise DeepEPContractError(f"low_latency_dispatch: {x.shape[0]} tokens exceed "
                                      f"num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}")
        call = self._ll_begin("low_latency_dispatch", async_finish, return_recv_hook)
        w, local, (t, k), h = self.group_size, num_experts // self.group_size, topk_idx.shape, x.shape[1]
        flat = topk_idx.reshape(-1)
        pair_ids = torch.nonzero(flat >= 0).flatten()
        experts = flat[pair_ids]
        order = torch.argsort(experts * max(t * k, 1) + pair_ids)
        pair_ids = pair_ids[order]
        send_counts = torch.bincount(experts, minlength=num_experts).view(w, local)
        recv_counts = self._t.exchange(send_counts.reshape(-1), "deep_ep low_latency_dispatch (counts)").view(w, local)
        pend = self._t.start(x[pair_ids // k], send_counts.sum(1).tolist(), recv_counts.sum(1).tolist(),
                             "deep_ep low_latency_dispatch (x)")
        capacity = num_max_dispatch_tokens_per_rank * w
        packed = _poison(torch.empty((local, capacity, h), dtype=x.dtype))
        recv_count = recv_counts.sum(0).int()
        if use_fp8:  # FP8 results are quantised from the rows once they have arrived
            result: Any = (_poison(torch.empty((local, capacity, h), dtype=torch.float32)).to(torch.float8_e4m3fn),
                           _poison(torch.empty((local, capacity, h // 128), dtype=torch.float32)))
        else:
            result = packed

        def complete() -> None:
            rows, offset = self._t.finish(pend), 0
            for src in range(w):
                for e in range(local):
                    n = int(recv_counts[src, e])
                    fill = int(recv_counts[:src, e].sum())
                    packed[e, fill : fill + n] = rows[offset : offset + n]
                    offset += n
            if use_fp8:
                q, scales = quantize_per_token_group(packed)
                result[0].copy_(q)
                result[1].copy_(scales)

        event, hook = self._finish(call, complete, async_finish, return_recv_hook)
        handle = _LLHandle(id(self), pair_ids, send_counts, recv_counts, t, k, h)
        return result, recv_count, handle, event, hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Any,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None):
        if not isinstance(handle, _LLHandle) or handle.owner != id(self):
            raise DeepEPContractError("low_latency_combine: handle must come from this buffer's low_latency_dispatch")
        if topk_idx.shape != (handle.num_tokens, handle.top_k):
            raise DeepEPContractError(f"low_latency_combine: topk_idx shape {tuple(topk_idx.shape)} differs from the "
                                      f"dispatch's ({handle.num_tokens}, {handle.top_k})")
        call = self._ll_begin("low_latency_combine", async_finish, return_recv_hook)
        w, local = handle.recv_counts.shape
        rows = []
        for src in range(w):  # back in the order each source sent them: (expert, token)
            for e in range(local):
                n = int(handle.recv_counts[src, e])
                fill = int(handle.recv_counts[:src, e].sum())
                rows.append(x[e, fill : fill + n])
        send = torch.cat(rows) if rows else x.new_zeros((0, handle.hidden))
        pend = self._t.start(send, handle.recv_counts.sum(1).tolist(), handle.send_counts.sum(1).tolist(),
                             "deep_ep low_latency_combine (x)")
        combined = _poison(out if out is not None else x.new_empty((handle.num_tokens, handle.hidden)))

        def complete() -> None:
            back = self._t.finish(pend)
            y = back.new_zeros((handle.num_tokens * handle.top_k, handle.hidden))
            y[handle.pair_ids] = back
            y = y.view(handle.num_tokens, handle.top_k, handle.hidden).float()
            wts = topk_weights.float()
            acc = y[:, 0] * wts[:, 0:1]
            for slot in range(1, handle.top_k):  # reduce with weights, slot by slot, in float32
                acc = acc + y[:, slot] * wts[:, slot : slot + 1]
            combined.copy_(acc.to(combined.dtype))

        event, hook = self._finish(call, complete, async_finish, return_recv_hook)
        return combined, event, hook
