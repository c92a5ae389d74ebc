"""Timeout-bounded waits on torch.distributed work: a distributed wait in `tbo` raises, it never hangs.

A peer that died or skipped a collective would otherwise block a rank forever; here the wait gives up after its
deadline and raises `CommTimeoutError` naming the rank and the op, so the failure is local and readable. A blocking
collective that is not tbo's own (an engine's, issued inside its code) gets the same deadline from `group_deadline`
on a gloo group, and its error the same name from `named_comm_error`.
"""

from __future__ import annotations

import datetime
from contextlib import contextmanager
from typing import Any, Iterator

from tbo.core.errors import CommTimeoutError

__all__ = ["wait_work", "group_deadline", "named_comm_error", "DEFAULT_TIMEOUT_S"]

#: Default deadline for one distributed wait, in seconds.
DEFAULT_TIMEOUT_S = 60.0

#: How transports report a peer that went away (gloo, NCCL): such a wait can never complete.
_PEER_LOST = ("connection closed", "connection reset", "broken pipe", "connection refused", "remote process exited")


def _rank_label() -> str:
    import torch.distributed as dist

    return f"rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else "rank ?"


def named_comm_error(exc: BaseException, what: str, timeout_s: float, label: str | None = None) -> BaseException:
    """``exc`` (raised by a distributed wait) as a `CommTimeoutError` naming ``label`` (default: this rank) and the
    op ``what`` when it says the deadline passed or the peer went away; else ``exc`` itself."""
    text = str(exc).strip()
    low = text.lower()
    label = label or _rank_label()
    if "timed out" in low or "timeout" in low:
        return CommTimeoutError(f"{label}: {what} timed out after {timeout_s:g}s")
    if any(marker in low for marker in _PEER_LOST):  # the peer process died: the wait can never finish
        return CommTimeoutError(f"{label}: {what} could not complete, the peer is gone: {text.splitlines()[0]}")
    return exc


@contextmanager
def group_deadline(group: Any, timeout_s: float) -> Iterator[None]:
    """While it lasts, a collective issued on ``group``'s gloo backend (by any code: an engine's own blocking
    collectives included) fails after ``timeout_s`` instead of the group's default (gloo: 30 minutes); the default
    comes back after. A group without a gloo backend is left as it is."""
    import torch
    import torch.distributed as dist

    backend = None
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError, ValueError):
        pass
    options = getattr(backend, "options", None)
    if not isinstance(backend, dist.ProcessGroupGloo) or not hasattr(options, "_timeout"):
        yield
        return
    previous = options._timeout
    backend._set_default_timeout(datetime.timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        backend._set_default_timeout(previous)


def wait_work(work: Any, timeout_s: float, what: str, label: str | None = None) -> None:
    """Wait for an async ``torch.distributed`` work handle, or raise `CommTimeoutError` after ``timeout_s``, naming
    ``label`` (default: this rank in the default group; a group of its own, such as an AFD pair's, names its own)."""
    try:
        completed = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        named = named_comm_error(exc, what, timeout_s, label)
        if named is exc:
            raise
        raise named from exc
    if completed is False:  # some backends report a missed deadline by returning False
        raise CommTimeoutError(f"{label or _rank_label()}: {what} timed out after {timeout_s:g}s")
