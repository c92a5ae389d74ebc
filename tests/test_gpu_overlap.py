"""Overlap on one GPU, checked so that it can fail (issue 22). Skipped without CUDA.

* The overlapped step exposes less communication than the single one, on a copy-engine link made slow enough (the
  copy stream sleeps after the fork, ``torch.cuda._sleep``) that the difference is certain, in front-loaded traces
  (the GPU's own timeline; the check that front-loading held is part of the test).
* Fork and join: with the copy stream asleep before the copies, results are still right, and the same step without
  the join reads buffers the copies have not reached (the test shows that it then fails).
* The front-loading check itself, timing events only inside traces, and ``reserve("cuda")`` serving transfers on
  ``cuda:0``. (``Tracer(cuda=True)`` over a backend other than the copy-engine link: test_gpu.py.)
"""

import pytest
import torch

from tbo.comm import CopyEngineLink, DispatchFormat, LocalBackend
from tbo.comm.devices import device_key
from tbo.experts import run_experts
from tbo.harness.gpu import FrontLoad, GpuShape, GpuWorkload, sleep_cycles_per_ms, traced_step
from tbo.models import ModelConfig, ReferenceModel, StaticAttentionMetadata
from tbo.split import ForwardMode, SplitPolicy
from tbo.testing.moe import SwiGLUExperts, make_routing
from tbo.tools.trace import Tracer, summary, traced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"
POLICY = SplitPolicy(decode_token_threshold=2, prefill_token_threshold=2)
H, I, E = 64, 64, 8


class SlowCopyLink(CopyEngineLink):
    """A copy-engine link made slow: after the fork, before the copies, the copy stream sleeps ``cycles`` per
    transfer plus ``cycles_per_token`` per token (inside the transfer's timing, and inside a captured graph)."""

    def __init__(self, inner, cycles=0, cycles_per_token=0.0, **kwargs):
        super().__init__(inner, **kwargs)
        self.cycles, self.cycles_per_token = cycles, cycles_per_token

    def _before_copies(self, transfer):
        n = int(self.cycles + self.cycles_per_token * transfer.num_tokens)
        if n > 0:
            torch.cuda._sleep(n)


def masked(capacity):
    return LocalBackend(E, DispatchFormat.MASKED, masked_capacity=capacity)


def decode_inputs(n, context, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 256, (n,), generator=g).to(DEV),
            "positions": torch.randint(context // 2, context, (n,), generator=g).to(DEV),
            "slots": torch.arange(n).to(DEV)}


def front_loaded(trace):
    verdict = FrontLoad.of(trace)
    assert verdict is not None and verdict.ok, f"{trace.label}: {verdict} (the measurement would be CPU-paced)"
    return trace


def test_overlap_hides_a_slow_link_that_a_single_batch_exposes():
    """Before, the overlap tests checked equality, comm_s > 0 and 0 <= exposed <= step: all always true."""
    # two layers (one dense, one MoE): few enough kernels for the CPU to queue a whole TBO step ahead of the GPU
    config = ModelConfig.deepseek_v3_tiny(hidden_size=1024, num_heads=8, head_dim=64, num_layers=2,
                                          moe_intermediate=512, dense_intermediate=2048, batch_invariant=False)
    t, moe_layers = 256, 1
    link = SlowCopyLink(masked(t))  # the payload's bytes only: the sleep is what makes it slow
    tracer = Tracer(cuda=True)
    model = ReferenceModel(config, link, device=DEV)
    model.use_backend(traced(link, tracer))
    cache = model.static_cache(t, 512)
    inputs = decode_inputs(t, 512)
    meta = StaticAttentionMetadata.decode(inputs["positions"], inputs["slots"], cache.scratch_slot, slot_offset=0)
    plan = POLICY.plan(ForwardMode.DECODE, t)

    def step(p, observer=None):
        return model.forward_tbo(inputs["ids"], meta, cache, "deepseek_decode", p, observer=observer)

    def trace(p, label):
        return front_loaded(traced_step(tracer, lambda obs: step(p, obs), label, [t], front_load_ms=100))

    for p in (None, plan, None, plan):  # warm-up: kernels, the copy stream, staging
        step(p)
    compute_s = summary(trace(None, "single, fast link")).step_s
    # the link, slowed: a single step's transfers together take as long as its compute
    link.cycles_per_token = sleep_cycles_per_ms() * 1e3 * compute_s / (2 * moe_layers * t)
    torch.testing.assert_close(step(plan), step(None), rtol=1e-3, atol=1e-3)
    single, tbo = summary(trace(None, "single, slow link")), summary(trace(plan, "TBO, slow link"))
    assert single.comm_s >= 0.8 * compute_s, f"the link was not slowed: {single}"
    assert single.exposed_s >= 0.5 * compute_s, f"one batch should expose most of the slow link: {single}"
    assert tbo.exposed_s <= 0.75 * single.exposed_s, f"TBO hid too little: single {single}; TBO {tbo}"


def _experts_on_gpu(seed):
    experts = SwiGLUExperts.build(E, H, I, seed=seed)
    return SwiGLUExperts(*(w.to(DEV) for w in (experts.w_gate, experts.w_up, experts.w_down))).local(0, E)


class NoJoinLink(SlowCopyLink):
    """The same link with the join removed: compute no longer waits for the copies."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept = []

    def _join(self, transfer):
        self.kept.append(transfer.held)  # the copies still use these: keep them until the test synchronises


@pytest.mark.parametrize("join", [True, False])
def test_copy_stream_asleep_before_the_copies_results_stand_or_fall_with_the_join(join):
    fn = _experts_on_gpu(4)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(4)).to(DEV)
    idx, w = make_routing(64, E, 2, seed=4)
    idx, w = idx.to(DEV), w.to(DEV)
    ref = masked(64)
    d = ref.dispatch_b(ref.dispatch_a(x, idx, w))
    want = ref.combine_b(ref.combine_a(run_experts(d, fn), d.handle))
    link = (SlowCopyLink if join else NoJoinLink)(masked(64), cycles=int(sleep_cycles_per_ms() * 50))
    torch.cuda.synchronize()
    state = link.dispatch_a(x, idx, w)  # the copy stream now sleeps 50 ms before copying
    hidden, ids, weights = state.transfer.received
    hidden.fill_(float("nan"))  # what compute reads if it does not wait for the copies (valid routing: no assert)
    weights.fill_(float("nan"))
    ids.copy_(idx)
    d = link.dispatch_b(state)
    out = link.combine_b(link.combine_a(run_experts(d, fn), d.handle))
    torch.cuda.synchronize()
    if join:
        assert torch.equal(out, want)
    else:
        assert not torch.equal(out, want), "without the join the result cannot be right: the check has no teeth"
        link.kept.clear()


def test_front_load_check_tells_a_parked_gpu_from_a_cpu_paced_one():
    work = GpuWorkload(GpuShape.tiny(), DEV, [64], capture=False)
    work.trace("decode", 64, True)  # warm-up
    parked = FrontLoad.of(work.trace("decode", 64, True, front_load=True, sleep_ms=200))
    assert parked is not None and parked.ok, parked
    barely = FrontLoad.of(work.trace("decode", 64, True, front_load=True, sleep_ms=0.001))
    assert barely is not None and not barely.ok, barely


def test_link_timing_events_only_inside_trace():
    work = GpuWorkload(GpuShape.tiny(), DEV, [16], capture=False)
    work.link.record_transfers = True
    work.time({"tbo": work.step("decode", 16, True, False)}, repeats=2, warmup=1)
    assert work.link.transfers and all(t.start is None and t.wait_start is None for t in work.link.transfers)
    work.link.reset_stats()
    work.trace("decode", 16, True)
    assert work.link.transfers and all(t.start is not None and t.wait_start is not None for t in work.link.transfers)
    assert work.link.stats()["comm_s"] > 0


def test_reserve_cuda_serves_transfers_on_cuda_0():
    link = CopyEngineLink(masked(64), dispatch_bytes_per_token=4096)
    link.reserve("cuda", 64 * 4096)
    key = device_key("cuda")
    streams, host = dict(link._streams), list(link._buffers[key].host)
    fn = _experts_on_gpu(5)
    x = torch.randn(64, H).to(DEV)
    idx, w = make_routing(64, E, 2, seed=5)
    d = link.dispatch_b(link.dispatch_a(x, idx.to(DEV), w.to(DEV)))
    link.combine_b(link.combine_a(run_experts(d, fn), d.handle))
    torch.cuda.synchronize()
    assert link._streams == streams and list(link._buffers) == [key]
    assert len(link._buffers[key].host) == len(host) and all(a is b for a, b in zip(link._buffers[key].host, host))
