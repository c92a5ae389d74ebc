"""vLLM's own blocking collectives under tbo's deadline: a stalled or lost data-parallel peer is a named
`CommTimeoutError` there too, as every wait of tbo's on a peer is (`tbo.comm.wait`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["call_bounded"]


def call_bounded(group: Any, timeout_s: float, what: str, call: Any, /, *args: Any, label: str | None = None,
                 **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, a blocking collective of vLLM's own on ``group`` inside it, waiting at most
    ``timeout_s`` (`tbo.comm.wait.group_deadline`); when it times out or loses its peer, a `CommTimeoutError` naming
    ``label`` (default: this rank) and ``what``."""
    from tbo.comm.wait import group_deadline, named_comm_error

    try:
        with group_deadline(group, timeout_s):
            return call(*args, **kwargs)
    except RuntimeError as e:
        named = named_comm_error(e, f"{what} (a data-parallel peer stalled or is gone)", timeout_s, label)
        if named is e:
            raise
        raise named from e
