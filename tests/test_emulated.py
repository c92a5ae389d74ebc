"""EmulatedLink on a simulated clock: exact timelines, no wall time asserted."""

import pytest
import torch

from tbo.comm import LocalBackend
from tbo.experts import run_experts
from tbo.comm.emulated import EmulatedLink, SimulatedClock, parse_link_spec
from tbo.testing.moe import SwiGLUExperts, make_routing

H = 8


def setup(latency=1.0, bw=64.0):
    clock = SimulatedClock()
    link = EmulatedLink(LocalBackend(4), latency, bw, clock)
    x = torch.randn(4, H)  # float32: 4 tokens x top-1 x 8 x 4 bytes = 128 bytes dispatched
    idx = torch.tensor([[0], [1], [2], [3]])
    return clock, link, x, idx, torch.ones(4, 1)


def test_compute_between_a_and_b_is_hidden():
    clock, link, x, idx, w = setup()
    state = link.dispatch_a(x, idx, w)
    assert state.transfer.complete == pytest.approx(1.0 + 128 / 64.0)  # latency + bytes / bandwidth = 3
    clock.advance(2.5)  # compute while the transfer flies
    link.dispatch_b(state)
    assert clock.now() == pytest.approx(3.0)
    assert link.stats.exposed_s == pytest.approx(0.5)  # only the part compute did not cover
    clock.advance(10)  # more compute than the transfer: nothing exposed
    s2 = link.dispatch_a(x, idx, w)
    clock.advance(10)
    link.dispatch_b(s2)
    assert link.stats.transfers[1].exposed == 0


def test_fifo_bandwidth_and_overlapping_latency():
    clock, link, x, idx, w = setup(latency=1.0, bw=64.0)
    a = link.dispatch_a(x, idx, w)
    b = link.dispatch_a(x, idx, w)  # queued behind a on the bandwidth; latencies overlap
    assert (a.transfer.complete, b.transfer.complete) == pytest.approx((3.0, 5.0))
    link.dispatch_b(b)  # waiting for b out of order is fine
    link.dispatch_b(a)
    assert clock.now() == pytest.approx(5.0)
    assert link.stats.comm_s == pytest.approx(5.0)  # busy [0, 5]: the overlap of a and b counted once
    assert link.stats.exposed_s == pytest.approx(5.0)
    c = link.dispatch_a(x, idx, w)  # the link is idle again: starts now
    assert c.transfer.complete == pytest.approx(8.0)


def test_results_unchanged_by_the_link():
    clock, link, x, idx, w = setup()
    experts = SwiGLUExperts.build(4, H, 16)
    x = torch.randn(6, H)
    idx, w = make_routing(6, 4, 2)
    d = link.dispatch_b(link.dispatch_a(x, idx, w))
    got = link.combine_b(link.combine_a(run_experts(d, experts.local(0, 4)), d.handle))
    ref_backend = LocalBackend(4)
    d2 = ref_backend.dispatch_b(ref_backend.dispatch_a(x, idx, w))
    want = ref_backend.combine_b(ref_backend.combine_a(run_experts(d2, experts.local(0, 4)), d2.handle))
    assert torch.equal(got, want)
    assert [t.kind for t in link.stats.transfers] == ["dispatch", "combine"]


def test_spec_parsing_and_errors():
    link = EmulatedLink.from_spec(LocalBackend(2), "20,50")
    assert link.latency_s == pytest.approx(20e-6) and link.bandwidth == pytest.approx(50e9)
    with pytest.raises(ValueError, match="LATENCY_US,GBPS"):
        EmulatedLink.from_spec(LocalBackend(2), "fast")
    with pytest.raises(ValueError, match=r"link spec '-1,50': latency must be >= 0"):
        parse_link_spec("-1,50")
    with pytest.raises(ValueError, match="bandwidth"):
        EmulatedLink(LocalBackend(2), 0.0, 0.0)


def test_wall_clock_sleeps_not_spins():
    import time

    link = EmulatedLink(LocalBackend(4), 0.05, 1e12)
    x, idx, w = torch.randn(2, H), torch.tensor([[0], [1]]), torch.ones(2, 1)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    link.dispatch_b(link.dispatch_a(x, idx, w))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    assert wall >= 0.05  # the deadline is honoured
    assert cpu < wall / 2  # sleeping, not spinning (a ratio with a wide margin)


def test_wall_clock_spins_only_the_tail():
    """With ``spin_s`` a wait sleeps, then spins its last ``spin_s``: the deadline is honoured to the spin loop's
    precision, and the CPU time is about the spin, not the whole wait (ratios with wide margins)."""
    import time

    from tbo.comm.emulated import WallClock

    clock = WallClock(spin_s=0.02)
    cpu0, start = time.process_time(), time.perf_counter()
    clock.sleep_until(start + 0.06)
    end, cpu = time.perf_counter(), time.process_time() - cpu0
    assert end >= start + 0.06
    assert 0.002 < cpu < 0.05  # spun for about 0.02 s of the 0.06 s wait
