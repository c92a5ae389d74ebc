"""What tbo did in this process's SGLang engines: `stats` sums every engine's own counters over `ENGINES`.

Without them nobody, a test included, could tell a run that overlapped from one that silently never split. The
counters live in the process that runs the model: SGLang's scheduler process (one per tensor-parallel rank), not the
process that made ``sgl.Engine``; from there ``stats_file`` reports them. The counters themselves are the
engine-neutral `tbo.integrations.engine.stats`.
"""

from __future__ import annotations

from typing import Any

from tbo.integrations.engine.stats import StatsRegistry

__all__ = ["ENGINES", "reset_stats", "stats"]

#: this process's SGLang engines' stats: each engine registers its own when it starts
ENGINES = StatsRegistry()


def stats() -> dict[str, Any]:
    """What TBO did in this process since it started (or since `reset_stats`): ``steps``, ``split_steps``,
    ``microbatches``, ``tokens``, ``split_tokens``, per-mode counts (``decode``, ``prefill``, ``mixed``),
    ``cut_requests`` (split steps that cut a prompt across microbatches), ``local_ffn_calls``; with ``op_times``,
    ``op_seconds``, ``op_calls`` and ``layers_seconds``. A copy: later steps do not change it."""
    return ENGINES.snapshot()


def reset_stats() -> None:
    """Zero this process's counters."""
    ENGINES.reset()
