"""Capture-safe MASKED decode: the fixed-shape route equals the counted one, and nothing reads the device on the host.

The ``meta`` device has shapes and no data: any ``.item()``, ``.tolist()``, ``nonzero`` or data-dependent shape
raises there. A step that runs on meta tensors is therefore free of host syncs, which is what CUDA-graph capture
needs; the GPU tests run the same step under ``torch.cuda.set_sync_debug_mode("error")`` and inside a graph.
"""

import pytest
import torch

from tbo.comm import DispatchFormat, LocalBackend, devices
from tbo.experts import run_experts
from tbo.comm.layout import expanded_route, expert_major_perm, static_masked_route, to_masked
from tbo.testing.moe import SwiGLUExperts, make_routing

H, I, E = 16, 24, 8


def moe(backend, x, idx, w, fn):
    d = backend.dispatch_b(backend.dispatch_a(x, idx, w))
    return d, backend.combine_b(backend.combine_a(run_experts(d, fn), d.handle))


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("tokens", [0, 1, 13, 40])
def test_static_masked_equals_counted_masked_bit_exact(top_k, tokens):
    experts = SwiGLUExperts.build(E, H, I, seed=top_k)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    idx, w = make_routing(tokens, E, top_k, seed=tokens + top_k, skew=2.0, drop=0.2)
    static = LocalBackend(E, DispatchFormat.MASKED, masked_capacity=max(tokens, 1))
    counted = LocalBackend(E, DispatchFormat.MASKED)  # capacity None: sized by the largest count, read on the host
    assert static.capture_safe and not counted.capture_safe
    ds, out_s = moe(static, x, idx, w, experts.local(0, E))
    dc, out_c = moe(counted, x, idx, w, experts.local(0, E))
    assert torch.equal(ds.tokens_per_expert, dc.tokens_per_expert)
    cap = dc.hidden.shape[1]
    assert torch.equal(ds.hidden[:, :cap], dc.hidden)  # the same matrices reach the experts
    assert not ds.hidden[:, cap:].any()
    assert torch.equal(out_s, out_c)
    _, out_e = moe(LocalBackend(E), x, idx, w, experts.local(0, E))
    assert torch.equal(out_s, out_e)


def test_static_route_layout_is_the_counted_layout():
    idx, _ = make_routing(30, E, 3, seed=7, drop=0.1)
    route = static_masked_route(idx, E, 30)
    counted = expanded_route(idx, 1, E)
    assert torch.equal(route.counts, counted.send_counts[0])
    # pair p sits at row dest[p] of the flat buffer; to_masked puts the counted route's rows in the same places
    pair_ids = torch.arange(idx.numel(), dtype=torch.float32).unsqueeze(1)
    flat = torch.zeros(route.scratch + 1, 1).index_put_((route.dest,), pair_ids)[: route.scratch].view(E, 30, 1)
    rows = pair_ids[counted.pair_ids][expert_major_perm(counted.send_counts)]
    assert torch.equal(flat, to_masked(rows, counted.send_counts[0], 30))
    assert int((route.dest == route.scratch).sum()) == int((idx < 0).sum())  # dropped slots go to scratch


def test_eager_slabs_hold_the_step_and_a_capture_refuses_more_than_the_capacity(monkeypatch):
    """Issue 22, defects 1-2. Eager, a step above ``masked_capacity`` gets slabs of its own size (before: a
    ValueError on the CPU, a sticky device assert on a GPU, e.g. a GraphRunner's eager fallback at twice its largest
    bucket). While capturing, such a step is refused on the host, before any device work."""
    b = LocalBackend(4, DispatchFormat.MASKED, masked_capacity=3)
    x = torch.randn(5, H)
    idx, w = torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1)
    d = b.dispatch_b(b.dispatch_a(x, idx, w))
    assert d.hidden.shape == (4, 5, H) and d.tokens_per_expert.tolist() == [5, 0, 0, 0]
    assert torch.equal(d.hidden[0], x)  # nothing dropped
    # only a row naming one expert twice can overflow slabs of the step's size: a ValueError on the CPU
    with pytest.raises(ValueError, match="more than the masked capacity 5 rows"):
        b.dispatch_a(x, torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2))
    monkeypatch.setattr(devices, "capturing", lambda device=None: True)  # what torch reports inside a capture
    with pytest.raises(ValueError, match="capturing a step of 5 tokens with masked_capacity=3"):
        b.dispatch_a(x, idx, w)
    assert b.dispatch_a(x[:3], idx[:3], w[:3]).pending.shape == (4, 3, H)  # within the capacity: captured as before
    with pytest.raises(ValueError, match="masked_capacity=0 must be a positive row count"):
        LocalBackend(4, DispatchFormat.MASKED, masked_capacity=0)


def test_top8_of_16_at_twice_the_capacity_runs_eagerly_and_equals_the_counted_route():
    experts = SwiGLUExperts.build(16, H, I, seed=8)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(8))
    idx, w = make_routing(64, 16, 8, seed=8)
    small = LocalBackend(16, DispatchFormat.MASKED, masked_capacity=32)  # a largest bucket of 32
    _, got = moe(small, x, idx, w, experts.local(0, 16))
    _, want = moe(LocalBackend(16), x, idx, w, experts.local(0, 16))
    assert torch.equal(got, want)


def test_capture_safe_only_for_fixed_capacity_masked():
    assert LocalBackend(E, DispatchFormat.MASKED, masked_capacity=8).capture_safe
    for fmt in (DispatchFormat.EXPANDED, DispatchFormat.NORMAL):
        assert not LocalBackend(E, fmt, masked_capacity=8).capture_safe
    assert not LocalBackend(E, DispatchFormat.MASKED).capture_safe


def _meta_moe(backend, tokens=12, top_k=2):
    experts = SwiGLUExperts.build(E, H, I)
    fn = SwiGLUExperts(*(w.to("meta") for w in (experts.w_gate, experts.w_up, experts.w_down))).local(0, E)
    x = torch.empty(tokens, H, device="meta")
    idx = torch.empty(tokens, top_k, dtype=torch.long, device="meta")
    w = torch.empty(tokens, top_k, device="meta")
    return moe(backend, x, idx, w, fn)


def test_masked_moe_runs_on_meta_tensors():
    d, out = _meta_moe(LocalBackend(E, DispatchFormat.MASKED, masked_capacity=12))
    assert out.device.type == "meta" and out.shape == (12, H)
    assert d.hidden.shape == (E, 12, H) and d.tokens_per_expert.shape == (E,)


@pytest.mark.parametrize("fmt,capacity", [(DispatchFormat.EXPANDED, None), (DispatchFormat.NORMAL, None),
                                          (DispatchFormat.MASKED, None)])
def test_meta_catches_the_formats_that_read_the_host(fmt, capacity):
    """The proof is only worth something if meta does catch host reads: the counted formats must fail there."""
    with pytest.raises((NotImplementedError, RuntimeError)):
        _meta_moe(LocalBackend(E, fmt, masked_capacity=capacity))


# ---- issue 22, defect 9: the MASKED expert paths of a GPU --------------------------------------------------------
def _stacked(experts):
    from tbo.experts import StackedSwiGLU

    return StackedSwiGLU(experts.w_gate, experts.w_up, experts.w_down)


@pytest.mark.parametrize("skew", [0.0, 3.0])
def test_grouped_and_batched_expert_paths_equal_the_counted_rows(skew):
    """The grouped path packs the routed rows expert after expert and runs one grouped GEMM per projection with the
    counts as device-side group ends; the batched one runs one GEMM chain over every slab. Both give each routed
    row its expert's output and zero elsewhere (checked here with the CPU's grouped_mm; a GPU runs it in bf16)."""
    from tbo.experts.run import _run_masked, _run_masked_batched, _run_masked_grouped

    experts = SwiGLUExperts.build(E, H, I, seed=11)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(11))
    idx, w = make_routing(40, E, 3, seed=11, skew=skew, drop=0.1)
    d = LocalBackend(E, DispatchFormat.MASKED, masked_capacity=40).dispatch_b(
        LocalBackend(E, DispatchFormat.MASKED, masked_capacity=40).dispatch_a(x, idx, w))
    assert d.tokens_per_expert.min() < d.tokens_per_expert.max()  # uneven groups, some maybe empty
    want = _run_masked(d.hidden, d.tokens_per_expert.tolist(), experts.local(0, E))
    for run in (_run_masked_grouped, _run_masked_batched):
        got = run(d.hidden, d.tokens_per_expert, _stacked(experts))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        rows = torch.arange(40).unsqueeze(0) >= d.tokens_per_expert.unsqueeze(1)
        assert not got[rows].any()  # rows past each count are exactly zero


def test_run_experts_picks_a_path_that_never_calls_the_expert_per_slab():
    """Before, MASKED off the CPU ran one GEMM chain per expert over its whole slab (16 chains at 16 experts). With
    stacked weights the per-expert function is not called at all."""
    from tbo.experts import masked_path

    experts = SwiGLUExperts.build(E, H, I, seed=12)
    calls = []

    def counted(e, rows):
        calls.append(e)
        return experts(e, rows)

    for dtype, path in ((torch.float32, "batched"), (torch.bfloat16, "grouped")):
        meta = SwiGLUExperts(*(t.to("meta", dtype) for t in (experts.w_gate, experts.w_up, experts.w_down)))
        x = torch.empty(12, H, device="meta", dtype=dtype)
        idx = torch.empty(12, 2, dtype=torch.long, device="meta")
        backend = LocalBackend(E, DispatchFormat.MASKED, masked_capacity=12)
        d = backend.dispatch_b(backend.dispatch_a(x, idx, torch.empty(12, 2, device="meta")))
        assert masked_path(d.hidden, _stacked(meta)) == path
        out = run_experts(d, counted, _stacked(meta))
        assert out.shape == (E, 12, H) and out.dtype == dtype and calls == []
        assert masked_path(d.hidden) == "per-expert"
        run_experts(d, counted)
        assert calls == list(range(E))
        calls.clear()
    assert masked_path(torch.zeros(E, 4, H), _stacked(experts)) == "counted"
    assert masked_path(torch.empty(E, 4, H, device="meta"), _stacked(experts)) == "per-expert"  # other device
