"""``tbo stats``: the table from stats files and from a ``/metrics`` text served on 127.0.0.1 (a local http.server:
no network), the exposition text the metrics module itself builds where prometheus_client is installed."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest

from tbo.integrations.engine.stats import StepStats
from tbo.tools.cli import main
from tbo.tools.stats_view import docs_from_files, docs_from_metrics, parse_exposition, render


def _stats(decode: int, split: int) -> StepStats:
    s = StepStats()
    for i in range(decode):
        s.record("decode", 8, 2 if i < split else 1, False)
        s.observe_step("decode", i < split, 0.03125 * (i + 1))  # binary fractions: sums exact in any order
    s.record("prefill", 40, 3, True)
    s.observe_step("prefill", True, 0.5)
    s.add_op_times({"attn": 0.25, "combine_b": 0.125}, {"attn": 4, "combine_b": 4}, 0.5)
    return s


def test_a_stats_file_per_rank_becomes_a_row_each(tmp_path, capsys):
    for rank, (decode, split) in enumerate([(7, 3), (5, 0)]):
        _stats(decode, split).write(str(tmp_path / f"stats-{rank}.json"))
    assert main(["stats", str(tmp_path / "stats-{rank}.json")]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:3]]
    # engine, rank, steps, split, ratio, mb/split, tokens, split tok, decode s/n, prefill s/n, mixed s/n, exposed
    assert rows[0] == ["-", "0", "8", "4", "50.0%", "2.25", "96", "64", "3/7", "1/1", "0/0", "0.1250"], out
    assert rows[1] == ["-", "1", "6", "1", "16.7%", "3.00", "80", "40", "0/5", "1/1", "0/0", "0.1250"], out
    assert "attn" in out and "0.2500 s" in out


def test_bad_sources_are_named(tmp_path, capsys):
    assert main(["stats", str(tmp_path / "none-{rank}.json")]) == 2
    assert "no stats file matches" in capsys.readouterr().err
    (tmp_path / "x.json").write_text('{"not": "stats"}')
    assert main(["stats", str(tmp_path / "x.json")]) == 2
    assert "holds no tbo stats" in capsys.readouterr().err


@pytest.fixture
def served_text(tmp_path):
    """A local http.server on 127.0.0.1 serving whatever ``text[0]`` holds as ``/metrics``."""
    text = [""]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = text[0].encode() if self.path == "/metrics" else b""
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", text
    server.shutdown()
    server.server_close()


#: what a served engine shows, as the stat logger writes it (`tbo.integrations.engine.metrics.families`)
METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE tbo:info gauge
tbo:info{backend="local",decode_strategy="qwen3_moe_decode",engine="0",model_name="m",rank="0",split="adaptive",version="0.1.0"} 1.0
# TYPE tbo:steps_total counter
tbo:steps_total{engine="0",model_name="m",rank="0"} 12.0
tbo:steps_total{engine="1",model_name="m",rank="1"} 4.0
# TYPE tbo:split_steps_total counter
tbo:split_steps_total{engine="0",model_name="m",rank="0"} 3.0
tbo:split_steps_total{engine="1",model_name="m",rank="1"} 0.0
tbo:microbatches_total{engine="0",model_name="m",rank="0"} 6.0
tbo:steps_by_mode_total{engine="0",mode="decode",model_name="m",rank="0"} 10.0
tbo:split_steps_by_mode_total{engine="0",mode="decode",model_name="m",rank="0"} 3.0
tbo:op_seconds_total{engine="0",model_name="m",op="dispatch_b",rank="0"} 0.5
tbo:op_calls_total{engine="0",model_name="m",op="dispatch_b",rank="0"} 6.0
tbo:split_ratio{engine="0",model_name="m",rank="0"} 0.25
tbo:adaptive_choice{choice="split, qwen3_moe_decode",engine="0",kind="decode",model_name="m",rank="0",tokens="8-15 tokens"} 1.0
tbo:adaptive_estimated_gain{engine="0",kind="decode",model_name="m",rank="0",tokens="8-15 tokens"} 1.25
tbo:adaptive_steps_total{engine="0",kind="decode",model_name="m",rank="0",tokens="8-15 tokens"} 9.0
tbo:adaptive_explored_total{engine="0",kind="decode",model_name="m",rank="0",tokens="8-15 tokens"} 2.0
"""


def test_a_metrics_url_becomes_a_row_per_worker(served_text, capsys):
    base, text = served_text
    text[0] = METRICS
    assert main(["stats", base]) == 0  # a bare host: /metrics appended
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:3]]
    assert rows[0] == ["0", "0", "12", "3", "25.0%", "2.00", "0", "0", "3/10", "0/0", "0/0", "0.5000"], out
    assert rows[1][:6] == ["1", "1", "4", "0", "0.0%", "-"], out
    assert "decode 8-15 tokens: split, qwen3_moe_decode (1.25x est.; 2 of 9 steps explored)" in out
    assert "decode_strategy qwen3_moe_decode" in out and "vllm" not in out


def test_watch_refreshes_with_what_the_server_shows_now(served_text, capsys):
    base, text = served_text
    text[0] = METRICS
    seen = []

    def bump() -> None:  # the server's figures move between two refreshes
        seen.append(1)
        text[0] = METRICS.replace('rank="1"} 4.0', 'rank="1"} 9.0')

    timer = threading.Timer(0.3, bump)
    timer.start()
    assert main(["stats", base + "/metrics", "--watch", "0.6", "--count", "2"]) == 0
    timer.join()
    frames = capsys.readouterr().out.split("\x1b[H\x1b[2J")[1:]
    assert len(frames) == 2 and seen
    assert [f.splitlines()[3].split()[2] for f in frames] == ["4", "9"], frames


def test_an_unreachable_url_is_named(capsys):
    import socket

    with socket.socket() as sock:  # bound, not listening: refused
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"
        assert main(["stats", url, "--timeout", "2"]) == 2
    assert f"cannot scrape {url}" in capsys.readouterr().err


def test_the_exposition_parser_reads_escaped_labels():
    samples = parse_exposition('a_total{x="q\\"uote",y="back\\\\slash, comma"} 1.5 1700000000\nb 2\n')
    assert samples == [("a_total", {"x": 'q"uote', "y": "back\\slash, comma"}, 1.5), ("b", {}, 2.0)]
    with pytest.raises(ValueError, match="line 1 of the metrics text"):
        parse_exposition("not a sample line at all{")


def test_the_metrics_families_read_back_as_the_stats_file(tmp_path):
    """Round trip through the stat logger's own families (prometheus_client's text): every stats_file figure back."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from tbo.integrations.engine.metrics import families

    stats = _stats(5, 2)
    doc = {"labels": {"engine": "0", "rank": "2"}, "info": {"version": "v"}, "stats": stats.as_dict()}

    class Collector:
        def collect(self):
            return families([doc], "m")

    registry = CollectorRegistry()
    registry.register(Collector())
    back = docs_from_metrics(parse_exposition(generate_latest(registry).decode()))
    assert len(back) == 1 and back[0]["labels"] == {"engine": "0", "rank": "2"} and back[0]["info"] == {"version": "v"}
    assert back[0]["stats"] == stats.as_dict()
    assert render(back).splitlines()[1].split()[:4] == ["0", "2", "6", "3"]


def test_sglang_s_labels_and_the_link_s_families_read_back(tmp_path):
    """An SGLang scheduler's slot (SGLang's scheduler labels, the emulated link's report): every sample labelled
    ``model_name`` and SGLang's labels, the link's busy, exposed and hidden seconds, and
    ``tbo stats`` reads the worker back by ``dp_rank``/``tp_rank``."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tbo.integrations.engine.metrics import SlotCollector, MetricsPublisher

    stats = _stats(7, 3)
    labels = {"engine_type": "unified", "tp_rank": "1", "pp_rank": "0", "moe_ep_rank": "0", "dp_rank": "2"}
    link = {"transfers": 12, "busy_s": 0.75, "exposed_s": 0.25}
    publisher = MetricsPublisher(tmp_path, labels, {"version": "v"}, lambda: {**stats.as_dict(), "link": link})
    publisher.publish()
    registry = CollectorRegistry()
    registry.register(SlotCollector(tmp_path, "org/model"))
    text = generate_latest(registry).decode()
    publisher.close()
    parsed = {f.name: f.samples for f in text_string_to_metric_families(text)}
    (steps,) = [s for s in parsed["tbo:steps"] if s.name == "tbo:steps_total"]
    assert steps.labels == {"model_name": "org/model", **labels} and steps.value == stats.steps == 8
    link_values = {name: [s.value for s in parsed[name] if s.name.endswith("_total")][0]
                   for name in ("tbo:link_transfers", "tbo:link_busy_seconds", "tbo:link_exposed_seconds",
                                "tbo:link_hidden_seconds")}
    assert link_values == {"tbo:link_transfers": 12, "tbo:link_busy_seconds": 0.75,
                           "tbo:link_exposed_seconds": 0.25, "tbo:link_hidden_seconds": 0.5}
    (back,) = docs_from_metrics(parse_exposition(text))
    assert back["labels"] == {"engine": "2", "rank": "1"} and back["info"] == {"version": "v"}
    assert {k: v for k, v in back["stats"].items() if not k.startswith("link_")} == stats.as_dict()
    with pytest.raises(ValueError, match="label"):
        MetricsPublisher(tmp_path, {"model_name": "org/model"}, {}, dict)


def test_the_adaptive_families_carry_each_bucket_s_choice_and_gain():
    """``split: "adaptive"``: a real `AdaptiveSplit` that learned split pays for decode (half unsplit's time) and not
    for prefill; its report, as the worker publishes it, becomes one choice per bucket with its estimated gain."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from tbo.integrations.engine.metrics import families
    from tbo.split.adaptive import UNSPLIT, AdaptiveSplit, Choice

    split = Choice("qwen3_moe_decode", 2)
    adaptive = AdaptiveSplit({"decode": [split], "prefill": [split]})
    for _ in range(200):
        for kind, tokens, split_s in (("decode", 40, 0.001), ("prefill", 300, 0.004)):
            choice = adaptive.choose(kind, tokens)
            adaptive.observe(kind, tokens, choice, 0.002 if choice == UNSPLIT else split_s)
    report = {"buckets": adaptive.stats(), "summary": adaptive.summary()}
    doc = {"labels": {"engine": "0", "rank": "0"}, "info": {}, "stats": {"steps": 400, "adaptive": [report]}}

    class Collector:
        def collect(self):
            return families([doc], "m")

    registry = CollectorRegistry()
    registry.register(Collector())
    samples = parse_exposition(generate_latest(registry).decode())
    choice = {(lab["kind"], lab["choice"]) for name, lab, v in samples if name == "tbo:adaptive_choice" and v == 1}
    gain = {lab["kind"]: v for name, lab, v in samples if name == "tbo:adaptive_estimated_gain"}
    steps = {lab["kind"]: v for name, lab, v in samples if name == "tbo:adaptive_steps_total"}
    assert choice == {("decode", "split, qwen3_moe_decode"), ("prefill", "unsplit")}, choice
    assert gain["decode"] == pytest.approx(2.0) and gain["prefill"] == 1.0, gain
    assert steps == {"decode": 200, "prefill": 200}
    back = docs_from_metrics(samples)[0]["stats"]["adaptive"][0]["buckets"]
    table = render([{"labels": {"engine": "0", "rank": "0"}, "info": {}, "stats": {"adaptive": [{"buckets": back}]}}])
    assert "decode 32-63 tokens: split, qwen3_moe_decode (2.00x est.;" in table, table


def test_the_step_histogram_is_a_prometheus_histogram_with_cumulative_buckets():
    """``tbo:step_seconds``: one histogram per kind and split, its ``le`` buckets cumulative up to ``+Inf`` (the
    count), as prometheus_client's own parser reads a histogram."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tbo.integrations.engine.metrics import families

    stats = StepStats()
    for seconds in (0.0625, 0.25, 0.25):
        stats.observe_step("decode", True, seconds)
    doc = {"labels": {"engine": "0", "rank": "0"}, "info": {}, "stats": stats.as_dict()}

    class Collector:
        def collect(self):
            return families([doc], "m")

    registry = CollectorRegistry()
    registry.register(Collector())
    (hist,) = [f for f in text_string_to_metric_families(generate_latest(registry).decode())
               if f.name == "tbo:step_seconds"]
    assert hist.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in hist.samples if s.name.endswith("_bucket")}
    assert buckets["0.05"] == 0 and buckets["0.075"] == 1 and buckets["0.3"] == 3 and buckets["+Inf"] == 3
    assert list(buckets.values()) == sorted(buckets.values())  # cumulative
    assert {s.name: s.value for s in hist.samples if not s.name.endswith("_bucket")} == {
        "tbo:step_seconds_count": 3, "tbo:step_seconds_sum": 0.5625}
    assert {s.labels["mode"] for s in hist.samples} == {"decode"} and {s.labels["split"] for s in hist.samples} == {
        "split"}
    # `tbo stats` reads it back and says it per kind: 3 split decode steps, 0.5625 s together
    back = docs_from_metrics(parse_exposition(generate_latest(registry).decode()))
    assert "  decode   split 187.50 ms (3 steps)" in render(back).splitlines()
