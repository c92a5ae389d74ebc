"""Timeout-bounded waits on torch.distributed work: a distributed wait in `tbo` raises, it never hangs.

A peer that died or skipped a collective would otherwise block a rank forever; here the wait gives up after its
deadline and raises `CommTimeoutError` naming the rank and the op, so the failure is local and readable.
"""

from __future__ import annotations

import datetime
from typing import Any

from tbo.core.errors import CommTimeoutError

__all__ = ["wait_work", "DEFAULT_TIMEOUT_S"]

#: Default deadline for one distributed wait, in seconds.
DEFAULT_TIMEOUT_S = 60.0

#: How transports report a peer that went away (gloo, NCCL): such a wait can never complete.
_PEER_LOST = ("connection closed", "connection reset", "broken pipe", "connection refused", "remote process exited")


def _rank_label() -> str:
    import torch.distributed as dist

    return f"rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else "rank ?"


def wait_work(work: Any, timeout_s: float, what: str) -> None:
    """Wait for an async ``torch.distributed`` work handle, or raise `CommTimeoutError` after ``timeout_s``."""
    try:
        completed = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise CommTimeoutError(f"{_rank_label()}: {what} timed out after {timeout_s:g}s") from exc
        if any(marker in text.lower() for marker in _PEER_LOST):  # the peer process died: the wait can never finish
            first_line = text.strip().splitlines()[0]
            raise CommTimeoutError(f"{_rank_label()}: {what} could not complete, the peer is gone: {first_line}") from exc
        raise
    if completed is False:  # some backends report a missed deadline by returning False
        raise CommTimeoutError(f"{_rank_label()}: {what} timed out after {timeout_s:g}s")
