"""A CPU stand-in for DeepEP V2's ``deep_ep.ElasticBuffer`` that keeps its contract, backed by real gloo all-to-all.

DeepEP V2 needs Hopper GPUs, NCCL >= 2.30.4 (the Gin backend) and PyTorch >= 2.10, yet the V2 backend must be
tested here. This stand-in has ``ElasticBuffer``'s methods, arguments and return values as of deep_ep 2.0/2.1
(``dispatch`` returns ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``, ``combine`` returns
``(combined_x, combined_topk_weights, event)``, the handle is an ``EPHandle`` with the same public attributes), and
it enforces the rules real V2 asserts or silently depends on:

* ``previous_event`` requires ``allocate_on_comm_stream=True``, and must be an ``EventHandle`` from ``capture()``;
* with ``async_with_compute_stream=True`` nothing waits until ``event.current_stream_wait()``: until then the
  returned tensors are in flight, and reading their values raises (their shape and dtype may be read: on a GPU they
  are known at once). On a GPU such a read is a silent race; here it is an error;
* a cached ``handle`` reuses the routing it was made with: passing a ``topk_idx`` with it, asking for a CPU sync,
  or other ``num_experts`` / ``expert_alignment`` / ``num_max_tokens_per_rank`` / ``do_expand`` is rejected;
* every rank makes the same calls in the same order (a cached dispatch is a different call from a fresh one), with
  the same ``num_experts``, ``num_max_tokens_per_rank``, ``expert_alignment`` and layout;
* ``x`` is BF16 ``[T, H]`` or FP8 ``(data, scales)``; ``topk_idx`` is int64, ``topk_weights`` float32; combine takes
  BF16; ``num_sms`` at most the device's; everything fits the size the buffer was built for;
* no call while torch's deterministic algorithms and ``fill_uninitialized_memory`` are both on (V2 asserts, as V1).

Violations raise `DeepEPContractError`, the V1 stand-in's error. Layouts, as V2 produces them:

* ``do_expand=False``: each token once per rank hosting any of its experts, in (source rank, token) order, with
  ``recv_topk_idx`` holding local expert ids (-1 for experts elsewhere) and ``recv_topk_weights`` ``[N, K]``;
* ``do_expand=True``: one row per (token, local expert), grouped by expert, each expert's rows starting at a
  multiple of ``expert_alignment`` (padding zeroed with ``do_zero_padding``), ``recv_topk_idx`` None and
  ``recv_topk_weights`` one weight per row. Within an expert, rows are in (source rank, token) order;
* that sorted order is what real V2 gives with ``deterministic=True`` (its sort epilogue); without it V2 receives
  in whatever order the transfers land, different from run to run. So the stand-in, built with
  ``deterministic=False`` (V2's default), permutes the received tokens (NORMAL) or each expert's rows (EXPANDED),
  by a seeded permutation (``receive_order_seed``, the rank and the call number: reproducible), never the identity
  when there are two or more to permute; the handle routes the combine back, as V2's metadata does;
* ``combine`` only sums (weights are not applied; ``topk_weights`` are reduced and returned, as for a backward
  pass), in float32, once within the rank and once at the source, like V2's default ``allow_multiple_reduction``.

``recv_src_metadata`` columns are the source token's global index (``rank * num_max_tokens_per_rank + token``), the
source rank (real V2 keeps a buffer slot there), then each top-k slot's expanded row (-1: none, or not expanded).
Not modelled (a clear error): ``do_cpu_sync=False`` without a handle, ``use_tma_aligned_col_major_sf``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from tbo.comm.layout import normal_route
from tbo.comm.transport import TorchDistributedTransport
from tbo.testing.deepep_standin import DeepEPContractError, _Event, check_call_order, check_torch_deterministic
from tbo.testing.deepep_standin import EventOverlap as _V1EventOverlap

__all__ = ["ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "DeepEPContractError", "topk_idx_t"]

#: ``deep_ep.topk_idx_t``
topk_idx_t = torch.int64

_OPS = ("dispatch", "dispatch (cached handle)", "combine", "barrier")
_ALIGNMENT = 2 << 20  # V2 sizes buffers in 2 MiB steps
_FP8 = torch.float8_e4m3fn
#: reading these from an in-flight tensor is fine: on a GPU they are known when the call returns
_METADATA = frozenset({
    "shape", "dtype", "device", "size", "dim", "ndim", "numel", "nbytes", "itemsize", "element_size", "layout",
    "stride", "is_contiguous", "is_floating_point", "is_cuda", "requires_grad", "data_ptr", "storage_offset",
    "empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones", "new_full",
})


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


class EventHandle:
    """``deep_ep.EventHandle``: a captured point on the current stream (on CPU there is nothing to wait for)."""

    def current_stream_wait(self) -> None:
        return None


class EventOverlap(_V1EventOverlap):
    """V2's ``EventOverlap``: ``current_stream_wait(release_handle=False)``, ``wait()``, a hook run after the wait."""

    def __init__(self, event: _Event | None = None, extra_tensors: Any = None) -> None:
        super().__init__(event, extra_tensors)
        self.hook_after_wait: Callable[[], Any] | None = None

    def current_stream_wait(self, release_handle: bool = False) -> Any:
        if self.event is None:
            raise DeepEPContractError(
                "current_stream_wait() on an event that holds nothing: the call was made without "
                "async_with_compute_stream=True (its results were complete on return), or the event was released")
        self.event.wait()
        result = None
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            result = hook()
        if release_handle:
            self.event = None
        return result

    def wait(self) -> Any:
        return self.current_stream_wait()

    def __exit__(self, *exc: Any) -> None:
        if self.event is not None:
            self.current_stream_wait()

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        if self.hook_after_wait is not None:
            raise DeepEPContractError("a hook is already registered on this EventOverlap")
        self.hook_after_wait = hook_after_wait


class _InFlight(torch.Tensor):
    """A received tensor whose event was not waited: reading its values raises. On arrival its class is switched
    back to ``torch.Tensor``, so afterwards it is an ordinary tensor at no cost."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property such as .shape
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name not in _METADATA:
            culprit = next((t for t in tree_leaves((args, kwargs or {})) if isinstance(t, _InFlight)), None)
            what = getattr(culprit, "_what", "a received tensor")
            raise DeepEPContractError(
                f"{what} was used ({name}) before event.current_stream_wait(): with async_with_compute_stream=True "
                "the compute stream does not wait for the transfer, so its values have not arrived")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _in_flight(t: torch.Tensor, what: str) -> torch.Tensor:
    view = t.as_subclass(_InFlight)
    view._what = what
    return view


def _arrived(*tensors: Any) -> None:
    for t in tensors:
        if isinstance(t, _InFlight):
            t.__class__ = torch.Tensor


def _poison(t: torch.Tensor) -> torch.Tensor:
    """Garbage that cannot pass for data: NaN (FP8 too), or the most negative int."""
    if t.dtype == _FP8:
        t.view(torch.uint8).fill_(0x7F)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(torch.iinfo(t.dtype).min)
    return t


def _needed_bytes(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int, fp8: bool) -> int:
    """The stand-in's own sizing (not DeepEP's formula): a send and a receive region of whole tokens."""
    dispatch = (hidden + hidden // 128 * 4 if fp8 else 2 * hidden) + num_topk * 12
    combine = 2 * hidden + num_topk * 4
    need = 2 * num_ranks * num_max_tokens_per_rank * max(dispatch, combine)
    return max(_ALIGNMENT, _align(need, _ALIGNMENT))


@dataclass
class _Route:
    """Who sent what where, kept by the handle so a cached dispatch and the combine can replay it."""

    token_ids: torch.Tensor  # [S] source token of each row sent, (destination, token) order
    local_idx: torch.Tensor  # [S, K] the destination's local expert ids, -1 for experts elsewhere
    send_counts: list[int]  # [W]
    recv_counts: list[int]  # [W]
    recv_local_idx: torch.Tensor  # [N, K] received rows' local expert ids
    slots: torch.Tensor  # [N, K] expanded row of each received (token, slot), -1 none; all -1 when not expanded
    src_global: torch.Tensor  # [N] received rows' source token, as ``rank * num_max_tokens_per_rank + token``
    num_tokens: int
    hidden: int
    order: torch.Tensor | None = None  # NORMAL, not deterministic: received row i is sorted row order[i]

    def received(self, sorted_rows: torch.Tensor) -> torch.Tensor:
        """Rows in sorted (source rank, token) order, as they land."""
        return sorted_rows if self.order is None else sorted_rows[self.order]

    def sorted(self, received_rows: torch.Tensor) -> torch.Tensor:
        """The inverse: rows as they landed, back in sorted order (what the combine sends)."""
        if self.order is None:
            return received_rows
        out = torch.empty_like(received_rows)
        out[self.order] = received_rows
        return out


class EPHandle:
    """``deep_ep.EPHandle``: the layout of one dispatch, for a cached dispatch or the combine."""

    def __init__(self, *, owner: int, route: _Route, do_expand: bool, num_experts: int, expert_alignment: int,
                 num_max_tokens_per_rank: int, num_sms: int, topk_idx: torch.Tensor, num_recv_tokens: int,
                 num_expanded_tokens: int, num_recv_tokens_per_expert_list: list[int],
                 psum_num_recv_tokens_per_scaleup_rank: torch.Tensor, psum_num_recv_tokens_per_expert: torch.Tensor,
                 num_unaligned_recv_tokens_per_expert: torch.Tensor | None, recv_src_metadata: torch.Tensor) -> None:
        self._owner, self._route = owner, route
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata


class ElasticBuffer:
    """``deep_ep.ElasticBuffer`` (EP dispatch and combine) on CPU over a gloo process group.

    ``num_cpu_timeout_secs`` bounds every wait on a peer. ``num_cpu_syncs`` counts the dispatches that waited on
    the CPU for the received counts (a cached-handle dispatch does not), which tests read; ``num_device_sms`` and
    ``nvlink_gbs`` are the device `get_theoretical_num_sms` models (an H100/H200 by default).
    """

    num_device_sms: int = 132
    nvlink_gbs: float = 450.0
    #: seeds the receive order of a buffer built with ``deterministic=False`` (with the rank and the call number)
    receive_order_seed: int = 0

    def __init__(self, group: Any, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False,
                 deterministic: bool = False, allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False) -> None:
        if group is None:
            raise DeepEPContractError("ElasticBuffer needs a process group (it calls group.rank() and group.size()); "
                                      "pass e.g. torch.distributed.group.WORLD")
        self._t = TorchDistributedTransport(group, float(num_cpu_timeout_secs))
        self.group = group
        self.rank_idx, self.num_ranks = self._t.rank, self._t.num_ranks
        if num_bytes is None:
            num_bytes = _needed_bytes(self.num_ranks, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch)
        elif num_bytes % _ALIGNMENT:
            raise DeepEPContractError(f"ElasticBuffer(num_bytes={num_bytes}): must be a multiple of 2 MiB")
        self.num_bytes, self.num_cpu_bytes = num_bytes, num_cpu_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.deterministic = deterministic
        self.allow_hybrid_mode, self.allow_multiple_reduction = allow_hybrid_mode, allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.num_allocated_qps = num_allocated_qps or (65 if allow_hybrid_mode else 17)
        self.explicitly_destroy = explicitly_destroy
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks  # one NVLink domain
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx
        self.num_rdma_ranks, self.num_nvlink_ranks = 1, self.num_ranks
        self.num_cpu_syncs = 0
        self._seq = 0
        self._destroyed = False
        self._t.exchange(torch.zeros(self.num_ranks, dtype=torch.int64), "ElasticBuffer() (construction barrier)")

    # ---- static API ---------------------------------------------------------------------------------------------
    @staticmethod
    def get_buffer_size_hint(group: Any, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        return _needed_bytes(group.size(), num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch)

    @staticmethod
    def capture() -> EventHandle:
        return EventHandle()

    def get_logical_domain_size(self) -> tuple[int, int]:
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_physical_domain_size(self) -> tuple[int, int]:
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """SMs for dispatch/combine: enough to push this rank's NVLink share at ``sm_write_gbs`` each, plus 25%.

        The stand-in's simplified model of one NVLink domain (real V2 also weighs reads and RDMA); like V2's, the
        result is even, at least 4, and at most the device's SMs.
        """
        if num_experts <= 0 or num_experts % self.num_ranks:
            raise DeepEPContractError(f"get_theoretical_num_sms: num_experts={num_experts} must be a positive "
                                      f"multiple of the {self.num_ranks} ranks")
        if not 0 < num_topk <= num_experts:
            raise DeepEPContractError(f"get_theoretical_num_sms: num_topk={num_topk} must be in [1, {num_experts}]")
        share = 1 - 1 / self.num_ranks  # what leaves the rank over NVLink
        sms = (nvlink_gbs or self.nvlink_gbs) * share / sm_write_gbs if share else self.num_device_sms
        sms = _align(max(4, math.ceil(sms * 1.25)), 2)
        if not self.prefer_overlap_with_compute:
            sms = max(sms, 64)
        return min(sms, self.num_device_sms)

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        self._agree("barrier")

    def destroy(self) -> None:
        if not self.explicitly_destroy:
            raise DeepEPContractError("destroy() needs an ElasticBuffer built with explicitly_destroy=True")
        self._destroyed = True

    # ---- contract checks ----------------------------------------------------------------------------------------
    def _agree(self, op: str, agreed: tuple[tuple[str, int], ...] = ()) -> None:
        if self._destroyed:
            raise DeepEPContractError(f"{op} on a destroyed ElasticBuffer")
        seq, self._seq = self._seq, self._seq + 1
        check_call_order(self._t, _OPS, op, seq, agreed)

    @staticmethod
    def _check_events(op: str, previous_event: Any, before_epilogue: Any, allocate_on_comm_stream: bool) -> None:
        for name, event in (("previous_event", previous_event), ("previous_event_before_epilogue", before_epilogue)):
            if event is not None and not isinstance(event, EventHandle):
                raise DeepEPContractError(f"{op}: {name} must be an EventHandle from ElasticBuffer.capture(), got "
                                          f"{type(event).__name__}")
        if previous_event is not None and not allocate_on_comm_stream:
            raise DeepEPContractError(f"{op}: previous_event requires allocate_on_comm_stream=True (the outputs are "
                                      "allocated on the communication stream, which waits for that event)")

    def _check_handle(self, op: str, handle: Any) -> EPHandle:
        if not isinstance(handle, EPHandle) or handle._owner != id(self):
            raise DeepEPContractError(f"{op}: handle must be an EPHandle from this buffer's dispatch, got "
                                      f"{type(handle).__name__}")
        return handle

    @staticmethod
    def _check_x(op: str, x: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(x, tuple):
            if len(x) != 2:
                raise DeepEPContractError(f"{op}: an FP8 x is a (data, scales) pair, got {len(x)} tensors")
            data, scales = x
            if data.dtype != _FP8 or data.dim() != 2:
                raise DeepEPContractError(f"{op}: FP8 data must be float8_e4m3fn [num_tokens, hidden], got "
                                          f"{data.dtype} {tuple(data.shape)}")
            want = (data.shape[0], data.shape[1] // 128)
            if scales.dtype != torch.float32 or tuple(scales.shape) != want or data.shape[1] % 128:
                raise DeepEPContractError(f"{op}: FP8 scales must be float32 {want} (one per token per 128 channels), "
                                          f"got {scales.dtype} {tuple(scales.shape)}")
            return data, scales
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise DeepEPContractError(f"{op}: x must be bfloat16 [num_tokens, hidden] or an FP8 (data, scales) "
                                      f"tuple, got {got}")
        return x, None

    # ---- dispatch -----------------------------------------------------------------------------------------------
    def dispatch(self, x: Any, topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None, num_experts: int | None = None,
                 num_max_tokens_per_rank: int | None = None, expert_alignment: int | None = None, num_sms: int = 0,
                 num_qps: int = 0, previous_event: EventHandle | None = None,
                 previous_event_before_epilogue: EventHandle | None = None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: EPHandle | None = None, do_handle_copy: bool = True,
                 do_cpu_sync: bool | None = None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False):
        op = "dispatch"
        check_torch_deterministic(op)
        self._check_events(op, previous_event, previous_event_before_epilogue, allocate_on_comm_stream)
        data, scales = self._check_x(op, x)
        num_tokens, hidden = data.shape
        if use_tma_aligned_col_major_sf:
            raise NotImplementedError("the CPU stand-in does not model use_tma_aligned_col_major_sf")
        if do_zero_padding and not do_expand:
            raise DeepEPContractError(f"{op}: do_zero_padding is only valid with do_expand=True")
        cached = handle is not None
        if cached:
            h = self._check_handle(op, handle)
            if topk_idx is not None:
                raise DeepEPContractError(
                    f"{op}: a cached handle reuses the routing it was made with, so topk_idx must be None; "
                    "dispatch without the handle for a new routing")
            if do_cpu_sync:
                raise DeepEPContractError(f"{op}: cannot do a CPU sync with a cached handle (do_cpu_sync must be "
                                          "None or False)")
            for name, given, was in (("num_experts", num_experts, h.num_experts),
                                     ("expert_alignment", expert_alignment, h.expert_alignment),
                                     ("num_max_tokens_per_rank", num_max_tokens_per_rank, h.num_max_tokens_per_rank),
                                     ("do_expand", do_expand, h.do_expand)):
                if given is not None and given != was:
                    raise DeepEPContractError(f"{op}: {name}={given} differs from the cached handle's {was}")
            if num_tokens != h._route.num_tokens:
                raise DeepEPContractError(f"{op}: x has {num_tokens} tokens, the cached handle was made for "
                                          f"{h._route.num_tokens}")
            topk_idx, num_experts = h.topk_idx, h.num_experts
            expert_alignment, max_tokens = h.expert_alignment, h.num_max_tokens_per_rank
        else:
            if num_experts is None:
                raise DeepEPContractError(f"{op}: num_experts is required without a cached handle")
            if topk_idx is None:
                raise DeepEPContractError(f"{op}: topk_idx is required without a cached handle")
            if topk_idx.dtype != topk_idx_t or topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
                raise DeepEPContractError(f"{op}: topk_idx must be int64 (deep_ep.topk_idx_t) [{num_tokens}, "
                                          f"num_topk], got {topk_idx.dtype} {tuple(topk_idx.shape)}")
            if do_cpu_sync is False:
                raise NotImplementedError("the CPU stand-in does not model do_cpu_sync=False without a cached handle")
            max_tokens = num_max_tokens_per_rank if num_max_tokens_per_rank is not None else (
                self.num_max_tokens_per_rank)
            expert_alignment = expert_alignment if expert_alignment is not None else 1
        num_topk = topk_idx.shape[1]
        if topk_weights is not None and (topk_weights.dtype != torch.float32 or
                                         tuple(topk_weights.shape) != tuple(topk_idx.shape)):
            raise DeepEPContractError(f"{op}: topk_weights must be float32 {tuple(topk_idx.shape)}, got "
                                      f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
        w = self.num_ranks
        if num_experts <= 0 or num_experts % w:
            raise DeepEPContractError(f"{op}: num_experts={num_experts} must be a positive multiple of {w} ranks")
        if num_tokens > max_tokens:
            raise DeepEPContractError(f"{op}: {num_tokens} tokens exceed num_max_tokens_per_rank={max_tokens}")
        need = _needed_bytes(w, max_tokens, hidden, num_topk, scales is not None)
        if need > self.num_bytes:
            raise DeepEPContractError(f"{op}: the buffer has {self.num_bytes} bytes, this dispatch needs {need} "
                                      "(size it with ElasticBuffer.get_buffer_size_hint)")
        if expert_alignment < 1:
            raise DeepEPContractError(f"{op}: expert_alignment must be >= 1, got {expert_alignment}")
        num_sms = num_sms or self.get_theoretical_num_sms(num_experts, num_topk)
        if num_sms > self.num_device_sms:
            raise DeepEPContractError(f"{op}: num_sms={num_sms} exceeds the device's {self.num_device_sms} SMs")
        self._agree("dispatch (cached handle)" if cached else "dispatch",
                    (("num_experts", num_experts), ("num_max_tokens_per_rank", max_tokens),
                     ("expert_alignment", expert_alignment), ("do_expand", int(do_expand))))
        local = num_experts // w
        if cached:
            route = h._route
        else:
            route = self._route(topk_idx, local, num_tokens, hidden, do_expand, expert_alignment)
            self.num_cpu_syncs += 1
        send, recv = route.send_counts, route.recv_counts
        pend = [self._t.start(data[route.token_ids], send, recv, "ElasticBuffer.dispatch (x)")]
        if scales is not None:
            pend.append(self._t.start(scales[route.token_ids], send, recv, "ElasticBuffer.dispatch (scales)"))
        if topk_weights is not None:
            pend.append(self._t.start(topk_weights[route.token_ids], send, recv,
                                      "ElasticBuffer.dispatch (topk_weights)"))

        n, valid = sum(recv), route.slots >= 0
        unaligned = torch.stack([(route.recv_local_idx == e).sum() for e in range(local)]) if local else (
            torch.zeros(0, dtype=torch.int64))
        aligned = [_align(int(c), expert_alignment) for c in unaligned]
        if do_expand:
            starts = [sum(aligned[:e]) for e in range(local)]
            psum_expert = torch.tensor([s + int(c) for s, c in zip(starts, unaligned)], dtype=torch.int32)
            rows = sum(aligned)
        else:
            psum_expert = torch.tensor(aligned, dtype=torch.int32).cumsum(0).int()
            rows = n
        out_x = _poison(data.new_empty((rows, hidden)))
        out_scales = _poison(scales.new_empty((rows, scales.shape[1]))) if scales is not None else None
        out_w = None
        if topk_weights is not None:
            out_w = _poison(torch.empty((rows,) if do_expand else (rows, num_topk), dtype=torch.float32))
        if do_expand and do_zero_padding:
            pad = torch.ones(rows, dtype=torch.bool)
            pad[route.slots[valid]] = False
            for t in (out_x, out_scales, out_w):
                if t is not None:
                    t[pad] = 0
        out_idx = route.received(route.recv_local_idx).clone() if not do_expand else None

        def complete() -> None:
            got = [self._t.finish(p) for p in pend]
            x_rows = got.pop(0)
            s_rows = got.pop(0) if scales is not None else None
            w_rows = got.pop(0) if topk_weights is not None else None
            if not do_expand:
                out_x.copy_(route.received(x_rows))
                if out_scales is not None:
                    out_scales.copy_(route.received(s_rows))
                if out_w is not None:
                    out_w.copy_(route.received(w_rows))
                return
            token, slot = torch.nonzero(valid, as_tuple=True)
            dest = route.slots[token, slot]
            out_x[dest] = x_rows[token]
            if out_scales is not None:
                out_scales[dest] = s_rows[token]
            if out_w is not None:
                out_w[dest] = w_rows[token, slot]

        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += unaligned.to(cumulative_local_expert_recv_stats.dtype)
        outs = (out_x, out_scales, out_idx, out_w)
        if async_with_compute_stream:
            names = ("recv_x", "recv_x scales", "recv_topk_idx", "recv_topk_weights")
            shown = tuple(None if t is None else _in_flight(t, f"dispatch call #{self._seq - 1}'s {name}")
                          for t, name in zip(outs, names))

            def arrive() -> None:
                complete()
                _arrived(*shown)

            event = EventOverlap(_Event(arrive))
        else:
            complete()
            shown, event = outs, EventOverlap(None)
        recv_x = (shown[0], shown[1]) if scales is not None else shown[0]
        if cached:
            return recv_x, shown[2], shown[3], h, event
        metadata = torch.full((n, 2 + num_topk), -1, dtype=torch.int32)
        src = torch.repeat_interleave(torch.arange(w), torch.tensor(recv, dtype=torch.int64))
        metadata[:, 0], metadata[:, 1], metadata[:, 2:] = route.src_global, src.int(), route.slots.int()
        metadata = route.received(metadata)
        new = EPHandle(owner=id(self), route=route, do_expand=do_expand, num_experts=num_experts,
                       expert_alignment=expert_alignment, num_max_tokens_per_rank=max_tokens, num_sms=num_sms,
                       topk_idx=topk_idx.clone() if do_handle_copy else topk_idx, num_recv_tokens=n,
                       num_expanded_tokens=rows if do_expand else 0, num_recv_tokens_per_expert_list=aligned,
                       psum_num_recv_tokens_per_scaleup_rank=torch.tensor(recv, dtype=torch.int32).cumsum(0).int(),
                       psum_num_recv_tokens_per_expert=psum_expert,
                       num_unaligned_recv_tokens_per_expert=unaligned.int() if do_expand else None,
                       recv_src_metadata=metadata)
        return recv_x, shown[2], shown[3], new, event

    def _route(self, topk_idx: torch.Tensor, local: int, num_tokens: int, hidden: int, do_expand: bool,
               expert_alignment: int) -> _Route:
        """The layout, agreed with the peers: the counts exchange is the CPU sync of a fresh dispatch."""
        w = self.num_ranks
        r = normal_route(topk_idx, torch.zeros(topk_idx.shape), w, local)
        send = r.send_counts.tolist()
        recv = self._t.exchange(r.send_counts.long(), "ElasticBuffer.dispatch (counts)").tolist()
        recv_idx = self._t.finish(self._t.start(r.local_idx.long(), send, recv, "ElasticBuffer.dispatch (layout)"))
        src_global = self.rank_idx * self.num_max_tokens_per_rank + r.token_ids
        src_global = self._t.finish(self._t.start(src_global.long(), send, recv, "ElasticBuffer.dispatch (sources)"))
        slots = torch.full(recv_idx.shape, -1, dtype=torch.int64)
        order = None
        if do_expand:
            offset = 0
            for e in range(local):
                token, slot = torch.nonzero(recv_idx == e, as_tuple=True)  # row-major: source rank, then token
                slots[token, slot] = offset + self._landing_order(token.numel(), e)
                offset = _align(offset + token.numel(), expert_alignment)
        elif not self.deterministic and recv_idx.shape[0] > 1:
            order = self._landing_order(recv_idx.shape[0], 0)
        return _Route(r.token_ids, r.local_idx, send, recv, recv_idx, slots, src_global.int(), num_tokens, hidden,
                      order)

    def _landing_order(self, n: int, salt: int) -> torch.Tensor:
        """Where ``n`` received rows land: sorted when deterministic, else a seeded permutation that moves some."""
        if self.deterministic or n < 2:
            return torch.arange(n)
        g = torch.Generator().manual_seed(hash((self.receive_order_seed, self.rank_idx, self._seq, salt)) % 2**62)
        perm = torch.randperm(n, generator=g)
        return perm.roll(1) if torch.equal(perm, torch.arange(n)) else perm

    # ---- combine ------------------------------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None = None, bias: Any = None,
                num_sms: int = 0, num_qps: int = 0, previous_event: EventHandle | None = None,
                previous_event_before_epilogue: EventHandle | None = None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False):
        op = "combine"
        check_torch_deterministic(op)
        self._check_events(op, previous_event, previous_event_before_epilogue, allocate_on_comm_stream)
        h = self._check_handle(op, handle)
        route = h._route
        rows = h.num_expanded_tokens if h.do_expand else h.num_recv_tokens
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or tuple(x.shape) != (rows, route.hidden):
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise DeepEPContractError(f"{op}: x must be bfloat16 [{rows}, {route.hidden}] (one row per "
                                      f"{'expanded slot' if h.do_expand else 'received token'}), got {got}")
        num_topk = route.slots.shape[1]
        want_w = (rows,) if h.do_expand else (rows, num_topk)
        if topk_weights is not None and (topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != want_w):
            raise DeepEPContractError(f"{op}: topk_weights must be float32 {want_w}, got {topk_weights.dtype} "
                                      f"{tuple(topk_weights.shape)}")
        biases = [] if bias is None else [bias] if isinstance(bias, torch.Tensor) else list(bias)
        for b in biases:
            if b.dtype != torch.bfloat16 or tuple(b.shape) != (route.num_tokens, route.hidden):
                raise DeepEPContractError(f"{op}: bias must be bfloat16 [{route.num_tokens}, {route.hidden}], got "
                                          f"{b.dtype} {tuple(b.shape)}")
        if len(biases) > 2:
            raise DeepEPContractError(f"{op}: at most 2 bias tensors, got {len(biases)}")
        self._agree(op, (("do_expand", int(h.do_expand)),))
        valid = route.slots >= 0
        if h.do_expand:  # reduce each received token's slots here first, in float32
            token, slot = torch.nonzero(valid, as_tuple=True)
            send = torch.zeros((route.slots.shape[0], route.hidden), dtype=torch.float32)
            send.index_add_(0, token, x[route.slots[token, slot]].float())
            send = send.to(x.dtype)
            send_w = None
            if topk_weights is not None:
                send_w = torch.where(valid, topk_weights[route.slots.clamp(min=0)], torch.zeros(()))
        else:  # back to sorted order: the order the sources sent them in
            send, send_w = route.sorted(x), None if topk_weights is None else route.sorted(topk_weights)
        back = self._t.start(send, route.recv_counts, route.send_counts, "ElasticBuffer.combine (x)")
        back_w = None if send_w is None else self._t.start(send_w, route.recv_counts, route.send_counts,
                                                           "ElasticBuffer.combine (topk_weights)")
        out = _poison(x.new_empty((route.num_tokens, route.hidden)))
        out_w = None if send_w is None else _poison(torch.empty((route.num_tokens, num_topk), dtype=torch.float32))

        def complete() -> None:
            acc = torch.zeros((route.num_tokens, route.hidden), dtype=torch.float32)
            acc.index_add_(0, route.token_ids, self._t.finish(back).float())
            for b in biases:
                acc += b.float()
            out.copy_(acc.to(out.dtype))
            if back_w is not None:
                mine = torch.where(route.local_idx >= 0, self._t.finish(back_w), torch.zeros(()))
                out_w.copy_(torch.zeros_like(out_w).index_add_(0, route.token_ids, mine))

        if async_with_compute_stream:
            seq = self._seq - 1
            shown = [None if t is None else _in_flight(t, f"combine call #{seq}'s {name}")
                     for t, name in ((out, "combined_x"), (out_w, "combined_topk_weights"))]

            def arrive() -> None:
                complete()
                _arrived(*shown)

            return shown[0], shown[1], EventOverlap(_Event(arrive))
        complete()
        return out, out_w, EventOverlap(None)
