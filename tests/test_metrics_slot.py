"""The path tbo's figures take from a worker to the process that serves ``/metrics``: a fixed-size shared-memory
slot per worker, overwritten in place by a background thread (`tbo.integrations.engine.metrics`). No engine needed:
the slot, the publisher and a reader in another process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tbo.integrations.engine.metrics import MetricsPublisher, MetricsSlot, metrics_dir, read_slot, read_slots
from tbo.integrations.engine.stats import StatsFile, StepStats


def test_a_slot_is_overwritten_in_place_and_read_whole(tmp_path):
    slot = MetricsSlot(tmp_path / "a.slot", size=4096)
    assert read_slot(slot.path) is None  # nothing published yet
    for n in (1, 300, 7):  # shorter after longer: the length frames the payload, not the file
        slot.write(json.dumps({"n": n, "pad": "x" * n}).encode())
        assert read_slot(slot.path) == {"n": n, "pad": "x" * n}
    assert os.path.getsize(slot.path) == 4096 and os.listdir(tmp_path) == ["a.slot"]
    with pytest.raises(ValueError, match="exceeds the slot's 4072"):
        slot.write(b"x" * 4073)
    slot.close()
    assert not slot.path.exists()


def test_a_torn_or_foreign_slot_reads_as_none(tmp_path):
    slot = MetricsSlot(tmp_path / "a.slot", size=4096)
    slot.write(b'{"n": 1}')
    with open(slot.path, "r+b") as f:  # a byte of the payload changed without its header: the CRC refuses it
        f.seek(24)
        f.write(b"[")
    assert read_slot(slot.path, tries=3) is None
    slot.write(b'{"n": 2}')
    with open(slot.path, "r+b") as f:  # a writer that died mid-write: the sequence number stays odd
        f.seek(8)
        f.write((5).to_bytes(8, "little"))
    assert read_slot(slot.path, tries=3) is None
    (tmp_path / "b.slot").write_bytes(b"not a slot at all, long enough to hold a header")
    assert read_slot(tmp_path / "b.slot") is None and read_slot(tmp_path / "missing.slot") is None


def test_the_publisher_publishes_from_its_thread_and_once_more_at_close(tmp_path):
    """The step path calls nothing: the thread reads the live counters; what a reader in another process sees
    after the last step equals the ``stats_file`` of the same counters, and the slot leaves with the engine."""
    stats = StepStats()
    publisher = MetricsPublisher(tmp_path / "m", {"engine": 1, "rank": 3}, {"version": "v"},
                                 stats.as_dict, interval_s=0.02).start()
    stop = threading.Event()

    def steps() -> None:  # a step loop racing the publisher, adding op names as it goes (dicts change size)
        i = 0
        while not stop.is_set():
            stats.record("decode" if i % 3 else "prefill", 8, 2 if i % 2 else 1, False)
            stats.add_op_times({f"op{i % 40}": 0.001}, {f"op{i % 40}": 1}, 0.002)
            i += 1

    thread = threading.Thread(target=steps)
    thread.start()
    time.sleep(0.3)
    stop.set()
    thread.join()
    time.sleep(0.1)  # a publish after the last step
    reader = [sys.executable, "-c", "import json, sys; from tbo.integrations.engine.metrics import read_slots; "
              "print(json.dumps(read_slots(sys.argv[1])))", str(tmp_path / "m")]
    docs = json.loads(subprocess.run(reader, capture_output=True, text=True, check=True,
                                     env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout)
    StatsFile(str(tmp_path / "stats.json")).write(stats)
    assert len(docs) == 1 and docs[0]["labels"] == {"engine": "1", "rank": "3"} and docs[0]["info"] == {"version": "v"}
    assert docs[0]["stats"] == json.loads((tmp_path / "stats.json").read_text())
    assert stats.steps > 100 and publisher.publishes >= 5, (stats.steps, publisher.publishes)
    stats.record("decode", 4, 2, False)  # after the last tick: close publishes it
    publisher.close(unlink=False)
    assert read_slots(tmp_path / "m")[0]["stats"]["steps"] == stats.steps
    publisher.slot.path.unlink()


def test_close_removes_the_slot_and_its_folder(tmp_path):
    publisher = MetricsPublisher(tmp_path / "m", {"engine": 0, "rank": 0}, {}, dict, interval_s=5).start()
    assert read_slots(tmp_path / "m") == [{"labels": {"engine": "0", "rank": "0"}, "info": {},
                                           "time": read_slots(tmp_path / "m")[0]["time"], "stats": {}}]
    publisher.close()
    assert not (tmp_path / "m").exists() and read_slots(tmp_path / "m") == []


def test_a_payload_too_large_for_the_slot_drops_its_adaptive_detail(tmp_path):
    big = {"steps": 3, "adaptive": [{"buckets": [{"kind": "decode", "pad": "x" * 5000}]}]}
    publisher = MetricsPublisher(tmp_path, {"rank": 0}, {}, lambda: big, interval_s=5, size=2048).start()
    doc = read_slots(tmp_path)[0]
    assert doc["truncated"] is True and doc["stats"] == {"steps": 3}
    publisher.close()


@pytest.mark.parametrize("key", ["", "a/b", "..", "x\0"])
def test_a_metrics_folder_key_is_a_plain_name(key):
    with pytest.raises(ValueError, match="metrics key"):
        metrics_dir(key)


def test_the_metrics_folder_is_named_by_the_key():
    assert metrics_dir("abc", base="/somewhere").as_posix() == "/somewhere/tbo-metrics-abc"
    with pytest.raises(ValueError, match="interval_s=0"):
        MetricsPublisher("/nonexistent", {}, {}, dict, interval_s=0)


def test_the_dashboard_loads_and_names_only_documented_metrics():
    """docs/grafana/tbo-dashboard.json: every panel queries tbo's metrics, each named in docs/metrics.md (the served
    test, tests/vllm/test_metrics.py, checks them against a real scrape)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    dashboard = json.loads((root / "docs" / "grafana" / "tbo-dashboard.json").read_text())
    page = (root / "docs" / "metrics.md").read_text()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 6 and all(p["targets"] for p in dashboard["panels"])
    names = {m for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"\btbo:[A-Za-z0-9_:]+",
                                                                                      t["expr"])}
    assert len(names) >= 8 and all(f"`{n}`" in page for n in names), sorted(n for n in names if f"`{n}`" not in page)


def test_the_metrics_keys_are_checked():
    from tbo.integrations.vllm.config import TboConfigError, parse_config

    assert parse_config({"tbo": {}}).metrics is True and parse_config({"tbo": {}}).metrics_interval_s == 1.0
    assert parse_config({"tbo": {"metrics": False}}).metrics is False
    with pytest.raises(TboConfigError, match="metrics_interval_s=0: Input should be greater than 0"):
        parse_config({"tbo": {"metrics_interval_s": 0}})
    with pytest.raises(TboConfigError, match="unknown key 'metric'"):
        parse_config({"tbo": {"metric": True}})


def test_the_panels_render_from_recorded_scrapes(tmp_path):
    """scripts/render_metrics_panels.py: a recording in the served test's shape becomes a PNG; its rates are the
    counters' differences over the window (here 3 of 4 steps split in each second)."""
    pytest.importorskip("matplotlib")
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "render_metrics_panels", Path(__file__).resolve().parents[1] / "scripts" / "render_metrics_panels.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    ids = {"engine": "0", "model_name": "m", "rank": "0"}

    def frame(t: int) -> list:
        return [t, {"tbo:steps": [["tbo:steps_total", ids, 4 * t]],
                    "tbo:split_steps": [["tbo:split_steps_total", ids, 3 * t]],
                    "tbo:steps_by_mode": [["tbo:steps_by_mode_total", {**ids, "mode": "decode"}, 4 * t]],
                    "tbo:op_seconds": [["tbo:op_seconds_total", {**ids, "op": "attn"}, 0.5 * t]],
                    "tbo:info": [["tbo:info", {**ids, "split": "static"}, 1]]}]

    frames = [frame(t) for t in range(6)]
    xs, ys = script._rates(frames, 1.0, lambda f: script._total(f, "tbo:split_steps"),
                           lambda f: script._total(f, "tbo:steps"))
    assert xs == [1, 2, 3, 4, 5] and ys == [0.75] * 5
    script.render(frames, str(tmp_path / "panels.png"))
    assert (tmp_path / "panels.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
