"""DeepEP V2 (``deep_ep.ElasticBuffer``) as an `EPBackend`: one buffer for prefill and decode, NORMAL or EXPANDED.

V2 replaced V1's two modes with one ``ElasticBuffer``: a dispatch returns ``(recv_x, recv_topk_idx,
recv_topk_weights, handle, event)`` and, with ``async_with_compute_stream=True``, nothing waits for it until
``event.current_stream_wait()``. The layouts it produces map onto tbo's formats like this:

* ``do_expand=False`` is **NORMAL**: each token once per rank hosting any of its experts, ``recv_topk_idx`` as local
  expert ids (-1 elsewhere) and ``recv_topk_weights``. V2's combine only sums, so the experts' output is weighted
  before it (`run_experts` does that for NORMAL), exactly as with V1's normal mode.
* ``do_expand=True`` is **EXPANDED**: one row per (token, local expert), grouped by expert, one weight per row.
  ``expert_alignment`` must stay 1 so the rows are dense (tbo's EXPANDED has no padding; the DeepGEMM runner pads
  for itself). V2's combine does not apply the weights, tbo's EXPANDED combine does: `combine_a` multiplies each row
  by its weight, in float32, before handing V2 the BF16 rows to sum.
* **MASKED** (``[experts, capacity, H]``, DeepGEMM's masked GEMM) is not a V2 layout: use V1's low-latency mode.

How the ``_a``/``_b`` split uses V2:

* A fresh dispatch waits on the CPU for the received counts (``do_cpu_sync``), like V1's normal mode. So
  ``dispatch_a`` only prepares (FP8 quantisation, ``capture()`` of the compute stream) and ``dispatch_b`` dispatches
  with that ``previous_event`` (which V2 only takes with ``allocate_on_comm_stream=True``), so the CPU blocks while
  the GPU still runs the other microbatch's work queued in between.
* A dispatch that reuses a cached layout (``reuse=``, decode with unchanged routing) needs no CPU sync: it is
  launched in ``dispatch_a`` with ``async_with_compute_stream=True`` and waited in ``dispatch_b``.
* A combine never syncs the CPU: launched in ``combine_a``, waited in ``combine_b``.

V2 has **no zero-SM receive-hook mode** ("0 SM RDMA low-latency EP is no longer supported"): its kernels hold
``num_sms`` SMs while they run, in decode as in prefill. ``num_sms`` defaults to
``ElasticBuffer.get_theoretical_num_sms(num_experts, top_k)`` (through `tbo.comm.sm_budget.deep_ep_elastic_num_sms`),
and the same count is what `comm_num_sms` tells a strategy to leave free of DeepGEMM.

V2's **copy and reduce epilogues run on every SM** of the device, whatever ``num_sms`` says (the dispatch's copy
epilogue and the combine's reduce epilogue are launched with the device's SM count: csrc/elastic/buffer.hpp:1125-1141
and :1315-1326): ``num_sms`` is what the transfer kernels hold while data moves, and each transfer then ends with a
short phase that takes the whole GPU. ``epilogue_num_sms`` says so; the simulator and ``tbo predict`` charge that
phase to compute (``CostModel.epilogues``). On **one rank** there is nothing to move and
``get_theoretical_num_sms`` returns every SM (elastic.py:816-818): the kernels then take the whole device, so there is
nothing to leave DeepGEMM beside them (`tbo.comm.sm_budget.gemm_num_sms_beside` gives no budget).

**Receive order.** V2 receives in the order transfers land, which differs from run to run, unless the buffer is
built with ``deterministic=True`` (a sort epilogue, elastic.py:1019-1027). tbo promises that the overlapped step
equals the single-batch step bit for bit; with the order free, rows meet the experts in another order each run and
sums of many rows round differently. So `create` builds deterministic buffers by default (``deterministic=False``
trades that for the sort's cost; results then agree to rounding, not bits), and `deterministic` reports what the
buffer in use does.

V2 moves BF16 or FP8 only: ``hidden`` must be bfloat16 unless ``use_fp8`` (which quantises any float input; on SM100
with power-of-two scales, ``round_scale``, as DeepGEMM's UE8M0 needs: `tbo.comm.fp8.ue8m0_wanted`), or an FP8
``(rows, scales)`` pair the caller quantised, sent as is (`tbo.comm.deepep.dispatch_payload`).
Written against DeepEP 2.0/2.1 (``deep_ep.ElasticBuffer``); keyword arguments the installed version does not accept
are left out, detected by signature. ``deep_ep`` is imported only by `create`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from tbo.util.optional import require
from tbo.comm.sm_budget import deep_ep_elastic_num_sms
from tbo.comm.deepep import _split_fp8, dispatch_payload, supported_kwargs
from tbo.comm.fp8 import ue8m0_wanted
from tbo.comm.layout import check_routing
from tbo.comm.types import DispatchFormat, DispatchOutput

__all__ = ["DeepEPElasticBackend", "elastic_buffer_class"]


def elastic_buffer_class(deep_ep: ModuleType, purpose: str) -> Any:
    """``deep_ep.ElasticBuffer``, or an ImportError saying that this deep_ep is V1 only."""
    cls = getattr(deep_ep, "ElasticBuffer", None)
    if cls is None:
        raise ImportError(
            f"{purpose} needs DeepEP V2 (deep_ep.ElasticBuffer, deep_ep >= 2.0), but the installed deep_ep "
            f"{getattr(deep_ep, '__version__', '?')} has only V1's Buffer; install DeepEP V2 from "
            "https://github.com/deepseek-ai/DeepEP, or use DeepEPNormalBackend / DeepEPLowLatencyBackend")
    return cls


@dataclass(eq=False)
class ElasticHandle:
    """What `combine_a` needs from a dispatch: V2's ``EPHandle``, the layout, and (EXPANDED) each row's weight."""

    handle: Any
    format: DispatchFormat
    num_topk: int
    num_rows: int
    row_weights: torch.Tensor | None = None  # EXPANDED: [rows] float32


@dataclass(eq=False)
class _DispatchState:
    x: Any  # BF16 tensor, or (fp8, scales)
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor
    previous_event: Any  # a fresh dispatch: the compute stream's point captured in _a
    launched: tuple | None  # a cached dispatch: what V2 returned in _a
    reuse: ElasticHandle | None
    nbytes: int


@dataclass(eq=False)
class _CombineState:
    combined: torch.Tensor
    event: Any
    nbytes: int


class DeepEPElasticBackend:
    """DeepEP V2 dispatch/combine over an ``ElasticBuffer``; the output format is NORMAL or EXPANDED."""

    #: ``dispatch_a`` takes pre-quantised FP8 ``(rows, scales)`` pairs (`tbo.comm.deepep.dispatch_payload`)
    carries_fp8 = True

    def __init__(self, buffer: Any, num_experts: int, *, format: DispatchFormat = DispatchFormat.NORMAL,
                 num_max_tokens_per_rank: int | None = None, use_fp8: bool = False, expert_alignment: int = 1,
                 num_sms: int | None = None, round_scale: bool | None = None) -> None:
        self.buffer = buffer
        self.rank, self.num_ranks = buffer.rank_idx, buffer.num_ranks
        if num_experts < 1 or num_experts % self.num_ranks:
            raise ValueError(f"num_experts={num_experts} must be a positive multiple of num_ranks={self.num_ranks}")
        self.num_experts, self.num_local_experts = num_experts, num_experts // self.num_ranks
        self.format = DispatchFormat(format)
        if self.format is DispatchFormat.MASKED:
            raise ValueError("DeepEP V2 has no MASKED layout ([experts, capacity, H]); use DispatchFormat.NORMAL or "
                             "EXPANDED, or V1's DeepEPLowLatencyBackend for the masked GEMM")
        if self.format is DispatchFormat.EXPANDED and expert_alignment != 1:
            raise ValueError(f"expert_alignment={expert_alignment} with EXPANDED: tbo's EXPANDED rows are dense, so "
                             "it must be 1 (the DeepGEMM runner pads each expert's rows itself)")
        if expert_alignment < 1:
            raise ValueError(f"expert_alignment must be >= 1, got {expert_alignment}")
        self.max_tokens = num_max_tokens_per_rank if num_max_tokens_per_rank is not None else (
            buffer.num_max_tokens_per_rank)
        if not self.max_tokens or self.max_tokens < 1:
            raise ValueError("num_max_tokens_per_rank is needed: the buffer was not built with one, pass it here")
        self.use_fp8, self.expert_alignment = use_fp8, expert_alignment
        self.round_scale = bool(use_fp8 and (ue8m0_wanted() if round_scale is None else round_scale))
        if num_sms is not None and (num_sms < 1 or num_sms % 2):
            raise ValueError(f"num_sms must be a positive even count, got {num_sms}")
        self._num_sms = num_sms
        self._sms_by_topk: dict[int, int] = {}
        self._unwaited: dict[int, Any] = {}  # launched, not yet waited (kept alive until then): drain() waits them

    @property
    def hidden_dtypes(self) -> tuple[torch.dtype, ...] | None:
        """What a tensor ``hidden`` may be: bfloat16, or (``use_fp8``, quantised here) any float."""
        return None if self.use_fp8 else (torch.bfloat16,)

    @property
    def deterministic(self) -> bool:
        """Whether the buffer sorts what it receives (``ElasticBuffer(deterministic=True)``): tbo's bit-exact
        promise needs it (see the module docstring)."""
        return bool(getattr(self.buffer, "deterministic", False))

    def epilogue_num_sms(self) -> int | None:
        """SMs V2's copy and reduce epilogues take at the end of each transfer: every SM of the device (None where
        that cannot be asked: no GPU and a buffer that does not say)."""
        sms = getattr(self.buffer, "num_device_sms", None)
        if sms is None:
            if not torch.cuda.is_available():
                return None
            sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        return int(sms)

    @classmethod
    def create(cls, group: Any, num_experts: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int, *,
               use_fp8: bool = False, deterministic: bool = True, buffer: Any = None,
               buffer_kwargs: dict[str, Any] | None = None, deep_ep: ModuleType | None = None,
               **kwargs: Any) -> "DeepEPElasticBackend":
        """Build (or reuse) an ``ElasticBuffer`` sized with ``get_buffer_size_hint`` for this model, and wrap it.

        ``deterministic`` (default True: tbo's bit-exact promise) builds the buffer with V2's sorted receive order.
        ``buffer``: an existing ElasticBuffer to share (V2 serves prefill and decode from one), checked to be big
        enough; it keeps its own ``deterministic``, and asking for another is an error. ``buffer_kwargs`` go to the
        ElasticBuffer constructor. ``deep_ep``: the module to use instead of importing it.
        """
        module = deep_ep if deep_ep is not None else require("deep_ep", "DeepEPElasticBackend")
        elastic = elastic_buffer_class(module, "DeepEPElasticBackend")
        need = elastic.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk=num_topk,
                                            use_fp8_dispatch=use_fp8)
        if buffer is None:
            buffer = elastic(group, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk,
                             use_fp8_dispatch=use_fp8, **{"deterministic": deterministic, **(buffer_kwargs or {})})
        elif bool(getattr(buffer, "deterministic", False)) != deterministic:
            raise ValueError(f"the shared ElasticBuffer was built with deterministic={buffer.deterministic}, but "
                             f"deterministic={deterministic} was asked for; build the buffer with it, or pass "
                             f"deterministic={buffer.deterministic}")
        elif buffer.num_bytes < need:
            raise ValueError(f"the shared ElasticBuffer has {buffer.num_bytes} bytes; {num_max_tokens_per_rank} "
                             f"tokens x hidden {hidden} x top-{num_topk} need {need} (get_buffer_size_hint)")
        return cls(buffer, num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank, use_fp8=use_fp8, **kwargs)

    def __repr__(self) -> str:
        return (f"DeepEPElasticBackend(rank={self.rank}, num_ranks={self.num_ranks}, num_experts={self.num_experts}, "
                f"format={self.format.name}, fp8={self.use_fp8})")

    def comm_num_sms(self, num_topk: int) -> int:
        """SMs V2's dispatch and combine kernels take for top-``num_topk`` routing: ``num_sms`` if given, else
        ``get_theoretical_num_sms``. A strategy leaves these free of DeepGEMM (``comm_num_sms=`` of the DeepSeek
        strategies)."""
        if self._num_sms is not None:
            return self._num_sms
        if num_topk not in self._sms_by_topk:
            self._sms_by_topk[num_topk] = deep_ep_elastic_num_sms(self.buffer, self.num_experts, num_topk)
        return self._sms_by_topk[num_topk]

    # ---- dispatch -----------------------------------------------------------------------------------------------
    def dispatch_a(self, hidden: torch.Tensor | tuple[torch.Tensor, torch.Tensor], topk_idx: torch.Tensor | None,
                   topk_weights: torch.Tensor, *, reuse: Any = None) -> _DispatchState:
        """Prepare (a fresh layout) or launch (``reuse``: the handle of an earlier dispatch with the same routing,
        which must then be given as ``topk_idx=None``; every rank must reuse together). ``hidden`` may be an FP8
        ``(rows, scales)`` pair quantised by the caller, sent as is."""
        x, rows, nbytes = dispatch_payload(hidden, self.use_fp8, self.round_scale)
        pair, hidden = isinstance(hidden, tuple), rows
        cached = self._as_handle(reuse) if reuse is not None else None
        if cached is not None:
            if topk_idx is not None:
                raise ValueError("dispatch_a: with reuse=, topk_idx must be None: a reused layout keeps its own "
                                 "routing (DeepEP V2 asserts topk_idx is None with a cached handle)")
            routed = cached.handle.topk_idx
            check_routing(hidden, routed, topk_weights.to(routed.device), self.num_experts, "dispatch_a")
        else:
            if topk_idx is None:
                raise ValueError("dispatch_a: topk_idx is None without reuse=")
            check_routing(hidden, topk_idx, topk_weights, self.num_experts, "dispatch_a")
        if hidden.shape[0] > self.max_tokens:
            raise ValueError(f"dispatch_a: {hidden.shape[0]} tokens exceed num_max_tokens_per_rank={self.max_tokens}")
        if not (self.use_fp8 or pair) and hidden.dtype != torch.bfloat16:
            raise TypeError(f"dispatch_a: DeepEP V2 moves bfloat16 (or FP8) activations, got hidden {hidden.dtype}; "
                            "cast to bfloat16 or build the backend with use_fp8=True")
        weights = topk_weights.float()
        if cached is None:
            return _DispatchState(x, topk_idx.long(), weights, self.buffer.capture(), None, None, nbytes)
        buf = self.buffer
        launched = buf.dispatch(x, **supported_kwargs(
            buf.dispatch, topk_weights=weights, num_sms=self.comm_num_sms(cached.num_topk),
            async_with_compute_stream=True, handle=cached.handle, do_expand=self.format is DispatchFormat.EXPANDED))
        state = _DispatchState(x, None, weights, None, launched, cached, nbytes)
        self._unwaited[id(state)] = state
        return state

    def dispatch_b(self, state: _DispatchState) -> DispatchOutput:
        if state.launched is None:
            buf, k = self.buffer, state.topk_idx.shape[1]
            state.launched = buf.dispatch(state.x, **supported_kwargs(
                buf.dispatch, topk_idx=state.topk_idx, topk_weights=state.topk_weights, num_experts=self.num_experts,
                num_max_tokens_per_rank=self.max_tokens, expert_alignment=self.expert_alignment,
                num_sms=self.comm_num_sms(k), previous_event=state.previous_event, async_with_compute_stream=True,
                allocate_on_comm_stream=True, do_expand=self.format is DispatchFormat.EXPANDED))
        else:
            self._unwaited.pop(id(state), None)
        recv_x, recv_idx, recv_weights, handle, event = state.launched
        state.launched = state.x = None
        event.current_stream_wait()
        hidden, scales = _split_fp8(recv_x)
        counts = torch.tensor(handle.num_recv_tokens_per_expert_list, dtype=torch.int64)
        k = handle.topk_idx.shape[1]
        if self.format is DispatchFormat.EXPANDED:
            ours = ElasticHandle(handle, self.format, k, hidden.shape[0], recv_weights)
            return DispatchOutput(DispatchFormat.EXPANDED, hidden, counts, ours, scales=scales)
        ours = ElasticHandle(handle, self.format, k, hidden.shape[0])
        if recv_idx is None:  # a cached dispatch that did not return them: the layout is the handle's
            raise RuntimeError("DeepEP V2 returned no recv_topk_idx for a NORMAL dispatch; NORMAL needs them")
        return DispatchOutput(DispatchFormat.NORMAL, hidden, counts, ours, topk_idx=recv_idx,
                              topk_weights=recv_weights, scales=scales)

    # ---- combine ------------------------------------------------------------------------------------------------
    def combine_a(self, expert_out: torch.Tensor, handle: Any) -> _CombineState:
        h = self._as_handle(handle)
        if expert_out.dim() != 2 or expert_out.shape[0] != h.num_rows:
            what = "expanded row" if h.format is DispatchFormat.EXPANDED else "received token"
            raise ValueError(f"combine_a: {h.format.name} expert output must be [{h.num_rows}, H] (one row per "
                             f"{what}), got {tuple(expert_out.shape)}")
        if h.format is DispatchFormat.EXPANDED:  # V2 only sums: apply the weights here, in float32
            x = (expert_out.float() * h.row_weights.unsqueeze(1)).to(torch.bfloat16)
        else:  # V2 combines BF16; run_experts already weighted NORMAL rows
            x = expert_out.to(torch.bfloat16)
        buf = self.buffer
        combined, _, event = buf.combine(x, h.handle, **supported_kwargs(
            buf.combine, num_sms=self.comm_num_sms(h.num_topk), async_with_compute_stream=True,
            allocate_on_comm_stream=False))
        state = _CombineState(combined, event, x.nbytes)
        self._unwaited[id(state)] = state
        return state

    def combine_b(self, state: _CombineState) -> torch.Tensor:
        self._unwaited.pop(id(state), None)
        state.event.current_stream_wait()
        combined, state.combined = state.combined, None
        return combined

    def _as_handle(self, handle: Any) -> ElasticHandle:
        if isinstance(handle, DispatchOutput):
            handle = handle.handle
        if not isinstance(handle, ElasticHandle):
            raise TypeError(f"expected the handle of this backend's dispatch_b, got {type(handle).__name__}")
        if handle.format is not self.format:
            raise ValueError(f"a {handle.format.name} handle given to a {self.format.name} backend")
        return handle

    # ---- failure recovery ---------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> list[str]:
        """Transfers launched and not waited (for the watchdog's report)."""
        return [f"DeepEP V2 {'combine' if isinstance(s, _CombineState) else 'cached dispatch'} (event not waited)"
                for s in self._unwaited.values()]

    def drain(self) -> int:
        """Wait every launched transfer, e.g. after an op failed mid-step, so none is left behind."""
        pending = list(self._unwaited.values())
        self._unwaited.clear()
        for state in pending:
            launched = state.launched if isinstance(state, _DispatchState) else None
            event = launched[-1] if launched is not None else getattr(state, "event", None)
            if event is not None:
                event.current_stream_wait()
        return len(pending)
