"""The vLLM stat-logger plugin (entry point ``vllm.stat_logger_plugins``: ``tbo =
tbo.integrations.vllm.metrics:TboStatLogger``): tbo's figures in the API server's own ``/metrics``.

vLLM loads the group's classes in the API server process (AsyncLLM) and builds each with the engine's config and
its engine indexes. `TboStatLogger` registers one collector in prometheus_client's default registry, the one vLLM's
``/metrics`` serves; at each scrape it reads the workers' shared-memory slots (`tbo.integrations.engine.metrics`,
written by `tbo.integrations.vllm.runner.metrics`) and yields ``tbo:*`` families labelled like vLLM's own
(``model_name``, ``engine``) and by the worker's ``rank``. vLLM's per-iteration ``record`` calls cost nothing here:
the figures are read when someone asks for them. An engine without the ``"tbo"`` key, or with ``metrics: false``,
gets no collector. The names start with ``tbo:``, not ``vllm:``, which vLLM's Prometheus logger unregisters.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from tbo.integrations.engine.metrics import SlotCollector, metrics_dir
from tbo.integrations.vllm.config import parse_config

__all__ = ["TboCollector", "TboStatLogger"]

logger = logging.getLogger("vllm.tbo")

#: the collector of one engine's slots (engine-neutral: `tbo.integrations.engine.metrics.SlotCollector`)
TboCollector = SlotCollector


class TboStatLogger(AggregateStatLoggerBase):
    """What vLLM builds from the entry point; registers a `TboCollector` for this engine's slots."""

    #: the collector this process registered last (a new logger, say a restarted AsyncLLM, replaces it)
    registered: TboCollector | None = None

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        from prometheus_client import REGISTRY

        self.collector = None
        config = parse_config(vllm_config.additional_config)
        if config is None or not config.metrics:
            return
        model_name = vllm_config.model_config.served_model_name
        self.collector = TboCollector(metrics_dir(str(vllm_config.instance_id)), str(model_name))
        previous, TboStatLogger.registered = TboStatLogger.registered, self.collector
        if previous is not None:
            try:
                REGISTRY.unregister(previous)
            except KeyError:
                pass
        REGISTRY.register(self.collector)
        logger.info("tbo: its metrics join /metrics from %s", self.collector.directory)

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        pass  # read at scrape time, not per iteration

    def log_engine_initialized(self) -> None:
        pass
