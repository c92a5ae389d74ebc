"""tbo's figures in vLLM's own ``/metrics``: the stat-logger plugin (entry point ``vllm.stat_logger_plugins``) in a
real OpenAI server started with tbo, scraped while clients run, parsed by prometheus_client's parser, and equal to
the ``stats_file`` of the same run. One server for the module (start-up dominates its time).

The editable install of the suite's venvs carries the entry points of the checkout it was made from; this module
puts its own distribution metadata, naming `tbo.integrations.vllm.metrics.TboStatLogger` under the group, on the
server's path, so the test runs whatever that install says (``make test-vllm`` reinstalls when pyproject.toml
changes, and pyproject.toml names the same class: a test below checks it).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ..served import assert_stats_equal, dashboard_metrics, get_json, scrape, settled, stats_file, value
from .helpers import MAX_TOKENS, SCENARIOS, TBO, _openai_server, _post, needs_vllm

ROOT = Path(__file__).resolve().parents[2]
ENTRY = "tbo.integrations.vllm.metrics:TboStatLogger"
ROUTE_ENTRY = "tbo.integrations.vllm.trace_route:TboTraceEndpoint"
#: the families every tbo engine shows (adaptive ones only under split "adaptive": `test_adaptive_families`)
FAMILIES = ("tbo:info", "tbo:steps", "tbo:split_steps", "tbo:microbatches", "tbo:tokens", "tbo:split_tokens",
            "tbo:steps_by_mode", "tbo:split_steps_by_mode", "tbo:cut_requests", "tbo:split_ratio",
            "tbo:microbatches_per_split_step", "tbo:op_seconds", "tbo:op_calls", "tbo:layers_seconds",
            "tbo:exposed_wait_seconds", "tbo:fallback_steps", "tbo:ep_size")


def test_pyproject_registers_the_stat_logger():
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r'\[project\.entry-points\."vllm\.stat_logger_plugins"\]\n([^\[]*)', text)
    assert section and f'tbo = "{ENTRY}"' in section.group(1)


def test_pyproject_registers_the_trace_route():
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r'\[project\.entry-points\."vllm\.endpoint_plugins"\]\n([^\[]*)', text)
    assert section and f'tbo_trace = "{ROUTE_ENTRY}"' in section.group(1)


def _entry_point_dist(root: Path) -> Path:
    """A folder holding a distribution whose only content is the stat-logger and endpoint entry points (tbo itself
    comes from the worktree on PYTHONPATH)."""
    info = root / "tbo_stat_logger-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tbo-stat-logger\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.stat_logger_plugins]\ntbo = {ENTRY}\n\n"
                                           f"[vllm.endpoint_plugins]\ntbo_trace = {ROUTE_ENTRY}\n")
    return root


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    """One OpenAI server with tbo, the stat logger and the trace route (``VLLM_PLUGINS`` names ``tbo_trace``),
    publishing every 0.2 s: (base URL, stats file, model, log)."""
    root = tmp_path_factory.mktemp("metrics")
    plugins = _entry_point_dist(root / "plugins")
    stats_path = root / "stats-{rank}.json"
    tbo = {**TBO, "stats_file": str(stats_path), "metrics_interval_s": 0.2}
    env = {"PYTHONPATH": f"{ROOT}:{plugins}", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_PLUGINS": "tbo,tbo_trace"}
    with _openai_server(models["qwen3_moe"], tbo, root / "server.log", env=env) as base:
        yield base, root / "stats-0.json", models["qwen3_moe"], root / "server.log"


@needs_vllm
def test_the_served_engine_s_metrics_carry_tbo_s_figures_that_move_with_the_work(served):
    """Before any request every family is there at 0; a request too small to split (5-token prefill, 1-token decodes:
    under both thresholds) counts steps and no split step; 16 concurrent clients split steps while the metrics are
    scraped; once they are done every figure of the scrape equals the worker's ``stats_file``."""
    base, stats_path, model, log = served
    scraped = scrape(base)
    assert set(FAMILIES) <= set(scraped), (sorted(set(FAMILIES) - set(scraped)), log.read_text()[-3000:])
    assert value(scraped, "tbo:steps") == 0
    vllm_labels = {(s[1]["model_name"], s[1]["engine"]) for s in scraped["vllm:num_requests_running"]}
    tbo_labels = {(s[1]["model_name"], s[1]["engine"]) for f in FAMILIES for s in scraped[f]}
    assert tbo_labels == vllm_labels == {(str(model), "0")}, (tbo_labels, vllm_labels)
    info = scraped["tbo:info"][0][1]
    assert info["split"] == "static" and info["decode_strategy"] == "qwen3_moe_decode" and info["version"]

    def complete(p: list[int]) -> None:
        _post(base + "/v1/completions", {"model": str(model), "prompt": p, "max_tokens": MAX_TOKENS,
                                         "temperature": 0, "ignore_eos": True})

    complete(SCENARIOS["small"][0])
    small = stats_file(stats_path)
    scraped = settled(base, small["steps"])
    assert value(scraped, "tbo:steps") == small["steps"] >= MAX_TOKENS
    assert value(scraped, "tbo:split_steps") == 0 == value(scraped, "tbo:split_ratio")
    # why: every one of those steps was below its kind's threshold, and the metric says so
    assert value(scraped, "tbo:unsplit_steps_by_reason", reason="below_threshold") == small["steps"]

    seen, frames, stop = [], [], threading.Event()

    def watch() -> None:  # a scraper beside the clients
        while not stop.is_set():
            scraped = scrape(base)
            seen.append(value(scraped, "tbo:split_steps"))
            frames.append((time.time(), {k: v for k, v in scraped.items() if k.startswith("tbo:")}))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(SCENARIOS["served"])) as pool:
            list(pool.map(complete, SCENARIOS["served"]))
    finally:
        stop.set()
        watcher.join()
    final = stats_file(stats_path)
    assert final["split_steps"] > 0 and final["op_seconds"], final
    scraped = settled(base, final["steps"])
    assert seen and seen == sorted(seen), seen  # counters never went back while the clients ran
    assert_stats_equal(scraped, final)
    record = os.environ.get("TBO_METRICS_RECORD")  # the scrapes, for scripts/render_metrics_panels.py
    if record:
        Path(record).write_text(json.dumps([*frames, (time.time(), scraped)]))
    samples = {name for family in scraped.values() for name, _, _ in family}
    named = dashboard_metrics()
    assert named and named <= samples, sorted(named - samples)  # the dashboard shows only what a server shows


# ---- the live trace: GET /tbo/trace (vLLM's endpoint plugin) ---------------------------------------------------------


def _assert_perfetto(trace: dict) -> list[dict]:
    """A Chrome / Perfetto JSON trace (the Trace Event Format's object form): ``traceEvents`` of metadata (``M``) and
    complete (``X``) events, each with its phase, name, pid and tid, the complete ones a ``ts`` and a ``dur`` in
    microseconds; returns the ``X`` events."""
    assert isinstance(trace["traceEvents"], list) and trace["displayTimeUnit"] == "ms"
    for e in trace["traceEvents"]:
        assert e["ph"] in ("M", "X") and isinstance(e["name"], str), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], float) and e["ts"] >= 0 and isinstance(e["dur"], float) and e["dur"] >= 0, e
        else:
            assert e["name"] in ("process_name", "thread_name") and isinstance(e["args"]["name"], str), e
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


@needs_vllm
def test_the_trace_route_refuses_bad_parameters_by_name(served):
    base = served[0]
    for query, culprit in (("steps=0", "steps='0'"), ("steps=65", "steps='65'"), ("steps=two", "steps='two'"),
                           ("steps=2.5", "steps='2.5'"), ("steps=-1", "steps='-1'"), ("timeout_s=0", "timeout_s='0'"),
                           ("timeout_s=1e9", "timeout_s='1e9'"), ("max_bytes=12", "max_bytes='12'"),
                           ("steps=2&n=3", "unknown query parameter(s) ['n']")):
        status, body = get_json(f"{base}/tbo/trace?{query}")
        assert status == 400 and culprit in body["error"], (query, status, body)


@needs_vllm
def test_a_step_less_engine_answers_at_the_deadline_with_what_it_has(served):
    """No request runs: the worker answers at the deadline, its reason named, no step on the trace."""
    base = served[0]
    status, trace = get_json(f"{base}/tbo/trace?steps=2&timeout_s=0.5")
    assert status == 200, trace
    assert not [e for e in _assert_perfetto(trace) if e["cat"] != "step"]
    (worker,) = trace["otherData"]["workers"]
    assert worker["steps"] == 0 and not worker["complete"] and worker["reason"].startswith("deadline: 0 of 2 steps")


@needs_vllm
def test_the_trace_route_records_the_next_steps_with_both_microbatches(served):
    """Clients run in rounds while ``GET /tbo/trace?steps=4`` waits: the answer is a Perfetto trace of 4 steps of
    the worker, both microbatches' compute and comm tracks on it (the split steps' ops, each transfer from its
    launch to its wait), every op inside its step; the request and trace files are gone afterwards."""
    base, _, model, log = served
    answer: dict = {}

    def trace() -> None:
        answer["got"] = get_json(f"{base}/tbo/trace?steps=4&timeout_s=60")

    def complete(p: list[int]) -> None:
        _post(base + "/v1/completions", {"model": str(model), "prompt": p, "max_tokens": MAX_TOKENS,
                                         "temperature": 0, "ignore_eos": True})

    asking = threading.Thread(target=trace)
    asking.start()
    with ThreadPoolExecutor(len(SCENARIOS["served"])) as pool:
        while asking.is_alive():  # rounds of clients until the trace answered (the worker arms within a tick)
            list(pool.map(complete, SCENARIOS["served"]))
    asking.join()
    status, trace = answer["got"]
    assert status == 200, (trace, log.read_text()[-3000:])
    (worker,) = trace["otherData"]["workers"]
    assert worker == {"worker": "engine 0 rank 0", "steps": 4, "asked": 4, "complete": True, "reason": "steps",
                      "truncated": False}
    spans = _assert_perfetto(trace)
    steps = [e for e in spans if e["cat"] == "step"]
    assert len(steps) == 4 and "split" in {e["name"].rsplit(" ", 1)[-1] for e in steps}
    ops = [e for e in spans if e["cat"] == "compute"]
    assert {e["args"]["microbatch"] for e in ops} == {0, 1}
    assert {(e["cat"], e["tid"]) for e in spans if e["cat"] != "step"} >= {("compute", 0), ("compute", 2),
                                                                           ("comm", 1), ("comm", 3)}
    assert {e["name"] for e in spans if e["cat"] == "comm"} == {"dispatch", "combine"}
    names = {e["name"] for e in ops}
    assert {"dispatch_a", "dispatch_b", "combine_a", "combine_b"} <= names and any("attn" in n for n in names), names
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"microbatch A compute", "microbatch B compute", "microbatch A comm", "microbatch B comm"} <= threads
    for e in ops:
        step = steps[e["args"]["step"]]
        assert step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1e-3, (e, step)
    folder = re.search(r"its metrics join /metrics from (\S+)", log.read_text())  # TboStatLogger's line
    assert folder and any(Path(folder.group(1)).glob("*.slot")), folder
    assert not [f.name for f in Path(folder.group(1)).iterdir() if f.name.startswith(("trace", ".trace"))]


def test_the_trace_route_is_loaded_only_where_vllm_plugins_names_it(tmp_path, monkeypatch):
    """vLLM's own loader and app wiring (`attach_endpoint_plugins`) with the entry point installed: VLLM_PLUGINS unset,
    or naming ``tbo`` alone, leaves no ``/tbo/trace`` route; naming ``tbo_trace`` attaches it (GET only)."""
    pytest.importorskip("vllm")
    from fastapi import FastAPI
    from vllm.plugins.endpoint_plugins.interface import attach_endpoint_plugins

    monkeypatch.syspath_prepend(str(_entry_point_dist(tmp_path / "plugins")))
    routes = {}
    for allow in (None, "tbo", "tbo,tbo_trace"):
        if allow is None:
            monkeypatch.delenv("VLLM_PLUGINS", raising=False)
        else:
            monkeypatch.setenv("VLLM_PLUGINS", allow)
        app = FastAPI()
        attach_endpoint_plugins(app, ("generate",))
        routes[allow] = {(r.path, tuple(sorted(r.methods))) for r in app.routes if r.path.startswith("/tbo")}
    assert routes == {None: set(), "tbo": set(), "tbo,tbo_trace": {("/tbo/trace", ("GET",))}}
    _refusals(app)


def _refusals(app) -> None:
    """The attached route, its state built by the plugin's ``init_state`` from a real VllmConfig (the engine client
    carries only its config here): each refusal names its cause."""
    import asyncio
    from types import SimpleNamespace

    from fastapi.testclient import TestClient
    from vllm.config import VllmConfig

    (plugin,) = app.state.endpoint_plugins
    client = TestClient(app)
    for additional, status, says in (({}, 404, "tbo is not on for this engine"),
                                     ({"tbo": {"metrics": False}}, 409, "'metrics': false"),
                                     ({"tbo": {}}, 503, "no tbo worker publishes to")):
        engine = SimpleNamespace(vllm_config=VllmConfig(additional_config=additional))
        asyncio.run(plugin.init_state(engine, app.state, None))
        got = client.get("/tbo/trace?steps=2&timeout_s=1")
        assert got.status_code == status and says in got.json()["error"], (additional, got.json())
        got = client.get("/tbo/trace?steps=100")  # parameters are checked first, whatever the engine
        assert got.status_code == 400 and "steps='100': an integer from 1 to 64" in got.json()["error"]
