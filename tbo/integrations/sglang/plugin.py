"""The SGLang plugin's entry point (group ``sglang.srt.plugins``): idle unless ``TBO_SGLANG_CONFIG`` is set.

SGLang calls `register` in every process it starts (the engine's, the scheduler's, the detokenizer's) and swallows
what a plugin raises there, so `register` does nothing that can fail and reads no config: it only hooks methods with
SGLang's own `HookRegistry`. When a runner has loaded its model (``ModelRunner.initialize``, AFTER), in the process
that runs it, the hook reads ``TBO_SGLANG_CONFIG``: unset or empty, it returns at once and SGLang runs as without
tbo; set, tbo is built on that runner (`SglangEngine`), and a bad key, a refused deployment or a model tbo cannot
serve fails the runner's start, naming the culprit: never a silent run without TBO. Two more of the runner's start
methods follow: when it has made its attention backend (``init_attention_backends``, AFTER) tbo makes each
microbatch's own (`tbo.integrations.sglang.runner.attention`), and before it captures graphs of the model
(``init_cuda_graphs``, BEFORE) tbo refuses them unless they are disabled (`check_graphs`).

Shutdown: ``Engine.shutdown`` SIGKILLs the scheduler processes, so nothing in them runs at exit. The engine's own
process therefore asks them first: where the engine started with ``TBO_SGLANG_CONFIG`` set (recorded when its
``TokenizerManager`` is made, in that process), ``Engine.shutdown`` (BEFORE) sends the schedulers SGLang's own RPC
request (`CLOSE_RPC`), answered by ``Scheduler.handle_rpc_request`` (AROUND: that method name only, every other RPC
is SGLang's): each closes its `SglangEngine` (tbo comes off the runner, the summary is logged and written to
``stats_file``) and replies with the summary lines, which the engine's process logs too. The wait is bounded
(`CLOSE_TIMEOUT_S`) and nothing there raises: a dead scheduler costs the summary, never the shutdown. A served
engine (``python -m sglang.launch_server``) shuts down another way: on SIGTERM its ``TokenizerManager`` drains the
requests and sends each scheduler SGLang's ``ShutdownReq``, whose handler (``Scheduler.handle_shutdown``, BEFORE)
closes tbo there first, so the server's log ends with tbo's summary and ``stats_file`` holds it.

Metrics: with ``--enable-metrics``, SGLang's ``add_prometheus_middleware`` (AROUND, hooked late, from the
``TokenizerManager`` hook, and only in a process that serves HTTP) gets tbo's collector into the registry its
``/metrics`` serves, and tbo's live trace route where ``SGLANG_PLUGINS`` names ``tbo_trace``
(`tbo.integrations.sglang.metrics`, `tbo.integrations.sglang.trace_route`); each scheduler publishes its figures
from `SglangEngine` (`tbo.integrations.sglang.runner.metrics`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["CLOSE_RPC", "CLOSE_TIMEOUT_S", "PROMETHEUS", "SERVED_SHUTDOWN", "TARGET", "engine_of", "register"]

logger = logging.getLogger("sglang.tbo")

#: the method whose end builds tbo on a runner
TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.initialize"
#: the method whose end gives tbo the runner's attention backend (made after ``initialize``): each microbatch's own
ATTENTION = "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends"
#: the method that captures SGLang's graphs of the model (after the attention backends): refused before it captures
GRAPHS = "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs"
#: where the engine's process records that tbo was asked for (the variable is set while the engine starts)
STARTED = "sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__"
#: before the schedulers are killed, each is asked to close tbo
SHUTDOWN = "sglang.srt.entrypoints.engine.Engine.shutdown"
#: a served engine's scheduler, told to stop (SIGTERM to the server: SGLang drains, then sends ``ShutdownReq``)
SERVED_SHUTDOWN = "sglang.srt.managers.scheduler.Scheduler.handle_shutdown"
#: the scheduler's RPC handler, which answers `CLOSE_RPC`
RPC = "sglang.srt.managers.scheduler.Scheduler.handle_rpc_request"
#: SGLang's function that mounts /metrics on the HTTP server's app: tbo's collector joins its registry there
PROMETHEUS = "sglang.srt.entrypoints.http_server.add_prometheus_middleware"
#: the RPC's method name (no method of SGLang's Scheduler has it)
CLOSE_RPC = "tbo_close"
#: how long the engine's process waits for the schedulers' reply at shutdown
CLOSE_TIMEOUT_S = 30.0
_ATTR = "_tbo_engine"
_ON = "_tbo_on"


def register() -> None:
    """Hook ``ModelRunner.initialize`` and the shutdown path; called by SGLang's plugin loader in every process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _after_initialize, HookType.AFTER)
    HookRegistry.register(ATTENTION, _after_attention_backends, HookType.AFTER)
    HookRegistry.register(GRAPHS, _before_graphs, HookType.BEFORE)
    HookRegistry.register(STARTED, _after_tokenizer_manager, HookType.AFTER)
    HookRegistry.register(SHUTDOWN, _before_shutdown, HookType.BEFORE)
    HookRegistry.register(RPC, _around_rpc, HookType.AROUND)
    HookRegistry.register(SERVED_SHUTDOWN, _before_served_shutdown, HookType.BEFORE)


def _around_prometheus(original: Any, app: Any, *args: Any, **kwargs: Any) -> Any:
    """The server's process, as SGLang mounts ``/metrics`` (``--enable-metrics``): tbo's figures join it, and the
    trace route is added where allow-listed (`tbo.integrations.sglang.metrics`)."""
    from tbo.integrations.sglang.metrics import around_prometheus

    return around_prometheus(original, app, *args, **kwargs)


def _after_initialize(result: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    from tbo.integrations.sglang.config import read

    config = read()  # at engine start, in the process that runs the model; never at import
    if config is None or getattr(runner, "is_draft_worker", False):
        return result
    from tbo.integrations.sglang.runner.engine import SglangEngine

    setattr(runner, _ATTR, SglangEngine(runner, config))
    return result


def _after_attention_backends(result: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    engine = engine_of(runner)
    if engine is not None:
        engine.bind_attention(runner)
    return result


def _before_graphs(runner: Any, *args: Any, **kwargs: Any) -> None:
    if engine_of(runner) is not None:
        from sglang.srt.model_executor.cuda_graph_config import cuda_graph_fully_disabled

        from tbo.integrations.sglang.runner.engine import check_graphs

        check_graphs(cuda_graph_fully_disabled())


def engine_of(runner: Any) -> Any:
    """The `SglangEngine` on ``runner`` (None: tbo is off there)."""
    return getattr(runner, _ATTR, None)


def _engine_of_scheduler(scheduler: Any) -> Any:
    """The `SglangEngine` on ``scheduler``'s model runner (None: tbo is off there)."""
    return engine_of(scheduler.tp_worker.model_runner)


def _after_tokenizer_manager(result: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """The engine's process: remember whether this engine started with tbo asked for (its schedulers read the same
    variable as they load the model), so that only such an engine's shutdown asks them to close tbo."""
    from tbo.integrations.sglang.errors import ENV

    on = bool(os.environ.get(ENV, "").strip())
    setattr(manager, _ON, on)
    if on:
        _hook_prometheus()
    return result


def _hook_prometheus() -> None:
    """Where this process serves HTTP (SGLang's server module is loaded: ``launch_server`` imports it before it
    starts the engine), hook its ``add_prometheus_middleware``, which the server's start calls by that module name.
    Registered here, late, and not in `register`: SGLang resolves every hook target in every process it starts, and
    resolving this one would import the HTTP server's module (its app, its event-loop policy) into the schedulers
    and into every ``sgl.Engine`` user's process."""
    import sys

    if PROMETHEUS.rsplit(".", 1)[0] not in sys.modules:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if PROMETHEUS not in HookRegistry._patched:
        HookRegistry.register(PROMETHEUS, _around_prometheus, HookType.AROUND)
        HookRegistry.apply_hooks()  # patches what is not patched yet: this target alone


def _before_shutdown(engine: Any, *args: Any, **kwargs: Any) -> None:
    """The engine's process, before SGLang kills its schedulers: each closes tbo and replies with its summary."""
    if getattr(engine, "_attached", False) or not getattr(getattr(engine, "tokenizer_manager", None), _ON, False):
        return None
    try:
        lines = close_schedulers(engine, CLOSE_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - a diagnostic: SGLang's shutdown goes on
        logger.exception("tbo: asking the schedulers to close tbo failed; no summary")
        return None
    for line in lines:
        logger.info(line)
    return None


def close_schedulers(engine: Any, timeout_s: float) -> list[str]:
    """Send `CLOSE_RPC` over the engine's RPC socket and wait up to ``timeout_s`` for the reply: the schedulers'
    summary lines (none: no reply in time, logged)."""
    from sglang.srt.managers.io_struct import RpcReqInput, sock_recv, sock_send

    socket = getattr(engine, "send_to_rpc", None)
    if socket is None:
        logger.warning("tbo: this SGLang engine has no RPC socket to its schedulers; tbo's summary is not shown")
        return []
    sock_send(socket, RpcReqInput(method=CLOSE_RPC))
    if not socket.poll(int(timeout_s * 1000)):
        logger.warning("tbo: the schedulers did not close tbo within %.0f s; tbo's summary is not shown", timeout_s)
        return []
    reply = sock_recv(socket)
    if not reply.success:
        logger.warning("tbo: closing tbo in a scheduler failed: %s", reply.message)
        return []
    return reply.message.splitlines()


def _before_served_shutdown(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """A scheduler told to stop (``ShutdownReq``): close tbo on its runner (the summary is logged and written to
    ``stats_file``) before SGLang's loop ends. Nothing raises: SGLang's shutdown goes on."""
    try:
        engine = _engine_of_scheduler(scheduler)
        if engine is not None:
            engine.close()
    except Exception:  # noqa: BLE001 - a diagnostic
        logger.exception("tbo: closing tbo at the server's shutdown failed")
    return None


def _around_rpc(original: Any, scheduler: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """The scheduler's process: `CLOSE_RPC` closes the `SglangEngine` on its runner (if any) and replies with the
    summary lines; every other RPC is SGLang's."""
    if getattr(request, "method", None) != CLOSE_RPC:
        return original(scheduler, request, *args, **kwargs)
    from sglang.srt.managers.io_struct import RpcReqOutput

    try:
        engine = _engine_of_scheduler(scheduler)
        lines = [] if engine is None else engine.close()
        return RpcReqOutput(success=True, message="\n".join(lines))
    except Exception as e:  # noqa: BLE001 - replied, so the engine's process does not wait out its timeout
        logger.exception("tbo: closing tbo at shutdown failed")
        return RpcReqOutput(success=False, message=f"{type(e).__name__}: {e}")
