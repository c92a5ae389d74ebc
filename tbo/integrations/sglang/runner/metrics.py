"""An SGLang scheduler's side of tbo's ``/metrics``: its engine's stats published to a shared-memory slot that the
server's ``/metrics`` (`tbo.integrations.sglang.metrics`) reads when it is scraped.

Why here: tbo counts in the scheduler process (the one that runs the model), while SGLang serves ``/metrics`` from
its HTTP server's process, merging what its processes wrote in prometheus_client's multiprocess mode. tbo's figures
take the engine-neutral path instead (`tbo.integrations.engine.metrics`: a fixed slot per worker, rewritten in place
by a thread, nothing per step). The slots' folder is named by ``SGLANG_RUN_ID``, which SGLang's launcher sets once
per server before it starts its processes, so every process of one server knows it and no other server's does.
Each slot carries the labels SGLang's scheduler puts on its own metrics: ``engine_type``, ``tp_rank``, ``pp_rank``,
``moe_ep_rank`` and, under DP, ``dp_rank`` (``model_name`` is added where ``/metrics`` is served).
"""

from __future__ import annotations

import os
from typing import Any

from tbo.integrations.engine.live_trace import LiveTrace
from tbo.integrations.engine.metrics import MetricsPublisher, metrics_dir, tbo_version
from tbo.integrations.sglang.errors import refuse

__all__ = ["RUN_ID", "engine_info", "metrics_key", "publish_metrics", "scheduler_labels", "stats_document"]

#: the variable SGLang's launcher sets once per server, inherited by every process it starts
RUN_ID = "SGLANG_RUN_ID"


def metrics_key(environ: Any = None) -> str | None:
    """This server's metrics key (``sglang-<SGLANG_RUN_ID>``); None where SGLang set no run id."""
    run_id = (os.environ if environ is None else environ).get(RUN_ID, "").strip()
    return f"sglang-{run_id}" if run_id else None


def scheduler_labels() -> dict[str, str]:
    """The labels SGLang's scheduler puts on its own metrics, for this process (model_name aside)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_disagg, get_parallel

    parallel = get_parallel()
    labels = {"engine_type": DisaggregationMode.to_engine_type(get_disagg().disaggregation_mode),
              "tp_rank": parallel.tp_rank, "pp_rank": parallel.pp_rank, "moe_ep_rank": parallel.moe_ep_rank}
    if getattr(parallel, "dp_rank", None) is not None:
        labels["dp_rank"] = parallel.dp_rank
    return {k: str(v) for k, v in labels.items()}


def stats_document(engine: Any) -> dict[str, Any]:
    """What ``stats_file`` holds for ``engine`` (an `SglangEngine`): its stats and its extra report (the link's
    figures, the adaptive buckets), less the summary lines and the attention report (the per-microbatch backends'
    class and count, and child batches planned: every split step's microbatches, which ``tbo:microbatches`` counts
    already)."""
    extra = engine.extra()
    return {**engine.stats.as_dict(), **{k: v for k, v in extra.items() if k not in ("summary", "attention")}}


def engine_info(engine: Any) -> dict[str, str]:
    """``tbo:info``'s labels: tbo's version, the strategies, the split policy and the backend."""
    config = engine.config
    names = config.strategy_names(shared_experts=False)
    return {"version": tbo_version(), "decode_strategy": names.decode, "prefill_strategy": names.prefill,
            "split": config.split, "num_microbatches": str(config.num_microbatches),
            "backend": "link" if config.link is not None else config.backend}


def publish_metrics(engine: Any) -> MetricsPublisher | None:
    """Start ``engine``'s publisher where SGLang serves ``/metrics`` (``--enable-metrics``) and the config keeps
    ``metrics`` on; None otherwise. A config that asks for ``"metrics": true`` by name on a server without
    ``--enable-metrics`` is refused (its figures would go nowhere). Its `close` is the undo; its thread also polls
    for a live trace request (docs/metrics.md, "A live trace"), armed on the engine's layer loop."""
    from sglang.srt.runtime_context import get_observability

    config = engine.config
    if not config.metrics:
        return None
    if not getattr(get_observability(), "enable_metrics", False):
        if "metrics" in config.model_fields_set:
            refuse({"metrics": True}, "SGLang's --enable-metrics, or no 'metrics' key",
                   "tbo's figures join SGLang's own /metrics, which this server does not serve")
        return None
    key = metrics_key()
    if key is None:
        refuse({"metrics": True}, f"a server started by SGLang's launcher (it sets {RUN_ID})",
               f"{RUN_ID} is unset in the scheduler: the server's /metrics could not find tbo's slots")
    directory = metrics_dir(key)
    labels = scheduler_labels()
    live = LiveTrace(directory, labels)
    engine.loop.live_trace = live
    return MetricsPublisher(directory, labels, engine_info(engine), lambda: stats_document(engine),
                            interval_s=config.metrics_interval_s, tick=live.poll).start()
