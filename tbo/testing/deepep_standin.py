"""A CPU stand-in for ``deep_ep.Buffer`` that keeps DeepEP's contract, backed by real gloo all-to-all.

DeepEP cannot run without GPUs and NVSHMEM, yet the DeepEP backends must be tested here. This stand-in has the same
methods, arguments and return shapes, and it enforces the rules real DeepEP asserts, or hangs without (read against
DeepEP 2.1.0, ``dd758caf``; ``docs/deepep.md`` cites the source line of each):

* ``allocate_on_comm_stream`` requires ``previous_event`` and ``async_finish``;
* ``async_finish`` and ``return_recv_hook`` together are rejected;
* **one low-latency call un-received at a time**: low-latency dispatch and combine share one double buffer, and
  each call's send phase cleans the other half, where the previous call's receive flags are; so a call made before
  the previous one was received (hook called, or event waited) would leave that one waiting forever on GPUs
  (DeepEP issue #513). Here it raises, naming both calls;
* every receive hook must be called, exactly once;
* every rank must make the same calls in the same order (each call exchanges a header and compares);
* low-latency kernels: ``x`` BF16 with a hidden size they are compiled for (and a multiple of 512 with FP8), at
  most 11 experts per token, ``num_ranks * num_max_dispatch_tokens_per_rank`` a multiple of 4, a queue depth
  (``NVSHMEM_QP_DEPTH``, read when the buffer is built, as DeepEP does) of at least ``2 * (tokens + 1)``, a QP per
  local expert, an RDMA buffer of ``get_low_latency_rdma_size_hint``'s size, ``use_ue8m0`` only with
  ``round_scale``; combine takes BF16 only;
* normal kernels: 2, 4 or 8 ranks (intranode; internode is not modelled), rows of a multiple of 16 bytes, BF16 into
  combine, and NVLink bytes enough for the channels of the config in effect (``Buffer.num_sms / 2``): a larger
  ``Buffer.num_sms`` than the buffer was sized for fails the call, as DeepEP's host assert does;
* no call while torch's deterministic algorithms and ``fill_uninitialized_memory`` are both on (DeepEP asserts:
  the fill kernels race its communication streams);
* received data is only there after the event is waited (``async_finish``) or the hook is called: until then the
  returned tensors hold NaN, so a backend that forgets to wait computes garbage instead of passing by luck.

Violations raise `DeepEPContractError`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from tbo.comm.deepep import LOW_LATENCY_HIDDEN, LOW_LATENCY_MAX_TOPK, NVSHMEM_QP_DEPTH
from tbo.comm.fp8 import pack_ue8m0, quantize_per_token_group
from tbo.comm.layout import normal_route
from tbo.comm.transport import TorchDistributedTransport
from tbo.comm.wait import DEFAULT_TIMEOUT_S

__all__ = ["Buffer", "Config", "EventOverlap", "DeepEPContractError", "check_call_order", "check_torch_deterministic",
           "contract_probe"]

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


def check_torch_deterministic(op: str) -> None:
    """DeepEP's ``check_torch_deterministic`` (V1 and V2 calls): with torch's deterministic algorithms on and
    ``fill_uninitialized_memory`` (on by default with them), ``torch.empty`` launches fill kernels that race the
    communication streams, so DeepEP asserts."""
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        raise DeepEPContractError(
            f"{op}: torch.use_deterministic_algorithms(True) with torch.utils.deterministic.fill_uninitialized_memory"
            " on: DeepEP asserts against both (the fill kernels race its streams); set fill_uninitialized_memory = "
            "False")


_SOURCE_META_BYTES = 8  # sizeof(SourceMeta): two ints
_MAX_TOPK_HINT, _MAX_SCALES_HINT = 128, 128  # what the size hints assume


@dataclass
class Config:
    """``deep_ep.Config``: normal-mode kernel settings, and the buffer sizes they need (DeepEP's own formulas).

    A channel is two SMs, so the sizes grow with ``num_sms``: a buffer sized for one SM count is too small for a
    larger one."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        if self.num_sms < 0 or self.num_sms % 2:
            raise DeepEPContractError(f"Config(num_sms={self.num_sms}): the SM count must be even")
        if not 0 < self.num_max_nvl_chunked_send_tokens < self.num_max_nvl_chunked_recv_tokens:
            raise DeepEPContractError("Config: need 0 < num_max_nvl_chunked_send_tokens < ..._recv_tokens")
        rdma_send = self.num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = -(-self.num_max_rdma_chunked_recv_tokens // rdma_send) * rdma_send
        if not 0 < rdma_send <= self.num_max_rdma_chunked_recv_tokens // 2:
            raise DeepEPContractError("Config: need 0 < num_max_rdma_chunked_send_tokens <= ..._recv_tokens / 2")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        rdma, nvl, channels = max(num_ranks // 8, 1), min(num_ranks, 8), self.num_sms // 2
        per_token = (hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK_HINT * 8 + _MAX_TOPK_HINT * 4
                     + _MAX_SCALES_HINT * 4)
        n = channels * nvl * ((2 * rdma + 3) * 4 + self.num_max_nvl_chunked_recv_tokens * per_token)
        return -(-n // 128) * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= 8:  # one NVLink domain: no RDMA
            return 0
        rdma, channels = num_ranks // 8, self.num_sms // 2
        per_token = (hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK_HINT * 8 + _MAX_TOPK_HINT * 4
                     + _MAX_SCALES_HINT * 4 + 16) * 2
        n = channels * rdma * ((8 * 2 + 2) * 2 * 4 + self.num_max_rdma_chunked_recv_tokens * per_token)
        return -(-n // 128) * 128


#: ``Buffer.get_dispatch_config`` / ``get_combine_config``: (nvl send, nvl recv, rdma send, rdma recv) by ranks
_DISPATCH_CONFIGS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                     24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                     96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128),
                     160: (28, 720, 12, 128)}
_COMBINE_CONFIGS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def _config(table: dict[int, tuple[int, int, int, int]], num_ranks: int) -> Config:
    if num_ranks not in table:
        raise DeepEPContractError(f"Unsupported number of EP ranks: {num_ranks} (DeepEP has configs for "
                                  f"{', '.join(map(str, table))})")
    return Config(Buffer.num_sms, *table[num_ranks])


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
    num_max_dispatch_tokens_per_rank: int
    num_experts: int

    @property
    def capacity(self) -> int:
        return self.num_max_dispatch_tokens_per_rank * self.recv_counts.shape[0]


@dataclass
class _LLCall:
    what: str
    hook: bool = False  # received through a hook (else through an event)
    pending: bool = False  # issued, not yet received: its data still occupies a buffer


@dataclass
class _Calls:
    seq: int = 0
    ll: list[_LLCall] = field(default_factory=list)  # the newest low-latency call (received or not)


class Buffer:
    """``deep_ep.Buffer`` on CPU over a gloo process group."""

    num_sms: int = 20

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._t = TorchDistributedTransport(group, timeout_s)
        self.group = group
        self.rank, self.group_size = self._t.rank, self._t.num_ranks
        for name, n in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if n < 0 or n % 128:
                raise DeepEPContractError(f"Buffer({name}={n}): must be a non-negative multiple of 128")
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        if low_latency_mode:
            if num_qps_per_rank <= 0:
                raise DeepEPContractError(f"Buffer(num_qps_per_rank={num_qps_per_rank}): must be positive")
            self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", str(NVSHMEM_QP_DEPTH)))
        self.num_qps_per_rank = num_qps_per_rank
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
        return _config(_DISPATCH_CONFIGS, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return _config(_COMBINE_CONFIGS, num_ranks)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """DeepEP's layout: two halves, each a send, a receive and a signalling region (sized for BF16)."""
        m, scales = num_max_dispatch_tokens_per_rank, hidden // 128
        dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
        combine_msg = scales * 4 + hidden * 2
        send = max(m * dispatch_msg, num_experts * m * combine_msg)
        recv = num_experts * m * max(dispatch_msg, combine_msg)
        signal = -(-num_experts * 4 // 128) * 128
        total = 2 * (send + recv + signal)
        return (total + 128) // 128 * 128

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
        if in_flight:
            previous = in_flight[-1]
            why = "its receive hook was not called" if previous.hook else "its event was not waited"
            raise DeepEPContractError(
                f"call #{self._calls.seq} {op} launched while {previous.what} is not received ({why}): low-latency "
                "dispatch and combine share one double buffer, and this call's send phase cleans the half holding "
                f"{previous.what}'s receive flags, so on GPUs it would never finish receiving and the ranks hang "
                "(DeepEP issue #513). Receive each low-latency call before the next one, in every microbatch")
        call = _LLCall(f"call #{self._agree(op)} {op}")
        self._calls.ll = [call]
        return call

    def _ll_check(self, op: str, num_max_dispatch_tokens_per_rank: int, hidden: int, num_topk: int,
                  num_experts: int) -> None:
        """The sizes DeepEP's low-latency kernels assert on (or were never compiled for)."""
        m, w = num_max_dispatch_tokens_per_rank, self.group_size
        if not self.low_latency_mode:
            raise DeepEPContractError(f"{op} needs a Buffer built with low_latency_mode=True")
        if self.nvshmem_qp_depth < (m + 1) * 2:
            raise DeepEPContractError(f"{op}: assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1)"
                                      f" * 2 failed ({self.nvshmem_qp_depth} < {(m + 1) * 2})")
        if (w * m) % 4:
            raise DeepEPContractError(f"{op}: num_ranks * num_max_dispatch_tokens_per_rank = {w * m}: TMA requires "
                                      "the number of tokens to be multiple of 4")
        if hidden % 128 or hidden not in LOW_LATENCY_HIDDEN:
            raise DeepEPContractError(f"{op}: Unsupported hidden {hidden} (the kernels are compiled for "
                                      f"{', '.join(map(str, LOW_LATENCY_HIDDEN))})")
        if num_topk > LOW_LATENCY_MAX_TOPK:
            raise DeepEPContractError(f"{op}: num_topk={num_topk} > kNumMaxTopK={LOW_LATENCY_MAX_TOPK}")
        if num_experts <= 0 or num_experts % w:
            raise DeepEPContractError(f"{op}: num_experts={num_experts} must be a positive multiple of {w} ranks")
        if self.num_qps_per_rank < num_experts // w:
            raise DeepEPContractError(f"{op}: num_qps_per_rank={self.num_qps_per_rank} < {num_experts // w} local "
                                      "experts (a device-side assert: one QP per local expert)")
        need = self.get_low_latency_rdma_size_hint(m, hidden, w, num_experts)
        if need > self.num_rdma_bytes:
            raise DeepEPContractError(f"{op}: the layout needs {need} RDMA bytes, the buffer has "
                                      f"{self.num_rdma_bytes} (size it with get_low_latency_rdma_size_hint)")

    def _normal_check(self, op: str, x: torch.Tensor, config: Any, num_topk: int, num_scales: int) -> Config:
        """Intranode normal kernels: the ranks they are compiled for, row bytes, and the NVLink bytes the config's
        channels need (DeepEP's host asserts)."""
        w = self.group_size
        if w not in (2, 4, 8):
            raise DeepEPContractError(f"{op}: Unsupported ranks {w} (intranode kernels: 2, 4, 8; internode is not "
                                      "modelled by the stand-in)")
        if x.dim() != 2 or (x.shape[1] * x.element_size()) % 16:
            raise DeepEPContractError(f"{op}: x must be 2-D with rows of a multiple of 16 bytes, got "
                                      f"{x.dtype} {tuple(x.shape)}")
        config = config if config is not None else (
            self.get_dispatch_config(w) if op == "dispatch" else self.get_combine_config(w))
        channels, r = config.num_sms // 2, config.num_max_nvl_chunked_recv_tokens
        per_token = x.shape[1] * x.element_size() + 4 + num_topk * 4
        if op == "dispatch":
            fixed = w * w * 4 + channels * w * 4 * 4
            per_token += num_topk * 8 + num_scales * 4
        else:
            fixed = channels * w * 4 * 2
        need = fixed + channels * w * r * per_token
        if need > self.num_nvl_bytes:
            raise DeepEPContractError(
                f"{op}: the config's {channels} channels (num_sms={config.num_sms}) need {need} NVLink bytes, the "
                f"buffer has {self.num_nvl_bytes} (sized with Config.get_nvl_buffer_size_hint for a smaller "
                "Buffer.num_sms?)")
        return config

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
        check_torch_deterministic("dispatch")
        self._check_stream_flags("dispatch", previous_event, async_finish, allocate_on_comm_stream)
        if handle is not None:
            raise DeepEPContractError("dispatch: cached-handle dispatch is not supported by the CPU stand-in")
        if None in (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights):
            raise DeepEPContractError("dispatch: num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, "
                                      "topk_idx and topk_weights are required without a handle")
        x, scales = x if isinstance(x, tuple) else (x, None)
        self._normal_check("dispatch", x, config, topk_idx.shape[1], 0 if scales is None else scales.shape[1])
        self._agree("dispatch")
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
        check_torch_deterministic("combine")
        self._check_stream_flags("combine", previous_event, async_finish, allocate_on_comm_stream)
        if not isinstance(handle, _NormalHandle) or handle.owner != id(self):
            raise DeepEPContractError("combine: handle must come from this buffer's dispatch")
        if x.dtype != torch.bfloat16:
            raise DeepEPContractError(f"combine: Unsupported type {x.dtype}: the combine kernel is compiled for "
                                      "bfloat16 only")
        if x.shape[0] != sum(handle.recv_counts):
            raise DeepEPContractError(f"combine: x has {x.shape[0]} rows, dispatch delivered {sum(handle.recv_counts)}")
        self._normal_check("combine", x, config, 0 if topk_weights is None else topk_weights.shape[1], 0)
        self._agree("combine")
        pend = self._t.start(x, handle.recv_counts, handle.send_counts, "deep_ep combine (x)")
        out = _poison(x.new_empty((handle.num_tokens, x.shape[1])))

        def complete() -> None:  # the kernel reduces in float32
            rows = self._t.finish(pend).float()
            acc = rows.new_zeros((handle.num_tokens, rows.shape[1])).index_add_(0, handle.token_ids, rows)
            out.copy_(acc.to(out.dtype))

        event, _ = self._finish(None, complete, async_finish, False)
        return out, None, event

    # ---- low-latency mode ---------------------------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        op = "low_latency_dispatch"
        check_torch_deterministic(op)
        if x.dim() != 2 or x.dtype != torch.bfloat16:
            raise DeepEPContractError(f"{op}: x must be bfloat16 [num_tokens, hidden], got {x.dtype} "
                                      f"{tuple(x.shape)}")
        if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
            raise DeepEPContractError(f"{op}: topk_idx must be int64 [{x.shape[0]}, num_topk], got {topk_idx.dtype} "
                                      f"{tuple(topk_idx.shape)}")
        self._ll_check(op, num_max_dispatch_tokens_per_rank, x.shape[1], topk_idx.shape[1], num_experts)
        if x.shape[0] > num_max_dispatch_tokens_per_rank:
            raise DeepEPContractError(f"{op}: {x.shape[0]} tokens exceed "
                                      f"num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}")
        if use_fp8 and x.shape[1] % 512:
            raise DeepEPContractError(f"{op}: FP8 needs hidden % 512 == 0, got {x.shape[1]}")
        if use_ue8m0 and not round_scale:
            raise DeepEPContractError(f"{op}: UE8M0 SF requires `round_scale=True`")
        call = self._ll_begin(op, async_finish, return_recv_hook)
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
            groups = h // 512 if use_ue8m0 else h // 128  # UE8M0: four exponents per int32
            result: Any = (_poison(torch.empty((local, capacity, h), dtype=torch.float32)).to(torch.float8_e4m3fn),
                           _poison(torch.empty((local, capacity, groups),
                                               dtype=torch.int32 if use_ue8m0 else torch.float32)))
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
                q, scales = quantize_per_token_group(packed, round_scale=round_scale)
                result[0].copy_(q)
                if use_ue8m0:  # rows past each expert's count are garbage (NaN): any exponent will do there
                    scales = pack_ue8m0(torch.where(torch.isnan(scales), torch.ones_like(scales), scales))
                result[1].copy_(scales)

        event, hook = self._finish(call, complete, async_finish, return_recv_hook)
        handle = _LLHandle(id(self), pair_ids, send_counts, recv_counts, t, k, h, num_max_dispatch_tokens_per_rank,
                           num_experts)
        return result, recv_count, handle, event, hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Any,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None):
        op = "low_latency_combine"
        check_torch_deterministic(op)
        if not isinstance(handle, _LLHandle) or handle.owner != id(self):
            raise DeepEPContractError(f"{op}: handle must come from this buffer's low_latency_dispatch")
        want = (handle.recv_counts.shape[1], handle.capacity, handle.hidden)
        if x.dim() != 3 or x.dtype != torch.bfloat16 or tuple(x.shape) != want:
            raise DeepEPContractError(f"{op}: x must be bfloat16 {list(want)} (local experts, num_ranks * "
                                      f"num_max_dispatch_tokens_per_rank, hidden), got {x.dtype} {tuple(x.shape)}")
        if topk_idx.shape != (handle.num_tokens, handle.top_k):
            raise DeepEPContractError(f"{op}: topk_idx shape {tuple(topk_idx.shape)} differs from the "
                                      f"dispatch's ({handle.num_tokens}, {handle.top_k})")
        if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_idx.shape:
            raise DeepEPContractError(f"{op}: topk_weights must be float32 {tuple(topk_idx.shape)}, got "
                                      f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
        if zero_copy and use_logfmt:
            raise DeepEPContractError(f"{op}: zero_copy and use_logfmt cannot both be set")
        self._ll_check(op, handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.top_k, handle.num_experts)
        call = self._ll_begin(op, async_finish, return_recv_hook)
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
