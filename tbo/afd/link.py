"""`DelayedSends`: an AFD connector's messages leave when an emulated link says they arrive.

Between attention and FFN ranks on one machine, a message arrives at once: a round trip then never shows, and what a
third microbatch is for cannot be seen. With ``link="LATENCY_US,GBPS"`` each side's connector books every message
(header and payload together) on a `tbo.comm.emulated.LinkTimeline` (the expert traffic's link timing, FIFO
bandwidth, overlapping latencies) and hands it to the transport only when the booked transfer completes: a thread
of this sender sleeps until then, so the receiver really sees it ``latency + bytes / bandwidth`` late, while the
sender's compute goes on. Each direction is its own link (a full-duplex wire): the attention side delays requests,
the FFN side answers. The messages keep their order; every check of the wire stays the receiver's.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from typing import Any, Callable

import torch

from tbo.comm.emulated import LinkClock, LinkTimeline, parse_link_spec

__all__ = ["DelayedSends", "link_timeline"]


def link_timeline(link: str | LinkTimeline | None, clock: LinkClock | None = None) -> LinkTimeline | None:
    """``"LATENCY_US,GBPS"`` (a ValueError naming it when malformed), a timeline as it is, or None."""
    if link is None or isinstance(link, LinkTimeline):
        return link
    return LinkTimeline(*parse_link_spec(link), clock)


class _DelayedWork:
    """A send handed to the transport later: ``wait(timeout)`` waits for the hand-over, then for the send."""

    def __init__(self) -> None:
        self.handed = threading.Event()
        self.inner: Any = None
        self.error: BaseException | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        if not self.handed.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0)):
            return False
        if self.error is not None:
            raise self.error
        left = None if deadline is None else datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
        return self.inner.wait(timeout=left) if left is not None else self.inner.wait()

    def is_completed(self) -> bool:
        return self.handed.is_set() and (self.error is not None or self.inner.is_completed())


class DelayedSends:
    """Messages (tensors to one peer) booked on ``timeline`` and sent by ``isend`` when each transfer completes."""

    def __init__(self, timeline: LinkTimeline, isend: Callable[[torch.Tensor, int], Any], name: str) -> None:
        self.timeline, self._isend = timeline, isend
        self._queue: deque[tuple[float, list[tuple[torch.Tensor, int, _DelayedWork]]]] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"tbo-afd-link-{name}")
        self._thread.start()

    def send(self, tensors: list[torch.Tensor], dst: int, kind: str) -> list[_DelayedWork]:
        """Book ``tensors`` as one message to ``dst`` and queue them; the works complete once they were sent."""
        transfer = self.timeline.book(kind, sum(t.numel() * t.element_size() for t in tensors))
        works = [_DelayedWork() for _ in tensors]
        with self._ready:
            if self._closed:
                raise RuntimeError("the AFD link was closed")
            self._queue.append((transfer.complete, [(t, dst, w) for t, w in zip(tensors, works)]))
            self._ready.notify()
        return works

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:
                    return
                due, message = self._queue[0]
            self.timeline.clock.sleep_until(due)
            with self._ready:
                self._queue.popleft()
            for tensor, dst, work in message:
                try:
                    work.inner = self._isend(tensor, dst)
                except BaseException as e:  # noqa: BLE001 - the waiter raises it, named by the connector
                    work.error = e
                work.handed.set()

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout=60)
