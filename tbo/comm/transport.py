"""Transports move rows between ranks for the all-to-all backends: locally (identity) or over torch.distributed.

A transport launches a transfer and returns a pending handle; finishing it waits, with a deadline. It keeps a
registry of transfers in flight, so that after a failed step they can be drained before their buffers are reused,
all within one deadline (at most ``0.2 x timeout_s`` more once a wait has timed out, ``timeout_s`` otherwise).

A distributed wait that timed out leaves its operation live inside the process group: a later step's operations
would pair with it (gloo then aborts on mismatched sizes, or silently moves the wrong rows). So after a
`CommTimeoutError` a `TorchDistributedTransport` is poisoned: it refuses every later transfer by name, and the
caller rebuilds the group (and the backend) on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tbo.comm.wait import DEFAULT_TIMEOUT_S, wait_work
from tbo.core.errors import CommTimeoutError

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

    def _drain_budget_s(self) -> float | None:
        return None

    def drain(self) -> int:
        """Wait out every transfer still in flight (e.g. after an op failed), all within one deadline; return how
        many there were."""
        pending = self.in_flight
        budget = self._drain_budget_s()
        deadline = None if budget is None else time.monotonic() + budget
        for p in pending:
            try:
                self.finish(p) if deadline is None else self._finish_by(p, deadline)
            except Exception:  # the step already failed; a second error would hide the first
                self._in_flight.pop(id(p), None)
        return len(pending)

    def _finish_by(self, pending: Pending, deadline: float) -> torch.Tensor:
        return self.finish(pending)


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
        self.poisoned: str | None = None  #: why this transport refuses every transfer (a wait that timed out)

    def _refuse_if_poisoned(self, what: str) -> None:
        if self.poisoned is not None:
            raise CommTimeoutError(f"rank {self.rank}: {what} refused: an earlier wait timed out ({self.poisoned}), "
                                   "and its operations are still live in the process group; rebuild the group and "
                                   "the backend on every rank before the next step")

    def _wait(self, work: Any, timeout_s: float, what: str) -> None:
        try:
            wait_work(work, timeout_s, what)
        except CommTimeoutError as e:
            self.poisoned = self.poisoned or str(e)
            raise

    def _drain_budget_s(self) -> float | None:
        return 0.2 * self.timeout_s if self.poisoned is not None else self.timeout_s

    def _finish_by(self, pending: Pending, deadline: float | None) -> torch.Tensor:
        if not pending.done:
            try:
                self._wait(pending.work, self.timeout_s if deadline is None else max(deadline - time.monotonic(),
                                                                                        1e-3), pending.what)
            finally:
                self._in_flight.pop(id(pending), None)
            pending.done = True
        return pending.out

    def exchange(self, send: torch.Tensor, what: str) -> torch.Tensor:
        import torch.distributed as dist

        self._refuse_if_poisoned(what)
        out = torch.empty_like(send)
        work = dist.all_to_all_single(out, send.contiguous(), group=self.group, async_op=True)
        self._wait(work, self.timeout_s, what)
        return out

    def start(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], what: str) -> Pending:
        import torch.distributed as dist

        self._refuse_if_poisoned(what)
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
        return self._finish_by(pending, None)
