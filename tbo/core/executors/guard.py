"""What the executor does when a step goes wrong: drain transfers after a failure, and time out a hung step.

* **Failure.** When an op raises, no further op runs; every transfer the backends still have in flight is waited
  out (``drain()``), so no buffer is freed or reused while a transfer writes into it; then the `OperationError` is
  raised. The same process group and backend can run the next step.
* **Hang.** With a watchdog, a step that runs past its deadline raises `HangError` naming each microbatch's
  position (stage and op), the transfers still pending, and who we are (``label``, e.g. the rank); optionally with
  every thread's stack. In the main thread the deadline is a SIGALRM, which also interrupts blocking sleeps and lock
  waits; elsewhere an asynchronous exception, delivered when the thread next runs Python code.

The executor sees only objects with ``in_flight`` (descriptions) and ``drain()``: no tensors, no distributed.
"""

from __future__ import annotations

import ctypes
import faulthandler
import signal
import tempfile
import threading
from typing import Any, Protocol, Sequence

from tbo.core.errors import HangError
from tbo.core.observer import Observer

__all__ = ["Drainable", "PositionObserver", "watchdog", "drain_all"]


class Drainable(Protocol):
    """A backend (or transport) that knows its transfers in flight."""

    @property
    def in_flight(self) -> list[Any]: ...

    def drain(self) -> int: ...


def drain_all(drainables: Sequence[Drainable]) -> list[str]:
    """Drain each; return the problems met (a failed step must not hide its first error behind a second)."""
    problems = []
    for d in drainables:
        try:
            d.drain()
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            problems.append(f"{type(d).__name__}.drain(): {type(exc).__name__}: {exc}")
    return problems


class PositionObserver(Observer):
    """Remembers where each microbatch is: the watchdog's report."""

    def __init__(self, num_microbatches: int, inner: Observer | None = None) -> None:
        self.inner = inner
        self.position: list[str] = ["not started"] * num_microbatches

    def on_stage_start(self, mb: int, stage: int) -> None:
        self.position[mb] = f"stage {stage}, between ops"
        if self.inner:
            self.inner.on_stage_start(mb, stage)

    def on_op_start(self, mb: int, stage: int, name: str) -> None:
        self.position[mb] = f"stage {stage}, in op {name!r}"
        if self.inner:
            self.inner.on_op_start(mb, stage, name)

    def on_op_end(self, mb: int, stage: int, name: str) -> None:
        self.position[mb] = f"stage {stage}, after op {name!r}"
        if self.inner:
            self.inner.on_op_end(mb, stage, name)

    def on_stage_end(self, mb: int, stage: int) -> None:
        self.position[mb] = f"stage {stage} done"
        if self.inner:
            self.inner.on_stage_end(mb, stage)

    def close(self) -> None:
        if self.inner:
            self.inner.close()


def _report(seconds: float, label: str, positions: PositionObserver, drainables: Sequence[Drainable],
            dump_stacks: bool) -> str:
    lines = [f"{label + ': ' if label else ''}the step ran past its {seconds:g}s watchdog"]
    lines += [f"  microbatch {mb}: {where}" for mb, where in enumerate(positions.position)]
    pending = [str(t) for d in drainables for t in d.in_flight]
    lines.append(f"  transfers pending: {', '.join(pending) if pending else 'none known'}")
    if dump_stacks:
        with tempfile.TemporaryFile("w+") as f:  # faulthandler writes to a real file descriptor
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            lines.append("  thread stacks:\n" + f.read())
    return "\n".join(lines)


class _Watchdog:
    def __init__(self, seconds: float, label: str, positions: PositionObserver, drainables: Sequence[Drainable],
                 dump_stacks: bool) -> None:
        self.seconds, self.label, self.positions = seconds, label, positions
        self.drainables, self.dump_stacks = drainables, dump_stacks

    def fire(self) -> str:
        return _report(self.seconds, self.label, self.positions, self.drainables, self.dump_stacks)

    def __enter__(self) -> "_Watchdog":
        if threading.current_thread() is threading.main_thread():
            def on_alarm(signum: int, frame: Any) -> None:
                raise HangError(self.fire())

            self._previous = signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
            self._timer = None
        else:
            target = threading.get_ident()

            def expire() -> None:
                message = self.fire()
                error = type("HangError", (HangError,), {"__init__": lambda s: HangError.__init__(s, message)})
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), ctypes.py_object(error))

            self._timer = threading.Timer(self.seconds, expire)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._timer is None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)
        else:
            self._timer.cancel()


def watchdog(seconds: float, label: str, positions: PositionObserver, drainables: Sequence[Drainable],
             dump_stacks: bool = False) -> _Watchdog:
    if seconds <= 0:
        raise ValueError(f"watchdog_s must be positive, got {seconds}")
    return _Watchdog(seconds, label, positions, drainables, dump_stacks)


