"""`Observer`: the one hook through which anything watches a run (tracers, profilers, framework callbacks).

The executor calls an observer only when one is given; without one it takes a path with no per-op extra work.
Anything a framework needs per stage (SGLang's buffer-length hook, say) belongs here, not in the executor.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["Observer", "FanoutObserver", "as_observer"]


class Observer:
    """Base class with no-op callbacks; override the ones you need."""

    def on_stage_start(self, mb: int, stage: int) -> None:
        pass

    def on_stage_end(self, mb: int, stage: int) -> None:
        pass

    def on_op_start(self, mb: int, stage: int, name: str) -> None:
        pass

    def on_op_end(self, mb: int, stage: int, name: str) -> None:
        pass

    def close(self) -> None:
        """Called once when a run ends, also when an op raised; release anything left open."""


class FanoutObserver(Observer):
    """Forwards every callback to several observers, in order."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = tuple(observers)

    def on_stage_start(self, mb: int, stage: int) -> None:
        for o in self.observers:
            o.on_stage_start(mb, stage)

    def on_stage_end(self, mb: int, stage: int) -> None:
        for o in self.observers:
            o.on_stage_end(mb, stage)

    def on_op_start(self, mb: int, stage: int, name: str) -> None:
        for o in self.observers:
            o.on_op_start(mb, stage, name)

    def on_op_end(self, mb: int, stage: int, name: str) -> None:
        for o in self.observers:
            o.on_op_end(mb, stage, name)

    def close(self) -> None:
        for o in self.observers:
            o.close()


def as_observer(observer: Observer | Sequence[Observer] | None) -> Observer | None:
    """One observer from None, an observer, or a list of them (called in list order)."""
    if observer is None or isinstance(observer, Observer):
        return observer
    observers = [o for o in observer if o is not None]
    return None if not observers else observers[0] if len(observers) == 1 else FanoutObserver(observers)
