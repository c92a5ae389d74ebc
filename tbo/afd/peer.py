"""What both ends of an AFD pair share below the group: the peer error, the secret's variable, the bounded JSON parser.

Why a module of its own: the transport (`tbo.afd.channel`), the handshake (`tbo.afd.handshake`) and the group that
uses both (`tbo.afd.group`) each need these few pieces, and while they lived in the group, the channel and the
handshake imported the group that imports them (an import circle). Here they sit below all three; the group
re-exports them where they were. No torch, no sockets.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["AFDPeerError", "TOKEN_ENV", "parse_json"]

#: the environment variable both sides read the shared secret from when it is not given explicitly
TOKEN_ENV = "TBO_AFD_TOKEN"
_MAX_JSON_BYTES = 1 << 16
_MAX_JSON_DEPTH = 32


class AFDPeerError(RuntimeError):
    """The other side of an AFD pair is missing, wrong, or gone; the message names it."""


def _depth(text: str) -> int:
    """The deepest nesting of ``[`` / ``{`` outside strings (json.loads recurses once per level)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_json(text: str | bytes, what: str, *, max_bytes: int = _MAX_JSON_BYTES,
               max_depth: int = _MAX_JSON_DEPTH) -> Any:
    """JSON text -> a Python value, or a ValueError naming ``what``: over ``max_bytes``, nested deeper than
    ``max_depth`` (checked before parsing: json.loads recurses once per level), not UTF-8 or not JSON."""
    if len(text) > max_bytes:
        raise ValueError(f"{what} is {len(text)} bytes, more than the {max_bytes} accepted")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{what} is not UTF-8 text: {e}") from None
    if _depth(text) > max_depth:
        raise ValueError(f"{what} is nested more than {max_depth} levels deep")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None
