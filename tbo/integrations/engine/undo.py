"""`UndoStack`: an engine integration built in steps, each of which registers how to take itself off again.

An integration changes things it does not own: methods of the engine's objects, process-wide registries, shared
modules (vLLM's rotary modules). Built step by step, a refusal at any step must leave all of them exactly as found,
and a shutdown must take every step off even when one of them fails. So each step records its undo here as it
changes something (`set_attr` records what it replaces), and `close` runs them all, last first.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

__all__ = ["UndoStack"]

logger = logging.getLogger("tbo.integrations")

_ABSENT = object()


class UndoStack:
    """The undos of an engine's build steps, run last first by `close` (see the module docstring)."""

    def __init__(self) -> None:
        self._undos: list[tuple[str, Callable[[], Any]]] = []

    def push(self, what: str, undo: Callable[[], Any]) -> None:
        """Run ``undo`` at `close` (``what`` names it in a failure's log)."""
        self._undos.append((what, undo))

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """``obj.name = value`` on the instance, undone by putting back what the instance held (an attribute of its
        own, or none: its class's shows again)."""
        before = vars(obj).get(name, _ABSENT)
        setattr(obj, name, value)

        def restore() -> None:
            if before is _ABSENT:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, before)

        self.push(f"{type(obj).__name__}.{name}", restore)

    def close(self) -> None:
        """Run every undo, last first, each whatever an earlier one raised; the first failure is raised at the end
        (every failure is logged). Undos run once: a second `close` does nothing."""
        first: BaseException | None = None
        while self._undos:
            what, undo = self._undos.pop()
            try:
                undo()
            except Exception as e:  # noqa: BLE001 - every undo runs; the first failure is raised below
                logger.exception("tbo: undoing %s failed", what)
                first = first or e
        if first is not None:
            raise first

    def __len__(self) -> int:
        return len(self._undos)
