"""`EmulatedLink`: make dispatch, combine and the tensor-parallel all-reduce take the time a real interconnect would,
without burning CPU.

On a 2-core machine real loopback traffic competes with compute for the CPU, so it cannot show overlap. The link
wraps any backend and gives each transfer a completion time of ``latency + bytes / bandwidth``: transfers share the
bandwidth in FIFO order, and their latencies overlap. The ``_a`` call only books the transfer; the ``_b`` call
sleeps until it completes. Compute done between ``_a`` and ``_b`` therefore really hides the transfer.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from tbo.comm.types import BackendWrapper, DispatchOutput

__all__ = ["EmulatedLink", "LinkTimeline", "LinkClock", "WallClock", "SimulatedClock", "LinkStats", "Transfer", "parse_link_spec"]


class LinkClock(Protocol):
    def now(self) -> float: ...

    def sleep_until(self, t: float) -> None: ...


class WallClock:
    """Real time. A wait sleeps, releasing the CPU (and the GIL) to whatever else runs, until ``spin_s`` before its
    deadline, and spins the rest.

    ``time.sleep`` wakes 50-120 us late on a VM, which makes every exposed wait longer than the transfer it emulates
    (and a simulator that models the link wrong by that much per wait). Spinning fixes that where one process owns
    its core (`tbo.harness.workload.TracedModel`); where several ranks share few cores, a spinning rank takes CPU from
    transports' threads, so the default is 0: sleep only. ``clock`` and ``sleep`` default to ``time.perf_counter``
    and ``time.sleep`` (tests pass a clock they move themselves, and see every sleep and every poll).
    """

    def __init__(self, spin_s: float = 0.0, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.spin_s = spin_s
        self._clock, self._sleep = clock, sleep

    def now(self) -> float:
        return self._clock()

    def sleep_until(self, t: float) -> None:
        delay = t - self._clock() - self.spin_s
        if delay > 0:
            self._sleep(delay)
        while self._clock() < t:
            pass


class SimulatedClock:
    """A clock that only moves when told: exact, noise-free timelines for tests."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt

    def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)


@dataclass
class Transfer:
    """One emulated transfer: when it was launched, when it completes, and when its ``_b`` waited."""

    kind: str
    nbytes: int
    launched: float
    complete: float
    wait_start: float | None = None
    wait_end: float | None = None

    @property
    def exposed(self) -> float:
        """Time the ``_b`` op blocked: the part of this transfer compute did not hide (0 until its wait has ended: a
        metrics thread may read a transfer whose ``_b`` is still waiting)."""
        start, end = self.wait_start, self.wait_end
        return 0.0 if start is None or end is None else end - start

    @property
    def duration(self) -> float:
        return self.complete - self.launched


#: transfers a `LinkStats` keeps one by one (its totals cover every transfer since the last reset)
LINK_STATS_KEEP = 4096


@dataclass
class LinkStats:
    """What the link carried since the last reset: totals over every transfer, kept as transfers are booked and
    waited for (so that reading them costs the same after a day of serving as after one step: an engine reads them
    for every ``stats_file`` write and every metrics publish), and the last `LINK_STATS_KEEP` transfers one by one
    (a link in a long-running server would otherwise grow without bound).

    The engine's thread books and waits while a metrics thread (`tbo.integrations.engine.metrics`) reads the
    totals, so both hold a lock; a transfer still in its wait counts no exposed time yet."""

    transfers: deque[Transfer] = field(default_factory=lambda: deque(maxlen=LINK_STATS_KEEP))
    count: int = 0  #: transfers booked since the last reset
    _exposed: float = 0.0
    _busy: tuple[float, float, float] | None = None  #: (busy time before the open interval, its start, end)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, transfer: Transfer) -> None:
        """A transfer booked (launched no earlier than the one before: the link's clock only moves on); one whose
        wait already ended counts its exposed time now, else `waited` does."""
        with self._lock:
            self.transfers.append(transfer)
            self.count += 1
            self._busy = _merge(self._busy, transfer.launched, transfer.complete)
            self._exposed += transfer.exposed

    def waited(self, transfer: Transfer) -> None:
        """``transfer``'s ``_b`` op has waited for it: the time it blocked joins the exposed total."""
        with self._lock:
            self._exposed += transfer.exposed

    @property
    def comm_s(self) -> float:
        """Time the link was busy: the union of the transfers' in-flight intervals (overlaps counted once)."""
        with self._lock:
            busy = self._busy
        return 0.0 if busy is None else busy[0] + busy[2] - busy[1]

    @property
    def exposed_s(self) -> float:
        """Time ``_b`` ops blocked on the link: the part of its transfers compute did not hide."""
        with self._lock:
            return self._exposed


def _merge(busy: tuple[float, float, float] | None, start: float, end: float) -> tuple[float, float, float]:
    if busy is None:
        return 0.0, start, end
    total, a, b = busy
    if start > b:
        return total + b - a, start, end
    return total, a, max(b, end)


@dataclass
class _InFlight:
    inner: Any
    transfer: Transfer


def parse_link_spec(spec: str) -> tuple[float, float]:
    """``"LATENCY_US,GBPS"`` (e.g. ``"20,50"``) as ``(latency_s, bandwidth_bytes_per_s)``; a ValueError naming the
    spec when it is malformed, the latency negative or the bandwidth not positive. One parser for every place a link
    is configured (the examples' ``--link``, the vLLM plugin's ``link`` key)."""
    try:
        latency_us, gbps = (float(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(f"link spec must be 'LATENCY_US,GBPS' (e.g. '20,50'), got {spec!r}") from None
    if latency_us < 0 or gbps <= 0:
        raise ValueError(f"link spec {spec!r}: latency must be >= 0 and bandwidth > 0")
    return latency_us * 1e-6, gbps * 1e9


class LinkTimeline:
    """The link's timing alone: each booked transfer completes ``latency + nbytes / bandwidth`` after it was booked,
    transfers sharing the bandwidth in FIFO order. `EmulatedLink` books expert traffic on it; AFD's link
    (`tbo.afd.link`) books the hidden states between attention and FFN ranks on it."""

    def __init__(self, latency_s: float, bandwidth_bytes_per_s: float, clock: LinkClock | None = None) -> None:
        if latency_s < 0 or bandwidth_bytes_per_s <= 0:
            raise ValueError(f"latency_s must be >= 0 and bandwidth > 0, got {latency_s}, {bandwidth_bytes_per_s}")
        self.latency_s = latency_s
        self.bandwidth = bandwidth_bytes_per_s
        self.clock: LinkClock = clock or WallClock()
        self.stats = LinkStats()
        self._free_at = float("-inf")  # when the link finishes the bytes already queued (FIFO)
        #: the wire time of every transfer booked so far (``latency + nbytes / bandwidth`` each), never reset: what
        #: an unsplit step, which waits for each transfer in turn, spends on the link (`tbo.split.adaptive`'s prior)
        self.booked_s = 0.0

    def transfer_time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth

    def reset_stats(self) -> None:
        self.stats = LinkStats()

    def book(self, kind: str, nbytes: int) -> Transfer:
        """A transfer of ``nbytes`` launched now: when it completes."""
        now = self.clock.now()
        start = max(now, self._free_at)
        self._free_at = start + nbytes / self.bandwidth
        self.booked_s += self.latency_s + nbytes / self.bandwidth
        transfer = Transfer(kind, nbytes, now, self._free_at + self.latency_s)
        self.stats.add(transfer)
        return transfer

    def wait(self, transfer: Transfer) -> None:
        """Sleep until ``transfer`` completes (the time slept is its ``exposed`` part)."""
        transfer.wait_start = self.clock.now()
        self.clock.sleep_until(transfer.complete)
        transfer.wait_end = max(self.clock.now(), transfer.wait_start)
        self.stats.waited(transfer)

    def describe(self) -> str:
        return f"latency={self.latency_s * 1e6:g}us, bandwidth={self.bandwidth / 1e9:g}GB/s"


class EmulatedLink(LinkTimeline, BackendWrapper):
    """An `EPBackend` (or `tbo.comm.allreduce.TPAllReduce`) wrapper whose transfers take ``latency_s + nbytes / bandwidth`` of (wall or simulated) time."""

    def __init__(self, inner: Any, latency_s: float, bandwidth_bytes_per_s: float,
                 clock: LinkClock | None = None) -> None:
        LinkTimeline.__init__(self, latency_s, bandwidth_bytes_per_s, clock)
        BackendWrapper.__init__(self, inner)

    @classmethod
    def from_spec(cls, inner: Any, spec: str, clock: LinkClock | None = None) -> "EmulatedLink":
        """``"LATENCY_US,GBPS"``, e.g. ``"20,50"``: 20 us latency, 50 GB/s (see `parse_link_spec`)."""
        return cls(inner, *parse_link_spec(spec), clock)

    def dispatch_a(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                   **agreed: Any) -> _InFlight:
        """The inner `EPBackend.dispatch_a` (``agreed``: its ``rows_per_rank``), booked on the link (``topk_idx``
        before ``topk_weights``, unlike ``torch.topk``)."""
        inner = self.inner.dispatch_a(hidden, topk_idx, topk_weights, **agreed)
        nbytes = getattr(inner, "nbytes", 0) or hidden.nbytes * topk_idx.shape[1]
        return _InFlight(inner, self.book("dispatch", nbytes))

    def dispatch_b(self, state: _InFlight) -> DispatchOutput:
        """Sleep until the booked transfer completes, then the inner `EPBackend.dispatch_b`."""
        self.wait(state.transfer)
        return self.inner.dispatch_b(state.inner)

    def combine_a(self, expert_out: torch.Tensor, handle: Any) -> _InFlight:
        """The inner `EPBackend.combine_a`, booked on the link."""
        inner = self.inner.combine_a(expert_out, handle)
        nbytes = getattr(inner, "nbytes", 0) or expert_out.nbytes
        return _InFlight(inner, self.book("combine", nbytes))

    def combine_b(self, state: _InFlight) -> torch.Tensor:
        """Sleep until the booked transfer completes, then the inner `EPBackend.combine_b`."""
        self.wait(state.transfer)
        return self.inner.combine_b(state.inner)

    def reduce_a(self, x: torch.Tensor, what: str = "all-reduce") -> _InFlight:
        """The inner `tbo.comm.allreduce.TPAllReduce.reduce_a`, booked on the link as the bytes one rank sends in
        a ring all-reduce (``wire_bytes``: ``2 (n - 1) / n`` times the payload; on one rank, the latency only)."""
        inner = self.inner.reduce_a(x, what)
        return _InFlight(inner, self.book("allreduce", int(getattr(inner, "wire_bytes", 0))))

    def reduce_b(self, state: _InFlight) -> torch.Tensor:
        """Sleep until the booked transfer completes, then the inner `TPAllReduce.reduce_b`."""
        self.wait(state.transfer)
        return self.inner.reduce_b(state.inner)

    def __repr__(self) -> str:
        return f"EmulatedLink({self.inner!r}, {self.describe()})"
