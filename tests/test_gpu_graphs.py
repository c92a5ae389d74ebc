"""CUDA-graph paths not covered by test_gpu.py, and what a device-side assert does (issue 22). Skipped without CUDA.

Prefill capture; a lazy capture switching modes on one bucket (the second capture warms up on padding, not on the
last request's live KV entries); ``clone_outputs=False``; prefill and decode graphs sharing a pool; the grouped-GEMM
expert path in bf16, captured and sync-free. In subprocesses, so that a regression (a sticky device assert, a broken
capture) cannot take the rest of the GPU suite down with it: the eager fallback above the largest bucket at top-8 of
16; an op failing inside a capture, whose own error must be what the caller sees; and a device assert, which is
asynchronous and sticky (why the capture-safe paths must make it impossible).
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tbo.comm import CopyEngineLink, DispatchFormat, LocalBackend
from tbo.experts import StackedSwiGLU, masked_path, run_experts
from tbo.models import ModelConfig, ReferenceModel, StaticAttentionMetadata
from tbo.runtime.cuda_graph import CudaGraphCapturer
from tbo.split import ForwardMode, SplitPolicy
from tbo.testing.moe import SwiGLUExperts, make_routing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[1]
DEV = "cuda"
POLICY = SplitPolicy(decode_token_threshold=2, prefill_token_threshold=2)
FAST = dict(rtol=1e-4, atol=1e-4)  # fp32 fast mode: another GEMM shape, another rounding


def setup(buckets=(4, 8, 16), **runner):
    config = ModelConfig.deepseek_v3_tiny(batch_invariant=False)
    link = CopyEngineLink(LocalBackend(8, DispatchFormat.MASKED, masked_capacity=64), dispatch_bytes_per_token=57344)
    model = ReferenceModel(config, link, device=DEV)
    cache = model.static_cache(32, 64)
    return model, cache, model.graph_runner(cache, "deepseek_decode", list(buckets), policy=POLICY, **runner)


def decode_inputs(n, seed, first_slot=0, context=64):
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 256, (n,), generator=g).to(DEV),
            "positions": torch.randint(context // 2, context, (n,), generator=g).to(DEV),
            "slots": (torch.arange(n) + first_slot).to(DEV)}


def eager(model, cache, inputs, tbo):
    """The unpadded eager step on ``cache`` (a copy of the runner's, taken before the run)."""
    n = inputs["ids"].shape[0]
    return model.decode_step(cache, "deepseek_decode")(inputs, POLICY.plan(ForwardMode.DECODE, n) if tbo else None)


def test_prefill_capture_replays_eager_single_and_tbo():
    model, cache, _ = setup()
    lens = [5, 30, 12]
    meta = StaticAttentionMetadata.build([0, 1, 2], lens, [0, 0, 0], cache.scratch_slot, DEV)
    plan = POLICY.plan(ForwardMode.EXTEND, sum(lens), lens)
    ids = torch.zeros(sum(lens), dtype=torch.long, device=DEV)
    capturer = CudaGraphCapturer()
    for p in (None, plan):
        replay, out = capturer.capture(lambda p=p: model.forward_tbo(ids, meta, cache, "deepseek_prefill", p))
        for seed in (1, 2):
            ids.copy_(torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(seed)))
            want = model.forward_tbo(ids.clone(), meta, cache.clone(), "deepseek_prefill", p)
            replay()
            torch.testing.assert_close(out, want, **FAST)


def test_lazy_capture_switching_modes_keeps_live_kv_entries():
    """The bucket's single graph runs first; its TBO graph is captured lazily on the next TBO request. That capture
    must warm up on padding: before, it re-ran the previous request's slots and positions, rewriting them."""
    model, cache, runner = setup()
    a = decode_inputs(6, seed=1)
    ref = cache.clone()
    torch.testing.assert_close(runner.run(a, tbo=False), eager(model, ref, a, False), **FAST)
    assert runner.last.how == "graph" and sorted(runner._graphs) == [(8, False)]
    slots, pos = a["slots"], a["positions"]
    cache.k[:, slots, pos] = 7.0  # A's entries move on (say its slots now hold other sequences)
    b = decode_inputs(5, seed=2, first_slot=16)
    ref = cache.clone()
    torch.testing.assert_close(runner.run(b, tbo=True), eager(model, ref, b, True), **FAST)
    assert sorted(runner._graphs) == [(8, False), (8, True)]
    assert (cache.k[:, slots, pos] == 7.0).all(), "the lazy TBO capture wrote the previous request's KV entries"
    c = decode_inputs(7, seed=3, first_slot=24)
    ref = cache.clone()
    torch.testing.assert_close(runner.run(c, tbo=False), eager(model, ref, c, False), **FAST)


def test_clone_outputs_false_returns_views_valid_until_the_next_replay():
    model, cache, runner = setup(buckets=(8,), clone_outputs=False)
    first = runner.run(decode_inputs(8, seed=1), tbo=True)
    kept = first.clone()
    b = decode_inputs(8, seed=2, first_slot=8)
    ref = cache.clone()
    second = runner.run(b, tbo=True)
    assert second.data_ptr() == first.data_ptr()  # one static output, viewed twice
    assert torch.equal(first, second) and not torch.equal(kept, second)  # the first view was overwritten
    torch.testing.assert_close(second, eager(model, ref, b, True), **FAST)


def test_prefill_and_decode_graphs_share_a_pool_without_clobbering():
    capturer = CudaGraphCapturer()
    model, cache, runner = setup(buckets=(4, 8), capturer=capturer)
    runner.capture_all(decode_inputs(1, seed=0))
    lens = [9, 14]
    meta = StaticAttentionMetadata.build([0, 1], lens, [0, 0], cache.scratch_slot, DEV)
    ids = torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(4)).to(DEV)
    plan = POLICY.plan(ForwardMode.EXTEND, sum(lens), lens)
    replay, prefill_out = capturer.capture(lambda: model.forward_tbo(ids, meta, cache, "deepseek_prefill", plan))
    assert len(capturer.graphs) == 2 * 2 + 1  # every graph in the capturer's one pool
    d = decode_inputs(7, seed=5, first_slot=8)  # slots apart from the prefill's
    ref = cache.clone()
    first = runner.run(d, tbo=True)
    torch.testing.assert_close(first, eager(model, ref, d, True), **FAST)
    replay()
    torch.testing.assert_close(prefill_out, model.forward_tbo(ids, meta, cache.clone(), "deepseek_prefill", plan),
                               **FAST)
    assert torch.equal(runner.run(d, tbo=True), first)  # the prefill replay left the decode graphs' memory alone


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                    reason="grouped_mm reads its group ends on the device from Hopper on")
def test_grouped_expert_path_equals_per_expert_captured_and_sync_free():
    experts = SwiGLUExperts.build(16, 128, 256, seed=1, dtype=torch.bfloat16)
    experts = SwiGLUExperts(*(w.to(DEV) for w in (experts.w_gate, experts.w_up, experts.w_down)))
    stacked = StackedSwiGLU(experts.w_gate, experts.w_up, experts.w_down)
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(1)).to(DEV, torch.bfloat16)
    idx, w = make_routing(256, 16, 8, seed=1, skew=1.5, drop=0.05)
    backend = LocalBackend(16, DispatchFormat.MASKED, masked_capacity=256)
    d = backend.dispatch_b(backend.dispatch_a(x, idx.to(DEV), w.to(DEV)))
    assert masked_path(d.hidden, stacked) == "grouped"
    fn = experts.local(0, 16)
    got, want = run_experts(d, fn, stacked), run_experts(d, fn)
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_experts(d, fn, stacked)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    replay, out = CudaGraphCapturer().capture(lambda: run_experts(d, fn, stacked))
    replay()
    torch.testing.assert_close(out, got)


# ---- in a subprocess: what could end the CUDA context ---------------------------------------------------------------
def isolated(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_eager_fallback_above_the_largest_bucket_at_top8_of_16():
    """Before, the fallback ran with the capacity of the largest bucket: at twice it, with top-8 of 16, a sticky
    device assert that ended the process."""
    run = isolated("""
        import torch
        from tbo.comm import CopyEngineLink, DispatchFormat, LocalBackend
        from tbo.models import ModelConfig, ReferenceModel
        from tbo.split import ForwardMode, SplitPolicy
        config = ModelConfig.deepseek_v3_tiny(num_experts=16, top_k=8, batch_invariant=False)
        link = CopyEngineLink(LocalBackend(16, DispatchFormat.MASKED, masked_capacity=8))
        model = ReferenceModel(config, link, device="cuda")
        counted = ReferenceModel(config, LocalBackend(16), device="cuda")  # routed counts read on the host
        cache = model.static_cache(32, 64)
        policy = SplitPolicy(decode_token_threshold=2)
        runner = model.graph_runner(cache, "deepseek_decode", [4, 8], policy=policy)
        g = torch.Generator().manual_seed(0)
        inputs = {"ids": torch.randint(0, 256, (16,), generator=g).cuda(),
                  "positions": torch.randint(32, 64, (16,), generator=g).cuda(), "slots": torch.arange(16).cuda()}
        runner.capture_all(inputs)
        for tbo in (False, True):
            ref = cache.clone()
            got = runner.run(inputs, tbo=tbo)
            assert runner.last.how == "eager" and "exceed the largest bucket 8" in runner.last.reason, runner.last
            want = counted.decode_step(ref, "deepseek_decode")(inputs, policy.plan(ForwardMode.DECODE, 16) if tbo
                                                                else None)
            torch.cuda.synchronize()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        print("eager fallback ok")
    """)
    assert run.returncode == 0 and "eager fallback ok" in run.stdout, run.stdout + run.stderr


def test_an_op_failing_inside_a_capture_raises_its_own_error():
    """Before, drain() synchronised on an event of the live capture (invalidating it), and ending the capture then
    failed over the op's error. Now drain joins the copy stream and the caller sees the OperationError alone."""
    run = isolated("""
        import torch
        from tbo import OperationError
        from tbo.comm import CopyEngineLink, DispatchFormat, LocalBackend, devices
        from tbo.comm.types import BackendWrapper
        from tbo.models import ModelConfig, ReferenceModel, StaticAttentionMetadata
        from tbo.runtime.cuda_graph import CudaGraphCapturer
        from tbo.split import ForwardMode, SplitPolicy

        class FailsInCapture(BackendWrapper):  # microbatch A's dispatch_b fails with its transfer still in flight
            armed = True
            def dispatch_b(self, state):
                if self.armed and devices.capturing("cuda"):
                    raise RuntimeError("tbo-test: dispatch_b failed")
                return self.inner.dispatch_b(state)

        link = CopyEngineLink(LocalBackend(8, DispatchFormat.MASKED, masked_capacity=16))
        backend = FailsInCapture(link)
        model = ReferenceModel(ModelConfig.deepseek_v3_tiny(batch_invariant=False), backend, device="cuda")
        cache = model.static_cache(16, 64)
        ids = torch.arange(16, device="cuda")
        meta = StaticAttentionMetadata.decode(torch.arange(16, device="cuda") + 30, torch.arange(16, device="cuda"),
                                              cache.scratch_slot)
        plan = SplitPolicy(decode_token_threshold=2).plan(ForwardMode.DECODE, 16)
        step = lambda: model.forward_tbo(ids, meta, cache, "deepseek_decode", plan)
        capturer = CudaGraphCapturer()
        try:
            capturer.capture(step)
        except OperationError as exc:
            notes = getattr(exc, "__notes__", [])
            assert "tbo-test: dispatch_b failed" in str(exc), exc
            assert not notes, notes  # neither draining nor ending the capture failed after it
            print("op error raised")
        assert link.in_flight == []
        backend.armed = False
        want = step()
        replay, out = capturer.capture(step)  # the context and the link still work
        replay()
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        print("capture after the failure ok")
    """)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "op error raised" in run.stdout and "capture after the failure ok" in run.stdout, out


def test_a_device_assert_is_asynchronous_and_sticky():
    """What `device_check` is on CUDA: not a ValueError to catch, but an assert that poisons the CUDA context."""
    run = isolated("""
        import torch
        from tbo.comm import DispatchFormat, LocalBackend
        backend = LocalBackend(4, DispatchFormat.MASKED, masked_capacity=8)
        x = torch.randn(8, 16, device="cuda")
        idx = torch.zeros(8, 2, dtype=torch.long, device="cuda")  # each token names expert 0 twice: 16 rows > 8
        backend.dispatch_a(x, idx, torch.ones(8, 2, device="cuda"))
        print("dispatch_a returned", flush=True)  # asynchronous: nothing has failed yet on the host
        try:
            torch.cuda.synchronize()
            print("no assert", flush=True)
        except RuntimeError as exc:
            print("synchronize raised:", type(exc).__name__, flush=True)
        try:
            (torch.ones(1, device="cuda") + 1).cpu()
            print("CUDA still usable", flush=True)
        except RuntimeError:
            print("CUDA context unusable", flush=True)
    """)
    out = run.stdout + run.stderr
    assert "dispatch_a returned" in run.stdout, out
    assert "synchronize raised: RuntimeError" in run.stdout and "device-side assert" in out, out
    assert "CUDA context unusable" in run.stdout, out
