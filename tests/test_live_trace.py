"""The live trace's path (`tbo.integrations.engine.live_trace`): a request file a worker's publisher thread polls,
the steps its layer loop records while armed, the size-capped trace file it writes, and the Perfetto trace the route
merges. No engine needed: the reference model's real split steps, the real publisher thread; the served vLLM route
is tested in tests/vllm/test_metrics.py."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tbo.integrations.engine.live_trace import (REQUEST_BYTES, LiveTrace, StepRecorder, TraceRequest, chrome_trace,
                                                read_request, read_trace_files, remove_request, trace_file_name,
                                                write_request)
from tbo.integrations.engine.metrics import MetricsPublisher
from tbo.models import AttentionMetadata, KVCache, ModelConfig, ReferenceModel
from tbo.split.plan import SplitPolicy
from tbo.split.index import ForwardMode
from tbo.tools.trace import Tracer, to_chrome_json, Trace, Span

ID = "0123456789abcdef"


def _split_step(observers, tokens=8, layers=2):
    """One split decode step of the reference model (local experts), every observer watching it."""
    from tbo.comm import LocalBackend
    from tbo.core.observer import as_observer

    config = ModelConfig.qwen3_moe_tiny(batch_invariant=False, num_layers=layers)
    model = ReferenceModel(config, LocalBackend(config.num_experts))
    meta = AttentionMetadata.build(range(tokens), [1] * tokens, [0] * tokens)
    plan = SplitPolicy().plan(ForwardMode.DECODE, tokens)
    model.forward_tbo(torch.arange(tokens) % config.vocab_size, meta, KVCache(), "qwen3_moe_decode", plan,
                      observer=as_observer(observers))
    return plan


def test_the_recorder_sees_a_real_split_step_as_tbo_trace_s_tracer_does():
    """Same ops, lanes, microbatches and stages as `Tracer` (without a traced backend) on the same run; every comm
    span starts at its launch op's end and ends at its wait op's end; the merged trace's events are
    `to_chrome_json`'s for that step (tbo trace's format)."""
    recorder, tracer = StepRecorder(), Tracer()
    _split_step([recorder, tracer])
    spans, trace = recorder.spans(), tracer.finish()
    key = lambda s: (s["lane"], s["mb"], s["stage"], s["name"])  # noqa: E731
    assert sorted(map(key, spans)) == sorted((s.lane, s.mb, s.stage, s.name) for s in trace.spans)
    assert {s["mb"] for s in spans} == {0, 1}
    comm = [s for s in spans if s["lane"] == "comm"]
    assert {s["name"] for s in comm} == {"dispatch", "combine"} and all(s["end"] >= s["start"] for s in comm)
    ops = [s for s in spans if s["lane"] == "compute"]
    for c in comm:
        launch = [o for o in ops if o["mb"] == c["mb"] and o["name"] == f"{c['name']}_a" and o["end"] == c["start"]]
        wait = [o for o in ops if o["mb"] == c["mb"] and o["name"] == f"{c['name']}_b" and o["end"] == c["end"]]
        assert len(launch) == 1 and len(wait) == 1, c
    merged = chrome_trace([{"id": ID, "labels": {"engine": "0", "rank": "0"}, "steps": [
        {"label": "decode step, split", "tokens": [4, 4], "spans": spans}]}])
    mine = Trace([Span(**s) for s in spans], [4, 4])
    want = [e for e in to_chrome_json(mine)["traceEvents"] if e["ph"] == "X"]
    got = [{**e, "args": {k: v for k, v in e["args"].items() if k != "step"}} for e in merged["traceEvents"]
           if e["ph"] == "X" and e["cat"] != "step"]
    assert got == want
    names = {e["args"]["name"] for e in merged["traceEvents"] if e["ph"] == "M"}
    assert {"microbatch A compute", "microbatch B comm", "engine 0 rank 0", "steps"} <= names


def test_a_worker_records_the_next_n_steps_when_asked_and_nothing_otherwise(tmp_path):
    """Unarmed, the loop gets no recorder; a request arms it at the next poll; N steps are recorded (a further step
    is not); the thread's next poll writes the file, which the route's reader returns; a request seen once is never
    run again."""
    live = LiveTrace(tmp_path, {"engine": 0, "rank": 1})
    live.poll()
    assert not live.armed and live.recorder() is None
    write_request(tmp_path, TraceRequest(ID, 2, time.time() + 30))
    live.poll()
    assert live.armed
    for _ in range(3):
        recorder = live.recorder()
        if recorder is None:
            break
        plan = _split_step([recorder])
        live.record(recorder, "decode step, split", [m.tokens_unpadded_len for m in plan.microbatches])
    assert not live.armed
    live.poll()
    docs = read_trace_files(tmp_path, ID, 1 << 20)
    assert [d["labels"] for d in docs] == [{"engine": "0", "rank": "1"}]
    assert len(docs[0]["steps"]) == 2 and docs[0]["complete"] and docs[0]["reason"] == "steps"
    assert docs[0]["steps"][0]["tokens"] == [4, 4]
    trace = chrome_trace(docs)
    assert {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"} >= {0, 1, 2, 3}
    json.dumps(trace)
    remove_request(tmp_path, ID)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    write_request(tmp_path, TraceRequest(ID, 2, time.time() + 30))  # the same id again: already answered
    live.poll()
    assert not live.armed


def test_a_step_less_worker_answers_at_the_deadline_with_its_reason(tmp_path):
    """The publisher thread itself (no step ever runs): armed at its first tick, it writes an empty trace naming the
    deadline once the deadline passed."""
    live = LiveTrace(tmp_path, {"engine": 0, "rank": 0})
    publisher = MetricsPublisher(tmp_path, {"engine": 0, "rank": 0}, {}, lambda: {"steps": 0}, interval_s=0.05,
                                 tick=live.poll).start()
    try:
        write_request(tmp_path, TraceRequest(ID, 4, time.time() + 0.3))
        deadline = time.monotonic() + 20
        while not read_trace_files(tmp_path, ID, 1 << 20) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        publisher.close()
    (doc,) = read_trace_files(tmp_path, ID, 1 << 20)
    assert doc["steps"] == [] and not doc["complete"] and doc["reason"].startswith("deadline: 0 of 4 steps")
    assert chrome_trace([doc])["otherData"]["workers"][0]["reason"] == doc["reason"]


def test_the_byte_cap_bounds_what_a_worker_records_and_writes(tmp_path):
    """A cap of about two and a half steps: recording stops once the estimate reaches it, and the file written
    stays under it, the steps that did not fit dropped and ``truncated`` said."""
    live = LiveTrace(tmp_path, {"engine": 0, "rank": 0})
    write_request(tmp_path, TraceRequest("0" * 16, 1, time.time() + 30))
    live.poll()
    recorder = live.recorder()
    _split_step([recorder])
    live.record(recorder, "decode step, split", [4, 4])
    live.poll()
    one = (tmp_path / trace_file_name("0" * 16, {"engine": "0", "rank": "0"})).stat().st_size
    cap = int(2.5 * one)
    write_request(tmp_path, TraceRequest(ID, 64, time.time() + 30, max_bytes=cap))
    live.poll()
    steps = 0
    while (recorder := live.recorder()) is not None:
        _split_step([recorder])
        live.record(recorder, "decode step, split", [4, 4])
        steps += 1
    assert 2 <= steps < 64
    live.poll()
    path = tmp_path / trace_file_name(ID, {"engine": "0", "rank": "0"})
    assert path.stat().st_size <= cap
    (doc,) = read_trace_files(tmp_path, ID, cap)
    assert doc["reason"] == f"byte cap: {cap} bytes reached" and doc["truncated"] and 1 <= len(doc["steps"]) < steps
    assert read_trace_files(tmp_path, ID, one // 2) == []  # a reader's cap below the file's size skips it


@pytest.mark.parametrize("bad, match", [
    (dict(id="../x", steps=1), "hex digits"), (dict(steps=0), "steps=0"), (dict(steps=65), "steps=65"),
    (dict(steps=True), "steps=True"), (dict(max_bytes=10), "max_bytes=10"), (dict(deadline="soon"), "deadline")])
def test_a_request_out_of_range_is_refused_by_name(bad, match):
    fields = {"id": ID, "steps": 2, "deadline": time.time(), **bad}
    with pytest.raises(ValueError, match=match):
        TraceRequest(**fields)


def test_a_worker_ignores_a_request_file_too_large_or_not_a_request(tmp_path):
    (tmp_path / "trace.request").write_text(json.dumps({"id": ID, "steps": 2, "deadline": time.time() + 30,
                                                        "pad": "x" * REQUEST_BYTES}))
    assert read_request(tmp_path) is None
    for text in ("not json", json.dumps({"id": ID, "steps": 1000, "deadline": time.time() + 30}), "[1]"):
        (tmp_path / "trace.request").write_text(text)
        live = LiveTrace(tmp_path, {"engine": 0, "rank": 0})
        live.poll()
        assert not live.armed, text


def test_workers_are_named_and_ordered_by_each_engine_s_labels():
    """vLLM's ``engine``/``rank`` and SGLang's ``dp_rank``/``tp_rank``/...: numbers ordered as numbers (rank 10 after
    rank 9), a worker named on a trace by its engine's labels."""
    from tbo.integrations.engine.live_trace import worker_name
    from tbo.integrations.engine.metrics import label_order

    vllm = [{"engine": "0", "rank": r} for r in ("10", "9", "2")]
    assert [w["rank"] for w in sorted(vllm, key=label_order)] == ["2", "9", "10"]
    assert worker_name({"engine": "1", "rank": "3"}) == "engine 1 rank 3"
    sglang = {"engine_type": "unified", "tp_rank": "1", "pp_rank": "0", "moe_ep_rank": "0", "dp_rank": "2"}
    assert worker_name(sglang) == "dp_rank 2 tp_rank 1 pp_rank 0 moe_ep_rank 0 engine_type unified"
    ordered = sorted([{**sglang, "tp_rank": "11"}, sglang, {**sglang, "dp_rank": "0"}], key=label_order)
    assert [(w["dp_rank"], w["tp_rank"]) for w in ordered] == [("0", "1"), ("2", "1"), ("2", "11")]
