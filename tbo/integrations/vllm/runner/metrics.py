"""A vLLM worker's side of tbo's ``/metrics``: its engine's stats published to a shared-memory slot that the API
server's stat logger (`tbo.integrations.vllm.metrics`) reads when ``/metrics`` is scraped.

Why here: the counters live in the worker (the process that runs the model), ``/metrics`` in the API server; the
path between them, and why it costs a step nothing, is `tbo.integrations.engine.metrics`. The slots' folder is named
by the engine's ``instance_id``, which vLLM's config carries to every process it starts, so the API server finds the
slots of its own engines and of no other server's.
"""

from __future__ import annotations

from typing import Any

from tbo.integrations.engine.live_trace import LiveTrace
from tbo.integrations.engine.metrics import MetricsPublisher, metrics_dir, tbo_version

__all__ = ["engine_info", "publish_metrics", "stats_document"]


def stats_document(engine: Any) -> dict[str, Any]:
    """What ``stats_file`` holds for ``engine`` (a `TboEngine`): its stats, and its `TboEngine.stats_extra`."""
    doc = engine.stats.as_dict()
    doc.update(engine.stats_extra())
    return doc


def engine_info(engine: Any) -> dict[str, str]:
    """``tbo:info``'s labels: tbo's version, the strategies, the split policy and the backend."""
    config = engine.config
    return {"version": tbo_version(), "decode_strategy": engine.names.decode,
            "prefill_strategy": engine.names.prefill, "split": config.split,
            "num_microbatches": str(config.num_microbatches), "backend": "afd" if engine.afd else config.backend}


def publish_metrics(engine: Any, rank: int) -> MetricsPublisher | None:
    """Start ``engine``'s publisher (None where the config's ``metrics`` is off); its `close` is the undo. Its
    thread also polls for a live trace request (docs/metrics.md, "A live trace"): the engine's layer loop gets the
    `LiveTrace` it arms (``loop.live_trace``)."""
    config, vllm_config = engine.config, engine.runner.vllm_config
    if not config.metrics:
        return None
    labels = {"engine": vllm_config.parallel_config.data_parallel_rank, "rank": rank}
    directory = metrics_dir(str(vllm_config.instance_id))
    live = LiveTrace(directory, labels)
    engine.loop.live_trace = live
    return MetricsPublisher(directory, labels, engine_info(engine), lambda: stats_document(engine),
                            interval_s=config.metrics_interval_s, tick=live.poll).start()
