"""The expert-parallel communication interface: what dispatch hands the experts, and what every backend provides.

``dispatch_a``/``combine_a`` launch and return a state object; ``dispatch_b``/``combine_b`` take that state and wait.
Backends keep no per-microbatch state: everything in flight lives in the returned state objects, which ops keep in
the microbatch's `State`. That is what lets two microbatches have transfers in flight at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["BackendWrapper", "DispatchFormat", "DispatchOutput", "DispatchState", "CombineState", "EPBackend",
           "payload_refusal"]


class DispatchFormat(enum.Enum):
    """How dispatched tokens are laid out for the expert compute; the expert runner is chosen by it."""

    #: one row per (token, expert) pair routed here, grouped by local expert; ``tokens_per_expert`` counts them
    EXPANDED = "expanded"
    #: ``[num_local_experts, capacity, H]`` with ``tokens_per_expert`` valid rows each (DeepEP low-latency, masked GEMM)
    MASKED = "masked"
    #: each token once per rank, with ``topk_idx`` as local expert ids or -1 and ``topk_weights`` (DeepEP normal)
    NORMAL = "normal"


@dataclass
class DispatchOutput:
    """Tokens as the local experts receive them, plus the opaque handle combine needs to send results back."""

    format: DispatchFormat
    hidden: torch.Tensor
    tokens_per_expert: torch.Tensor
    handle: Any
    topk_idx: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    scales: torch.Tensor | None = None  #: FP8 per-token-group scales when ``hidden`` is quantised

    @property
    def num_local_experts(self) -> int:
        return int(self.tokens_per_expert.shape[0])


@dataclass
class DispatchState:
    """A dispatch in flight: returned by ``dispatch_a``, consumed by ``dispatch_b``."""

    pending: Any
    nbytes: int = 0
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class CombineState:
    """A combine in flight: returned by ``combine_a``, consumed by ``combine_b``."""

    pending: Any
    nbytes: int = 0
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class EPBackend(Protocol):
    """Expert-parallel dispatch and combine. ``combine_b(combine_a(run(dispatch_b(dispatch_a(x)))))`` equals
    ``sum_k w_k * expert_{e_k}(x)`` per token.

    Experts are numbered globally: rank ``r`` owns global experts ``r * num_local_experts`` to
    ``(r + 1) * num_local_experts - 1``, and its expert function receives the local index
    (``global - r * num_local_experts``). Every rank calls the four methods in the same order, once per microbatch
    and layer, including a rank with no tokens (it dispatches an empty batch): they are collectives.

    Optionally a backend has ``in_flight_limit``, a `tbo.core.inflight.InFlightLimit`, when its transport cannot
    hold any number of transfers in flight across microbatches (DeepEP low-latency: one un-received call). Binding
    a strategy to layers over it checks the compiled schedule against that limit. (Not a protocol member: absent
    means no limit.)

    What ``dispatch_a`` moves (`payload_refusal` reads it; absent means the defaults): ``carries_fp8`` (default
    False), True when ``hidden`` may also be an FP8 ``(rows float8_e4m3fn [T, H], scales float32 [T, H // 128])``
    pair quantised by the caller, sent as is and received as ``DispatchOutput.hidden`` and ``.scales`` (DeepEP's
    FP8 dispatch); ``hidden_dtypes`` (default None: any), the dtypes a tensor ``hidden`` may have (DeepEP V2 and
    low-latency: bfloat16 only).
    """

    rank: int
    num_ranks: int
    num_experts: int
    num_local_experts: int

    def dispatch_a(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Any:
        """Launch sending each token's row to the ranks owning its experts, and return at once with the in-flight
        state (keep it in the microbatch's `State`; pass it to `dispatch_b`).

        ``hidden`` is ``[num_tokens, hidden]``; ``topk_idx`` ``[num_tokens, top_k]`` integer global expert ids, -1 for
        an empty slot; ``topk_weights`` the same shape, floating point. Note the order: indices first, weights
        second, the reverse of ``torch.topk``, which returns ``(values, indices)``; write
        ``weights, idx = torch.topk(scores, k)`` and then ``dispatch_a(hidden, idx, weights)``. Swapped tensors are
        refused (an integer ``topk_idx`` is required), never misrouted.
        """
        ...

    def dispatch_b(self, state: Any) -> DispatchOutput:
        """Wait for the dispatch `dispatch_a` launched, and return the rows this rank's experts must process, laid
        out in the backend's `DispatchFormat`, with the handle `combine_a` needs to send the results back."""
        ...

    def combine_a(self, expert_out: torch.Tensor, handle: Any) -> Any:
        """Launch sending the experts' outputs back to the tokens' ranks, and return at once with the in-flight
        state. ``expert_out`` has the layout and row order of the `DispatchOutput` it answers (what `run_experts`
        returns); ``handle`` is that output's ``handle``."""
        ...

    def combine_b(self, state: Any) -> torch.Tensor:
        """Wait for the combine, and return ``[num_tokens, hidden]``: per token, the sum over its top-k slots of
        ``weight * expert output`` (zero for a token whose slots are all -1), in the order `dispatch_a` got them."""
        ...

    @property
    def in_flight(self) -> list[Any]:
        """Transfers launched and not yet waited: what the watchdog reports when a step hangs."""
        ...

    def drain(self) -> int:
        """Wait out every transfer still in flight and return how many there were. The executor calls it when an op
        fails mid-step, so that nothing still writes into buffers the caller is about to free or reuse."""
        ...


class BackendWrapper:
    """Base of backends that wrap another (an emulated link, a tracer, a copy-engine link): the topology and the
    in-flight/drain contract are the inner backend's; a subclass overrides the transfer methods it changes. The
    inner one is an `EPBackend` (dispatch and combine) or a `tbo.comm.allreduce.TPAllReduce` (``reduce_a`` and
    ``reduce_b``): each wrapper method passes on to the inner one's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rank, self.num_ranks = inner.rank, inner.num_ranks
        # an EP backend's topology; a `tbo.comm.allreduce.TPAllReduce` has none (it wraps the same way)
        self.num_experts = getattr(inner, "num_experts", 0)
        self.num_local_experts = getattr(inner, "num_local_experts", 0)

    @property
    def in_flight(self) -> list[Any]:
        return self.inner.in_flight

    @property
    def in_flight_limit(self) -> Any:
        """The inner backend's `tbo.core.inflight.InFlightLimit` (None: it has none): wrapping changes no buffer."""
        return getattr(self.inner, "in_flight_limit", None)

    @property
    def masked_capacity(self) -> int | None:
        """The inner backend's fixed MASKED capacity (None: none is set): a wrapper moves the same slabs."""
        return getattr(self.inner, "masked_capacity", None)

    @property
    def accepts_rows_per_rank(self) -> bool:
        """Whether ``dispatch_a`` takes the agreed ``rows_per_rank`` (the inner backend's: a wrapper passes them on;
        see `tbo.comm.alltoall`)."""
        return bool(getattr(self.inner, "accepts_rows_per_rank", False))

    @property
    def carries_fp8(self) -> bool:
        """Whether ``dispatch_a`` takes a pre-quantised FP8 ``(rows, scales)`` pair (the inner backend's)."""
        return bool(getattr(self.inner, "carries_fp8", False))

    @property
    def hidden_dtypes(self) -> tuple[torch.dtype, ...] | None:
        """The dtypes a tensor ``hidden`` may have (the inner backend's; None: any)."""
        return getattr(self.inner, "hidden_dtypes", None)

    def drain(self) -> int:
        return self.inner.drain()

    def dispatch_a(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                   **agreed: Any) -> Any:
        """The inner backend's `EPBackend.dispatch_a` (``topk_idx`` before ``topk_weights``, unlike torch.topk);
        ``agreed`` (``rows_per_rank``) passed on."""
        return self.inner.dispatch_a(hidden, topk_idx, topk_weights, **agreed)

    def dispatch_b(self, state: Any) -> DispatchOutput:
        """The inner backend's `EPBackend.dispatch_b`."""
        return self.inner.dispatch_b(state)

    def combine_a(self, expert_out: torch.Tensor, handle: Any) -> Any:
        """The inner backend's `EPBackend.combine_a`."""
        return self.inner.combine_a(expert_out, handle)

    def combine_b(self, state: Any) -> torch.Tensor:
        """The inner backend's `EPBackend.combine_b`."""
        return self.inner.combine_b(state)

    def reduce_a(self, x: torch.Tensor, what: str = "all-reduce") -> Any:
        """The inner reducer's `tbo.comm.allreduce.TPAllReduce.reduce_a`."""
        return self.inner.reduce_a(x, what)

    def reduce_b(self, state: Any) -> torch.Tensor:
        """The inner reducer's `tbo.comm.allreduce.TPAllReduce.reduce_b`."""
        return self.inner.reduce_b(state)


def payload_refusal(backend: Any, dtype: torch.dtype, fp8: bool) -> str | None:
    """Why ``backend``'s ``dispatch_a`` cannot move this payload, or None when it can: FP8 ``(rows, scales)`` pairs
    (``fp8``), or tensors of ``dtype`` (see `EPBackend`: ``carries_fp8``, ``hidden_dtypes``)."""
    name = type(getattr(backend, "inner", backend)).__name__
    if fp8:
        if not getattr(backend, "carries_fp8", False):
            return (f"{name} moves one tensor per token and no scales; FP8 rows with their scales travel over DeepEP "
                    "only (backend 'deepep')")
        return None
    dtypes = getattr(backend, "hidden_dtypes", None)
    if dtypes is not None and dtype not in dtypes:
        return f"{name} moves {', '.join(str(d).replace('torch.', '') for d in dtypes)} activations, not {dtype}"
    return None
