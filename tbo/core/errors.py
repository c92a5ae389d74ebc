"""Every error `tbo` raises on purpose, in one place, so callers can catch them by kind.

Each names its culprit: a strategy error names the list index, an operation error names the microbatch, stage and op,
and a communication error names the rank and the op. Nothing is swallowed: run-time errors chain to the original.
"""

from __future__ import annotations

__all__ = ["StrategyError", "OperationError", "CommTimeoutError", "HangError"]


class StrategyError(ValueError):
    """A strategy (an operation list with Yield markers) is malformed, or cannot be bound or joined."""


class OperationError(RuntimeError):
    """An op raised while running overlapped; the original exception is chained as ``__cause__``.

    The attributes say where, because with two microbatches interleaved a bare traceback does not: the same op runs
    once per microbatch, and the stage index separates layers.
    """

    def __init__(self, microbatch: int, stage: int, op_name: str, cause: BaseException) -> None:
        self.microbatch = microbatch
        self.stage = stage
        self.op_name = op_name
        super().__init__(
            f"microbatch {microbatch}, stage {stage}, op {op_name!r} failed: {type(cause).__name__}: {cause}"
        )


class CommTimeoutError(TimeoutError):
    """A distributed wait did not complete: its deadline passed, or the peer went away. Raised instead of hanging;
    the message names the rank and the op."""


class HangError(TimeoutError):
    """A whole overlapped step ran past its watchdog deadline; the message gives every microbatch's position."""
