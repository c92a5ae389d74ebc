"""The vLLM endpoint plugin (entry point ``vllm.endpoint_plugins``: ``tbo_trace =
tbo.integrations.vllm.trace_route:TboTraceEndpoint``): ``GET /tbo/trace?steps=N`` records the next N steps' overlap
timeline on every worker of the served engine and answers one Perfetto trace in ``tbo trace``'s format.

Why a plugin of its own: vLLM loads an endpoint plugin only when ``VLLM_PLUGINS`` names it (unset, vLLM warns and
loads none), so the route exists only where an operator allow-listed ``tbo_trace`` beside ``tbo``; allow-listing
``tbo`` alone serves tbo without it. The route reaches the workers by no engine RPC: it writes a request file into
the engine's metrics folder, which each worker's metrics publisher thread polls, and reads back the JSON trace file
each worker writes (`tbo.integrations.engine.live_trace`: the path, its bounds, why). Nothing is unpickled; every
query parameter is checked and a bad one is a 400 that names it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tbo.integrations.engine.live_trace import (DEFAULT_STEPS, DEFAULT_TIMEOUT_S, MAX_BYTES, MAX_STEPS,
                                                MAX_TIMEOUT_S, TraceRequest, chrome_trace, read_trace_files,
                                                remove_request, trace_file_name, write_request)
from tbo.integrations.engine.metrics import metrics_dir, read_slots
from tbo.integrations.vllm.config import parse_config

__all__ = ["ROUTE", "TboTraceEndpoint", "TraceParams", "parse_params"]

logger = logging.getLogger("vllm.tbo")

ROUTE = "/tbo/trace"
_INT = re.compile(r"^[0-9]{1,9}$")
_NUMBER = re.compile(r"^[0-9]{1,6}(\.[0-9]{1,6})?$")


class TraceParams:
    """The route's checked query: ``steps`` (1..`MAX_STEPS`), ``timeout_s`` (0 < t <= `MAX_TIMEOUT_S`),
    ``max_bytes`` per worker (1024..`MAX_BYTES`)."""

    def __init__(self, steps: int = DEFAULT_STEPS, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_bytes: int = MAX_BYTES) -> None:
        self.steps, self.timeout_s, self.max_bytes = steps, timeout_s, max_bytes


def parse_params(query: Any) -> TraceParams:
    """``query`` (a mapping of query parameters to their values) checked; a ValueError names the culprit."""
    known = {"steps", "timeout_s", "max_bytes"}
    unknown = sorted(set(query) - known)
    if unknown:
        raise ValueError(f"unknown query parameter(s) {unknown}: the route takes {sorted(known)}")
    params = TraceParams()
    if "steps" in query:
        raw = query["steps"]
        if not _INT.match(raw) or not 1 <= int(raw) <= MAX_STEPS:
            raise ValueError(f"steps={raw!r}: an integer from 1 to {MAX_STEPS}")
        params.steps = int(raw)
    if "timeout_s" in query:
        raw = query["timeout_s"]
        if not _NUMBER.match(raw) or not 0 < float(raw) <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s={raw!r}: seconds, more than 0 and at most {MAX_TIMEOUT_S:g}")
        params.timeout_s = float(raw)
    if "max_bytes" in query:
        raw = query["max_bytes"]
        if not _INT.match(raw) or not 1024 <= int(raw) <= MAX_BYTES:
            raise ValueError(f"max_bytes={raw!r}: an integer from 1024 to {MAX_BYTES}")
        params.max_bytes = int(raw)
    return params


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
            workers = [d["labels"] for d in read_slots(engine.directory)]
            if not workers:
                return _error(503, f"no tbo worker publishes to {engine.directory} (has the engine started?)")
            request_id = secrets.token_hex(8)
            deadline = time.time() + params.timeout_s
            names = {trace_file_name(request_id, w): w for w in workers}
            write_request(engine.directory, TraceRequest(request_id, params.steps, deadline, params.max_bytes))
            # each worker notices within one publisher tick and answers within one tick of its deadline
            grace = 2 * engine.config.metrics_interval_s + 1.0
            try:
                while time.time() < deadline + grace:
                    if all((engine.directory / name).exists() for name in names):
                        break
                    await asyncio.sleep(0.05)
                docs = await asyncio.to_thread(read_trace_files, engine.directory, request_id, params.max_bytes)
            finally:
                remove_request(engine.directory, request_id)
        answered = {trace_file_name(request_id, d["labels"]) for d in docs}
        missing = [f"engine {w.get('engine', '0')} rank {w.get('rank', '0')}" for n, w in names.items()
                   if n not in answered]
        if not docs:
            return _error(504, f"timeout: no tbo worker answered within timeout_s={params.timeout_s:g} s (and "
                               f"{grace:g} s of grace); missing: {', '.join(missing)}")
        logger.info("tbo: a live trace of %d step(s) from %d worker(s)", params.steps, len(docs))
        return JSONResponse(chrome_trace(docs, missing))
