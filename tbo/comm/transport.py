"""Transports move rows between ranks for the all-to-all backends: locally (identity) or over torch.distributed.

A transport launches a transfer and returns a pending handle; finishing it waits, with a deadline. It keeps a
registry of transfers in flight, so that after a failed step they can be drained before their buffers are reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tbo.comm.wait import DEFAULT_TIMEOUT_S, wait_work

__all__ = ["Transport", "LocalTransport", "TorchDistributedTransport", "Pending"]

_BYTE_ONLY = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
              if hasattr(torch, n)}


@dataclass(eq=False)
class Pending:
    """A transfer in flight: the work handle (None when already complete), its output buffer, and what it is."""

    work: Any
    out: torch.Tensor
    what: str
    done: bool = False

    def __str__(self) -> str:
        return self.what


class Transport:
    """Interface: ``exchange`` (small, blocking) and ``start``/``finish`` (payload, asynchronous)."""

    rank: int = 0
    num_ranks: int = 1

    def __init__(self) -> None:
        self._in_flight: dict[int, Pending] = {}

    def exchange(self, send: torch.Tensor, what: str) -> torch.Tensor:
        raise NotImplementedError

    def start(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], what: str) -> Pending:
        raise NotImplementedError

    def finish(self, pending: Pending) -> torch.Tensor:
        raise NotImplementedError

    @property
    def in_flight(self) -> list[Pending]:
        """Transfers started and not yet finished."""
        return list(self._in_flight.values())

    def drain(self) -> int:
        """Wait out every transfer still in flight (e.g. after an op failed); return how many there were."""
        pending = self.in_flight
        for p in pending:
            try:
                self.finish(p)
            except Exception:  # the step already failed; a second error would hide the first
                self._in_flight.pop(id(p), None)
        return len(pending)


class LocalTransport(Transport):
    """One rank: every row stays here. The reference all distributed transports must match."""

    def exchange(self, send: torch.Tensor, what: str) -> torch.Tensor:
        return send

    def start(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], what: str) -> Pending:
        return Pending(None, send, what, done=True)

    def finish(self, pending: Pending) -> torch.Tensor:
        return pending.out


class TorchDistributedTransport(Transport):
    """``all_to_all_single`` with uneven splits over any process group (gloo on CPU, NCCL on GPU)."""

    def __init__(self, group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        import torch.distributed as dist

        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("TorchDistributedTransport needs torch.distributed initialised (see tbo.harness.launch)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.timeout_s = timeout_s

    def exchange(self, send: torch.Tensor, what: str) -> torch.Tensor:
        import torch.distributed as dist

        out = torch.empty_like(send)
        work = dist.all_to_all_single(out, send.contiguous(), group=self.group, async_op=True)
        wait_work(work, self.timeout_s, what)
        return out

    def start(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], what: str) -> Pending:
        import torch.distributed as dist

        out = send.new_empty((int(sum(recv_splits)), *send.shape[1:]))
        wire_out, wire_send = out, send.contiguous()
        if send.dtype in _BYTE_ONLY:  # gloo has no float8 types: move the bytes
            wire_out, wire_send = out.view(torch.uint8), wire_send.view(torch.uint8)
        work = dist.all_to_all_single(wire_out, wire_send, output_split_sizes=list(recv_splits),
                                      input_split_sizes=list(send_splits), group=self.group, async_op=True)
        pending = Pending(work, out, what)
        self._in_flight[id(pending)] = pending
        return pending

    def finish(self, pending: Pending) -> torch.Tensor:
        if not pending.done:
            try:
                wait_work(pending.work, self.timeout_s, pending.what)
            finally:
                self._in_flight.pop(id(pending), None)
            pending.done = True
        return pending.out
