"""DeepEP V1 backends on the CPU stand-in of deep_ep.Buffer (real gloo underneath), and the stand-in's rules: the ones
DeepEP 2.1.0 asserts or hangs without (docs/deepep.md cites each)."""

import re

import pytest
import torch
import torch.distributed as dist

from tbo.comm import DispatchFormat, LocalBackend
from tbo.comm.deepep import (LOW_LATENCY_HIDDEN, DeepEPLowLatencyBackend, DeepEPNormalBackend, check_low_latency_sizes,
                             supported_kwargs)
from tbo.comm.fp8 import dequantize_per_token_group, quantize_per_token_group
from tbo.comm.sm_budget import deep_ep_num_sms
from tbo.core.errors import OperationError, StrategyError
from tbo.core.executors import execute_operations, execute_overlapped_operations
from tbo.core.operations import Yield
from tbo.core.state import State
from tbo.core.strategy import OperationsStrategy
from tbo.experts import run_experts
from tbo.harness.launch import launch
from tbo.ops import ExpertParallelOps
from tbo.strategies import bind_layers
from tbo.testing.deepep_standin import Buffer, contract_probe
from tbo.testing.moe import SwiGLUExperts, make_routing

from .rounded_moe import rounded_moe

TOKENS = {2: [9, 0], 4: [5, 0, 11, 3]}
MAX_TOKENS = 16
E = 8
LL_HIDDEN = 2048  # the smallest hidden size DeepEP's low-latency kernels are compiled for


def global_batch(world, top_k, hidden, seed):
    counts = TOKENS[world]
    x = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    idx, w = make_routing(sum(counts), E, top_k, seed=seed, drop=0.1)
    return counts, x, idx, w


def expert_fn(hidden, seed, rank, num_local):
    """SwiGLU experts in float32 whatever the rows' dtype (BF16, or FP8 rows dequantised), cast back to it."""
    experts = SwiGLUExperts.build(E, hidden, 32, seed=seed)
    base = rank * num_local
    return lambda e, x: experts(base + e, x.float()).to(x.dtype)


def moe(backend, x, idx, w, fn, bf16_combine=False):
    d = backend.dispatch_b(backend.dispatch_a(x, idx, w))
    out = run_experts(d, fn)
    return backend.combine_b(backend.combine_a(out.to(torch.bfloat16) if bf16_combine else out, d.handle))


def normal_buffer(hidden, **kw):
    """A normal-mode buffer sized as DeepEP says: its configs' NVLink hints, for the Buffer.num_sms now in effect."""
    w = dist.get_world_size()
    nvl = max(c.get_nvl_buffer_size_hint(hidden * 2, w) for c in (Buffer.get_dispatch_config(w),
                                                                   Buffer.get_combine_config(w)))
    return Buffer(num_nvl_bytes=nvl, timeout_s=30, **kw)


def ll_buffer(hidden=LL_HIDDEN, max_tokens=MAX_TOKENS, **kw):
    w = dist.get_world_size()
    kw.setdefault("num_qps_per_rank", E // w)  # one QP per local expert, as DeepEPLowLatencyBackend.create asks
    return Buffer(num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, w, E),
                  low_latency_mode=True, timeout_s=30, **kw)


def make_backend(kind, use_fp8, hidden):
    if kind == "normal":
        return DeepEPNormalBackend(normal_buffer(hidden), E, use_fp8=use_fp8, hidden=hidden)
    return DeepEPLowLatencyBackend(ll_buffer(hidden), E, MAX_TOKENS, use_fp8=use_fp8)


def _run(rank, world, cases):
    results = []
    for kind, top_k, hidden, use_fp8, seed in cases:
        counts, x, idx, w = global_batch(world, top_k, hidden, seed)
        lo = sum(counts[:rank])
        sl = slice(lo, lo + counts[rank])
        backend = make_backend(kind, use_fp8, hidden)
        results.append(moe(backend, x[sl], idx[sl], w[sl], expert_fn(hidden, seed, rank, backend.num_local_experts)))
        assert backend.buffer.pending_hooks() == []
    return results


CASES = [("normal", k, 16, False, 7 * k) for k in (2, 4)] + [("low_latency", k, LL_HIDDEN, False, 7 * k)
                                                            for k in (2, 4)]
FP8_CASES = [("normal", 2, 128, True, 3), ("low_latency", 2, LL_HIDDEN, True, 4)]


def reference(world, kind, top_k, hidden, use_fp8, seed):
    counts, x, idx, w = global_batch(world, top_k, hidden, seed)
    if use_fp8:  # the same rounding the FP8 path applies, done up front
        x = dequantize_per_token_group(*quantize_per_token_group(x))
    fmt = DispatchFormat.NORMAL if kind == "normal" else DispatchFormat.MASKED
    # DeepEP combines BF16: with FP8 dispatch the experts' float32 output is cast first, here as there
    return moe(LocalBackend(E, fmt), x, idx, w, expert_fn(hidden, seed, 0, E), bf16_combine=use_fp8)


def rounded_reference(world, kind, top_k, hidden, use_fp8, seed):
    """NORMAL mode's output rounded where its ranks round it (`rounded_moe`)."""
    counts, x, idx, w = global_batch(world, top_k, hidden, seed)
    if use_fp8:
        x = dequantize_per_token_group(*quantize_per_token_group(x))
    return rounded_moe(x, idx, w, expert_fn(hidden, seed, 0, E), E, world)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_deepep_backends_equal_local_reference(world):
    cases = CASES + (FP8_CASES if world == 2 else [])
    per_rank = launch(_run, world, cases, timeout_s=240)
    for c, case in enumerate(cases):
        got = torch.cat([per_rank[r][c] for r in range(world)])
        want = reference(world, *case)
        kind, use_fp8 = case[0], case[3]
        assert got.dtype == torch.bfloat16  # what DeepEP's combine returns
        if kind == "low_latency":  # MASKED: the same rows per expert, the same float32 reduction
            assert torch.equal(got, want), f"low-latency top-{case[1]} fp8={use_fp8} on {world} ranks differs"
        else:  # NORMAL sums per-rank partial results, each rounded to BF16 first: the oracle rounds them too
            assert torch.equal(got, rounded_reference(world, *case)), f"normal top-{case[1]} fp8={use_fp8} differs"
            assert not torch.equal(got, want)  # a single rank's rounding differs: the oracle's rounding matters


def _violations(rank, world):
    """Each DeepEP rule, broken on purpose; returns the error each raised (None if it did not)."""
    found = {}
    expect = contract_probe(found)

    x = torch.randn(4, 16).to(torch.bfloat16)
    idx, w = make_routing(4, E, 2, seed=rank)
    normal = normal_buffer(16)
    layout = normal.get_dispatch_layout(idx, E)
    expect("allocate_on_comm_stream without previous_event",
           lambda: normal.dispatch(x, None, layout[0], None, layout[3], layout[2], idx, w, async_finish=True,
                                   allocate_on_comm_stream=True))
    expect("allocate_on_comm_stream without async_finish",
           lambda: normal.get_dispatch_layout(idx, E, previous_event=Buffer.capture(), allocate_on_comm_stream=True))
    # data arrives only at the event's wait
    recv, _, recv_w, _, handle, event = normal.dispatch(x, None, layout[0], None, layout[3], layout[2], idx, w,
                                                        previous_event=Buffer.capture(), async_finish=True)
    found["nan before wait"] = bool(torch.isnan(recv.float()).all()) if recv.numel() else True
    event.current_stream_wait()
    found["finite after wait"] = bool(torch.isfinite(recv.float()).all())
    expect("normal combine in float32", lambda: normal.combine(recv.float(), handle))
    normal.combine(recv, handle)
    small = Buffer(num_nvl_bytes=1 << 20, timeout_s=20)  # room for 20 SMs' channels of these rows, not for 72
    small.dispatch(x, None, layout[0], None, layout[3], layout[2], idx, w)
    with deep_ep_num_sms(72, Buffer):  # more channels than the buffer was sized for: DeepEP's host assert
        expect("more SMs than the buffer was sized for",
               lambda: small.dispatch(x, None, layout[0], None, layout[3], layout[2], idx, w))
    torch.use_deterministic_algorithms(True)
    try:
        expect("torch deterministic with fill_uninitialized_memory",
               lambda: normal.dispatch(x, None, layout[0], None, layout[3], layout[2], idx, w))
    finally:
        torch.use_deterministic_algorithms(False)

    xl = torch.randn(4, LL_HIDDEN).to(torch.bfloat16)
    ll = ll_buffer()
    dispatch = lambda **kw: ll.low_latency_dispatch(xl, idx, MAX_TOKENS, E, use_fp8=False, **kw)  # noqa: E731
    expect("async_finish with return_recv_hook", lambda: dispatch(async_finish=True, return_recv_hook=True))
    r1 = dispatch(return_recv_hook=True)
    found["nan before hook"] = bool(torch.isnan(r1[0].float()).all())
    expect("second call before the first is received", lambda: dispatch(async_finish=True))
    r1[4]()  # r1 received: the next call may launch ...
    expect("hook called twice", r1[4])
    r2 = dispatch(async_finish=True)
    expect("event not waited before the next call", lambda: dispatch(return_recv_hook=True))
    r2[3].current_stream_wait()
    r3 = dispatch(return_recv_hook=True)
    found["pending hooks"] = ll.pending_hooks()
    expect("combine before the dispatch is received",
           lambda: ll.low_latency_combine(torch.zeros(E // world, MAX_TOKENS * world, LL_HIDDEN,
                                                      dtype=torch.bfloat16), idx, w, r3[2]))
    r3[4]()
    expect("combine of float32", lambda: ll.low_latency_combine(r3[0].float(), idx, w, r3[2]))
    out, _, hook = ll.low_latency_combine(r3[0], idx, w, r3[2], return_recv_hook=True)
    hook()
    # the kernels' limits
    expect("float32 x", lambda: ll.low_latency_dispatch(xl.float(), idx, MAX_TOKENS, E, use_fp8=False))
    expect("hidden 1024", lambda: ll.low_latency_dispatch(xl[:, :1024], idx, MAX_TOKENS, E, use_fp8=False))
    idx12 = torch.stack([torch.randperm(E)[:1] for _ in range(4)]).repeat(1, 12)
    expect("top-12", lambda: ll.low_latency_dispatch(xl, idx12, MAX_TOKENS, E, use_fp8=False))
    expect("ranks * tokens not a multiple of 4",
           lambda: ll_buffer(max_tokens=15).low_latency_dispatch(xl, idx, 15, E, use_fp8=False))
    expect("queue depth", lambda: ll_buffer(max_tokens=600).low_latency_dispatch(xl, idx, 600, E, use_fp8=False))
    expect("UE8M0 without round_scale",
           lambda: ll.low_latency_dispatch(xl, idx, MAX_TOKENS, E, use_fp8=True, use_ue8m0=True))
    expect("RDMA buffer too small",
           lambda: Buffer(num_rdma_bytes=1 << 20, low_latency_mode=True, num_qps_per_rank=E, timeout_s=20
                          ).low_latency_dispatch(xl, idx, MAX_TOKENS, E, use_fp8=False))
    expect("fewer QPs than local experts",
           lambda: ll_buffer(num_qps_per_rank=1).low_latency_dispatch(xl, idx, MAX_TOKENS, E, use_fp8=False))
    (q, s), _, _, _, hook = ll.low_latency_dispatch(xl, idx, MAX_TOKENS, E, use_fp8=True, round_scale=True,
                                                    use_ue8m0=True, return_recv_hook=True)
    hook()
    found["ue8m0 scales"] = (s.dtype, s.shape[-1])
    expect("odd SM count", lambda: Buffer.set_num_sms(3))
    other = ll_buffer(num_nvl_bytes=normal.num_nvl_bytes)  # a fresh buffer for both modes: ranks now diverge
    if rank == 0:
        expect("different call order", lambda: other.get_dispatch_layout(idx, E) and other.dispatch(
            x, None, layout[0], None, layout[3], layout[2], idx, w))
    else:
        expect("different call order", lambda: other.low_latency_dispatch(xl, idx, MAX_TOKENS, E))
    return found


@pytest.mark.dist
def test_standin_enforces_deepep_rules():
    r0, r1 = launch(_violations, 2, timeout_s=180)
    for found in (r0, r1):
        assert "requires previous_event and async_finish" in found["allocate_on_comm_stream without previous_event"]
        assert "requires previous_event and async_finish" in found["allocate_on_comm_stream without async_finish"]
        assert found["nan before wait"] is True and found["finite after wait"] is True
        assert "Unsupported type torch.float32" in found["normal combine in float32"]
        assert "NVLink bytes, the buffer has" in found["more SMs than the buffer was sized for"]
        assert "fill_uninitialized_memory" in found["torch deterministic with fill_uninitialized_memory"]
        assert "cannot both be set" in found["async_finish with return_recv_hook"]
        assert found["nan before hook"] is True
        second = found["second call before the first is received"]
        assert "call #1 low_latency_dispatch launched while call #0 low_latency_dispatch is not received" in second
        assert "its receive hook was not called" in second and "DeepEP issue #513" in second
        assert "called twice" in found["hook called twice"]
        assert "its event was not waited" in found["event not waited before the next call"]
        assert len(found["pending hooks"]) == 1 and "low_latency_dispatch" in found["pending hooks"][0]
        assert "low_latency_combine launched while" in found["combine before the dispatch is received"]
        assert "x must be bfloat16" in found["combine of float32"]
        assert "x must be bfloat16" in found["float32 x"]
        assert "Unsupported hidden 1024" in found["hidden 1024"]
        assert "num_topk=12 > kNumMaxTopK=11" in found["top-12"]
        assert "multiple of 4" in found["ranks * tokens not a multiple of 4"]
        assert "nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2" in found["queue depth"]
        assert "UE8M0 SF requires `round_scale=True`" in found["UE8M0 without round_scale"]
        assert "get_low_latency_rdma_size_hint" in found["RDMA buffer too small"]
        assert "one QP per local expert" in found["fewer QPs than local experts"]
        assert found["ue8m0 scales"] == (torch.int32, LL_HIDDEN // 512)
        assert "must be even" in found["odd SM count"]
    assert "rank 0 made call #" in r0["different call order"] and "low_latency_dispatch" in r0["different call order"]
    assert "rank 1 made call #" in r1["different call order"]


# ---- the low-latency rule as a property of the schedule ------------------------------------------------------------
class _MoELayer(ExpertParallelOps):
    """A MoE layer's expert-parallel ops over a backend, with the compute around them reduced to bookkeeping."""

    kind = "moe"

    def __init__(self, backend, fn):
        self.backend, self.fn = backend, fn

    def local_expert(self, e, rows):
        return self.fn(e, rows)

    def op_route(self, state, hidden_states):
        state.moe_in = hidden_states

    def op_attn(self, state):
        pass

    def op_dispatch_a(self, state):
        state.dispatch = self.backend.dispatch_a(state.pop("moe_in"), *state.routes)

    def op_shared(self, state):
        pass

    def op_output(self, state):
        return {"hidden_states": state.pop("routed_out")}


def decode_layer(delta):
    """The DeepSeek decode shape: a Yield after each launch; microbatch A leads by ``delta`` stages."""
    return OperationsStrategy(delta_stages=delta, operations=[
        "route", Yield, "attn", Yield, "dispatch_a", "shared", Yield, "dispatch_b", "experts", "combine_a", Yield,
        "combine_b", Yield, "output"])


def _decode_microbatches(rank, world, delta):
    """Two microbatches through two layers over low-latency mode, in the order the executor runs a decode schedule
    of lead ``delta``. Returns what binding said, what the run did, and whether it equals one microbatch at a time."""
    backend = DeepEPLowLatencyBackend(ll_buffer(), E, MAX_TOKENS)
    fn = expert_fn(LL_HIDDEN, 1, rank, backend.num_local_experts)
    layers = [_MoELayer(backend, fn) for _ in range(2)]
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(n, LL_HIDDEN, generator=g).to(torch.bfloat16) for n in (5, 3)]
    routes = [make_routing(x.shape[0], E, 2, seed=10 * rank + i) for i, x in enumerate(xs)]

    def states():
        out = []
        for r in routes:
            state = State()
            state.pin(routes=r)
            out.append(state)
        return out

    try:
        bind_layers(layers, decode_layer(delta))
        bound = None
    except StrategyError as exc:
        bound = str(exc)
    unchecked = OperationsStrategy.concat([decode_layer(delta).bind(layer) for layer in layers])
    alone = [execute_operations({"hidden_states": x}, unchecked, state=s) for x, s in zip(xs, states())]
    try:
        outs = execute_overlapped_operations([{"hidden_states": x} for x in xs], unchecked, states=states(),
                                             drain=[backend])
        ran = all(torch.equal(o["hidden_states"], a["hidden_states"]) for o, a in zip(outs, alone))
    except OperationError as exc:
        ran = (exc.microbatch, exc.op_name, type(exc.__cause__).__name__, str(exc.__cause__))
    return bound, ran, backend.in_flight


@pytest.mark.dist
def test_low_latency_decode_order_with_lead_two_runs_and_equals_one_at_a_time():
    for bound, ran, in_flight in launch(_decode_microbatches, 2, 2, timeout_s=120):
        assert bound is None  # the schedule keeps one low-latency call un-received at a time
        assert ran is True and in_flight == []


@pytest.mark.dist
def test_low_latency_lead_one_is_refused_at_bind_and_caught_by_the_standin():
    """With delta 1, B's dispatch launches while A's combine is un-received: a hang on GPUs (DeepEP #513). Binding
    refuses the schedule; run anyway, the stand-in raises where the GPUs would hang (the old stand-in, which allowed
    two calls alive, let this pass)."""
    for bound, ran, in_flight in launch(_decode_microbatches, 2, 1, timeout_s=120):
        assert "cannot run over DeepEP low-latency with 2 microbatches and delta_stages=1" in bound
        assert ("microbatch 1's 'dispatch_a' (stage 2, operations[4]) launches while microbatch 0's 'combine_a' "
                "(stage 3, operations[9]) is not yet received (its 'combine_b' has not run)") in bound
        mb, op, cause, message = ran
        assert (mb, op, cause) == (1, "dispatch_a", "DeepEPContractError")
        assert "low_latency_dispatch launched while call #" in message
        assert "low_latency_combine is not received (its receive hook was not called)" in message
        assert in_flight == []  # the executor drained what was launched before raising


def test_low_latency_limits_named_before_the_kernel_asserts():
    check_low_latency_sizes(2, 16, LL_HIDDEN, 8, use_fp8=True)  # fine
    cases = [((2, 15), "num_ranks * num_max_dispatch_tokens_per_rank = 2 * 15 = 30 must be a multiple of 4 (DeepEP's "
                       "TMA needs it); use num_max_dispatch_tokens_per_rank=16"),
             ((2, 512), "needs a queue depth of at least 1026, but NVSHMEM_QP_DEPTH is 1024: use at most 511"),
             ((2, 16, 1024), "hidden=1024: DeepEP's low-latency kernels are compiled for hidden sizes 2048, 2560"),
             ((2, 16, 7168, 12), "top-k 12: DeepEP's low-latency kernels route each token to at most 11 experts")]
    for args, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            check_low_latency_sizes(*args)
    assert 7168 in LOW_LATENCY_HIDDEN and 7680 not in LOW_LATENCY_HIDDEN

    class FakeBuffer:  # the backend reads rank, size and queue depth only, until a call is made
        rank, group_size, nvshmem_qp_depth = 0, 2, 1024

    with pytest.raises(ValueError, match="multiple of 4"):
        DeepEPLowLatencyBackend(FakeBuffer(), E, 15)
    backend = DeepEPLowLatencyBackend(FakeBuffer(), E, 16)
    idx, w = make_routing(4, E, 2)
    with pytest.raises(TypeError, match="takes bfloat16 hidden states.*got torch.float32"):
        backend.dispatch_a(torch.randn(4, LL_HIDDEN), idx, w)
    with pytest.raises(ValueError, match="hidden=1024"):
        backend.dispatch_a(torch.randn(4, 1024).to(torch.bfloat16), idx, w)
    with pytest.raises(ValueError, match="use_ue8m0=True needs use_fp8=True"):
        DeepEPLowLatencyBackend(FakeBuffer(), E, 16, use_ue8m0=True)
    assert DeepEPLowLatencyBackend(FakeBuffer(), E, 16, use_fp8=True).use_ue8m0 is False  # no SM100 here
    assert DeepEPLowLatencyBackend(FakeBuffer(), E, 16, use_fp8=True, use_ue8m0=True).use_ue8m0 is True


def _ue8m0_dispatch(rank, world):
    """On SM100 the backend asks DeepEP for UE8M0 scales (round_scale + use_ue8m0): int32-packed exponents that
    run_experts unpacks, equal to the power-of-two float scales they encode."""
    backend = DeepEPLowLatencyBackend(ll_buffer(), E, MAX_TOKENS, use_fp8=True, use_ue8m0=True)
    fn = expert_fn(LL_HIDDEN, 2, rank, backend.num_local_experts)
    x = torch.randn(6, LL_HIDDEN, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    idx, w = make_routing(6, E, 2, seed=rank, skew=0.0)  # uniform: both ranks receive rows
    d = backend.dispatch_b(backend.dispatch_a(x, idx, w))
    scales = (d.scales.dtype, d.scales.shape[-1])
    rows = dequantize_per_token_group(d.hidden, d.scales)  # what run_experts sees, from the packed exponents
    out = backend.combine_b(backend.combine_a(run_experts(d, fn), d.handle))
    return scales, rows, d.tokens_per_expert, out, backend.use_ue8m0


@pytest.mark.dist
def test_ue8m0_scales_over_low_latency():
    per_rank = launch(_ue8m0_dispatch, 2, timeout_s=120)
    xs = [torch.randn(6, LL_HIDDEN, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16) for r in (0, 1)]
    rounded = [dequantize_per_token_group(*quantize_per_token_group(x, round_scale=True)) for x in xs]
    routing = [make_routing(6, E, 2, seed=r, skew=0.0) for r in (0, 1)]
    idx, w = torch.cat([i for i, _ in routing]), torch.cat([w for _, w in routing])
    # the single-process reference on the same power-of-two-scaled rows, its combine in BF16 as DeepEP's
    want = moe(LocalBackend(E, DispatchFormat.MASKED), torch.cat(rounded), idx, w, expert_fn(LL_HIDDEN, 2, 0, E),
               bf16_combine=True)
    for rank, (scales, rows, counts, out, used) in enumerate(per_rank):
        assert used and scales == (torch.int32, LL_HIDDEN // 512)
        mine = range(rank * E // 2, (rank + 1) * E // 2)
        assert counts.tolist() == [int((idx == e).sum()) for e in mine], f"rank {rank} received other rows"
        assert sum(counts.tolist()) >= 3, f"rank {rank} received too few rows for the check to mean much"
        for e in range(E // 2):  # every row received is one of the senders' rows, quantised with power-of-two scales
            for row in rows[e, : int(counts[e])]:
                assert any(bool((r == row).all(1).any()) for r in rounded)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, want[6 * rank:6 * (rank + 1)]), f"rank {rank}: the combined output differs"


def _normal_sm_budget(rank, world):
    """A V1 normal buffer sized for Buffer.num_sms=20: raising it to 24 is refused before any kernel runs, the
    old count stays, and the backend's own call-time check names the bytes."""
    backend = DeepEPNormalBackend(normal_buffer(16), E, hidden=16)
    errors = {}
    try:
        with deep_ep_num_sms(24, Buffer, backends=[backend]):
            pass
    except ValueError as exc:
        errors["budget"] = str(exc)
    restored = Buffer.num_sms
    with deep_ep_num_sms(20, Buffer, backends=[backend]):  # what it was sized for: fine
        x = torch.randn(3, 16).to(torch.bfloat16)
        idx, w = make_routing(3, E, 2, seed=rank)
        moe(backend, x, idx, w, expert_fn(16, 1, rank, backend.num_local_experts))
    Buffer.num_sms = 24  # set behind tbo's back: the next call refuses, DeepEP would overrun the buffer
    try:
        backend.dispatch_b(backend.dispatch_a(x, idx, w))
    except ValueError as exc:
        errors["call"] = str(exc)
    finally:
        Buffer.num_sms = 20
    return errors, restored


@pytest.mark.dist
def test_raising_deep_ep_sms_past_the_buffer_is_refused():
    for errors, restored in launch(_normal_sm_budget, 2, timeout_s=120):
        assert restored == 20
        for key in ("budget", "call"):
            assert "Buffer.num_sms=24: DeepEP's normal dispatch then needs" in errors[key], errors
            assert "it was made with Buffer.num_sms=20 in effect" in errors[key]


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

