"""SGLang's live trace route: ``GET /tbo/trace?steps=N`` on SGLang's own HTTP server, the same route as vLLM's
(`tbo.integrations.vllm.trace_route`): the next N steps' overlap timeline of every scheduler, one Perfetto trace in
``tbo trace``'s format.

Why this seat: SGLang has no endpoint plugin group. Its general plugins (``sglang.srt.plugins``) hook SGLang's
functions without editing them, and the one that mounts ``/metrics`` on the app (``add_prometheus_middleware``,
hooked by `tbo.integrations.sglang.metrics`) hands tbo the app as it starts: the route is added there, beside
``/metrics``. So it exists only where SGLang serves ``/metrics`` (``--enable-metrics``), tbo is on with ``metrics``
(the route travels through the metrics folder), and, off unless allow-listed as vLLM's is, where ``SGLANG_PLUGINS``
names ``tbo_trace`` beside ``tbo`` (`ALLOW`). The work of the route (the request file, the wait, the merge, the
bounds) is engine-neutral: `tbo.integrations.engine.live_trace`. Every query parameter is checked; nothing is
unpickled.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from fastapi import Request  # SGLang's server is FastAPI's; the route's annotations resolve at module level
from fastapi.responses import JSONResponse

from tbo.integrations.engine.live_trace import ROUTE, parse_params, run_trace

__all__ = ["ALLOW", "allowed", "mount_trace_route"]

logger = logging.getLogger("sglang.tbo")

#: the name ``SGLANG_PLUGINS`` must list for the route (beside ``tbo``, which loads the plugin itself)
ALLOW = "tbo_trace"


def allowed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``SGLANG_PLUGINS`` (of ``environ``, default the process's) names `ALLOW`: unset, it does not."""
    names = (os.environ if environ is None else environ).get("SGLANG_PLUGINS", "")
    return ALLOW in {n.strip() for n in names.split(",")}


def mount_trace_route(app: Any, directory: Path, config: Any) -> bool:
    """Add ``GET /tbo/trace`` to ``app`` where allow-listed; whether it was added."""
    if not allowed():
        return False
    lock = asyncio.Lock()

    async def trace(request: Request) -> JSONResponse:
        """Record the next ``steps`` steps on every scheduler; the merged Perfetto trace (200), or an error that says
        why: 400 a bad parameter, 409 a trace under way, 503 no scheduler publishing, 504 none answered in time."""
        try:
            params = parse_params(dict(request.query_params))
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        if lock.locked():
            return JSONResponse({"error": "a trace is under way for this server: ask again when it has answered"},
                                status_code=409)
        async with lock:
            status, body = await run_trace(directory, params, config.metrics_interval_s)
        return JSONResponse(body, status_code=status)

    app.add_api_route(ROUTE, trace, methods=["GET"], summary="tbo: a live overlap trace of the next steps")
    logger.info("tbo: GET %s serves a live overlap trace (SGLANG_PLUGINS names %s)", ROUTE, ALLOW)
    return True
