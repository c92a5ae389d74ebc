"""tbo's figures in SGLang's own ``/metrics``: a real ``python -m sglang.launch_server --enable-metrics`` started
with tbo (``TBO_SGLANG_CONFIG``), scraped while clients run, parsed by prometheus_client's parser, labelled as
SGLang's scheduler labels its own, and equal to the ``stats_file`` of the same run; and the live trace route on the
same server (``SGLANG_PLUGINS`` names ``tbo_trace``); then 16 concurrent clients get plain SGLang's offline tokens,
and the server, stopped as an operator stops it (SIGTERM), leaves tbo's summary. One server for the module (start-up
dominates its time); the last test stops it.

The server loads tbo through the venv's entry point (``tbo = tbo.integrations.sglang.plugin:register``, unchanged by
this feature) and imports tbo from this checkout (``PYTHONPATH``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from ..served import (assert_stats_equal, dashboard_metrics, free_port, get_json, scrape, server, settled, stats_file,
                      stop_server, value)
from .helpers import engine, greedy, save_qwen3_moe

ROOT = Path(__file__).resolve().parents[2]
#: the families every tbo engine shows in SGLang (the link's: this server runs an emulated link)
FAMILIES = ("tbo:info", "tbo:steps", "tbo:split_steps", "tbo:microbatches", "tbo:tokens", "tbo:split_tokens",
            "tbo:steps_by_mode", "tbo:split_steps_by_mode", "tbo:cut_requests", "tbo:split_ratio",
            "tbo:microbatches_per_split_step", "tbo:op_seconds", "tbo:op_calls", "tbo:layers_seconds",
            "tbo:exposed_wait_seconds", "tbo:fallback_steps", "tbo:ep_size", "tbo:link_transfers",
            "tbo:link_busy_seconds", "tbo:link_exposed_seconds", "tbo:link_hidden_seconds")
#: thresholds a lone 5-token request stays under (a 5-token prefill, 1-token decodes) and a batch of clients passes
TBO = {"num_microbatches": 2, "decode_token_threshold": 4, "prefill_token_threshold": 8, "op_times": True,
       "link": "5,50", "metrics_interval_s": 0.2}
NEW_TOKENS = 6
SMALL = [1, 2, 3, 4, 5]
CLIENTS = [[10 + i, 20 + i, 30 + i, 40 + i, 50 + i, 60 + i, 70 + i, 80 + i, 90 + i][: 3 + i] for i in range(8)]


@contextlib.contextmanager
def _sglang_server(model: Path, tbo: dict[str, Any], log_path: Path, env: dict[str, str]) -> Iterator[str]:
    """What a user runs: ``python -m sglang.launch_server --enable-metrics`` on loopback (SGLang's CPU engine, fp32,
    the torch_native attention tbo needs), ``TBO_SGLANG_CONFIG`` set; yields its base URL once ``/health`` answers.
    On leaving, the server's process group gets SIGTERM, then SIGKILL after 30 s, whatever happened."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
           "--attention-backend", "torch_native", "--disable-cuda-graph", "--skip-tokenizer-init", "--enable-metrics",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-total-tokens", "2048",
           "--mem-fraction-static", "0.05", "--log-level", "info"]
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "TBO_SGLANG_CONFIG": json.dumps(tbo),
           "PYTHONPATH": f"{ROOT}" + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
           **env}
    with server(cmd, env, log_path, stop_s=30) as base:
        yield base


def _generate(base: str, prompt: list[int]) -> dict:
    body = json.dumps({"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS,
                                                                "ignore_eos": True}}).encode()
    req = urllib.request.Request(base + "/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One SGLang server with tbo, ``--enable-metrics`` and the trace route, publishing every 0.2 s: (base URL, stats
    file, model, log)."""
    root = tmp_path_factory.mktemp("sglang-metrics")
    model = save_qwen3_moe(root / "qwen3_moe")
    tbo = {**TBO, "stats_file": str(root / "stats-{rank}.json")}
    with _sglang_server(model, tbo, root / "server.log", {"SGLANG_PLUGINS": "tbo,tbo_trace"}) as base:
        yield base, root / "stats-0.json", model, root / "server.log"


def test_the_served_engine_s_metrics_carry_tbo_s_figures_that_move_with_the_work(served):
    """Every family is there, labelled as SGLang's scheduler labels its own; SGLang's warm-up request and a lone
    request, both under the thresholds, count steps and no split step; 8 concurrent clients split steps while the metrics are scraped
    (the split steps never go back); once they are done every figure of the scrape equals the ``stats_file``."""
    base, stats_path, model, log = served
    scraped = scrape(base)
    assert set(FAMILIES) <= set(scraped), (sorted(set(FAMILIES) - set(scraped)), log.read_text()[-3000:])
    warm = stats_file(stats_path)  # the server's own warm-up request ran before /health answered: under both
    assert warm["steps"] > 0 and warm["split_steps"] == 0, warm  # thresholds, so steps and no split step
    scraped = settled(base, warm["steps"])
    assert value(scraped, "tbo:steps") == warm["steps"] and value(scraped, "tbo:split_steps") == 0
    (tbo_labels,) = {tuple(sorted(s[1].items())) for s in scraped["tbo:steps"]}
    tbo_labels = dict(tbo_labels)
    assert tbo_labels["model_name"] == str(model) and tbo_labels["tp_rank"] == "0", tbo_labels
    sglang = [got for family, samples in scraped.items() if family.startswith("sglang:")
              for _, got, _ in samples if "tp_rank" in got]
    assert sglang, sorted(scraped)
    for got in sglang:  # SGLang's scheduler metrics carry the same values of the labels tbo's carry
        assert {k: got.get(k) for k in tbo_labels} == tbo_labels, (got, tbo_labels)
    info = scraped["tbo:info"][0][1]
    assert info["split"] == "static" and info["backend"] == "link" and info["version"], info

    _generate(base, SMALL)
    small = stats_file(stats_path)
    scraped = settled(base, small["steps"])
    assert value(scraped, "tbo:steps") == small["steps"] >= warm["steps"] + NEW_TOKENS
    assert value(scraped, "tbo:split_steps") == 0 == small["split_steps"] == value(scraped, "tbo:split_ratio")
    # why: every one of those steps was below its kind's threshold, and the metric says so
    assert value(scraped, "tbo:unsplit_steps_by_reason", reason="below_threshold") == small["steps"]

    seen, stop = [], threading.Event()

    def watch() -> None:  # a scraper beside the clients
        while not stop.is_set():
            seen.append(value(scrape(base), "tbo:split_steps"))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(CLIENTS)) as pool:
            for _ in range(2):
                list(pool.map(lambda p: _generate(base, p), CLIENTS))
    finally:
        stop.set()
        watcher.join()
    final = stats_file(stats_path)
    assert final["split_steps"] > 0 and final["op_seconds"] and final["link"]["transfers"] > 0, final
    scraped = settled(base, final["steps"])
    assert seen and seen == sorted(seen), seen
    assert_stats_equal(scraped, final)
    samples = {name for family in scraped.values() for name, _, _ in family}
    named = dashboard_metrics()
    assert named and named <= samples, sorted(named - samples)  # the dashboard shows only what a server shows


# ---- the live trace: GET /tbo/trace on SGLang's app ----------------------------------------------------------------


def test_the_trace_route_refuses_bad_parameters_by_name(served):
    base = served[0]
    for query, culprit in (("steps=0", "steps='0'"), ("steps=65", "steps='65'"), ("timeout_s=1e9", "timeout_s='1e9'"),
                           ("steps=2&n=3", "unknown query parameter(s) ['n']")):
        status, body = get_json(f"{base}/tbo/trace?{query}")
        assert status == 400 and culprit in body["error"], (query, status, body)


def test_the_trace_route_records_the_next_steps_with_both_microbatches(served):
    """Clients run in rounds while ``GET /tbo/trace?steps=4`` waits: a Perfetto trace of 4 steps of the scheduler
    (named by SGLang's labels), both microbatches' compute and comm tracks on it, every op inside its step; the
    request and trace files are gone afterwards."""
    base, _, _, log = served
    answer: dict = {}

    def trace() -> None:
        answer["got"] = get_json(f"{base}/tbo/trace?steps=4&timeout_s=60")

    asking = threading.Thread(target=trace)
    asking.start()
    with ThreadPoolExecutor(len(CLIENTS)) as pool:
        while asking.is_alive():
            list(pool.map(lambda p: _generate(base, p), CLIENTS))
    asking.join()
    status, trace = answer["got"]
    assert status == 200, (trace, log.read_text()[-3000:])
    (worker,) = trace["otherData"]["workers"]
    assert worker["steps"] == 4 and worker["complete"] and worker["reason"] == "steps", worker
    assert "tp_rank 0 pp_rank 0 moe_ep_rank 0 engine_type unified" in worker["worker"], worker
    events = trace["traceEvents"]
    for e in events:
        assert e["ph"] in ("M", "X") and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], float) and e["ts"] >= 0 and e["dur"] >= 0, e
    spans = [e for e in events if e["ph"] == "X"]
    steps = [e for e in spans if e["cat"] == "step"]
    assert len(steps) == 4 and "split" in {e["name"].rsplit(" ", 1)[-1] for e in steps}, steps
    ops = [e for e in spans if e["cat"] == "compute"]
    assert {e["args"]["microbatch"] for e in ops} == {0, 1}
    assert {e["name"] for e in spans if e["cat"] == "comm"} == {"dispatch", "combine"}
    for e in ops:
        step = steps[e["args"]["step"]]
        assert step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1e-3, (e, step)
    folder = re.search(r"its metrics join /metrics from (\S+)", log.read_text())
    assert folder and any(Path(folder.group(1)).glob("*.slot")), log.read_text()[-3000:]
    assert not [f.name for f in Path(folder.group(1)).iterdir() if f.name.startswith(("trace", ".trace"))]


# ---- 16 concurrent clients, then the operator's stop (the module's last test: it stops the server) -----------------

#: 16 prompts of 2 to 10 tokens, all different
SIXTEEN = [[(7 * i + 3 * j) % 199 + 1 for j in range(2 + i % 9)] for i in range(16)]


def test_sixteen_concurrent_clients_get_plain_sglangs_offline_tokens_and_the_stop_leaves_tbos_summary(served):
    """16 clients at once on ``/generate``: each gets the greedy tokens plain SGLang (no tbo) gives the same prompts
    offline, while the server split steps of theirs. SIGTERM, as an operator stops a server: SGLang drains and sends
    its schedulers ``ShutdownReq``, tbo closes there first (`tbo.integrations.sglang.plugin`), the server exits on the
    SIGTERM alone, and its log and ``stats_file`` end with tbo's summary of the run."""
    base, stats_path, model, log = served
    before = stats_file(stats_path)
    with ThreadPoolExecutor(len(SIXTEEN)) as pool:
        answers = list(pool.map(lambda p: _generate(base, p), SIXTEEN))
    got = [a["output_ids"] for a in answers]
    during = stats_file(stats_path)
    assert during["split_steps"] > before["split_steps"], (before, during)  # tbo split steps of these clients
    assert "summary" not in during
    assert stop_server(base), log.read_text()[-3000:]  # exited on the SIGTERM, within its 60 s
    closed = stats_file(stats_path)
    assert closed["summary"][0].startswith(f"tbo: {closed['split_steps']} of {closed['steps']} forward steps "
                                           "overlapped"), closed.get("summary")
    assert closed["steps"] >= during["steps"] and closed["split_steps"] >= during["split_steps"]
    assert closed["summary"][0] in log.read_text(), log.read_text()[-3000:]
    with engine(model) as plain:
        want = greedy(plain, SIXTEEN, NEW_TOKENS, ignore_eos=True)
    assert got == want
    assert all(len(t) == NEW_TOKENS for t in got), got
