"""`Observer`: the one hook through which anything watches a run (tracers, profilers, framework callbacks).

The executor calls an observer only when one is given; without one it takes a path with no per-op extra work.
Anything a framework needs per stage (SGLang's buffer-length hook, say) belongs here, not in the executor.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["Observer", "RecordFunctionObserver", "FanoutObserver"]


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


class RecordFunctionObserver(Observer):
    """Adds a ``torch.profiler.record_function`` range per stage and per op, so overlapped runs read well in traces."""

    def __init__(self) -> None:
        from torch.profiler import record_function  # lazy: the executor itself never imports torch

        self._record_function = record_function
        self._open: list[Any] = []

    def _enter(self, label: str) -> None:
        ctx = self._record_function(label)
        ctx.__enter__()
        self._open.append(ctx)

    def _exit(self) -> None:
        self._open.pop().__exit__(None, None, None)

    def on_stage_start(self, mb: int, stage: int) -> None:
        self._enter(f"tbo/mb{mb}/stage{stage}")

    def on_stage_end(self, mb: int, stage: int) -> None:
        self._exit()

    def on_op_start(self, mb: int, stage: int, name: str) -> None:
        self._enter(f"tbo/mb{mb}/{name}")

    def on_op_end(self, mb: int, stage: int, name: str) -> None:
        self._exit()

    def close(self) -> None:
        """Close ranges left open by an op that raised."""
        while self._open:
            self._exit()


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
