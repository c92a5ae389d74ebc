"""DeepEP backends for GPU users: normal mode (prefill, high throughput) and low-latency mode (decode).

They follow DeepEP's own rules, because TBO only works if they do:

* **Normal mode** blocks the CPU for counts inside ``dispatch``. So ``dispatch_a`` only prepares (optional FP8
  quantisation, and ``Buffer.capture()`` to mark where the compute stream is); ``dispatch_b`` runs
  ``get_dispatch_layout`` and ``dispatch`` with ``previous_event``, ``async_finish=True`` and
  ``allocate_on_comm_stream=True``, then waits on the returned event. Combine is split the same way.
* **Low-latency mode** issues the transfer in ``_a`` with ``return_recv_hook=True`` (and never ``async_finish``);
  ``_b`` calls the hook, which is what receives the data. Dispatch and combine share one double buffer, and each
  call's send phase cleans the half holding the previous call's receive flags: a call launched before the previous
  one was received makes that one wait forever (DeepEP issue #513). So at most **one** low-latency call may be
  un-received at a time, across all microbatches and layers: the backend declares it (`LOW_LATENCY_LIMIT`, its
  ``in_flight_limit``) and binding a strategy checks the compiled schedule against it (`tbo.core.inflight`).
  Its kernels take BF16 ``x``, a hidden size from a fixed list, at most 11 experts per token and a bounded
  ``num_max_dispatch_tokens_per_rank``: checked here, naming the culprit, before DeepEP's asserts would fire.
* **Combine moves BF16** in both modes (DeepEP's V1 intranode combine and both low-latency calls accept nothing
  else), so ``combine_a`` casts the experts' output to BF16: with FP8 dispatch `run_experts` returns float32.
* **FP8 rows quantised by the caller**: normal mode (and V2) also take ``hidden`` as an FP8 ``(rows, scales)``
  pair, sent as is (DeepEP's ``x`` may be that tuple): the caller's experts then receive the very bits their own
  quantiser produced (`tbo.integrations.vllm.model.quant`: vLLM's, under the layer's quant config), as vLLM's own DeepEP
  prepare sends them. ``use_fp8`` quantises a plain tensor with `tbo.comm.fp8` instead.
* **UE8M0 scales on SM100**: low-latency FP8 dispatch passes ``round_scale`` and ``use_ue8m0`` when the device wants
  them (`tbo.comm.fp8.ue8m0_wanted`), as SGLang does; the scales then arrive packed in int32.

``deep_ep`` is imported only by `create`; a buffer built elsewhere (or the CPU stand-in in `tbo.testing`) can be
passed in directly. Written against DeepEP V1 (``deep_ep.Buffer``, 1.x, still exported by 2.x as
``deep_ep.buffers.legacy``) and read against DeepEP 2.1.0 (``dd758caf``): every rule above cites its source line in
``docs/deepep.md``. DeepEP V2's ``ElasticBuffer`` is `tbo.comm.deepep_elastic`. Keyword arguments the installed
version does not accept are left out, detected by signature.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any, Callable

import torch

from tbo.core.inflight import InFlightLimit
from tbo.util.optional import require
from tbo.comm.fp8 import quantize_per_token_group, ue8m0_wanted
from tbo.comm.layout import check_routing
from tbo.comm.types import DispatchFormat, DispatchOutput

__all__ = ["DeepEPNormalBackend", "DeepEPLowLatencyBackend", "LOW_LATENCY_LIMIT", "LOW_LATENCY_HIDDEN",
           "LOW_LATENCY_MAX_TOPK", "NVSHMEM_QP_DEPTH", "check_low_latency_sizes", "dispatch_payload",
           "supported_kwargs", "v1_buffer_class", "to_bf16"]

#: DeepEP V1 low-latency: one un-received call at a time, dispatch and combine together (see the module docstring).
LOW_LATENCY_LIMIT = InFlightLimit(
    1, frozenset({"dispatch", "combine"}), "DeepEP low-latency",
    "its dispatch and combine share one double buffer, and each call's send phase cleans the half holding the "
    "previous call's receive flags, so on GPUs that call would never finish receiving and the step hangs: "
    "DeepEP issue #513")
#: The hidden sizes DeepEP's low-latency kernels are compiled for (``SWITCH_HIDDEN``, launch.cuh:113-134).
LOW_LATENCY_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
#: At most this many experts per token (``kNumMaxTopK``, internode_ll.cu:493/501 dispatch, :1166/1179 combine).
LOW_LATENCY_MAX_TOPK = 11
#: ``NVSHMEM_QP_DEPTH`` when the environment does not set it (legacy.py:113); a low-latency call asserts
#: ``depth >= (num_max_dispatch_tokens_per_rank + 1) * 2`` (legacy.py:609, :665).
NVSHMEM_QP_DEPTH = 1024


def check_low_latency_sizes(num_ranks: int, num_max_dispatch_tokens_per_rank: int, hidden: int | None = None,
                            num_topk: int | None = None, use_fp8: bool = False,
                            qp_depth: int = NVSHMEM_QP_DEPTH) -> None:
    """Raise a ValueError naming the culprit for sizes DeepEP's low-latency kernels assert on (on the GPU, a C++
    assert, or a kernel never compiled for the size): checked when the backend is built and at each call."""
    m = num_max_dispatch_tokens_per_rank
    if m < 1:
        raise ValueError(f"num_max_dispatch_tokens_per_rank must be >= 1, got {m}")
    if (num_ranks * m) % 4:
        fit = next(n for n in range(m, m + 4) if (num_ranks * n) % 4 == 0)
        raise ValueError(f"num_ranks * num_max_dispatch_tokens_per_rank = {num_ranks} * {m} = {num_ranks * m} must "
                         f"be a multiple of 4 (DeepEP's TMA needs it); use num_max_dispatch_tokens_per_rank={fit}")
    if qp_depth < (m + 1) * 2:
        raise ValueError(f"num_max_dispatch_tokens_per_rank={m} needs a queue depth of at least {(m + 1) * 2}, but "
                         f"NVSHMEM_QP_DEPTH is {qp_depth}: use at most {qp_depth // 2 - 1} tokens per rank, or set "
                         f"NVSHMEM_QP_DEPTH >= {(m + 1) * 2} before the buffer is built")
    if hidden is not None:
        if hidden not in LOW_LATENCY_HIDDEN:
            raise ValueError(f"hidden={hidden}: DeepEP's low-latency kernels are compiled for hidden sizes "
                             f"{', '.join(map(str, LOW_LATENCY_HIDDEN))} only; use DeepEPNormalBackend or V2")
        if use_fp8 and hidden % 512:
            raise ValueError(f"hidden={hidden}: low-latency FP8 dispatch needs a multiple of 512")
    if num_topk is not None and num_topk > LOW_LATENCY_MAX_TOPK:
        raise ValueError(f"top-k {num_topk}: DeepEP's low-latency kernels route each token to at most "
                         f"{LOW_LATENCY_MAX_TOPK} experts")


def to_bf16(expert_out: torch.Tensor) -> torch.Tensor:
    """The experts' output as the BF16 DeepEP's combine takes (FP8 dispatch makes `run_experts` return float32)."""
    return expert_out if expert_out.dtype == torch.bfloat16 else expert_out.to(torch.bfloat16)


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
                          f"{getattr(module, '__version__', '?')} does not export it (DeepEP 1.x and 2.x both do: "
                          "is it a partial build?); use DeepEPElasticBackend (V2), kind='v2' in deepep_backend")
    return buffer_cls


def _split_fp8(recv: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    return recv if isinstance(recv, tuple) else (recv, None)


def dispatch_payload(hidden: torch.Tensor | tuple[torch.Tensor, torch.Tensor], use_fp8: bool,
                     round_scale: bool = False) -> tuple[Any, torch.Tensor, int]:
    """``(x, rows, nbytes)``: what DeepEP's dispatch is given as ``x`` (an FP8 ``(rows, scales)`` pair the caller
    quantised, as is; ``hidden`` quantised per 128-channel group when ``use_fp8``; else ``hidden``), the row tensor
    (for the routing checks) and the bytes sent. A pair must be float8_e4m3fn rows ``[T, H]`` with float32 scales
    ``[T, H // 128]``, the format DeepEP's FP8 dispatch moves: anything else is refused here, naming it."""
    if isinstance(hidden, tuple):
        if len(hidden) != 2:
            raise ValueError(f"dispatch_a: an FP8 payload is a (rows, scales) pair, got {len(hidden)} tensors")
        rows, scales = hidden
        want = (rows.shape[0], rows.shape[1] // 128) if rows.dim() == 2 else None
        if rows.dtype != torch.float8_e4m3fn or rows.dim() != 2 or rows.shape[1] % 128:
            raise TypeError(f"dispatch_a: FP8 rows must be float8_e4m3fn [tokens, hidden] with hidden a multiple of "
                            f"128, got {rows.dtype} {tuple(rows.shape)}")
        if scales.dtype != torch.float32 or tuple(scales.shape) != want:
            raise TypeError(f"dispatch_a: FP8 scales must be float32 {want} (one per token per 128 channels), got "
                            f"{scales.dtype} {tuple(scales.shape)}")
        return (rows, scales), rows, rows.nbytes + scales.nbytes
    if use_fp8:
        x = quantize_per_token_group(hidden, round_scale=round_scale)
        return x, hidden, x[0].nbytes + x[1].nbytes
    return hidden, hidden, hidden.nbytes


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
    """DeepEP normal (high-throughput) dispatch/combine; the output format is NORMAL.

    Its buffers are sized for the kernels' channels, one per two of ``Buffer.num_sms`` SMs, as in effect when the
    buffer is made (``Config.get_nvl_buffer_size_hint``); DeepEP reads ``Buffer.num_sms`` again at every call
    (``get_dispatch_config``), so a larger count set later needs more bytes than the buffer has. Each call checks
    that the configs in effect fit the buffer (`check_buffer_fits`), and `tbo.comm.sm_budget.deep_ep_num_sms`
    refuses, given this backend, an SM count that would not. ``hidden`` (the model's) lets the check size exactly;
    without it the first call's is used, and before any call a count above the one at creation is refused.
    """

    format = DispatchFormat.NORMAL
    #: ``dispatch_a`` takes pre-quantised FP8 ``(rows, scales)`` pairs (`dispatch_payload`); rows of any dtype
    carries_fp8 = True
    hidden_dtypes = None

    def __init__(self, buffer: Any, num_experts: int, *, use_fp8: bool = False, expert_alignment: int = 1,
                 dispatch_config: Any = None, combine_config: Any = None, hidden: int | None = None) -> None:
        self.buffer = buffer
        self.rank, self.num_ranks = buffer.rank, buffer.group_size
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts={num_experts} must be a multiple of num_ranks={self.num_ranks}")
        self.num_experts, self.num_local_experts = num_experts, num_experts // self.num_ranks
        self.use_fp8, self.expert_alignment = use_fp8, expert_alignment
        self.dispatch_config, self.combine_config = dispatch_config, combine_config
        self.hidden = hidden
        self.num_sms_at_creation = getattr(buffer, "num_sms", None)  # Buffer.num_sms: a class attribute
        self._fits: set[tuple[Any, int]] = set()  # (Buffer.num_sms, hidden) already checked

    @classmethod
    def create(cls, group: Any, num_experts: int, num_nvl_bytes: int, num_rdma_bytes: int = 0, *,
               deep_ep: ModuleType | None = None, **kwargs: Any) -> "DeepEPNormalBackend":
        """Build a ``deep_ep.Buffer`` for ``group`` (needs deep_ep, or the module passed as ``deep_ep``), wrap it."""
        buffer_cls = v1_buffer_class(deep_ep, "DeepEPNormalBackend")
        return cls(buffer_cls(group, num_nvl_bytes, num_rdma_bytes), num_experts, **kwargs)

    def _configs(self) -> tuple[Any, Any]:
        buf = self.buffer
        return (self.dispatch_config or buf.get_dispatch_config(self.num_ranks),
                self.combine_config or buf.get_combine_config(self.num_ranks))

    def check_buffer_fits(self, hidden: int | None = None) -> None:
        """Raise ValueError if the dispatch and combine configs now in effect (``Buffer.num_sms``) need more bytes
        than the buffer was made with, for ``hidden`` channels (BF16, the larger of the two wire formats)."""
        hidden = hidden or self.hidden
        num_sms = getattr(self.buffer, "num_sms", None)
        if (num_sms, hidden or 0) in self._fits:
            return
        if hidden is None:
            if num_sms is not None and self.num_sms_at_creation is not None and num_sms > self.num_sms_at_creation:
                raise ValueError(f"Buffer.num_sms={num_sms}, but this DeepEP buffer was made with Buffer.num_sms="
                                 f"{self.num_sms_at_creation}, and its bytes may be too few for the wider configs: "
                                 "pass hidden= to DeepEPNormalBackend so tbo can check, or lower the SM count")
            return
        for config, what in zip(self._configs(), ("dispatch", "combine")):
            for have, hint, kind in ((self.buffer.num_nvl_bytes, config.get_nvl_buffer_size_hint, "NVLink"),
                                     (self.buffer.num_rdma_bytes, config.get_rdma_buffer_size_hint, "RDMA")):
                need = int(hint(hidden * 2, self.num_ranks))
                if need > have:
                    raise ValueError(
                        f"Buffer.num_sms={num_sms}: DeepEP's normal {what} then needs {need} {kind} bytes for "
                        f"hidden {hidden} (Config.get_{'nvl' if kind == 'NVLink' else 'rdma'}_buffer_size_hint), "
                        f"but this buffer has {have}: it was made with Buffer.num_sms={self.num_sms_at_creation} in "
                        "effect, and DeepEP would overrun it. Lower the SM count, or make the buffer with it in effect")
        self._fits.add((num_sms, hidden))

    def dispatch_a(self, hidden: torch.Tensor | tuple[torch.Tensor, torch.Tensor], topk_idx: torch.Tensor,
                   topk_weights: torch.Tensor) -> _NormalDispatchState:
        """`EPBackend.dispatch_a`: quantise to FP8 if asked (an FP8 ``(rows, scales)`` pair is sent as is:
        `dispatch_payload`) and capture an event; the transfer starts in ``_b``. ``topk_idx`` comes before
        ``topk_weights``, the reverse of ``torch.topk``'s ``(values, indices)``."""
        x, rows, nbytes = dispatch_payload(hidden, self.use_fp8)
        check_routing(rows, topk_idx, topk_weights, self.num_experts, "dispatch_a")
        return _NormalDispatchState(x, topk_idx.long(), topk_weights.float(), self.buffer.capture(), nbytes)

    def dispatch_b(self, state: _NormalDispatchState) -> DispatchOutput:
        """`EPBackend.dispatch_b`: layout and dispatch on DeepEP's stream after the captured event, then wait."""
        buf = self.buffer
        self.hidden = self.hidden or _split_fp8(state.x)[0].shape[1]
        self.check_buffer_fits()
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
        """`EPBackend.combine_a`: cast the experts' output to the BF16 DeepEP combines and capture an event; the
        combine runs in ``_b``."""
        x = to_bf16(expert_out)
        return _NormalCombineState(x, handle, self.buffer.capture(), x.nbytes)

    @property
    def in_flight(self) -> list[Any]:
        """Normal mode launches and waits inside ``_b``: nothing is ever in flight between ops."""
        return []

    def drain(self) -> int:
        return 0

    def combine_b(self, state: _NormalCombineState) -> torch.Tensor:
        """`EPBackend.combine_b`: combine on DeepEP's stream after the captured event, then wait."""
        buf = self.buffer
        self.check_buffer_fits()
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
    whole decode step with it. ``in_flight_limit`` is `LOW_LATENCY_LIMIT`: one un-received call at a time.

    ``use_ue8m0`` (FP8 only): ship UE8M0 scales (``round_scale`` and ``use_ue8m0``); None asks the device
    (`ue8m0_wanted`: SM100 yes, SM90 no). The received scales are then int32, four exponents each.
    """

    format = DispatchFormat.MASKED
    capture_safe = True
    in_flight_limit = LOW_LATENCY_LIMIT
    #: its kernels take bfloat16 and quantise to FP8 themselves (``use_fp8``): no caller-quantised pairs
    carries_fp8 = False
    hidden_dtypes = (torch.bfloat16,)

    def __init__(self, buffer: Any, num_experts: int, num_max_dispatch_tokens_per_rank: int, *,
                 use_fp8: bool = False, use_ue8m0: bool | None = None) -> None:
        self.buffer = buffer
        self.rank, self.num_ranks = buffer.rank, buffer.group_size
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts={num_experts} must be a multiple of num_ranks={self.num_ranks}")
        self.num_experts, self.num_local_experts = num_experts, num_experts // self.num_ranks
        self.max_tokens = num_max_dispatch_tokens_per_rank
        self.qp_depth = int(getattr(buffer, "nvshmem_qp_depth", NVSHMEM_QP_DEPTH))
        check_low_latency_sizes(self.num_ranks, self.max_tokens, qp_depth=self.qp_depth)
        if use_ue8m0 and not use_fp8:
            raise ValueError("use_ue8m0=True needs use_fp8=True: UE8M0 is a format for FP8 scales")
        self.use_fp8 = use_fp8
        self.use_ue8m0 = bool(use_fp8 and (ue8m0_wanted() if use_ue8m0 is None else use_ue8m0))
        self._unreceived: weakref.WeakSet = weakref.WeakSet()  # states whose hook has not run: drain() runs it

    @classmethod
    def create(cls, group: Any, num_experts: int, num_max_dispatch_tokens_per_rank: int, hidden: int, *,
               deep_ep: ModuleType | None = None, **kwargs: Any) -> "DeepEPLowLatencyBackend":
        """Build a low-latency ``deep_ep.Buffer`` sized for this model (needs deep_ep, or the module passed as
        ``deep_ep``) and wrap it. The sizes are checked against the kernels' limits first."""
        buffer_cls = v1_buffer_class(deep_ep, "DeepEPLowLatencyBackend")
        num_ranks = group.size()
        check_low_latency_sizes(num_ranks, num_max_dispatch_tokens_per_rank, hidden,
                                use_fp8=kwargs.get("use_fp8", False))
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
        if hidden.dtype != torch.bfloat16:
            raise TypeError(f"dispatch_a: DeepEP's low-latency dispatch takes bfloat16 hidden states (it quantises "
                            f"to FP8 itself), got {hidden.dtype}; cast to bfloat16")
        check_low_latency_sizes(self.num_ranks, self.max_tokens, hidden.shape[1], topk_idx.shape[1], self.use_fp8,
                                self.qp_depth)
        buf = self.buffer
        idx = topk_idx.long()
        recv_x, recv_count, handle, _event, hook = buf.low_latency_dispatch(
            hidden, idx, self.max_tokens, self.num_experts,
            **supported_kwargs(buf.low_latency_dispatch, use_fp8=self.use_fp8, round_scale=self.use_ue8m0,
                               use_ue8m0=self.use_ue8m0, async_finish=False, return_recv_hook=True))
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
        """`EPBackend.combine_a`: issue the low-latency combine (of BF16: the experts' output is cast) with a
        receive hook and return."""
        buf = self.buffer
        x = to_bf16(expert_out)
        combined, _event, hook = buf.low_latency_combine(
            x, handle.topk_idx, handle.topk_weights, handle.handle,
            **supported_kwargs(buf.low_latency_combine, async_finish=False, return_recv_hook=True))
        state = _LLCombineState(combined, hook, x.nbytes)
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
