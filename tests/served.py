"""What the served-engine tests of both engines share: a server process on loopback, and its ``/metrics`` read back.

tests/vllm/ and tests/sglang/ each start their engine's real HTTP server (vLLM's OpenAI server, SGLang's
``launch_server``) as a user does, wait for ``/health``, and scrape ``/metrics`` with prometheus_client's own parser;
only the command line differs. Standard library only at import (each engine's venv has prometheus_client)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server(cmd: list[str], env: dict[str, str], log_path: Path, *, start_s: float = 300,
           stop_s: float = 60) -> Iterator[str]:
    """Run ``cmd`` (which names its ``--port``) in its own process group, output to ``log_path``; yield its base URL
    once ``/health`` answers. A port another process took first is replaced by a free one. On leaving, the group gets
    SIGTERM (graceful: workers write their stats files at shutdown), then SIGKILL after ``stop_s``, whatever
    happened. A test may stop it earlier as an operator does, with `stop_server` (its process is ``SERVERS[base]``)."""
    cmd = list(cmd)
    at = cmd.index("--port") + 1
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + start_s
        while True:
            if proc.poll() is not None and "Address already in use" in log_path.read_text() and \
                    time.monotonic() < deadline:  # another process took the free port first: take another
                cmd[at] = str(free_port())
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            assert proc.poll() is None, "the server exited: " + log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, \
                f"the server did not come up in {start_s:.0f} s: " + log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{cmd[at]}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        base = f"http://127.0.0.1:{cmd[at]}"
        SERVERS[base] = proc
        yield base
    finally:
        SERVERS.pop(f"http://127.0.0.1:{cmd[at]}", None)
        _stop(proc, stop_s)
        log.close()


#: the servers `server` runs, by base URL
SERVERS: dict[str, subprocess.Popen] = {}


def _stop(proc: subprocess.Popen, stop_s: float, group: bool = True) -> bool:
    """SIGTERM to ``proc``'s group (``group``) or to ``proc`` alone, SIGKILL to the group after ``stop_s``; whether it
    exited on the SIGTERM."""
    if proc.poll() is not None:
        return True
    if group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=stop_s)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False


def stop_server(base: str, stop_s: float = 60) -> bool:
    """Stop the server at ``base`` as an operator does (``kill PID``, a container's stop): SIGTERM to its process alone,
    which then stops its own children; SIGKILL to the group after ``stop_s``. Whether it exited on the SIGTERM."""
    return _stop(SERVERS[base], stop_s, group=False)


def scrape(base: str) -> dict:
    """``/metrics`` parsed by prometheus_client: family name -> [(sample name, labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def value(scraped: dict, family: str, **labels: str) -> float:
    """The sum of ``family``'s samples whose labels include ``labels``."""
    return sum(v for name, got, v in scraped.get(family, []) if labels.items() <= got.items()
               and not name.endswith("_created"))


def histogram_equal(scraped: dict, family: str, doc: dict, prefix: str) -> int:
    """Every ``<prefix>count`` / ``sum`` / ``bucket`` entry of a stats_file document (keys ``"mode|split"``, buckets
    ``"mode|split|le"``) equals its sample of the histogram ``family``; returns how many were compared."""
    compared = 0
    for part in ("count", "sum", "bucket"):
        for key, want in doc.get(prefix + part, {}).items():
            mode, split, *le = key.split("|")
            got = [v for name, labels, v in scraped.get(family, []) if name == f"{family}_{part}"
                   and labels.get("mode") == mode and labels.get("split") == split
                   and (not le or labels["le"] != "+Inf" and float(labels["le"]) == float(le[0]))]
            assert got == [want], (family, part, key, got, want)
            compared += 1
    return compared


def settled(base: str, want: float, timeout_s: float = 30) -> dict:
    """Scrape until ``tbo:steps`` reaches ``want`` steps (a metrics slot lags by at most ``metrics_interval_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        scraped = scrape(base)
        if value(scraped, "tbo:steps") >= want or time.monotonic() > deadline:
            return scraped
        time.sleep(0.2)


def stats_file(path: Path, timeout_s: float = 10) -> dict:
    """A worker's ``stats_file``, once it exists."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return json.loads(path.read_text())


#: ``stats_file`` reports that ``/metrics`` does not carry: SGLang's per-microbatch attention backends (their class,
#: their count, and child batches planned, which equal ``microbatches``: tbo:microbatches carries that figure)
UNPUBLISHED = ("attention",)


def assert_stats_equal(scraped: dict, doc: dict) -> None:
    """Every figure of a worker's ``stats_file`` document equals its metric in the scrape (floats exactly: both are
    Python's repr): counters, labelled families, the link's, the step-time histogram and the derived gauges; and
    every counted step timed, every unsplit one with its reason."""
    compared = 0
    for field, figure in doc.items():
        family = f"tbo:{field}"
        if field == "link":
            for key, name in (("transfers", "link_transfers"), ("busy_s", "link_busy_seconds"),
                              ("exposed_s", "link_exposed_seconds")):
                assert value(scraped, f"tbo:{name}") == figure[key], (key, figure)
                compared += 1
            assert value(scraped, "tbo:link_hidden_seconds") == max(figure["busy_s"] - figure["exposed_s"], 0.0)
        elif field.startswith("step_seconds_"):
            continue  # the histogram's three fields: compared below, whole
        elif field in UNPUBLISHED:
            continue
        elif isinstance(figure, dict):
            label = field.rsplit("_by_", 1)[1] if "_by_" in field else "op"  # mode, strategy, reason
            for key, v in figure.items():
                assert value(scraped, family, **{label: key}) == v, (field, key)
                compared += 1
        elif isinstance(figure, (int, float)) and not isinstance(figure, bool):
            assert value(scraped, family) == figure, (field, figure, scraped.get(family))
            compared += 1
    compared += histogram_equal(scraped, "tbo:step_seconds", doc, "step_seconds_")
    # every counted step was timed, and the split ones under "split": the histogram says how long each kind took
    assert sum(doc["step_seconds_count"].values()) == doc["steps"], doc["step_seconds_count"]
    for mode, n in doc["split_steps_by_mode"].items():
        assert doc["step_seconds_count"].get(f"{mode}|split", 0) == n, (mode, doc["step_seconds_count"])
    steps, split = doc["steps"], doc["split_steps"]
    # every unsplit step says why (none under "other"): here the thresholds, or too few requests to cut
    assert sum(doc["unsplit_steps_by_reason"].values()) == steps - split and "other" not in \
        doc["unsplit_steps_by_reason"], doc["unsplit_steps_by_reason"]
    assert value(scraped, "tbo:split_ratio") == split / steps
    assert value(scraped, "tbo:microbatches_per_split_step") == doc["microbatches"] / split
    assert value(scraped, "tbo:exposed_wait_seconds") == sum(v for k, v in doc["op_seconds"].items()
                                                              if k.endswith("_b"))
    assert compared > 30, compared


def dashboard_metrics() -> set[str]:
    """The metric names the Grafana dashboard's queries use (docs/grafana/tbo-dashboard.json): a served test asserts
    each is among what its server showed."""
    path = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "tbo-dashboard.json"
    dashboard = json.loads(path.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return {m for e in exprs for m in re.findall(r"\btbo:[A-Za-z0-9_:]+", e)}


def get_json(url: str, timeout: float = 120) -> tuple[int, dict]:
    """GET ``url``: (status, JSON body), error statuses included (the trace route answers its refusals in JSON)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
