"""`CopyEngineLink`: a one-GPU stand-in for the network, moving each transfer through the copy engines.

On one GPU there is no interconnect to overlap with, and an `EmulatedLink` sleeps on the host, which a GPU stream
cannot overlap with. This link wraps any `EPBackend` and gives every dispatch and combine a real asynchronous
transfer: ``_a`` records an event on the current (compute) stream, makes the link's copy stream wait for it, and
there copies the payload device -> pinned host -> device. The copy engines move it without using SMs, as RDMA
would. ``_b`` makes the compute stream wait for the copy stream's completion event, then hands the received
payload to the inner backend. Nothing blocks the CPU, so compute launched between ``_a`` and ``_b`` really runs
beside the transfer, and the whole thing is capture-safe: inside ``torch.cuda.graph`` the events become the fork
and join of the captured graph.

Bytes per transfer are configurable per token (``dispatch_bytes_per_token``, ``combine_bytes_per_token``): FP8
dispatch at top-8 of hidden 7168 is ``8 * 7168 = 57344`` bytes per token out, BF16 combine ``8 * 7168 * 2 =
114688`` back. The real payload (the inner backend's input) always travels and bytes beyond it are filler, so the
results are exactly the inner backend's; a configured size below the payload's is raised to it (``nbytes`` says
what moved).

Memory safety across streams: the payload read and the buffers written on the copy stream are held by the
transfer until its ``_b`` (after which the compute stream is ordered behind the copies), and `drain` settles
transfers whose ``_b`` never came: the host waits for them, or, while a graph is being captured (where a host wait
would invalidate the capture), the compute stream joins them, so that the capture still ends and the failed op's
error is the one raised. Pinned staging and filler buffers are kept for the link's lifetime, which is what a
captured graph, holding their addresses, needs. Streams and buffers are kept per device, keyed by
`tbo.comm.devices.device_key` (``"cuda"`` and ``"cuda:0"`` are one device).

Off CUDA the same link runs synchronously (the copy happens inside ``_a``, through a host buffer), with host-time
stamps: the logic, the byte accounting and the results can be checked on a CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from tbo.comm import devices
from tbo.comm.devices import device_key
from tbo.comm.types import BackendWrapper, DispatchOutput

__all__ = ["CopyEngineLink", "CopyTransfer"]


@dataclass(eq=False)
class CopyTransfer:
    """One transfer through the copy engines. Stamps are CUDA events (on a GPU) or host seconds (off CUDA).

    ``start``/``end`` bracket the copies on the copy stream; ``wait_start``/``wait_end`` bracket the compute
    stream's wait in ``_b``, so their distance is how long compute stalled on it (the exposed part).
    """

    kind: str
    nbytes: int
    num_tokens: int
    start: Any = None
    end: Any = None
    wait_start: Any = None
    wait_end: Any = None
    done: Any = None  #: what the compute stream waits on (the end event; an untimed one under capture)
    device: Any = None  #: the payload's device: whose compute stream joins the copy stream
    received: tuple[torch.Tensor, ...] = ()
    held: tuple[torch.Tensor, ...] = ()  #: read or written on the copy stream: kept alive until ``_b``
    waited: bool = False

    def __str__(self) -> str:
        return f"copy-engine {self.kind} of {self.nbytes} bytes ({self.num_tokens} tokens)"

    def duration_s(self) -> float | None:
        """Seconds the copies took (None when not timed, e.g. captured); reading CUDA events waits for them."""
        return _between(self.start, self.end)

    def exposed_s(self) -> float | None:
        """Seconds the compute stream stalled in ``_b`` (None before ``_b`` or untimed)."""
        return _between(self.wait_start, self.wait_end)


def _between(a: Any, b: Any) -> float | None:
    if a is None or b is None:
        return None
    if isinstance(a, float):
        return max(b - a, 0.0)
    b.synchronize()
    return max(a.elapsed_time(b) / 1e3, 0.0)


@dataclass(eq=False)
class _Sent:
    """The link's state for one transfer in flight: the inner call's arguments travel in ``transfer``."""

    transfer: CopyTransfer
    args: tuple[Any, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.transfer.nbytes


@dataclass(frozen=True)
class _LinkHandle:
    """The inner backend's combine handle, plus what sizes the combine transfer."""

    inner: Any
    num_tokens: int
    top_k: int


@dataclass
class _Buffers:
    """Per device: pinned host staging, and device filler (read from / written to; contents never matter)."""

    host: list[torch.Tensor] = field(default_factory=list)  #: every size ever used: graphs keep old addresses
    filler_src: list[torch.Tensor] = field(default_factory=list)
    filler_dst: list[torch.Tensor] = field(default_factory=list)


class CopyEngineLink(BackendWrapper):
    """An `EPBackend` wrapper whose dispatch and combine travel device -> pinned host -> device on a side stream.

    ``dispatch_bytes_per_token`` / ``combine_bytes_per_token``: bytes one token puts on the wire in each direction;
    None sends ``top_k * hidden * element size`` (each token to ``top_k`` experts in its own dtype). ``stream``:
    the copy stream (one is created per device when first needed). ``timing``: record CUDA timing events (for
    `Tracer(cuda=True)` and `CopyTransfer.duration_s`); they are skipped while a graph is being captured.
    """

    def __init__(self, inner: Any, *, dispatch_bytes_per_token: int | None = None,
                 combine_bytes_per_token: int | None = None, stream: Any = None, timing: bool = True) -> None:
        for name, value in (("dispatch_bytes_per_token", dispatch_bytes_per_token),
                            ("combine_bytes_per_token", combine_bytes_per_token)):
            if value is not None and value < 0:
                raise ValueError(f"{name}={value} must be >= 0 bytes (or None: top_k * hidden * element size)")
        super().__init__(inner)
        self.dispatch_bytes_per_token = dispatch_bytes_per_token
        self.combine_bytes_per_token = combine_bytes_per_token
        self.timing = timing
        self._streams: dict[Any, Any] = {} if stream is None else {device_key(stream.device): stream}
        self._buffers: dict[Any, _Buffers] = {}
        self._in_flight: dict[int, CopyTransfer] = {}
        self.transfers: list[CopyTransfer] = []  #: every transfer since `reset_stats` (for `stats`)
        self.record_transfers = False

    def __repr__(self) -> str:
        return (f"CopyEngineLink({self.inner!r}, dispatch_bytes_per_token={self.dispatch_bytes_per_token}, "
                f"combine_bytes_per_token={self.combine_bytes_per_token})")

    @property
    def format(self) -> Any:
        return getattr(self.inner, "format", None)

    @property
    def capture_safe(self) -> bool:
        """The link adds no host sync; it is capture-safe when the backend it wraps is."""
        return bool(getattr(self.inner, "capture_safe", False))

    # ---- the contract every backend keeps -----------------------------------------------------------------------
    @property
    def in_flight(self) -> list[Any]:
        return [str(t) for t in self._in_flight.values()] + list(self.inner.in_flight)

    def drain(self) -> int:
        """Settle every transfer whose ``_b`` never came (after a failed step), then the inner backend's.

        Outside a capture the host waits for each one. While a graph is being captured it must not: a host sync
        invalidates the capture, and a copy stream forked into the capture but never joined back makes ending the
        capture fail, an error that would replace the failed op's. There the compute stream joins each transfer
        instead (the join its ``_b`` would have made), so the capture ends and the caller sees the op's error.
        """
        pending = list(self._in_flight.values())
        for t in pending:
            if t.done is not None and not isinstance(t.done, float):
                if devices.capturing(t.device):
                    self._join(t)
                else:
                    t.done.synchronize()
            t.held, t.received = (), ()
        self._in_flight.clear()
        return len(pending) + self.inner.drain()

    def reset_stats(self) -> None:
        self.transfers = []

    def stats(self) -> dict[str, float]:
        """Totals over `transfers` (set ``record_transfers``): bytes, copy seconds, exposed seconds. Waits for the
        recorded events."""
        durations = [t.duration_s() or 0.0 for t in self.transfers]
        exposed = [t.exposed_s() or 0.0 for t in self.transfers]
        return {"transfers": len(self.transfers), "bytes": sum(t.nbytes for t in self.transfers),
                "comm_s": sum(durations), "exposed_s": sum(exposed)}

    @property
    def accepts_rows_per_rank(self) -> bool:
        """False: this link moves the step's tensors itself, with no count exchange to replace."""
        return False

    # ---- dispatch / combine -------------------------------------------------------------------------------------
    def dispatch_a(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> _Sent:
        t = hidden.shape[0]
        k = topk_idx.shape[1] if topk_idx.dim() == 2 else 1
        per_token = self.dispatch_bytes_per_token
        if per_token is None:
            per_token = k * hidden.shape[-1] * hidden.element_size() if hidden.dim() == 2 else 0
        transfer = self._send("dispatch", (hidden, topk_idx, topk_weights), t * per_token, t)
        return _Sent(transfer, (t, k))

    def dispatch_b(self, state: _Sent) -> DispatchOutput:
        hidden, topk_idx, topk_weights = self._receive(state)
        t, k = state.args
        out = self.inner.dispatch_b(self.inner.dispatch_a(hidden, topk_idx, topk_weights))
        return replace(out, handle=_LinkHandle(out.handle, t, k))

    def combine_a(self, expert_out: torch.Tensor, handle: Any) -> _Sent:
        if not isinstance(handle, _LinkHandle):
            raise TypeError(f"combine_a: the handle must come from this CopyEngineLink's dispatch_b, got "
                            f"{type(handle).__name__}")
        per_token = self.combine_bytes_per_token
        if per_token is None:
            per_token = handle.top_k * expert_out.shape[-1] * expert_out.element_size()
        transfer = self._send("combine", (expert_out,), handle.num_tokens * per_token, handle.num_tokens)
        return _Sent(transfer, (handle,))

    def combine_b(self, state: _Sent) -> torch.Tensor:
        (expert_out,) = self._receive(state)
        (handle,) = state.args
        return self.inner.combine_b(self.inner.combine_a(expert_out, handle.inner))

    # ---- the transfer -------------------------------------------------------------------------------------------
    def _send(self, kind: str, payload: Sequence[torch.Tensor], nbytes: int, num_tokens: int) -> CopyTransfer:
        payload = tuple(p.contiguous() for p in payload)  # on the compute stream, before the fork
        size = sum(p.nbytes for p in payload)
        nbytes = max(int(nbytes), size)
        transfer = CopyTransfer(kind, nbytes, num_tokens)
        device = payload[0].device
        if device.type == "cuda":
            self._send_cuda(transfer, payload, size, device)
        else:
            self._send_sync(transfer, payload, size)
        self._in_flight[id(transfer)] = transfer
        if self.record_transfers:
            self.transfers.append(transfer)
        return transfer

    def _receive(self, state: _Sent) -> tuple[torch.Tensor, ...]:
        transfer = state.transfer
        if transfer.waited:
            raise RuntimeError(f"{transfer} was already received: each _a state is waited once")
        if isinstance(transfer.done, float) or transfer.done is None:  # off CUDA: it completed inside _a
            transfer.wait_start = transfer.wait_end = time.perf_counter()
        else:
            compute = _compute_stream(transfer.device)
            timed = self.timing and not devices.capturing(transfer.device)
            if timed:
                transfer.wait_start = _record(compute, True)
            self._join(transfer)
            if timed:
                transfer.wait_end = _record(compute, True)
        received = transfer.received
        transfer.waited, transfer.held, transfer.received = True, (), ()
        self._in_flight.pop(id(transfer), None)
        return received

    def _before_copies(self, transfer: CopyTransfer) -> None:
        """Runs on the copy stream after the fork, before the copies (inside the transfer's timing): nothing here.
        A subclass can model a slower link with device work here (``torch.cuda._sleep``), captured with the rest."""

    def _join(self, transfer: CopyTransfer) -> None:
        """The join: the compute stream waits for the transfer's copies (no host wait; captured as a graph edge)."""
        _compute_stream(transfer.device).wait_event(transfer.done)

    def _send_cuda(self, transfer: CopyTransfer, payload: tuple[torch.Tensor, ...], size: int, device: Any) -> None:
        transfer.device = device
        compute = _compute_stream(device)
        side = self._stream(device)
        timed = self.timing and not devices.capturing(device)
        received = tuple(torch.empty_like(p) for p in payload)  # allocated on the compute stream, which reads them
        host = self._host(device, transfer.nbytes)
        extra = transfer.nbytes - size
        filler_src, filler_dst = self._filler(device, extra)
        side.wait_stream(compute)  # fork: the payload is ready
        with torch.cuda.stream(side):
            if timed:
                transfer.start = _record(side, True)
            self._before_copies(transfer)
            offset = 0
            for p in payload:  # device -> pinned host: the "send"
                host[offset : offset + p.nbytes].copy_(_bytes(p), non_blocking=True)
                offset += p.nbytes
            if extra:
                host[offset : offset + extra].copy_(filler_src[:extra], non_blocking=True)
            offset = 0
            for r in received:  # pinned host -> device: the "receive"
                _bytes(r).copy_(host[offset : offset + r.nbytes], non_blocking=True)
                offset += r.nbytes
            if extra:
                filler_dst[:extra].copy_(host[offset : offset + extra], non_blocking=True)
            transfer.done = _record(side, timed)
            if timed:
                transfer.end = transfer.done
        transfer.received = received
        transfer.held = (*payload, *received, host, filler_src, filler_dst)

    def _send_sync(self, transfer: CopyTransfer, payload: tuple[torch.Tensor, ...], size: int) -> None:
        """Off CUDA: the same copies, done now through a host buffer (meta tensors carry no bytes to copy)."""
        transfer.start = time.perf_counter()
        transfer.device = payload[0].device
        if payload[0].device.type == "meta":
            received = tuple(torch.empty_like(p) for p in payload)
        else:
            host = torch.empty(transfer.nbytes, dtype=torch.uint8)
            offset, received = 0, []
            for p in payload:
                host[offset : offset + p.nbytes].copy_(_bytes(p.cpu()))
                offset += p.nbytes
            offset = 0
            for p in payload:
                r = torch.empty_like(p)
                _bytes(r).copy_(host[offset : offset + p.nbytes].to(p.device))
                received.append(r)
                offset += p.nbytes
            received = tuple(received)
        transfer.received = received
        transfer.end = transfer.done = time.perf_counter()

    # ---- streams and buffers ------------------------------------------------------------------------------------
    def _stream(self, device: Any) -> Any:
        key = device_key(device)
        if key not in self._streams:
            self._streams[key] = _new_stream(key)
        return self._streams[key]

    def reserve(self, device: Any, nbytes: int) -> None:
        """Make the copy stream and staging for transfers of up to ``nbytes`` now (before capturing graphs, say:
        a transfer then allocates nothing). ``"cuda"`` means the current CUDA device, as for tensors."""
        device = device_key(device)
        if device.type == "cuda":
            self._stream(device)
            self._host(device, nbytes)
            self._filler(device, nbytes)

    def _host(self, device: Any, nbytes: int) -> torch.Tensor:
        bufs = self._buffers.setdefault(device_key(device), _Buffers())
        if not bufs.host or bufs.host[-1].numel() < nbytes:
            size = max(nbytes, 2 * bufs.host[-1].numel() if bufs.host else 1 << 20)
            bufs.host.append(_pinned(size))
        return bufs.host[-1]

    def _filler(self, device: Any, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = device_key(device)
        bufs = self._buffers.setdefault(key, _Buffers())
        if not bufs.filler_src or bufs.filler_src[-1].numel() < nbytes:
            size = max(nbytes, 2 * bufs.filler_src[-1].numel() if bufs.filler_src else 1 << 20)
            bufs.filler_src.append(_device_bytes(size, key))
            bufs.filler_dst.append(_device_bytes(size, key))
        return bufs.filler_src[-1], bufs.filler_dst[-1]


# ---- what the link asks of CUDA (one place each, so a CPU test can stand in for them) -------------------------------
def _compute_stream(device: Any) -> Any:
    return torch.cuda.current_stream(device)


def _new_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device=device)


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _device_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view (bool and float8 included)."""
    return t.reshape(-1).view(torch.uint8)


def _record(stream: Any, timing: bool) -> Any:
    event = torch.cuda.Event(enable_timing=timing)
    event.record(stream)
    return event
