"""tbo's figures in SGLang's own ``/metrics`` (served with ``--enable-metrics``), from the process that serves it.

SGLang builds its ``/metrics`` route in its HTTP server's process (``add_prometheus_middleware``, called when the
server's app starts): a fresh prometheus_client registry holding one ``MultiProcessCollector``, which merges what
SGLang's own collectors (the scheduler's, the tokenizer manager's) wrote in multiprocess mode. tbo's figures take
the engine-neutral slots instead (`tbo.integrations.engine.metrics`, written by `tbo.integrations.sglang.runner.
metrics` in each scheduler), so tbo must join that registry: the plugin hooks ``add_prometheus_middleware``
(AROUND, `around_prometheus`) and, while SGLang's own function runs and only then, SGLang's ``MultiProcessCollector``
is one that also registers tbo's `SlotCollector` in the registry it is given (a scoped patch: the module attribute is
restored before the hook returns). Every scrape then reads the slots: nothing per step, nothing per SGLang stats
tick. A server whose ``TBO_SGLANG_CONFIG`` is unset, or says ``"metrics": false``, gets nothing.

The samples are labelled as SGLang's scheduler labels its own: ``model_name`` (SGLang's served model name), then
what each scheduler published (``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``, and ``dp_rank`` under DP);
names and meanings are vLLM's (``tbo:*``, docs/metrics.md), so one dashboard reads both.
"""

from __future__ import annotations

import logging
from typing import Any

from tbo.integrations.engine.metrics import SlotCollector, metrics_dir
from tbo.integrations.sglang.config import read
from tbo.integrations.sglang.runner.metrics import RUN_ID, metrics_key

__all__ = ["TARGET", "around_prometheus", "collector_for"]

logger = logging.getLogger("sglang.tbo")

#: SGLang's function that mounts ``/metrics`` on its app (looked up by the server's lifespan when it runs)
TARGET = "sglang.srt.entrypoints.http_server.add_prometheus_middleware"


def collector_for(model_name: str) -> SlotCollector | None:
    """The collector of this server's slots, where tbo is on for it with metrics (None otherwise)."""
    config = read()  # the server's process: the variable its schedulers read, inherited from it
    if config is None or not config.metrics:
        return None
    key = metrics_key()
    if key is None:
        logger.warning("tbo: %s is unset in SGLang's server process: tbo's figures are not in /metrics", RUN_ID)
        return None
    return SlotCollector(metrics_dir(key), model_name)


def _served_model_name(app: Any) -> str:
    try:
        from sglang.srt.runtime_context import get_serving

        return str(get_serving().served_model_name)
    except Exception:  # noqa: BLE001 - a release without the runtime context: the app's server args
        return str(getattr(getattr(app, "server_args", None), "served_model_name", ""))


def around_prometheus(original: Any, app: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's ``add_prometheus_middleware(app)``, with tbo's collector in the registry it builds (where tbo is on
    with metrics); then tbo's trace route, where allow-listed (`tbo.integrations.sglang.trace_route`)."""
    collector = collector_for(_served_model_name(app))
    if collector is None:
        return original(app, *args, **kwargs)
    from prometheus_client import multiprocess  # SGLang's /metrics is on: it set PROMETHEUS_MULTIPROC_DIR already

    from tbo.integrations.sglang.trace_route import mount_trace_route

    sglang_collector = multiprocess.MultiProcessCollector
    joined: list[Any] = []

    class WithTbo(sglang_collector):  # type: ignore[misc, valid-type]
        """SGLang's multiprocess collector; the registry it joins gets tbo's collector too."""

        def __init__(self, registry: Any, *a: Any, **kw: Any) -> None:
            super().__init__(registry, *a, **kw)
            if registry is not None and not joined:
                registry.register(collector)
                joined.append(registry)

    multiprocess.MultiProcessCollector = WithTbo
    try:
        result = original(app, *args, **kwargs)
    finally:
        multiprocess.MultiProcessCollector = sglang_collector
    if joined:
        logger.info("tbo: its metrics join /metrics from %s", collector.directory)
    else:
        logger.warning("tbo: SGLang's /metrics built no multiprocess registry; tbo's figures are not in it")
    mount_trace_route(app, collector.directory, read())
    return result
