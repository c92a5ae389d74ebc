"""`OpTimes`: wall time per op, summed over runs, so that a deployment can see where a step's time goes.

The question every overlap deployment asks first is whether TBO hid the traffic: a ``*_b`` op's time is the wait
its transfer left exposed, the other ops' time is compute. This observer answers it without a profiler, for the
unsplit and the split path alike (both run as ops), at the cost of two clock reads per op, and only when asked.
"""

from __future__ import annotations

import time
from typing import Callable

from tbo.core.observer import Observer
from tbo.core.operations import comm_role

__all__ = ["OpTimes", "ops_of_role"]


def ops_of_role(seconds: dict[str, float], role: str) -> dict[str, float]:
    """The entries of ``seconds`` (op name -> seconds, as `OpTimes` or ``stats()["op_seconds"]`` hold them) whose op
    has the communication role ``role``: ``"launch"`` (``*_a``, ``afd_send``) or ``"wait"`` (``*_b``, ``afd_recv``)."""
    return {name: s for name, s in seconds.items() if (comm_role(name) or ("",))[0] == role}


class OpTimes(Observer):
    """Adds each op's wall time to ``seconds[name]`` and counts it in ``calls[name]`` (microbatches and layers
    summed); ``clock`` is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._started: dict[int, float] = {}  # per microbatch: ops of one microbatch never nest

    def on_op_start(self, mb: int, stage: int, name: str) -> None:
        self._started[mb] = self.clock()

    def on_op_end(self, mb: int, stage: int, name: str) -> None:
        elapsed = self.clock() - self._started.pop(mb)
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
        self.calls[name] = self.calls.get(name, 0) + 1

    def close(self) -> None:
        self._started.clear()  # an op that raised never ended: drop its start

    def exposed_wait_s(self) -> float:
        """The summed time of the waits (``*_b``, ``afd_recv``): transfer time the overlap did not hide."""
        return sum(ops_of_role(self.seconds, "wait").values())
