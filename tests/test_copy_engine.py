"""`CopyEngineLink`: results equal the wrapped backend's, bytes are accounted as configured, transfers in flight are
drained, and traces show the comm lane. CPU tests run its synchronous path; GPU tests its streams and events."""

import time

import pytest
import torch

from tbo.comm import CopyEngineLink, DispatchFormat, LocalBackend
from tbo.experts import run_experts
from tbo.models import AttentionMetadata, KVCache, ModelConfig, ReferenceModel
from tbo.split import ForwardMode, SplitPolicy
from tbo.testing.moe import SwiGLUExperts, make_routing
from tbo.tools.trace import Tracer, summary, traced

H, I, E = 16, 24, 8
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def backend(fmt, capacity=64):
    return LocalBackend(E, fmt, masked_capacity=capacity if fmt is DispatchFormat.MASKED else None)


def moe(b, x, idx, w, fn):
    d = b.dispatch_b(b.dispatch_a(x, idx, w))
    return b.combine_b(b.combine_a(run_experts(d, fn), d.handle))


def inputs(tokens=13, top_k=2, device="cpu", dtype=torch.float32):
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    idx, w = make_routing(tokens, E, top_k, seed=2, drop=0.1)
    return x, idx.to(device), w.to(device)


@pytest.mark.parametrize("fmt", list(DispatchFormat))
def test_results_equal_the_wrapped_backend(fmt):
    fn = SwiGLUExperts.build(E, H, I, seed=3).local(0, E)
    x, idx, w = inputs()
    assert torch.equal(moe(CopyEngineLink(backend(fmt)), x, idx, w, fn), moe(backend(fmt), x, idx, w, fn))


def test_bytes_per_token_as_configured():
    x, idx, w = inputs(tokens=10, top_k=2)
    link = CopyEngineLink(backend(DispatchFormat.EXPANDED))
    s = link.dispatch_a(x, idx, w)
    assert s.nbytes == 10 * 2 * H * 4  # default: top_k * hidden * element size per token
    d = link.dispatch_b(s)
    c = link.combine_a(run_experts(d, lambda e, r: r), d.handle)
    assert c.nbytes == 10 * 2 * H * 4
    link.combine_b(c)
    fp8 = CopyEngineLink(backend(DispatchFormat.EXPANDED), dispatch_bytes_per_token=8 * 7168,
                         combine_bytes_per_token=8 * 7168 * 2)
    s = fp8.dispatch_a(x, idx, w)
    assert s.nbytes == 10 * 57344
    d = fp8.dispatch_b(s)
    c = fp8.combine_a(run_experts(d, lambda e, r: r), d.handle)
    assert c.nbytes == 10 * 114688
    fp8.combine_b(c)
    tiny = CopyEngineLink(backend(DispatchFormat.EXPANDED), dispatch_bytes_per_token=1)
    payload = x.nbytes + idx.nbytes + w.nbytes
    assert tiny.dispatch_a(x, idx, w).nbytes == payload  # the real payload always travels


def test_in_flight_drain_and_misuse():
    x, idx, w = inputs()
    link = CopyEngineLink(backend(DispatchFormat.MASKED))
    a = link.dispatch_a(x, idx, w)
    b = link.dispatch_a(x[:5], idx[:5], w[:5])  # two microbatches in flight
    assert len(link.in_flight) == 2 and "dispatch" in link.in_flight[0]
    link.dispatch_b(a)
    with pytest.raises(RuntimeError, match="already received"):
        link.dispatch_b(a)
    assert link.drain() == 1 and link.in_flight == []
    assert b.transfer.held == () and b.transfer.received == ()  # drained: nothing is held any more
    d = LocalBackend(E).dispatch_b(LocalBackend(E).dispatch_a(x, idx, w))
    with pytest.raises(TypeError, match="handle must come from this CopyEngineLink"):
        link.combine_a(run_experts(d, lambda e, r: r), d.handle)
    with pytest.raises(ValueError, match="dispatch_bytes_per_token=-1"):
        CopyEngineLink(LocalBackend(E), dispatch_bytes_per_token=-1)


class FakeStream:
    """What the link asks of a CUDA stream, recorded: lets its stream logic run on a CPU."""

    def __init__(self, device=None):
        self.device, self.waited = device, []

    def wait_event(self, event):
        self.waited.append(event)


class FakeEvent:
    def __init__(self):
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1


def test_index_less_cuda_device_is_the_same_key_as_cuda_0(monkeypatch):
    """Issue 22, defect 5: ``torch.device("cuda") != torch.device("cuda:0")``. ``reserve("cuda", n)`` filled caches
    that transfers (whose tensors report ``cuda:0``) never looked up: a second copy stream, and staging allocated at
    the first transfer, possibly inside a capture. Now both name one key."""
    from tbo.comm import copy_engine, devices

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    made = []
    seams = {"_new_stream": lambda device: made.append(device) or FakeStream(device),  # CPU stand-ins for CUDA
             "_pinned": lambda n: torch.empty(n, dtype=torch.uint8),
             "_device_bytes": lambda n, device: torch.empty(n, dtype=torch.uint8)}
    for name, value in seams.items():
        monkeypatch.setattr(copy_engine, name, value, raising=False)
    assert devices.device_key("cuda") == devices.device_key("cuda:0") == torch.device("cuda", 0)
    assert devices.device_key("cpu") == torch.device("cpu")
    link = CopyEngineLink(backend(DispatchFormat.MASKED))
    link.reserve("cuda", 4 << 20)
    cuda0 = torch.device("cuda", 0)  # what a transfer's payload reports
    stream, host, filler = link._stream(cuda0), link._host(cuda0, 4 << 20), link._filler(cuda0, 4 << 20)
    assert made == [cuda0] and list(link._streams) == [cuda0] and list(link._buffers) == [cuda0]
    bufs = link._buffers[cuda0]
    assert len(bufs.host) == 1 and host is bufs.host[0] and filler[0] is bufs.filler_src[0]
    given = FakeStream(torch.device("cuda"))
    assert CopyEngineLink(LocalBackend(E), stream=given)._stream("cuda:0") is given


def test_drain_inside_a_capture_joins_the_streams_instead_of_waiting_on_the_host(monkeypatch):
    """Issue 22, defect 3: an op failing while a graph is captured. ``drain()`` synchronised on an event recorded
    inside the live capture (which invalidates it), and transfers never joined left the copy stream unjoined, so
    ending the capture raised over the op's own error. Inside a capture drain must join (compute waits for the
    event), outside it must wait on the host. Modelled with the link's own seams: torch's capture query and the
    compute stream."""
    from tbo.comm import copy_engine, devices
    from tbo.comm.copy_engine import CopyTransfer

    compute = FakeStream()
    monkeypatch.setattr(copy_engine, "_compute_stream", lambda device: compute, raising=False)
    link = CopyEngineLink(backend(DispatchFormat.MASKED))

    def in_flight():
        t = CopyTransfer("dispatch", 64, 4, done=FakeEvent(), held=(torch.zeros(4),))
        t.device = torch.device("cuda", 0)
        link._in_flight[id(t)] = t
        return t

    monkeypatch.setattr(devices, "capturing", lambda device=None: True)
    a, b = in_flight(), in_flight()
    assert link.drain() == 2 and link.in_flight == []
    assert compute.waited == [a.done, b.done]  # the join each missing _b would have made
    assert a.done.synchronized == b.done.synchronized == 0  # no host sync inside the capture
    assert a.held == () and b.held == ()
    monkeypatch.setattr(devices, "capturing", lambda device=None: False)
    c = in_flight()
    assert link.drain() == 1 and c.done.synchronized == 1 and compute.waited == [a.done, b.done]


def test_meta_tensors_pass_through_without_host_reads():
    link = CopyEngineLink(backend(DispatchFormat.MASKED, capacity=12))
    assert link.capture_safe
    x = torch.empty(12, H, device="meta")
    idx = torch.empty(12, 2, dtype=torch.long, device="meta")
    d = link.dispatch_b(link.dispatch_a(x, idx, torch.empty(12, 2, device="meta")))
    out = link.combine_b(link.combine_a(torch.empty(E, 12, H, device="meta"), d.handle))
    assert out.shape == (12, H) and out.device.type == "meta"


def _decode(model, tokens=12):
    ids = torch.arange(tokens)
    meta = AttentionMetadata.build(range(tokens), [1] * tokens, [0] * tokens)
    plan = SplitPolicy().plan(ForwardMode.DECODE, tokens)
    return ids, meta, plan


def test_traced_link_shows_the_comm_lane():
    tracer = Tracer()
    link = CopyEngineLink(backend(DispatchFormat.MASKED), dispatch_bytes_per_token=1000)
    model = ReferenceModel(ModelConfig.deepseek_v3_tiny(num_layers=2), traced(link, tracer))
    ids, meta, plan = _decode(model)
    model.forward_tbo(ids, meta, KVCache(), "deepseek_decode", plan, observer=tracer)
    trace = tracer.finish()
    comm = trace.lane("comm")
    assert sorted({s.name for s in comm}) == ["combine", "dispatch"]
    assert len(comm) == 2 * 2 * 1  # one MoE layer, two microbatches, dispatch and combine
    assert {s.nbytes for s in comm if s.name == "dispatch"} == {6000}
    ops = trace.lane("compute")
    for s in comm:  # off CUDA the copy runs inside dispatch_a / combine_a: its span lies inside that op's
        assert any(o.name == f"{s.name}_a" and o.start <= s.start and s.end <= o.end for o in ops)


class HostEvent:
    """An event with CUDA's interface that records host time: lets the tracer's clock merging run on a CPU."""

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def test_event_and_host_stamps_share_one_clock():
    """Ops timed by events and transfers/waits timed on the host land on one timeline (seconds since the origin).

    Before: ops were event milliseconds from the first op and transfers perf_counter seconds, so a 27 ms step read
    as 35 seconds."""
    from tbo.comm.emulated import EmulatedLink
    from tbo.tools.trace import _CudaClock

    tracer = Tracer()
    tracer._time = _CudaClock(HostEvent, lambda: None)
    tracer.cuda = True
    link = EmulatedLink(backend(DispatchFormat.MASKED), latency_s=2e-4, bandwidth_bytes_per_s=1e9)
    model = ReferenceModel(ModelConfig.deepseek_v3_tiny(num_layers=2), traced(link, tracer))
    ids, meta, plan = _decode(model)
    t0 = time.perf_counter()
    model.forward_tbo(ids, meta, KVCache(), "deepseek_decode", plan, observer=tracer)
    t1 = time.perf_counter()
    origin = tracer._time.origin_host
    trace = tracer.finish()
    lo, hi = t0 - origin, t1 - origin
    assert trace.lane("comm") and trace.lane("compute")
    for s in trace.spans:
        assert lo <= s.start <= s.end <= hi, s
    assert summary(trace).step_s <= hi - lo


def test_cuda_tracer_stamps_every_launch_and_wait_with_events_whatever_the_backend():
    """Issue 22, defect 6: under ``Tracer(cuda=True)`` only a CopyEngineLink's transfers were events; every other
    backend's launches and waits were ``perf_counter`` stamps, the CPU's issue time, and a wait span measured the
    Python call, not the stream's stall. Now an event is recorded on the current stream as every ``_a`` starts
    (the transfer's start) and around every ``_b`` (the stall); here a LocalBackend, with host-time stand-ins for
    CUDA events."""
    from tbo.tools.trace import _CudaClock

    recorded = []

    class CountedEvent(HostEvent):
        def record(self, stream=None):
            super().record(stream)
            recorded.append(self)

    tracer = Tracer()
    tracer._time = _CudaClock(CountedEvent, lambda: None)
    tracer.cuda = True
    recorded.clear()  # the origin
    model = ReferenceModel(ModelConfig.deepseek_v3_tiny(num_layers=2), traced(backend(DispatchFormat.MASKED), tracer))
    ids, meta, plan = _decode(model)
    model.forward_tbo(ids, meta, KVCache(), "deepseek_decode", plan, observer=tracer)
    ops = len(tracer.trace.lane("compute"))
    launches = waits = 2 * 2  # one MoE layer, two microbatches, dispatch and combine
    assert len(recorded) == 2 * ops + launches + 2 * waits
    assert len(tracer._unresolved) >= 2 * 4  # comm and wait spans wait for their events, resolved in finish
    trace = tracer.finish()
    assert sorted({s.name for s in trace.lane("comm")}) == ["combine", "dispatch"] and len(trace.lane("comm")) == 4
    for s in trace.spans:
        assert 0 <= s.start <= s.end, s
    tracer.begin("decode, TBO", [mb.tokens_len for mb in plan.microbatches])
    assert tracer.trace.label == "decode, TBO" and tracer.trace.tokens == [6, 6] and not tracer.trace.spans


def test_begin_takes_the_origin_again_and_marks_land_on_the_trace_clock():
    """On a clock the test moves itself (events and host stamps alike): `begin` takes the origin again, and an
    event mark and a host mark of the same instant land on the same trace time, measured from the new origin."""
    from tbo.tools.trace import _CudaClock

    now = [0.0]

    class ClockedEvent(HostEvent):
        def record(self, stream=None):
            self.t = now[0]

    tracer = Tracer()
    tracer._time = _CudaClock(ClockedEvent, lambda: None, lambda: now[0])
    tracer.cuda = True
    assert tracer._time.origin_host == 0.0
    now[0] = 0.5
    tracer.begin("step")
    assert tracer._time.origin_host == 0.5
    now[0] = 0.75
    tracer.mark("event")
    tracer.mark("host", now[0])
    assert tracer.finish().marks == {"event": 0.25, "host": 0.25}


def test_events_in_a_host_tracer_are_refused():
    tracer = Tracer()
    with pytest.raises(ValueError, match="Tracer\\(cuda=True\\)"):
        tracer.on_comm_span("dispatch", 10, HostEvent(), HostEvent())


# ---- GPU -----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("fmt", list(DispatchFormat))
def test_gpu_results_equal_local_backend(fmt):
    experts = SwiGLUExperts.build(E, H, I, seed=3)
    dev = SwiGLUExperts(*(t.cuda() for t in (experts.w_gate, experts.w_up, experts.w_down))).local(0, E)
    x, idx, w = inputs(tokens=64, device="cuda")
    link = CopyEngineLink(backend(fmt), dispatch_bytes_per_token=57344, combine_bytes_per_token=114688)
    got = moe(link, x, idx, w, dev)
    want = moe(backend(fmt), x, idx, w, dev)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert link.in_flight == []


@pytest.mark.gpu
@cuda
def test_gpu_two_in_flight_and_compute_between():
    """TBO's pattern: A and B both in flight, compute launched between _a and _b; results equal one at a time."""
    fn = SwiGLUExperts.build(E, H, I, seed=4)
    dev = SwiGLUExperts(*(t.cuda() for t in (fn.w_gate, fn.w_up, fn.w_down))).local(0, E)
    xa, ia, wa = inputs(tokens=96, device="cuda")
    xb, ib, wb = xa[:40] * 2, ia[:40], wa[:40]
    link = CopyEngineLink(backend(DispatchFormat.MASKED, capacity=96), dispatch_bytes_per_token=57344)
    link.record_transfers = True
    sa, sb = link.dispatch_a(xa, ia, wa), link.dispatch_a(xb, ib, wb)
    xa @ torch.randn(H, 4096, device="cuda")  # compute on the compute stream while both copies run
    da, db = link.dispatch_b(sa), link.dispatch_b(sb)
    ca = link.combine_a(run_experts(da, dev), da.handle)
    cb = link.combine_a(run_experts(db, dev), db.handle)
    out_a, out_b = link.combine_b(ca), link.combine_b(cb)
    ref = backend(DispatchFormat.MASKED, capacity=96)
    assert torch.equal(out_a, moe(ref, xa, ia, wa, dev)) and torch.equal(out_b, moe(ref, xb, ib, wb, dev))
    stats = link.stats()
    assert stats["transfers"] == 4 and stats["bytes"] >= 96 * 57344
    # the overlap: compute stalled for less than the copies took (the matmul and B's experts ran under them)
    assert stats["exposed_s"] < stats["comm_s"], stats


@pytest.mark.gpu
@cuda
def test_gpu_link_inside_a_cuda_graph():
    fn = SwiGLUExperts.build(E, H, I, seed=5)
    dev = SwiGLUExperts(*(t.cuda() for t in (fn.w_gate, fn.w_up, fn.w_down))).local(0, E)
    x, idx, w = inputs(tokens=32, device="cuda")
    link = CopyEngineLink(backend(DispatchFormat.MASKED, capacity=32), dispatch_bytes_per_token=4096)
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe(link, static_x, idx, w, dev)  # warm-up: streams, staging buffers
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(link, static_x, idx, w, dev)
    for scale in (1.0, -0.5):
        static_x.copy_(x * scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe(backend(DispatchFormat.MASKED, capacity=32), x * scale, idx, w, dev))
