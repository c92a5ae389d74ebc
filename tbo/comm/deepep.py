"""DeepEP backends for GPU users: normal mode (prefill, high throughput) and low-latency mode (decode).

They follow DeepEP's own rules, because TBO only works if they do:

* **Normal mode** blocks the CPU for counts inside ``dispatch``. So ``dispatch_a`` only prepares (optional FP8
  quantisation, and ``Buffer.capture()`` to mark where the compute stream is); ``dispatch_b`` runs
  ``get_dispatch_layout`` and ``dispatch`` with ``previous_event``, ``async_finish=True`` and
  ``allocate_on_comm_stream=True``, then waits on the returned event. Combine is split the same way.
* **Low-latency mode** issues the transfer in ``_a`` with ``return_recv_hook=True`` (and never ``async_finish``);
  ``_b`` calls the hook, which is what receives the data. At most two low-latency results may be alive at once
  (DeepEP double-buffers), so the dispatch output must be dropped before the next-but-one call.

``deep_ep`` is imported only by `create`; a buffer built elsewhere (or the CPU stand-in in `tbo.testing`) can be
passed in directly. Written against DeepEP V1 (``deep_ep.Buffer``, 1.x, still exported by 2.x as
``deep_ep.buffers.legacy``); DeepEP V2's ``ElasticBuffer`` is `tbo.comm.deepep_elastic`. Keyword arguments the
installed version does not accept are left out, detected by signature.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any, Callable

import torch

from tbo.util.optional import require
from tbo.comm.fp8 import quantize_per_token_group
from tbo.comm.layout import check_routing
from tbo.comm.types import DispatchFormat, DispatchOutput

__all__ = ["DeepEPNormalBackend", "DeepEPLowLatencyBackend", "supported_kwargs", "v1_buffer_class"]


@lru_cache(maxsize=64)
def _parameters(fn: Callable) -> tuple[frozenset[str], bool]:
    params = inspect.signature(fn).parameters.values()
    return frozenset(p.name for p in params), any(p.kind is p.VAR_KEYWORD for p in params)


def supported_kwargs(fn: Callable, **kwargs: Any) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``fn`` accepts (all of them if it takes ``**kwargs``)."""
    names, var_kw = _parameters(getattr(fn, "__func__", fn))
    return kwargs if var_kw else {k: v for k, v in kwargs.items() if k in names}


def v1_buffer_class(deep_ep: ModuleType | None, purpose: str) -> Any:
    """``deep_ep.Buffer`` (V1), or an ImportError saying how to get it (or to use V2 instead)."""
    module = deep_ep if deep_ep is not None else require("deep_ep", purpose)
    buffer_cls = getattr(module, "Buffer", None)
    if buffer_cls is None:
        raise ImportError(f"{purpose} needs DeepEP V1's deep_ep.Buffer, but this deep_ep "
                          f"{getattr(module, '__version__', '?')} was built without it (DISABLE_LEGACY=1); use "
                          "DeepEPElasticBackend (V2), kind='v2' in deepep_backend")
    return buffer_cls


def _split_fp8(recv: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    return recv if isinstance(recv, tuple) else (recv, None)


# ---- normal mode ------------------------------------------------------------------------------------------------
@dataclass
class _NormalDispatchState:
    x: Any  # tensor, or (fp8, scales)
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    event: Any
    nbytes: int


@dataclass
class _NormalCombineState:
    x: torch.Tensor
    handle: Any
    event: Any
    nbytes: int


class DeepEPNormalBackend:
    """DeepEP normal (high-throughput) dispatch/combine; the output format is NORMAL."""

    format = DispatchFormat.NORMAL

    def __init__(self, buffer: Any, num_experts: int, *, use_fp8: bool = False, expert_alignment: int = 1,
                 dispatch_config: Any = None, combine_config: Any = None) -> None:
        self.buffer = buffer
        self.rank, self.num_ranks = buffer.rank, buffer.group_size
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts={num_experts} must be a multiple of num_ranks={self.num_ranks}")
        self.num_experts, self.num_local_experts = num_experts, num_experts // self.num_ranks
        self.use_fp8, self.expert_alignment = use_fp8, expert_alignment
        self.dispatch_config, self.combine_config = dispatch_config, combine_config

    @classmethod
    def create(cls, group: Any, num_experts: int, num_nvl_bytes: int, num_rdma_bytes: int = 0, *,
               deep_ep: ModuleType | None = None, **kwargs: Any) -> "DeepEPNormalBackend":
        """Build a ``deep_ep.Buffer`` for ``group`` (needs deep_ep, or the module passed as ``deep_ep``), wrap it."""
        buffer_cls = v1_buffer_class(deep_ep, "DeepEPNormalBackend")
        return cls(buffer_cls(group, num_nvl_bytes, num_rdma_bytes), num_experts, **kwargs)

    def dispatch_a(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
                   ) -> _NormalDispatchState:
        """`EPBackend.dispatch_a`: quantise to FP8 if asked and capture an event; the transfer starts in ``_b``.
        ``topk_idx`` comes before ``topk_weights``, the reverse of ``torch.topk``'s ``(values, indices)``."""
        check_routing(hidden, topk_idx, topk_weights, self.num_experts, "dispatch_a")
        x = quantize_per_token_group(hidden) if self.use_fp8 else hidden
        nbytes = hidden.nbytes if not self.use_fp8 else x[0].nbytes + x[1].nbytes
        return _NormalDispatchState(x, topk_idx.long(), topk_weights.float(), self.buffer.capture(), nbytes)

    def dispatch_b(self, state: _NormalDispatchState) -> DispatchOutput:
        """`EPBackend.dispatch_b`: layout and dispatch on DeepEP's stream after the captured event, then wait."""
        buf = self.buffer
        per_rank, per_rdma_rank, per_expert, in_rank, event = buf.get_dispatch_layout(
            state.topk_idx, self.num_experts,
            **supported_kwargs(buf.get_dispatch_layout, previous_event=state.event, async_finish=True,
                               allocate_on_comm_stream=True))
        recv_x, recv_idx, recv_weights, counts, handle, event = buf.dispatch(
            state.x,
            **supported_kwargs(buf.dispatch, topk_idx=state.topk_idx, topk_weights=state.topk_weights,
                               num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
                               is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                               expert_alignment=self.expert_alignment, config=self.dispatch_config,
                               previous_event=event, async_finish=True, allocate_on_comm_stream=True))
        event.current_stream_wait()
        hidden, scales = _split_fp8(recv_x)
        return DispatchOutput(DispatchFormat.NORMAL, hidden, torch.tensor(counts, dtype=torch.int64), handle,
                              topk_idx=recv_idx, topk_weights=recv_weights, scales=scales)

    def combine_a(self, expert_out: torch.Tensor, handle: Any) -> _NormalCombineState:
        """`EPBackend.combine_a`: capture an event; the combine runs in ``_b``."""
        return _NormalCombineState(expert_out, handle, self.buffer.capture(), expert_out.nbytes)

    @property
    def in_flight(self) -> list[Any]:
        """Normal mode launches and waits inside ``_b``: nothing is ever in flight between ops."""
        return []

    def drain(self) -> int:
        return 0

    def combine_b(self, state: _NormalCombineState) -> torch.Tensor:
        """`EPBackend.combine_b`: combine on DeepEP's stream after the captured event, then wait."""
        buf = self.buffer
        combined, _, event = buf.combine(
            state.x, state.handle,
            **supported_kwargs(buf.combine, config=self.combine_config, previous_event=state.event,
                               async_finish=True, allocate_on_comm_stream=True))
        event.current_stream_wait()
        return combined


# ---- low-latency mode -------------------------------------------------------------------------------------------
@dataclass
class _LLHandle:
    handle: Any
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


@dataclass(eq=False)
class _LLDispatchState:
    recv_x: Any
    recv_count: torch.Tensor | None
    handle: _LLHandle
    hook: Callable[[], None] | None
    nbytes: int


@dataclass(eq=False)
class _LLCombineState:
    combined: torch.Tensor | None
    hook: Callable[[], None] | None
    nbytes: int


class DeepEPLowLatencyBackend:
    """DeepEP low-latency dispatch/combine with receive hooks; the output format is MASKED.

    The multi-GPU capture-safe backend: fixed ``[local experts, num_max_dispatch_tokens_per_rank * ranks, H]``
    buffers and no host read here (the expert ids are range-checked on the device), so a CUDA graph can hold a
    whole decode step with it.
    """

    format = DispatchFormat.MASKED
    capture_safe = True

    def __init__(self, buffer: Any, num_experts: int, num_max_dispatch_tokens_per_rank: int, *,
                 use_fp8: bool = False) -> None:
        self.buffer = buffer
        self.rank, self.num_ranks = buffer.rank, buffer.group_size
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts={num_experts} must be a multiple of num_ranks={self.num_ranks}")
        self.num_experts, self.num_local_experts = num_experts, num_experts // self.num_ranks
        self.max_tokens = num_max_dispatch_tokens_per_rank
        self.use_fp8 = use_fp8
        self._unreceived: weakref.WeakSet = weakref.WeakSet()  # states whose hook has not run: drain() runs it

    @classmethod
    def create(cls, group: Any, num_experts: int, num_max_dispatch_tokens_per_rank: int, hidden: int, *,
               deep_ep: ModuleType | None = None, **kwargs: Any) -> "DeepEPLowLatencyBackend":
        """Build a low-latency ``deep_ep.Buffer`` sized for this model (needs deep_ep, or the module passed as
        ``deep_ep``) and wrap it."""
        buffer_cls = v1_buffer_class(deep_ep, "DeepEPLowLatencyBackend")
        num_ranks = group.size()
        rdma = buffer_cls.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                         num_experts)
        buffer = buffer_cls(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=num_experts // num_ranks)
        return cls(buffer, num_experts, num_max_dispatch_tokens_per_rank, **kwargs)

    def dispatch_a(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
                   ) -> _LLDispatchState:
        """`EPBackend.dispatch_a`: issue the low-latency dispatch with a receive hook and return. ``topk_idx`` comes
        before ``topk_weights``, the reverse of ``torch.topk``'s ``(values, indices)``."""
        check_routing(hidden, topk_idx, topk_weights, self.num_experts, "dispatch_a", sync_free=True)
        if hidden.shape[0] > self.max_tokens:
            raise ValueError(f"dispatch_a: {hidden.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank="
                             f"{self.max_tokens}")
        buf = self.buffer
        idx = topk_idx.long()
        recv_x, recv_count, handle, _event, hook = buf.low_latency_dispatch(
            hidden, idx, self.max_tokens, self.num_experts,
            **supported_kwargs(buf.low_latency_dispatch, use_fp8=self.use_fp8, async_finish=False,
                               return_recv_hook=True))
        state = _LLDispatchState(recv_x, recv_count, _LLHandle(handle, idx, topk_weights.float()), hook,
                                 hidden.nbytes * idx.shape[1])
        self._unreceived.add(state)
        return state

    def dispatch_b(self, state: _LLDispatchState) -> DispatchOutput:
        """`EPBackend.dispatch_b`: call the receive hook (the data arrives) and return the MASKED layout."""
        self._unreceived.discard(state)
        state.hook()  # the data arrives here
        hidden, scales = _split_fp8(state.recv_x)
        out = DispatchOutput(DispatchFormat.MASKED, hidden, state.recv_count, state.handle, scales=scales)
        state.recv_x = state.recv_count = state.hook = None  # the output now owns the buffer view
        return out

    def combine_a(self, expert_out: torch.Tensor, handle: _LLHandle) -> _LLCombineState:
        """`EPBackend.combine_a`: issue the low-latency combine with a receive hook and return."""
        buf = self.buffer
        combined, _event, hook = buf.low_latency_combine(
            expert_out, handle.topk_idx, handle.topk_weights, handle.handle,
            **supported_kwargs(buf.low_latency_combine, async_finish=False, return_recv_hook=True))
        state = _LLCombineState(combined, hook, expert_out.nbytes)
        self._unreceived.add(state)
        return state

    def combine_b(self, state: _LLCombineState) -> torch.Tensor:
        """`EPBackend.combine_b`: call the receive hook and return the combined tokens."""
        self._unreceived.discard(state)
        state.hook()
        combined, state.combined, state.hook = state.combined, None, None
        return combined

    @property
    def in_flight(self) -> list[Any]:
        return [f"low-latency {'dispatch' if isinstance(s, _LLDispatchState) else 'combine'} (hook not called)"
                for s in list(self._unreceived)]

    def drain(self) -> int:
        """Receive every low-latency transfer whose hook was not called, so DeepEP's buffers are free again."""
        pending = list(self._unreceived)
        for state in pending:
            self._unreceived.discard(state)
            if state.hook is not None:
                state.hook()
                state.hook = None
        return len(pending)
