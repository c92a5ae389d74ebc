"""`interval_union`: the time covered by possibly overlapping intervals.

Both the trace summary (how long the link was busy, how much compute ran) and the emulated link's own statistics
need it; it lives here so that neither a library module nor a tool imports the other for one function.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["interval_union"]


def interval_union(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals, overlaps counted once."""
    total, covered_to = 0.0, float("-inf")
    for start, end in sorted(intervals):
        start = max(start, covered_to)
        if end > start:
            total += end - start
        covered_to = max(covered_to, end)
    return total
