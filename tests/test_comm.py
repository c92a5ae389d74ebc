"""Expert-parallel backends over real gloo processes, against the local reference."""

import time

import pytest
import torch

from tbo import CommTimeoutError
from tbo.comm import DispatchFormat, LocalBackend, TorchDistributedBackend
from tbo.experts import run_experts
from tbo.harness.launch import RankError, launch
from tbo.testing.moe import SwiGLUExperts, dense_moe_reference, make_routing

HIDDEN, INTER = 16, 24
TOKENS = {2: [9, 0], 4: [5, 0, 11, 3]}  # one rank has no tokens


def global_batch(world, top_k, num_experts, seed):
    counts = TOKENS[world]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), HIDDEN, generator=g)
    idx, w = make_routing(sum(counts), num_experts, top_k, seed=seed, skew=2.0, drop=0.1)
    return counts, x, idx, w


def moe(backend, x, idx, w, experts_fn):
    d = backend.dispatch_b(backend.dispatch_a(x, idx, w))
    return backend.combine_b(backend.combine_a(run_experts(d, experts_fn), d.handle))


def reference(world, top_k, fmt, seed, num_experts):
    counts, x, idx, w = global_batch(world, top_k, num_experts, seed)
    experts = SwiGLUExperts.build(num_experts, HIDDEN, INTER, seed=seed)
    return moe(LocalBackend(num_experts, fmt), x, idx, w, experts.local(0, num_experts))


def _equivalence(rank, world, cases):
    results = []
    for top_k, fmt, seed, num_experts in cases:
        counts, x, idx, w = global_batch(world, top_k, num_experts, seed)
        lo = sum(counts[:rank])
        sl = slice(lo, lo + counts[rank])
        experts = SwiGLUExperts.build(num_experts, HIDDEN, INTER, seed=seed)
        backend = TorchDistributedBackend(num_experts, fmt, timeout_s=30)
        out = moe(backend, x[sl], idx[sl], w[sl], experts.local(rank, backend.num_local_experts))
        results.append(out)
    return results


CASES = [(k, f, 10 * k + i, 8) for k in (2, 4) for i, f in enumerate(DispatchFormat)]


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_distributed_equals_local(world):
    per_rank = launch(_equivalence, world, CASES, timeout_s=180)
    for c, (top_k, fmt, seed, num_experts) in enumerate(CASES):
        got = torch.cat([per_rank[r][c] for r in range(world)])
        want = reference(world, top_k, fmt, seed, num_experts)
        assert got.shape == want.shape
        if fmt is DispatchFormat.NORMAL:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, want), f"{fmt.name} top-{top_k} on {world} ranks is not bit-identical"


@pytest.mark.parametrize("fmt", list(DispatchFormat))
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_local_backend_matches_dense_formula(fmt, top_k):
    experts = SwiGLUExperts.build(8, HIDDEN, INTER, seed=3)
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(1))
    idx, w = make_routing(13, 8, top_k, seed=top_k, drop=0.15)
    got = moe(LocalBackend(8, fmt), x, idx, w, experts.local(0, 8))
    torch.testing.assert_close(got, dense_moe_reference(x, idx, w, experts), rtol=1e-5, atol=1e-5)


def test_one_rank_normal_moves_nothing_when_every_token_is_routed():
    """On one rank, with every token routed, NORMAL dispatch is the identity: no gather out, no scatter back (the
    vLLM plugin's unsplit steps pay for nothing else). A token with no expert stays on the route (deciding
    otherwise would read the ids on the host, a GPU sync per layer) and comes back as zeros; the counts are
    bincount's, computed without its syncs."""
    experts = SwiGLUExperts.build(8, HIDDEN, INTER, seed=3)
    b = LocalBackend(8, DispatchFormat.NORMAL)
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(2))
    idx, w = make_routing(6, 8, 2, seed=5)
    d = b.dispatch_b(b.dispatch_a(x, idx, w))
    assert d.handle.route.identity and d.hidden is x
    assert torch.equal(d.tokens_per_expert, torch.bincount(idx.flatten(), minlength=8))
    y = run_experts(d, experts.local(0, 8))
    assert b.combine_b(b.combine_a(y, d.handle)) is y
    torch.testing.assert_close(y, dense_moe_reference(x, idx, w, experts), rtol=1e-5, atol=1e-5)
    idx[3] = -1  # token 3 names no expert: still the identity, and token 3 comes back as zeros
    d = b.dispatch_b(b.dispatch_a(x, idx, w))
    assert d.handle.route.identity and d.hidden is x
    assert torch.equal(b.combine_b(b.combine_a(run_experts(d, experts.local(0, 8)), d.handle))[3], torch.zeros(HIDDEN))
    assert torch.equal(d.tokens_per_expert, torch.bincount(idx[idx >= 0], minlength=8))
    torch.testing.assert_close(moe(b, x, idx, w, experts.local(0, 8)), dense_moe_reference(x, idx, w, experts),
                               rtol=1e-5, atol=1e-5)


def test_masked_capacity_bounds_captured_steps_not_eager_ones():
    """A step above ``masked_capacity`` runs eagerly with slabs of its size (capture refuses it: test_capture_safe)."""
    b = LocalBackend(4, DispatchFormat.MASKED, masked_capacity=2)
    x = torch.randn(6, HIDDEN)
    idx = torch.zeros(6, 1, dtype=torch.long)
    assert torch.equal(moe(b, x, idx, torch.ones(6, 1), lambda e, rows: rows), x)  # every row back, none dropped


def test_counted_masked_layout_refuses_rows_beyond_its_capacity():
    """The counted MASKED layout (multi-rank, counts read on the host) keeps a fixed capacity: more is a ValueError."""
    from tbo.comm.layout import to_masked

    with pytest.raises(ValueError, match="received 6 rows, more than the masked capacity 2"):
        to_masked(torch.zeros(6, HIDDEN), torch.tensor([6, 0, 0, 0]), 2)


@pytest.mark.parametrize(
    "args,match",
    [((torch.zeros(4), torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2)), "hidden must be"),
     ((torch.zeros(4, 8), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2)), r"topk_idx must be \[4"),
     ((torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 3)), "topk_weights shape"),
     ((torch.zeros(4, 8), torch.zeros(4, 2), torch.zeros(4, 2)), r"integer tensor, got torch.float32$"),
     ((torch.zeros(4, 8), *torch.topk(torch.rand(4, 8), 2)), "look swapped: the order is "
      r"\(hidden, topk_idx, topk_weights\), while torch.topk returns \(values, indices\)"),
     ((torch.zeros(4, 8), torch.full((4, 2), 8, dtype=torch.long), torch.zeros(4, 2)), r"\[-1, 8\)"),
     ((torch.zeros(4, 8, device="meta"), torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2)),
      "different devices")],
)
def test_bad_routing_inputs(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LocalBackend(8).dispatch_a(*args)


def test_bad_expert_output_shape():
    b = LocalBackend(4)
    x = torch.randn(3, HIDDEN)
    d = b.dispatch_b(b.dispatch_a(x, torch.tensor([[0], [1], [2]]), torch.ones(3, 1)))
    with pytest.raises(ValueError, match=r"expert output must be \[3, H\]"):
        b.combine_a(torch.zeros(2, HIDDEN), d.handle)
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        LocalBackend(0)


def _two_in_flight(rank, world):
    """Microbatch A and B both have dispatches in flight; the TBO interleaving; compare with one at a time."""
    num_experts, top_k = 8, 2
    experts = SwiGLUExperts.build(num_experts, HIDDEN, INTER, seed=5)
    backend = TorchDistributedBackend(num_experts, DispatchFormat.EXPANDED, timeout_s=30)
    fn = experts.local(rank, backend.num_local_experts)
    g = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(n, HIDDEN, generator=g) for n in (4 + rank, 3)]
    routes = [make_routing(x.shape[0], num_experts, top_k, seed=rank * 10 + i) for i, x in enumerate(xs)]
    alone = [moe(backend, x, *r, fn) for x, r in zip(xs, routes)]
    da = backend.dispatch_a(xs[0], *routes[0])
    db = backend.dispatch_a(xs[1], *routes[1])
    oa = backend.dispatch_b(da)
    ca = backend.combine_a(run_experts(oa, fn), oa.handle)
    ob = backend.dispatch_b(db)
    cb = backend.combine_a(run_experts(ob, fn), ob.handle)
    overlapped = [backend.combine_b(ca), backend.combine_b(cb)]
    return all(torch.equal(a, b) for a, b in zip(alone, overlapped)), len(backend.transport.in_flight)


@pytest.mark.dist
def test_two_microbatches_in_flight_over_gloo():
    assert launch(_two_in_flight, 2) == [(True, 0), (True, 0)]


def _skip_collective(rank, world, timeout_s):
    backend = TorchDistributedBackend(4, timeout_s=timeout_s)
    if rank == 1:
        time.sleep(timeout_s + 3)  # alive, but busy elsewhere: it never joins the collective
        return "skipped"
    try:
        backend.dispatch_a(torch.randn(2, HIDDEN), torch.tensor([[0], [3]]), torch.ones(2, 1))
    except CommTimeoutError as exc:
        return str(exc)
    return "no error"


@pytest.mark.dist
def test_timeout_instead_of_hang():
    """The backend's 2 s deadline fires, naming the rank and the op; a hang would hit launch's 60 s deadline."""
    r0, r1 = launch(_skip_collective, 2, 2.0, timeout_s=60)
    assert r1 == "skipped"
    assert "rank 0" in r0 and "dispatch_a" in r0 and "timed out after 2s" in r0


def _peer_dies(rank, world):
    import os

    backend = TorchDistributedBackend(4, timeout_s=600)  # longer than launch's deadlines: the death must be seen
    if rank == 1:
        os._exit(0)  # the process dies without a word
    try:
        backend.dispatch_a(torch.randn(2, HIDDEN), torch.tensor([[0], [3]]), torch.ones(2, 1))
    except CommTimeoutError as exc:
        return str(exc)
    return "no error"


@pytest.mark.dist
def test_peer_death_raises_comm_timeout_error():
    """A dead peer is a named error on the survivor, seen as such: the backend's own deadline is longer than launch's
    (60 s, and 30 s for the survivor's report after rank 1 is gone), so waiting it out would fail here."""
    with pytest.raises(RankError, match="rank 1 exited") as info:
        launch(_peer_dies, 2, timeout_s=60, failure_grace_s=30)
    message = info.value.results[0]
    assert "rank 0: dispatch_a" in message and ("peer is gone" in message or "timed out" in message)


# ---- agreed rows: NORMAL without the count exchange --------------------------------------------------------------


def _agreed_rows(rank, world, signal_dir):
    """The same microbatches dispatched twice, by the count exchange and by agreed rows (two in flight at once, one
    of them empty on a rank); then rank 1 starts its dispatch only once rank 0's ``dispatch_a`` has returned, which
    with a count exchange would wait for rank 1 forever."""
    from pathlib import Path

    num_experts, top_k = 8, 2
    experts = SwiGLUExperts.build(num_experts, HIDDEN, INTER, seed=7)
    backend = TorchDistributedBackend(num_experts, DispatchFormat.NORMAL, timeout_s=30)
    fn = experts.local(rank, backend.num_local_experts)
    sizes = [[5 + 2 * r, 0 if r == 1 else 3] for r in range(world)]  # per rank, per microbatch
    g = torch.Generator().manual_seed(300 + rank)
    xs = [torch.randn(n, HIDDEN, generator=g) for n in sizes[rank]]
    routes = [make_routing(x.shape[0], num_experts, top_k, seed=rank * 10 + i, drop=0.2) for i, x in enumerate(xs)]
    exchanged = [moe(backend, x, *r, fn) for x, r in zip(xs, routes)]
    exchanges = backend.count_exchanges
    agreed = [tuple(s[m] for s in sizes) for m in range(2)]
    states = [backend.dispatch_a(x, *r, rows_per_rank=agreed[m]) for m, (x, r) in enumerate(zip(xs, routes))]
    sent = [s.nbytes for s in states]
    outs = [backend.dispatch_b(s) for s in states]
    combines = [backend.combine_a(run_experts(o, fn), o.handle) for o in outs]
    overlapped = [backend.combine_b(c) for c in combines]
    same = all(torch.equal(a, b) for a, b in zip(exchanged, overlapped))
    # bf16 rows travel as bytes: what arrives is bit for bit what the count exchange delivers
    low = [backend.dispatch_b(backend.dispatch_a(xs[0].bfloat16(), *routes[0], **kw))
           for kw in ({}, {"rows_per_rank": agreed[0]})]
    same = same and all(torch.equal(getattr(low[0], f), getattr(low[1], f)) for f in ("hidden", "topk_idx",
                                                                                     "topk_weights"))
    same = same and low[1].hidden.dtype == torch.bfloat16
    exchanges += 1
    # the ordering test: rank 0 launches first, and only then tells rank 1 to start
    flag = Path(signal_dir) / "rank0-launched"
    x, r = xs[0], routes[0]
    if rank == 0:
        state = backend.dispatch_a(x, *r, rows_per_rank=agreed[0])
        flag.touch()
    else:
        deadline = time.monotonic() + 20
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not flag.exists():
            return "rank 0 never returned from dispatch_a"
        state = backend.dispatch_a(x, *r, rows_per_rank=agreed[0])
    out = backend.dispatch_b(state)
    late = backend.combine_b(backend.combine_a(run_experts(out, fn), out.handle))
    return (same, torch.equal(late, exchanged[0]), exchanges, backend.count_exchanges - exchanges, sent,
            [int(o.hidden.shape[0]) for o in outs])


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_agreed_rows_dispatch_equals_the_exchange_and_waits_for_no_peer(world, tmp_path):
    """NORMAL dispatch by agreed rows (`rows_per_rank`): bit-identical results to the count exchange's, with two
    microbatches in flight and an empty one; no count exchange made; the padding is on the wire (and counted), and
    dropped on arrival; and ``dispatch_a`` returns before the peer has even started its own."""
    results = launch(_agreed_rows, world, str(tmp_path), timeout_s=180)
    for rank, res in enumerate(results):
        assert not isinstance(res, str), f"rank {rank}: {res}"
        same, late_same, before, after, sent, received = res
        assert same and late_same, f"rank {rank}: agreed-rows results differ from the count exchange's"
        assert before == 3 and after == 0, f"rank {rank}: count exchanges {before} then {after}"
        row = HIDDEN * 4 + 2 * (8 + 4)  # fp32 row, int64 ids, fp32 weights
        n = [5 + 2 * rank, 0 if rank == 1 else 3]
        assert sent[0] >= (world - 1) * n[0] * row  # every peer's chunk padded to this rank's rows
        assert received[0] <= sum(5 + 2 * r for r in range(world))  # the padding dropped on arrival
    assert any(r[5][0] > 0 for r in results)  # rows did arrive


def _bad_rows(rank, world):
    backend = TorchDistributedBackend(8, DispatchFormat.NORMAL, timeout_s=5)
    x, (idx, w) = torch.randn(3, HIDDEN), make_routing(3, 8, 2, seed=1)
    errors = []
    for rows in ([3], [3, -1], [4, 3] if rank == 0 else [3, 4]):
        try:
            backend.dispatch_a(x, idx, w, rows_per_rank=rows)
        except ValueError as e:
            errors.append(str(e))
    try:
        TorchDistributedBackend(8, DispatchFormat.EXPANDED, timeout_s=5).dispatch_a(x, idx, w, rows_per_rank=[3, 3])
    except ValueError as e:
        errors.append(str(e))
    return errors, backend.count_exchanges, len(backend.transport.in_flight)


@pytest.mark.dist
def test_agreed_rows_that_cannot_be_this_dispatchs_are_refused_by_name():
    for errors, exchanges, in_flight in launch(_bad_rows, 2, timeout_s=60):
        assert len(errors) == 4 and exchanges == 0 and in_flight == 0, errors
        assert "must give 2 row counts" in errors[0] and "must give 2 row counts" in errors[1]
        assert "dispatches 4 rows, but it was given 3" in errors[2]
        assert "needs the NORMAL layout" in errors[3]


# ---- agreed rows: one byte record per row, any width, alignment and row count --------------------------------------

#: (hidden dtype, weights dtype, hidden size, top-k): every mix of hidden and weight dtypes, with widths that make the
#: record's byte width no multiple of 8 (292 = hidden 64 fp32 + top-3 int64 ids + top-3 fp32 weights: the engine
#: crash) and odd top-k
PACKED_CASES = [(h, w, size, k) for i, (h, w) in enumerate(
    (h, w) for h in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    for w in (torch.float32, torch.bfloat16, torch.float16))
    for size, k in [((64, 3), (7, 1), (13, 3))[i % 3]]]
#: token rows per rank: a one-row receive (rank 1 gets rank 0's one row and none of its own), zero-row receives
#: (rank 0 from rank 1, and every rank in the last), one row each way, and a one-row sender beside a larger one
PACKED_ROWS = [(1, 0), (1, 1), (3, 1), (0, 0)]


def _packed_inputs(source, rows, hidden_dtype, weights_dtype, hidden, top_k, seed):
    """Rank ``source``'s tokens: every token names an expert on the other rank (4 experts, 2 per rank)."""
    g = torch.Generator().manual_seed(seed * 10 + source)
    x = (torch.randn(rows, hidden, generator=g) * 4).to(hidden_dtype)
    if top_k == 1:
        idx = torch.full((rows, 1), 2 * (1 - source), dtype=torch.long)
    else:
        idx = torch.stack([torch.randperm(4, generator=g)[:top_k] for _ in range(rows)]) if rows else torch.zeros(
            0, top_k, dtype=torch.long)
    w = torch.rand(rows, top_k, generator=g).to(weights_dtype)
    return x, idx, w


def _expected_arrivals(rank, cases):
    """What a dispatch must deliver to ``rank``, computed from every source's inputs alone, as bytes."""
    out = []
    for c, (hd, wd, hidden, k) in enumerate(PACKED_CASES):
        for r, rows in enumerate(PACKED_ROWS):
            parts = []
            for source in range(2):
                x, idx, w = _packed_inputs(source, rows[source], hd, wd, hidden, k, 100 * c + r)
                mine = (idx // 2 == rank).any(dim=1)
                local = torch.where(idx // 2 == rank, idx - 2 * rank, torch.full_like(idx, -1))
                parts.append((x[mine], local[mine], w[mine]))
            out.append(tuple(torch.cat([p[f] for p in parts]).view(torch.uint8) for f in range(3)))
    return out


def _packed_dispatch(rank, world):
    backend = TorchDistributedBackend(4, DispatchFormat.NORMAL, timeout_s=30)
    got, errors = [], []
    for c, (hd, wd, hidden, k) in enumerate(PACKED_CASES):
        for r, rows in enumerate(PACKED_ROWS):
            x, idx, w = _packed_inputs(rank, rows[rank], hd, wd, hidden, k, 100 * c + r)
            try:
                d = backend.dispatch_b(backend.dispatch_a(x, idx, w, rows_per_rank=rows))
            except Exception as e:  # noqa: BLE001 - reported with its case, the other cases still run
                errors.append(f"{hd} rows, {wd} weights, hidden {hidden}, top-{k}, rows {rows}: {e}")
                backend.drain()
                got.append(None)
                continue
            assert d.hidden.dtype == hd and d.topk_weights.dtype == wd, (d.hidden.dtype, d.topk_weights.dtype)
            got.append((d.hidden.view(torch.uint8), d.topk_idx.view(torch.uint8), d.topk_weights.view(torch.uint8)))
    return got, errors, backend.count_exchanges


@pytest.mark.dist
def test_agreed_rows_records_unpack_for_any_width_alignment_and_row_count():
    """Every mix of hidden and weight dtypes (float8 rows included), odd top-k, record widths no multiple of 8,
    one-row and zero-row receives: what arrives is, bit for bit, the rows, local ids and weights the peers sent this
    rank (computed from their inputs alone). A one-row receive of 292-byte records used to fail in ``unpack``
    (``.view(torch.int64)`` of a slice that kept the record's stride), killing both vLLM engines."""
    results = launch(_packed_dispatch, 2, timeout_s=120)
    assert any(rows == (1, 0) for rows in PACKED_ROWS)
    for rank, (got, errors, exchanges) in enumerate(results):
        assert not errors, f"rank {rank}: " + "; ".join(errors)
        assert exchanges == 0
        want = _expected_arrivals(rank, PACKED_CASES)
        for n, (g, e) in enumerate(zip(got, want)):
            case = (PACKED_CASES[n // len(PACKED_ROWS)], PACKED_ROWS[n % len(PACKED_ROWS)])
            assert all(torch.equal(a, b) for a, b in zip(g, e)), f"rank {rank}, case {case}: arrivals differ"
    # the crash's own case ran: rank 1 received exactly one 292-byte record
    one_row = PACKED_CASES.index((torch.float32, torch.float32, 64, 3)) * len(PACKED_ROWS)
    assert results[1][0][one_row][0].shape == (1, 64 * 4)


def test_packing_round_trips_any_row_count():
    """`_Packing` alone, in one process: pack then unpack gives back the same bits for 0, 1 and 5 rows, however
    the records were sliced out of a bigger buffer (a byte offset that is no multiple of any element size)."""
    from tbo.comm.alltoall import _Packing

    for hd, wd, hidden, k in PACKED_CASES:
        p = _Packing(hd, hidden, torch.int64, wd, k)
        for rows in (0, 1, 5):
            x, idx, w = _packed_inputs(0, rows, hd, wd, hidden, k, rows)
            records = p.pack(x, idx, w)
            assert records.shape == (rows, sum(p.widths)) and records.dtype == torch.uint8
            wide = torch.zeros(rows, records.shape[1] + 3, dtype=torch.uint8)  # a wider row stride
            wide[:, 3:] = records
            flat = torch.zeros(3 + records.numel(), dtype=torch.uint8)  # dense rows from byte 3
            flat[3:] = records.flatten()
            for rec in (records, wide[:, 3:], flat[3:].view(records.shape)):
                a, b, c = p.unpack(rec)
                assert torch.equal(a.view(torch.uint8), x.view(torch.uint8)) and torch.equal(b, idx) and \
                    torch.equal(c.view(torch.uint8), w.view(torch.uint8)), (hd, wd, hidden, k, rows)
