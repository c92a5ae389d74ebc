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


class ManualTime:
    """A clock for `WallClock` that moves only when slept on (by exactly the delay) or polled (by ``poll_s``, the
    cost of one spin iteration): every sleep and every poll is seen, and no real time passes."""

    def __init__(self, poll_s=1e-4):
        self.t, self.poll_s, self.sleeps, self.polls = 100.0, poll_s, [], 0

    def clock(self):
        self.polls += 1
        self.t += self.poll_s
        return self.t

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.t += seconds


def test_wall_clock_sleeps_not_spins():
    """The link's wait is one sleep to the transfer's completion, not a spin: the deadline is honoured."""
    from tbo.comm.emulated import WallClock

    time = ManualTime()
    link = EmulatedLink(LocalBackend(4), 0.05, 1e12, WallClock(clock=time.clock, sleep=time.sleep))
    x, idx, w = torch.randn(2, H), torch.tensor([[0], [1]]), torch.ones(2, 1)
    link.dispatch_b(link.dispatch_a(x, idx, w))
    transfer, = link.stats.transfers
    assert transfer.duration == pytest.approx(0.05 + x.nbytes / 1e12)
    assert len(time.sleeps) == 1 and time.sleeps[0] == pytest.approx(transfer.complete - transfer.wait_start,
                                                                      abs=2 * time.poll_s)
    assert transfer.wait_end >= transfer.complete  # woken at (not before) the deadline
    assert time.polls <= 6  # book, wait start, sleep, one check after waking, wait end: no spinning


def test_wall_clock_spins_only_the_tail():
    """With ``spin_s`` a wait sleeps until ``spin_s`` before its deadline, then spins: polls until the deadline."""
    from tbo.comm.emulated import WallClock

    time = ManualTime(poll_s=1e-3)
    clock = WallClock(spin_s=0.02, clock=time.clock, sleep=time.sleep)
    deadline = time.t + 0.06
    clock.sleep_until(deadline)
    assert time.sleeps == [pytest.approx(0.04, abs=2e-3)]  # the wait less its spun tail
    assert time.t >= deadline and time.t - deadline < 2e-3  # spun to the deadline, no further
    assert 15 <= time.polls <= 25  # about 0.02 s of 1 ms polls


def test_a_metrics_thread_reads_the_link_s_totals_while_the_engine_books_transfers():
    """The engine's thread books and waits on the link while a metrics thread (the /metrics publisher) reads its
    totals: a transfer whose ``_b`` is still waiting counts no exposed time yet, and the readers never see the deque
    of transfers change under them (which raises). The reader's sums are of a consistent copy: never above the final
    totals, and equal to them once the writer is done."""
    import threading

    from tbo.comm.emulated import LinkTimeline, Transfer

    waiting = Transfer("dispatch", 8, 0.0, 1.0, wait_start=0.5)  # mid-wait: wait_end not yet set
    assert waiting.exposed == 0.0
    clock = SimulatedClock()
    link = LinkTimeline(1.0, 1e12, clock)  # latency-bound: each transfer completes 1 s after its launch
    done, errors, reads = threading.Event(), [], [0]

    def read() -> None:
        try:
            while not done.is_set():
                stats = link.stats
                exposed = stats.exposed_s  # read before the count, which only grows
                assert exposed <= stats.count * 0.5 + 1e-6 and stats.comm_s >= 0
                reads[0] += 1
        except Exception as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(20_000):  # 5x the transfers kept one by one: folding runs too
            transfer = link.book("dispatch", 1)
            clock.advance(0.5)  # half of it hidden
            link.wait(transfer)
            clock.advance(0.5 * (i % 3))  # apart, or overlapping the next one's interval
    finally:
        done.set()
        reader.join(30)
    assert not errors, errors[0]
    assert reads[0] > 0 and link.stats.count == 20_000
    assert link.stats.exposed_s == pytest.approx(20_000 * 0.5)
