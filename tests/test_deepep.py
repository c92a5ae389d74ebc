"""DeepEP backends on the CPU stand-in of deep_ep.Buffer (real gloo underneath), and the stand-in's rules."""

import pytest
import torch

from tbo.comm import DispatchFormat, LocalBackend
from tbo.experts import run_experts
from tbo.comm.deepep import DeepEPLowLatencyBackend, DeepEPNormalBackend, supported_kwargs
from tbo.comm.fp8 import dequantize_per_token_group, quantize_per_token_group
from tbo.harness.launch import launch
from tbo.comm.sm_budget import deep_ep_num_sms
from tbo.testing.deepep_standin import Buffer, contract_probe
from tbo.testing.moe import SwiGLUExperts, make_routing

TOKENS = {2: [9, 0], 4: [5, 0, 11, 3]}
MAX_TOKENS = 16


def global_batch(world, top_k, hidden, seed, num_experts=8):
    counts = TOKENS[world]
    x = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(seed))
    idx, w = make_routing(sum(counts), num_experts, top_k, seed=seed, drop=0.1)
    return counts, x, idx, w


def moe(backend, x, idx, w, fn):
    d = backend.dispatch_b(backend.dispatch_a(x, idx, w))
    out = run_experts(d, fn)
    return backend.combine_b(backend.combine_a(out, d.handle))


def make_backend(kind, use_fp8):
    if kind == "normal":
        return DeepEPNormalBackend(Buffer(timeout_s=30), 8, use_fp8=use_fp8)
    return DeepEPLowLatencyBackend(Buffer(low_latency_mode=True, timeout_s=30), 8, MAX_TOKENS, use_fp8=use_fp8)


def _run(rank, world, cases):
    results = []
    for kind, top_k, hidden, use_fp8, seed in cases:
        counts, x, idx, w = global_batch(world, top_k, hidden, seed)
        lo = sum(counts[:rank])
        sl = slice(lo, lo + counts[rank])
        backend = make_backend(kind, use_fp8)
        experts = SwiGLUExperts.build(8, hidden, 32, seed=seed)
        results.append(moe(backend, x[sl], idx[sl], w[sl], experts.local(rank, backend.num_local_experts)))
        assert backend.buffer.pending_hooks() == []
    return results


CASES = [(kind, k, 16, False, 7 * k) for kind in ("normal", "low_latency") for k in (2, 4)]
FP8_CASES = [("normal", 2, 128, True, 3), ("low_latency", 2, 128, True, 4)]


def reference(world, kind, top_k, hidden, use_fp8, seed):
    counts, x, idx, w = global_batch(world, top_k, hidden, seed)
    if use_fp8:  # the same rounding the FP8 path applies, done up front
        x = dequantize_per_token_group(*quantize_per_token_group(x))
    fmt = DispatchFormat.NORMAL if kind == "normal" else DispatchFormat.MASKED
    experts = SwiGLUExperts.build(8, hidden, 32, seed=seed)
    return moe(LocalBackend(8, fmt), x, idx, w, experts.local(0, 8))


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_deepep_backends_equal_local_reference(world):
    cases = CASES + (FP8_CASES if world == 2 else [])
    per_rank = launch(_run, world, cases, timeout_s=180)
    for c, case in enumerate(cases):
        got = torch.cat([per_rank[r][c] for r in range(world)])
        want = reference(world, *case)
        kind, use_fp8 = case[0], case[3]
        if kind == "low_latency" and not use_fp8:
            assert torch.equal(got, want), f"low-latency top-{case[1]} on {world} ranks is not bit-identical"
        else:  # NORMAL sums partial results across ranks: a different rounding order
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _violations(rank, world):
    """Each DeepEP rule, broken on purpose; returns the error each raised (None if it did not)."""
    found = {}
    expect = contract_probe(found)

    x = torch.randn(4, 16)
    idx, w = make_routing(4, 8, 2, seed=rank)
    normal = Buffer(timeout_s=20)
    layout = normal.get_dispatch_layout(idx, 8)
    expect("allocate_on_comm_stream without previous_event",
           lambda: normal.dispatch(x, None, layout[0], None, layout[3], layout[2], idx, w, async_finish=True,
                                   allocate_on_comm_stream=True))
    expect("allocate_on_comm_stream without async_finish",
           lambda: normal.get_dispatch_layout(idx, 8, previous_event=Buffer.capture(), allocate_on_comm_stream=True))
    # data arrives only at the event's wait
    recv, *_rest, event = normal.dispatch(x, None, layout[0], None, layout[3], layout[2], idx, w,
                                          previous_event=Buffer.capture(), async_finish=True)
    found["nan before wait"] = bool(torch.isnan(recv).all()) if recv.numel() else True
    event.current_stream_wait()
    found["finite after wait"] = bool(torch.isfinite(recv).all())

    ll = Buffer(low_latency_mode=True, timeout_s=20)
    expect("async_finish with return_recv_hook",
           lambda: ll.low_latency_dispatch(x, idx, MAX_TOKENS, 8, use_fp8=False, async_finish=True,
                                           return_recv_hook=True))
    r1 = ll.low_latency_dispatch(x, idx, MAX_TOKENS, 8, use_fp8=False, return_recv_hook=True)
    r2 = ll.low_latency_dispatch(x, idx, MAX_TOKENS, 8, use_fp8=False, async_finish=True)
    found["nan before hook"] = bool(torch.isnan(r1[0]).all())
    expect("third result alive", lambda: ll.low_latency_dispatch(x, idx, MAX_TOKENS, 8, use_fp8=False))
    r1[4]()  # r1 received: a third call is allowed now ...
    expect("hook called twice", r1[4])
    r3 = ll.low_latency_dispatch(x, idx, MAX_TOKENS, 8, use_fp8=False, return_recv_hook=True)
    expect("event never waited before reuse",  # ... but r2 was never waited and r3 never hooked
           lambda: ll.low_latency_dispatch(x, idx, MAX_TOKENS, 8, use_fp8=False))
    r2[3].current_stream_wait()
    found["pending hooks"] = ll.pending_hooks()
    r4 = ll.low_latency_dispatch(x, idx, MAX_TOKENS, 8, use_fp8=False, return_recv_hook=True)
    expect("hook never called before reuse",
           lambda: ll.low_latency_dispatch(x, idx, MAX_TOKENS, 8, use_fp8=False, return_recv_hook=True))
    r3[4](), r4[4]()
    expect("odd SM count", lambda: Buffer.set_num_sms(3))
    other = Buffer(low_latency_mode=True, timeout_s=20)  # a fresh buffer: ranks now diverge on purpose
    if rank == 0:
        expect("different call order", lambda: other.get_dispatch_layout(idx, 8) and other.dispatch(
            x, None, layout[0], None, layout[3], layout[2], idx, w))
    else:
        expect("different call order", lambda: other.low_latency_dispatch(x, idx, MAX_TOKENS, 8))
    return found


@pytest.mark.dist
def test_standin_enforces_deepep_rules():
    r0, r1 = launch(_violations, 2, timeout_s=120)
    for found in (r0, r1):
        assert "requires previous_event and async_finish" in found["allocate_on_comm_stream without previous_event"]
        assert "requires previous_event and async_finish" in found["allocate_on_comm_stream without async_finish"]
        assert found["nan before wait"] is True and found["finite after wait"] is True
        assert "cannot both be set" in found["async_finish with return_recv_hook"]
        assert "2 low-latency results are alive" in found["third result alive"]
        assert found["nan before hook"] is True
        assert "called twice" in found["hook called twice"]
        assert "its event was never waited" in found["event never waited before reuse"]
        assert "its receive hook was never called" in found["hook never called before reuse"]
        assert len(found["pending hooks"]) == 1 and "low_latency_dispatch" in found["pending hooks"][0]
        assert "must be even" in found["odd SM count"]
    assert "rank 0 made call #" in r0["different call order"] and "low_latency_dispatch" in r0["different call order"]
    assert "rank 1 made call #" in r1["different call order"]


def _tbo_decode_pattern(rank, world):
    """Two microbatches through low-latency mode in the decode TBO order; results equal one-at-a-time."""
    backend = make_backend("low_latency", False)
    experts = SwiGLUExperts.build(8, 16, 32, seed=1)
    fn = experts.local(rank, backend.num_local_experts)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(n, 16, generator=g) for n in (5, 3)]
    routes = [make_routing(x.shape[0], 8, 2, seed=10 * rank + i) for i, x in enumerate(xs)]
    alone = [moe(backend, x, *r, fn) for x, r in zip(xs, routes)]
    sa = backend.dispatch_a(xs[0], *routes[0])
    sb = backend.dispatch_a(xs[1], *routes[1])  # two dispatches in flight: the double buffer is full
    da = backend.dispatch_b(sa)  # A's hook receives it, freeing a buffer ...
    ca = backend.combine_a(run_experts(da, fn), da.handle)  # ... for A's combine, while B's dispatch still flies
    db = backend.dispatch_b(sb)
    yb = run_experts(db, fn)
    out_a = backend.combine_b(ca)
    cb = backend.combine_a(yb, db.handle)
    out_b = backend.combine_b(cb)
    return torch.equal(out_a, alone[0]) and torch.equal(out_b, alone[1])


@pytest.mark.dist
def test_low_latency_two_microbatches_in_decode_order():
    assert launch(_tbo_decode_pattern, 2) == [True, True]


def test_supported_kwargs_filters_by_signature():
    def old(x, async_finish=False):
        return x

    def any_kw(x, **kw):
        return x

    assert supported_kwargs(old, async_finish=True, allocate_on_comm_stream=True) == {"async_finish": True}
    assert supported_kwargs(any_kw, a=1, b=2) == {"a": 1, "b": 2}


def test_deep_ep_num_sms_save_restore():
    before = Buffer.num_sms
    with deep_ep_num_sms(24, Buffer):
        assert Buffer.num_sms == 24
    assert Buffer.num_sms == before
    with pytest.raises(RuntimeError):
        with deep_ep_num_sms(16, Buffer):
            raise RuntimeError("forward failed")
    assert Buffer.num_sms == before


def test_create_without_deep_ep_says_how_to_install():
    from tbo.util.optional import try_import

    if try_import("deep_ep") is not None:
        pytest.skip("deep_ep is installed")
    with pytest.raises(ImportError, match="DeepEPNormalBackend needs the optional package 'deep_ep'.*from source"):
        DeepEPNormalBackend.create(None, 8, 1 << 20)
    with pytest.raises(ImportError, match="DeepEPLowLatencyBackend"):
        DeepEPLowLatencyBackend.create(None, 8, 128, 1024)
