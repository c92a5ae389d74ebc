"""What tbo did in this process's vLLM engines: `stats` sums every engine's own counters over `ENGINES`.

Without them nobody, a test included, could tell a run that overlapped from one that silently never split. The
counters live in the process that runs the model: the engine's own process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
and one worker, each worker process otherwise (there, ``stats_file`` or the shutdown line reports them). The counters
themselves, engine-independent, are `tbo.integrations.engine.stats`.
"""

from __future__ import annotations

from typing import Any

from tbo.integrations.engine.stats import StatsRegistry

__all__ = ["ENGINES", "reset_stats", "stats"]

#: this process's vLLM engines' stats: each engine registers its own when it starts, and retires them when it closes
ENGINES = StatsRegistry()


def stats() -> dict[str, Any]:
    """What TBO did in this process since it started (or since `reset_stats`): ``steps``, ``split_steps``,
    ``microbatches``, ``tokens``, ``split_tokens``, per-mode counts (``decode``, ``prefill``, ``mixed``; ``idle``: a
    data-parallel rank's dummy steps while its peers work), ``cut_requests``; with speculative decoding
    ``verify_steps``, ``split_verify_steps``, ``split_verify_steps_varying_k`` (split verify steps whose requests
    brought different draft counts), ``verified_draft_tokens``, and for a drafter that runs a model (MTP)
    ``draft_steps`` (its model's forwards, each draft token's) and ``split_draft_steps``; ``afd_stages_sent`` and
    ``local_ffn_calls`` (attention-FFN disaggregation), and with data parallel + expert parallel ``ep_size``,
    ``remote_rows`` (token rows sent to other ranks), ``count_exchanges`` (dispatches that waited on a row-count
    exchange: none once the step agreed every rank's rows), ``peer_strategy_steps``, ``idle_skipped`` (idle steps
    every rank ran at once, at a wave's end: their layer stacks skipped) and ``vllm_dp_all_reduces`` (forwards whose
    vLLM DP batch coordination all-reduced beside tbo's agreement: 0 without CUDA graphs); with a FULL
    ``cudagraph_mode``, ``graph_captures``, ``graph_replays`` and ``graph_eager_steps`` (CUDA graphs of split decode
    steps: `tbo.integrations.vllm.step.graphs`); with ``op_times``,
    ``op_seconds`` and ``op_calls`` per op name (a ``*_b`` op's time is a wait the overlap left exposed) and
    ``layers_seconds``; in a compiled engine ``op_compiles`` (graphs traced of tbo's compiled op functions),
    ``op_compile_bound`` (the most there can be), ``compiled_op_calls`` and ``guarded_op_calls`` (those through
    dynamo's guards); with ``split: "adaptive"``, ``adaptive``: per live engine, its buckets (estimates, samples,
    choice, steps, explored) and one summary line per bucket. A copy: later steps do not change it."""
    return ENGINES.snapshot()


def reset_stats() -> None:
    """Zero this process's counters (the engines' own, behind their shutdown lines, are kept)."""
    ENGINES.reset()
