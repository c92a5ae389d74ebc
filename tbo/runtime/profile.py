"""`RecordFunctionObserver`: torch.profiler ranges per stage and per op, so overlapped runs read well in traces.

It is an ordinary `Observer`; it lives outside the core because it needs torch. Pass it as ``observer=`` to the
executor, or ``profile=True`` to `model_forward_maybe_tbo`.
"""

from __future__ import annotations

from typing import Any

from torch.profiler import record_function

from tbo.core.observer import Observer

__all__ = ["RecordFunctionObserver"]


class RecordFunctionObserver(Observer):
    """Adds a ``torch.profiler.record_function`` range per stage and per op, so overlapped runs read well in traces."""

    def __init__(self) -> None:
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
