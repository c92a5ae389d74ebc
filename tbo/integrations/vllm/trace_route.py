"""The vLLM endpoint plugin (entry point ``vllm.endpoint_plugins``: ``tbo_trace =
tbo.integrations.vllm.trace_route:TboTraceEndpoint``): ``GET /tbo/trace?steps=N`` records the next N steps' overlap
timeline on every worker of the served engine and answers one Perfetto trace in ``tbo trace``'s format.

Why a plugin of its own: vLLM loads an endpoint plugin only when ``VLLM_PLUGINS`` names it (unset, vLLM warns and
loads none), so the route exists only where an operator allow-listed ``tbo_trace`` beside ``tbo``; allow-listing
``tbo`` alone serves tbo without it. The route reaches the workers by no engine RPC: it writes a request file into
the engine's metrics folder, which each worker's metrics publisher thread polls, and reads back the JSON trace file
each worker writes (`tbo.integrations.engine.live_trace`: the path, its bounds, why, and the route's work,
which SGLang's route shares). Nothing is unpickled; every
query parameter is checked and a bad one is a 400 that names it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tbo.integrations.engine.live_trace import ROUTE, TraceParams, parse_params, run_trace
from tbo.integrations.engine.metrics import metrics_dir
from tbo.integrations.vllm.config import parse_config

__all__ = ["ROUTE", "TboTraceEndpoint", "TraceParams", "parse_params"]


class _Engine:
    """What the route knows of the served engine: its metrics folder, its tbo config, one trace at a time."""

    def __init__(self, vllm_config: Any) -> None:
        self.config = parse_config(vllm_config.additional_config)
        self.directory = metrics_dir(str(vllm_config.instance_id))
        self.lock = asyncio.Lock()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class TboTraceEndpoint:
    """What vLLM builds from the entry point: attaches ``GET /tbo/trace`` and keeps the engine's folder."""

    name = "tbo_trace"
    required_tasks = ("generate",)  # an engine that generates; the render-only server has none to trace

    def attach_router(self, app: Any) -> None:
        app.add_api_route(ROUTE, self.trace, methods=["GET"], summary="tbo: a live overlap trace of the next steps")

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        state.tbo_trace = None if engine_client is None else _Engine(engine_client.vllm_config)

    async def trace(self, request: Request) -> JSONResponse:
        """Record the next ``steps`` steps on every worker; the merged Perfetto trace (200), or an error that says
        why: 400 a bad parameter, 404 tbo off for this engine, 409 a trace under way or metrics off, 503 no worker
        publishing, 504 no worker answered by the deadline."""
        try:
            params = parse_params(dict(request.query_params))
        except ValueError as e:
            return _error(400, str(e))
        engine: _Engine | None = getattr(request.app.state, "tbo_trace", None)
        if engine is None or engine.config is None:
            return _error(404, "tbo is not on for this engine (its additional_config has no 'tbo' key)")
        if not engine.config.metrics:
            return _error(409, "the live trace travels through tbo's metrics folder, and this engine's tbo config "
                               "says 'metrics': false")
        if engine.lock.locked():
            return _error(409, "a trace is under way for this engine: ask again when it has answered")
        async with engine.lock:
            status, body = await run_trace(engine.directory, params, engine.config.metrics_interval_s)
        return JSONResponse(body, status_code=status)
