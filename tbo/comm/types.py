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

__all__ = ["BackendWrapper", "DispatchFormat", "DispatchOutput", "DispatchState", "CombineState", "EPBackend"]


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
    ``sum_k w_k * expert_{e_k}(x)`` per token."""

    rank: int
    num_ranks: int
    num_experts: int
    num_local_experts: int

    def dispatch_a(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Any: ...

    def dispatch_b(self, state: Any) -> DispatchOutput: ...

    def combine_a(self, expert_out: torch.Tensor, handle: Any) -> Any: ...

    def combine_b(self, state: Any) -> torch.Tensor: ...

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
    in-flight/drain contract are the inner backend's; a subclass overrides the four transfer methods it changes."""

    def __init__(self, inner: EPBackend) -> None:
        self.inner = inner
        self.rank, self.num_ranks = inner.rank, inner.num_ranks
        self.num_experts, self.num_local_experts = inner.num_experts, inner.num_local_experts

    @property
    def in_flight(self) -> list[Any]:
        return self.inner.in_flight

    def drain(self) -> int:
        return self.inner.drain()

    def dispatch_a(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Any:
        return self.inner.dispatch_a(hidden, topk_idx, topk_weights)

    def dispatch_b(self, state: Any) -> DispatchOutput:
        return self.inner.dispatch_b(state)

    def combine_a(self, expert_out: torch.Tensor, handle: Any) -> Any:
        return self.inner.combine_a(expert_out, handle)

    def combine_b(self, state: Any) -> torch.Tensor:
        return self.inner.combine_b(state)
