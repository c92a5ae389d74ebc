"""The tensor-parallel all-reduce as a transfer (`TPAllReduce`): real gloo ranks, exact sums, asynchronous launch,
named failures within their deadline, and the emulated link's overlap on a simulated clock."""

import os
import time
from pathlib import Path

import pytest
import torch

from tbo import CommTimeoutError
from tbo.comm import AllReduceState, TPAllReduce, ring_allreduce_bytes
from tbo.comm.emulated import EmulatedLink, SimulatedClock
from tbo.harness.launch import RankError, launch

SHAPES = [(7, 13), (1, 5), (0, 9), (4, 1), (3, 2, 11)]  # odd widths, one row, zero rows, a 3-d tensor


def _part(rank, shape, integers):
    g = torch.Generator().manual_seed(1000 * rank + sum(shape))
    if integers:  # exactly representable sums: equal to the sum in any order of addition (3 ranks)
        return torch.randint(-1000, 1000, shape, generator=g).float()
    return torch.randn(shape, generator=g)


def _sums(rank, world, integers):
    reducer = TPAllReduce(timeout_s=30)
    states = [reducer.reduce_a(_part(rank, s, integers).clone()) for s in SHAPES]  # all in flight at once
    in_flight = len(reducer.in_flight)
    results = [reducer.reduce_b(st) for st in reversed(states)][::-1]  # waited out of order
    return (results, in_flight, reducer.launched, (reducer.rank, reducer.num_ranks), len(reducer.in_flight),
            _order_depends_on_rows(reducer, rank))


def _order_depends_on_rows(reducer, rank):
    """How many elements of a random [64, 1024] sum differ when its rows are reduced in two messages instead of one:
    gloo's ring adds each element's parts in an order that follows the message's size from three ranks on."""
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(rank))
    whole = reducer.reduce_b(reducer.reduce_a(x.clone()))
    parts = [reducer.reduce_b(reducer.reduce_a(x[rows].clone())) for rows in (slice(0, 21), slice(21, 64))]
    return int((torch.cat(parts) != whole).sum())


@pytest.mark.dist
@pytest.mark.parametrize("world, integers", [(2, False), (3, True)])
def test_sum_over_gloo_ranks_is_exact(world, integers):
    per_rank = launch(_sums, world, integers, timeout_s=120)
    nonempty = sum(1 for s in SHAPES if torch.Size(s).numel())
    for rank, (results, in_flight, launched, topology, left, reordered) in enumerate(per_rank):
        assert topology == (rank, world)
        # docs/strategies.md: over two ranks a sum is a + b whatever rows travel together; over three the order
        # of the additions, and so the last bits, follow the message (what TP >= 3 cannot promise bit for bit)
        assert (reordered == 0) if world == 2 else (reordered > 0), reordered
        assert (in_flight, launched, left) == (nonempty, nonempty, 0)  # zero rows launch nothing, on every rank
        for shape, got in zip(SHAPES, results):
            parts = [_part(r, shape, integers) for r in range(world)]
            want = parts[0]
            for p in parts[1:]:
                want = want + p
            assert got.shape == torch.Size(shape)
            assert torch.equal(got, want), f"rank {rank}, shape {shape}: not the exact sum"
            if world == 2 and got.numel():
                assert not torch.equal(got, parts[rank])  # the peer's part really arrived


def _launch_returns_before_the_peer(rank, world, signal_dir):
    """Rank 1 contributes only after rank 0's reduce_a has returned (a file says so): if reduce_a waited for the
    peer, rank 0 would never write it and rank 1 would report the missing signal."""
    reducer = TPAllReduce(timeout_s=30)
    flag = Path(signal_dir) / "rank0-launched"
    x = torch.full((3, 5), float(rank + 1))
    if rank == 0:
        state = reducer.reduce_a(x)
        completed_early = state.pending.is_completed()  # rank 1 has not contributed yet: it waits for the flag
        flag.write_text("1")
        return completed_early, reducer.reduce_b(state)
    deadline = time.monotonic() + 20
    while not flag.exists():
        if time.monotonic() > deadline:
            return "rank 0's reduce_a did not return before rank 1 contributed", None
        time.sleep(0.01)
    return None, reducer.reduce_b(reducer.reduce_a(x))


@pytest.mark.dist
def test_reduce_a_returns_before_the_peer_has_contributed(tmp_path):
    (early, r0), (status, r1) = launch(_launch_returns_before_the_peer, 2, str(tmp_path), timeout_s=90)
    assert status is None and early is False
    assert torch.equal(r0, torch.full((3, 5), 3.0)) and torch.equal(r1, r0)


def _peer_skips(rank, world, timeout_s):
    reducer = TPAllReduce(timeout_s=timeout_s)
    if rank == 1:
        time.sleep(timeout_s + 3)  # alive, but never joins the collective
        return "skipped"
    state = reducer.reduce_a(torch.ones(2, 3), "mlp_reduce")
    try:
        reducer.reduce_b(state)
    except CommTimeoutError as exc:
        first = str(exc)
    else:
        return "no error", ""
    try:
        reducer.reduce_a(torch.ones(2, 3), "attn_reduce")
    except CommTimeoutError as exc:
        return first, str(exc)
    return first, "not refused"


@pytest.mark.dist
def test_missed_deadline_is_named_and_poisons_the_reducer():
    """The 2 s deadline fires (a hang would meet launch's 60 s one), naming the rank and the reduction; the next
    reduction is refused by name, since the timed-out one is still live in the group."""
    (first, second), skipped = launch(_peer_skips, 2, 2.0, timeout_s=60)
    assert skipped == "skipped"
    assert "rank 0 of 2" in first and "mlp_reduce (reduce_b)" in first and "timed out after 2s" in first
    assert "attn_reduce refused" in second and "rebuild the group" in second


def _peer_dies(rank, world):
    reducer = TPAllReduce(timeout_s=600)  # longer than launch's deadlines: the death itself must be seen
    if rank == 1:
        os._exit(0)
    try:
        reducer.reduce_b(reducer.reduce_a(torch.ones(4, 7), "attn_reduce"))
    except CommTimeoutError as exc:
        return str(exc)
    return "no error"


@pytest.mark.dist
def test_dead_peer_is_named_within_the_deadline():
    with pytest.raises(RankError, match="rank 1 exited") as info:
        launch(_peer_dies, 2, timeout_s=60, failure_grace_s=30)
    message = info.value.results[0]
    assert "rank 0 of 2" in message and "attn_reduce" in message
    assert "peer is gone" in message or "timed out" in message


def _drained_and_linked(rank, world):
    reducer = TPAllReduce(timeout_s=30)
    reducer.reduce_a(torch.ones(5, 3))
    reducer.reduce_a(torch.ones(2, 3))
    drained, left = reducer.drain(), len(reducer.in_flight)
    clock = SimulatedClock()
    link = EmulatedLink.from_spec(reducer, "1000000,0.000000064", clock)  # latency 1 s, 64 bytes/s
    x = torch.full((4, 3), float(rank + 1))  # 48 bytes: a ring over 2 ranks sends 2 * 1/2 of them = 48
    state = link.reduce_a(x)
    clock.advance(0.5)  # compute hides half a second of the 1.75 s transfer
    out = link.reduce_b(state)
    t = link.stats.transfers[0]
    return drained, left, out, (t.kind, t.nbytes, t.complete, t.exposed, clock.now())


@pytest.mark.dist
def test_drain_and_the_emulated_link_over_gloo():
    for drained, left, out, (kind, nbytes, complete, exposed, now) in launch(_drained_and_linked, 2, timeout_s=90):
        assert (drained, left) == (2, 0)
        assert torch.equal(out, torch.full((4, 3), 3.0))
        assert (kind, nbytes) == ("allreduce", 48)
        assert complete == pytest.approx(1.0 + 48 / 64) and now == pytest.approx(complete)
        assert exposed == pytest.approx(complete - 0.5)


# ---- one process: the identity, the byte model and the link's overlap ---------------------------------------------


def test_one_rank_is_the_identity_and_still_a_state():
    reducer = TPAllReduce()
    x = torch.randn(3, 5)
    state = reducer.reduce_a(x)
    assert isinstance(state, AllReduceState) and state.nbytes == x.nbytes and state.wire_bytes == 0
    assert reducer.reduce_b(state) is x and reducer.launched == 0 and reducer.in_flight == []
    with pytest.raises(RuntimeError, match="already waited"):
        reducer.reduce_b(state)
    with pytest.raises(TypeError, match="AllReduceState"):
        reducer.reduce_b(x)
    with pytest.raises(TypeError, match="takes a tensor"):
        reducer.reduce_a([1.0])
    with pytest.raises(ValueError, match="timeout_s"):
        TPAllReduce(timeout_s=0)


def test_ring_bytes():
    assert [ring_allreduce_bytes(1200, n) for n in (1, 2, 3, 4, 8)] == [0, 1200, 1600, 1800, 2100]
    with pytest.raises(ValueError):
        ring_allreduce_bytes(10, 0)


def test_compute_between_reduce_a_and_b_hides_the_link():
    """Over an emulated link the reduction takes latency + wire bytes / bandwidth; compute between ``_a`` and ``_b``
    hides it (simulated clock: exact, no wall time). On one rank only the latency is booked."""
    clock = SimulatedClock()
    link = EmulatedLink(TPAllReduce(), latency_s=2.0, bandwidth_bytes_per_s=1.0, clock=clock)
    x = torch.ones(2, 3)
    a = link.reduce_a(x, "attn_reduce")
    clock.advance(1.5)  # the other microbatch's compute
    assert link.reduce_b(a) is x
    b = link.reduce_a(x)
    clock.advance(5.0)  # more compute than the transfer: nothing exposed
    link.reduce_b(b)
    first, second = link.stats.transfers
    assert (first.kind, first.nbytes, first.complete) == ("allreduce", 0, 2.0)
    assert first.exposed == pytest.approx(0.5) and second.exposed == 0
    assert link.stats.exposed_s == pytest.approx(0.5)
    assert link.num_ranks == 1 and link.in_flight == [] and link.drain() == 0
