"""The simulator on hand-computed timelines, the metrics, the exporters, fitting, recommending and tuning."""

import json

import pytest
import torch

from tbo import OperationsStrategy, StrategyError, Yield
from tbo.comm import LocalBackend
from tbo.comm.emulated import EmulatedLink
from tbo.models import AttentionMetadata, KVCache, ModelConfig, ReferenceModel
from tbo.tools.simulate import (Cost, CostModel, TransferCost, _candidates, compare, find_threshold, fit_costs, recommend,
                          simulate, tune)
from tbo.tools.trace import Span, Trace, Tracer, save_chrome_json, save_png, summary, to_chrome_json, traced

LAYER = OperationsStrategy(operations=["attn", "dispatch_a", Yield, "dispatch_b", "mlp"])


def per_token(c):
    return Cost(kind="linear", per_token=c)


def costs(attn, mlp, bytes_per_token, latency=0.0, attn_fixed=0.0, mlp_fixed=0.0):
    return CostModel(ops={"attn": Cost(seconds=attn_fixed, per_token=attn), "mlp": Cost(seconds=mlp_fixed,
                     per_token=mlp)}, transfers={"dispatch": TransferCost(bytes_per_token=bytes_per_token)},
                     latency_s=latency, bandwidth=1.0)


def test_hand_computed_tbo_wins():
    c = costs(1.0, 1.0, 1.0)
    single = simulate(LAYER, c, [4], 0)
    # attn 0-4; dispatch on the link 4-8; dispatch_b waits 4-8; mlp 8-12
    assert single.step_s == pytest.approx(12.0)
    tbo = simulate(LAYER, c, [2, 2])
    # A attn 0-2, A link 2-4; B attn 2-4, B link 4-6; A mlp 4-6 (arrived at 4); B mlp 6-8 (arrived at 6)
    assert tbo.step_s == pytest.approx(8.0)
    s = summary(tbo.trace)
    assert (s.compute_s, s.comm_s, s.exposed_s) == pytest.approx((8.0, 4.0, 0.0))
    comparison = compare(LAYER, c, 4)
    assert comparison.speedup == pytest.approx(1.5) and comparison.lower_bound_s == pytest.approx(8.0)


def test_hand_computed_latency_and_fifo():
    c = costs(1.0, 1.0, 1.0, latency=3.0)
    tbo = simulate(LAYER, c, [2, 2])
    # A link 2-4 (+3 latency: arrives 7); B link 4-6 (arrives 9); A waits 4-7, mlp 7-9; B mlp 9-11
    assert tbo.step_s == pytest.approx(11.0)
    waits = [(w.mb, w.start, w.end) for w in tbo.trace.lane("wait")]
    assert waits == [(0, 4.0, 7.0)]


def test_hand_computed_tbo_loses_to_fragmentation():
    c = costs(0.1, 0.1, 0.1, attn_fixed=5.0, mlp_fixed=5.0)
    single = simulate(LAYER, c, [4], 0)
    assert single.step_s == pytest.approx(5.4 + 0.4 + 5.4)  # attn, exposed dispatch, mlp
    tbo = simulate(LAYER, c, [2, 2])
    assert tbo.step_s == pytest.approx(4 * 5.2)  # every fixed cost paid twice; the 0.2 transfers fully hidden
    rec = recommend(LAYER, c, 4)
    assert rec.split is False and rec.predicted_speedup == pytest.approx(11.2 / 20.8)
    assert "fragmentation" in rec.reason and "run unsplit" in rec.reason


def test_wait_without_launch_is_reported():
    bad = OperationsStrategy(operations=["attn", Yield, "dispatch_b"], fragment=True)  # built, only to simulate
    with pytest.raises(ValueError, match="dispatch_b waits for a 'dispatch' transfer that was never launched"):
        simulate(bad, costs(1, 1, 1), [2, 2])


def test_roofline_cost():
    c = Cost(kind="roofline", flops_per_token=2e6, peak_flops=1e12, weight_bytes=1e6, mem_bw=1e9)
    assert c(10) == pytest.approx(1e-3)  # memory bound: weights dominate
    assert c(10_000) == pytest.approx(0.02)  # compute bound
    assert 2 * c(5) > c(10)  # fragmentation: two half batches read the weights twice


def test_find_threshold():
    # fixed cost 2 per call (paid twice when split) vs a transfer of 1 per token that TBO can hide
    c = costs(0.5, 0.5, 1.0, attn_fixed=2.0, mlp_fixed=2.0)
    n = find_threshold(LAYER, c, max_tokens=1024)
    assert n is not None and recommend(LAYER, c, n).split and not recommend(LAYER, c, n - 1).split


def test_tune_finds_known_optimum():
    c = costs(1.0, 1.0, 1.0)
    best = tune(["attn", "dispatch_a", "dispatch_b", "mlp"], c, 4, num_layers=2)
    assert [str(o) if o is Yield else o for o in best.operations] == ["attn", "dispatch_a", "Yield", "dispatch_b",
                                                                     "mlp"]
    assert best.delta_stages == 0
    joined = OperationsStrategy.concat([best, best])
    assert simulate(joined, c, [2, 2]).step_s == pytest.approx(16.0)  # = total compute: every transfer hidden


def test_metrics_on_synthetic_trace_exact():
    t = Trace(spans=[
        Span("compute", 0, 0, "attn", 0.0, 2.0), Span("comm", 0, 0, "dispatch", 2.0, 5.0, 100),
        Span("compute", 1, 0, "attn", 2.0, 4.0), Span("compute", 0, 1, "dispatch_b", 4.0, 5.5),
        Span("wait", 0, 1, "dispatch_wait", 4.0, 5.0), Span("comm", 1, 0, "dispatch", 4.0, 6.0, 100),
        Span("compute", 1, 1, "dispatch_b", 5.5, 6.5), Span("wait", 1, 1, "dispatch_wait", 5.5, 6.0),
    ], tokens=[3, 3])
    s = summary(t)
    assert s.step_s == 6.5 and s.comm_s == 4.0 and s.exposed_s == 1.5
    assert s.compute_s == pytest.approx(6.5 - 1.5)
    assert s.hidden_fraction == pytest.approx(1 - 1.5 / 4.0)


def test_chrome_json_schema_and_png(tmp_path):
    t = simulate(LAYER, costs(1, 1, 1, latency=0.5), [2, 2]).trace
    doc = to_chrome_json(t)
    events = doc["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(t.spans)
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0
    assert {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"} == {
        "microbatch A compute", "microbatch A comm", "microbatch B compute", "microbatch B comm"}
    path = save_chrome_json(t, tmp_path / "trace.json")
    assert json.loads(path.read_text())["traceEvents"]
    png = save_png(t, tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_tracer_on_real_run_and_fit():
    """Trace the reference model over an emulated link at several sizes, fit costs, predict the measured trace."""
    tracer_traces = []
    config = ModelConfig.qwen3_moe_tiny(batch_invariant=False, num_layers=2)
    for n in (4, 8, 16):
        tracer = Tracer(label=f"{n} tokens")
        link = EmulatedLink(LocalBackend(config.num_experts), 1e-4, 2e8)
        model = ReferenceModel(config, traced(link, tracer))
        meta = AttentionMetadata.build(range(n), [1] * n, [0] * n)
        ids = torch.arange(n) % config.vocab_size
        tracer.trace.tokens = [n]
        model.forward_tbo(ids, meta, KVCache(), "qwen3_moe_decode", None, observer=tracer)
        tracer_traces.append(tracer.finish())
    last = tracer_traces[-1]
    assert {s.name for s in last.lane("comm")} == {"dispatch", "combine"}
    row_bytes = config.hidden_size * 4 * config.top_k  # float32 rows, one copy per top-k slot, either way
    assert [s.nbytes for s in last.lane("comm")] == [16 * row_bytes] * 4
    s = summary(last)
    # structure, not wall-clock: how long a wait lasts depends on the machine's load (a descheduled process oversleeps
    # its transfer), but every wait is a _b op blocked inside its own op span, and only waits count as exposed
    waits, ops = last.lane("wait"), last.lane("compute")
    assert waits and {w.name for w in waits} <= {"dispatch_wait", "combine_wait"}
    assert all(any(o.mb == w.mb and o.start <= w.start and w.end <= o.end for o in ops) for w in waits)
    assert s.exposed_s == pytest.approx(sum(w.duration for w in waits)) and s.compute_s > 0 and s.comm_s > 0
    fitted = fit_costs(tracer_traces, latency_s=1e-4, bandwidth=2e8)
    assert {k: (t.bytes_per_token, t.bytes_fixed) for k, t in fitted.transfers.items()} == {
        "dispatch": (row_bytes, 0.0), "combine": (row_bytes, 0.0)}
    assert "attn_core" in fitted.ops
    # CostModel round-trips through JSON (what `tbo simulate --costs` reads)
    assert CostModel.model_validate_json(fitted.model_dump_json()) == fitted


def test_fit_from_overlapped_traces_only():
    """With only overlapped traces, their samples are the costs, single-batch and overlapped alike."""
    t = simulate(LAYER, costs(1.0, 2.0, 1.0), [3, 5]).trace
    fitted = fit_costs([t], latency_s=0.0, bandwidth=1.0, kind="table")
    assert set(fitted.overlapped) == {"attn", "dispatch_a", "dispatch_b", "mlp"}
    assert fitted.op("attn", 3) == pytest.approx(3.0) and fitted.op("mlp", 5) == pytest.approx(10.0)
    assert simulate(LAYER, fitted, [3, 5]).step_s == pytest.approx(simulate(LAYER, costs(1.0, 2.0, 1.0), [3, 5]).step_s)


@pytest.mark.parametrize("kind", ["linear", "table"])
def test_fit_recovers_overlapped_costs_per_microbatch(kind):
    """The second microbatch runs attn warm (half cost), the first runs mlp cold (+1 s): fitted and predicted."""
    truth = costs(1.0, 2.0, 1.0)
    truth.overlapped = {"attn": (per_token(1.0), per_token(0.5)),
                        "mlp": (Cost(seconds=1.0, per_token=2.0), per_token(2.0))}
    traces = [simulate(LAYER, truth, [n], 0).trace for n in (2, 4, 6)]
    traces += [simulate(LAYER, truth, [n, n]).trace for n in (1, 2, 3)]
    fitted = fit_costs(traces, latency_s=0.0, bandwidth=1.0, kind=kind)
    assert fitted.op("attn", 4) == pytest.approx(4.0)  # single batch: the plain cost
    assert fitted.op("attn", 2, mb=1, overlapped=True) == pytest.approx(1.0)
    assert fitted.op("mlp", 2, mb=0, overlapped=True) == pytest.approx(5.0)
    for tokens in ([4], [2, 2], [3, 3]):
        assert simulate(LAYER, fitted, tokens).step_s == pytest.approx(simulate(LAYER, truth, tokens).step_s)


def test_fit_averages_an_ops_calls_within_a_trace():
    """The first layer's op runs cold: a cost per call must still add up to the measured step."""
    layers = OperationsStrategy.concat([LAYER] * 3)
    trace = simulate(layers, costs(1.0, 2.0, 1.0), [4], 0).trace
    first_attn = next(s for s in trace.spans if s.name == "attn")
    for s in trace.spans:  # the first attn takes 3 s longer; everything after it shifts
        if s.start >= first_attn.end:
            s.start, s.end = s.start + 3.0, s.end + 3.0
    first_attn.end += 3.0
    fitted = fit_costs([trace], latency_s=0.0, bandwidth=1.0, kind="table")
    assert fitted.op("attn", 4) == pytest.approx(5.0)  # (7 + 4 + 4) / 3; a median of calls (4) loses the 3 s
    assert simulate(layers, fitted, [4], 0).step_s == pytest.approx(summary(trace).step_s)


def test_tune_keeps_launch_and_wait_apart_for_any_naming():
    """afd_send/afd_recv are a launch and its wait by the shared naming rule, not by the X_a/X_b suffix."""
    c = CostModel(ops={"attn": per_token(1.0), "output": per_token(1.0)},
                  transfers={"afd": TransferCost(bytes_per_token=1.0)}, bandwidth=1.0)
    ops = ["attn", "afd_send", "afd_recv", "output"]
    for candidate in _candidates(ops, c, max_yields=3):
        stages = OperationsStrategy(operations=candidate).stage_names
        assert not any("afd_send" in s and "afd_recv" in s for s in stages), stages
    best = tune(ops, c, 4, num_layers=2)
    stages = [list(s) for s in best.stage_names]
    assert not any("afd_send" in s and "afd_recv" in s for s in stages)
    assert ["attn", "afd_send"] in stages and ["afd_recv", "output"] in stages


def _accuracy_benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "simulator_accuracy.py"
    spec = importlib.util.spec_from_file_location("simulator_accuracy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_accuracy_benchmark_scores_decisions_only_where_the_steps_tell():
    """The benchmark's verdicts: a sign test per routing; routings that disagree, or pairs that cannot tell, tie."""
    bench = _accuracy_benchmark()
    assert bench.sign_test([2.0] * 6, [1.0] * 6) == (True, pytest.approx(2 / 64))  # TBO wins 6 of 6 pairs
    assert bench.sign_test([1.0] * 5, [2.0] * 5)[0] is None  # 5 pairs can never reach p < 0.05
    assert bench.sign_test([1.0] * 10, [2.0] * 9 + [0.5])[0] is False  # single wins 9 of 10: p = 0.021
    assert bench.sign_test([1.0] * 8, [2.0] * 7 + [0.5])[0] is None  # 7 of 8: p = 0.07
    # pairs interleave routings 0, 1, 0, 1, ...: routing 0 prefers TBO, routing 1 single
    single, tbo = [2.0, 1.0] * 6, [1.0, 2.0] * 6
    faster, why = bench.faster_mode(single, tbo, routings=2)
    assert faster is None and why.startswith("faster mode depends on the routing")
    assert bench.settled(single, tbo, 2)
    assert bench.faster_mode([2.0] * 12, [1.0] * 12, routings=2) == (True, "")
    faster, why = bench.faster_mode([2.0] * 4, [1.0] * 4, routings=2)
    assert faster is None and why.startswith("cannot tell") and not bench.settled([2.0] * 4, [1.0] * 4, 2)


def test_png_labels_ops_and_draws_exposed_waits_apart(tmp_path, monkeypatch):
    """What the PNG shows, read off the figure as it is saved: op names on the bars wide enough to hold them, and
    each exposed wait as a white, red-hatched bar over its op (not a tint of the compute colour)."""
    import matplotlib.figure

    trace = Trace([Span("compute", 0, 0, "attn_core", 0.0, 0.010), Span("compute", 0, 1, "dispatch_b", 0.010, 0.020),
                   Span("wait", 0, 1, "dispatch_wait", 0.011, 0.019), Span("comm", 0, 0, "dispatch", 0.004, 0.019),
                   Span("compute", 0, 1, "experts", 0.020, 0.030),  # same stage, after the wait: still labelled
                   Span("compute", 1, 0, "tiny", 0.030, 0.0300001)])
    seen = {}
    original = matplotlib.figure.Figure.savefig

    def spy(fig, *args, **kwargs):
        ax = fig.axes[0]
        seen["texts"] = [t.get_text() for t in ax.texts]
        seen["hatched"] = [(c.get_hatch(), tuple(c.get_facecolor()[0]), c.get_zorder()) for c in ax.collections
                           if c.get_hatch()]
        seen["legend"] = [t.get_text() for t in ax.get_legend().get_texts()]
        return original(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    path = save_png(trace, tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # "tiny" is too narrow; dispatch_b waited 8 of its 10 ms, so its bar says "wait"
    assert sorted(seen["texts"]) == ["attn_core", "dispatch", "experts", "wait"]
    (hatch, face, zorder), = seen["hatched"]
    assert hatch == "////" and face == (1.0, 1.0, 1.0, 1.0) and zorder > 2  # white, over the compute bars
    assert "exposed wait (a _b op blocked)" in seen["legend"]


def test_tune_never_proposes_a_schedule_the_backend_cannot_run():
    """Over DeepEP low-latency (one un-received call at a time) the search skips every placement and lead that
    launches over an un-received call, at any layer boundary; unrestricted, its best choice would hang the GPUs."""
    from tbo.comm.deepep import LOW_LATENCY_LIMIT
    from tbo.core.inflight import InFlightLimit, in_flight_violations

    c = CostModel(ops={"attn": per_token(1.0), "experts": per_token(1.0), "output": per_token(0.5)},
                  transfers={"dispatch": TransferCost(bytes_per_token=1.0),
                             "combine": TransferCost(bytes_per_token=1.0)}, bandwidth=1.0)
    ops = ["attn", "dispatch_a", "dispatch_b", "experts", "combine_a", "combine_b", "output"]
    free = tune(ops, c, 4)
    assert in_flight_violations(OperationsStrategy.concat([free] * 2), LOW_LATENCY_LIMIT)
    safe = tune(ops, c, 4, in_flight_limit=LOW_LATENCY_LIMIT)
    for layers in (2, 3):
        assert not in_flight_violations(OperationsStrategy.concat([safe] * layers), LOW_LATENCY_LIMIT)
    OperationsStrategy.concat([safe] * 3).check_in_flight(LOW_LATENCY_LIMIT)  # binding would accept it
    with pytest.raises(StrategyError, match="every placement of .* breaks the strict link's limit of 1"):
        tune(["attn", "dispatch_a", "dispatch_b", "output"], c, 4, microbatches=3,
             in_flight_limit=InFlightLimit(1, backend="the strict link"))  # 3 microbatches: a launch per round


def test_device_wide_epilogue_is_compute_at_the_wait():
    """DeepEP V2's epilogues take every SM: the simulator charges them at the wait, where nothing overlaps them."""
    c = costs(1.0, 1.0, 1.0)
    c.epilogues["dispatch"] = Cost(kind="constant", seconds=0.5)
    single = simulate(LAYER, c, [4], 0)
    assert single.step_s == pytest.approx(12.5)  # attn 0-4, link 4-8, epilogue 8-8.5, mlp 8.5-12.5
    epilogue = [s for s in single.trace.lane("compute") if s.name == "dispatch_epilogue"]
    assert [(s.start, s.end) for s in epilogue] == [(8.0, 8.5)]
    tbo = simulate(LAYER, c, [2, 2])
    # A attn 0-2, link 2-4; B attn 2-4, link 4-6; A: epilogue 4-4.5, mlp 4.5-6.5; B: epilogue 6.5-7, mlp 7-9
    assert tbo.step_s == pytest.approx(9.0)
    assert summary(tbo.trace).compute_s == pytest.approx(9.0)  # counted once, as compute
