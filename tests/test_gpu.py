"""The reference model on a GPU: op path == forward(), TBO == single (decode and prefill, DeepSeek and Qwen3, fp32 and
bf16), the copy-engine link == the local backend, graph replay == eager for every bucket, the captured decode step
under ``torch.cuda.set_sync_debug_mode("error")``, and ``Tracer(cuda=True)`` on one clock. Skipped without CUDA.

Tolerances: fp32 batch-invariant 1e-5 (cuBLAS may pick another kernel for another batch count), fp32 fast mode 1e-4,
bf16 2% of the logits' largest magnitude (TBO runs every GEMM on half the rows, rounding differently in bf16).
No wall-clock asserts, except the tracer's step length against the wall time of the same step (within 20%).
"""

import time

import pytest
import torch

from tbo.comm import CopyEngineLink, DispatchFormat, LocalBackend
from tbo.models import AttentionMetadata, KVCache, ModelConfig, ReferenceModel, StaticAttentionMetadata
from tbo.split import ForwardMode, SplitPolicy
from tbo.tools.trace import Tracer, traced

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODELS = {"deepseek": ModelConfig.deepseek_v3_tiny, "qwen3_moe": ModelConfig.qwen3_moe_tiny}
POLICY = SplitPolicy(decode_token_threshold=2, prefill_token_threshold=2)
DEV = "cuda"


def close(got, want, dtype, batch_invariant=True):
    if dtype == "bfloat16":
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)
    else:
        tol = 1e-5 if batch_invariant else 1e-4
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def prefill_then_decode(model, family, lens, seed=0):
    """Prefill then two decode steps over a growing cache; forward(), the unsplit op path and TBO, own caches."""
    caches = {k: KVCache() for k in ("forward", "ops", "tbo")}
    ids = torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(seed)).to(DEV)
    steps = [("prefill", ids, AttentionMetadata.build(range(len(lens)), lens, [0] * len(lens)))]
    for d in range(2):
        steps.append(("decode", (torch.arange(len(lens)) + d).to(DEV),
                      AttentionMetadata.build(range(len(lens)), [1] * len(lens), [c + d for c in lens])))
    out = []
    for mode, ids, meta in steps:
        fm = ForwardMode.EXTEND if mode == "prefill" else ForwardMode.DECODE
        plan = POLICY.plan(fm, meta.num_tokens, list(meta.extend_lens) if mode == "prefill" else None)
        name = f"{family}_{mode}"
        ref = model.forward(ids, meta, caches["forward"])
        out.append((mode, ref, model.forward_tbo(ids, meta, caches["ops"], name, None),
                    model.forward_tbo(ids, meta, caches["tbo"], name, plan)))
    return out


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_ops_and_tbo_equal_forward_on_gpu(family, dtype, batch_invariant):
    model = ReferenceModel(MODELS[family](dtype=dtype, batch_invariant=batch_invariant), device=DEV)
    for mode, ref, ops, tbo in prefill_then_decode(model, family, [5, 9, 3, 7]):
        assert ref.device.type == DEV and ref.dtype == getattr(torch, dtype)
        close(ops, ref, dtype, batch_invariant)
        close(tbo, ref, dtype, batch_invariant)


@pytest.mark.parametrize("family", list(MODELS))
def test_gpu_weights_are_the_cpu_weights_and_logits_agree(family):
    config = MODELS[family]()
    cpu, gpu = ReferenceModel(config), ReferenceModel(config, device=DEV)
    assert torch.equal(gpu.layers[-1].experts_w[2].cpu(), cpu.layers[-1].experts_w[2])
    assert torch.equal(gpu.embedding.cpu(), cpu.embedding)
    lens = [4, 6]
    meta = AttentionMetadata.build(range(2), lens, [0, 0])
    ids = torch.arange(10)
    torch.testing.assert_close(gpu.forward(ids.to(DEV), meta, KVCache()).cpu(), cpu.forward(ids, meta, KVCache()),
                               rtol=1e-4, atol=1e-4)


def masked(capacity=64):
    return LocalBackend(8, DispatchFormat.MASKED, masked_capacity=capacity)


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_static_cache_on_gpu_tbo_equals_single(family, dtype):
    model = ReferenceModel(MODELS[family](dtype=dtype, batch_invariant=False), masked(), device=DEV)
    cache = model.static_cache(8, 64)
    lens = [5, 30, 12]
    ids = torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(1)).to(DEV)
    meta = StaticAttentionMetadata.build([2, 0, 5], lens, [0, 0, 0], cache.scratch_slot, DEV)
    ref = model.forward(ids, meta, cache.clone())
    close(model.forward_tbo(ids, meta, cache.clone(), f"{family}_prefill",
                            POLICY.plan(ForwardMode.EXTEND, sum(lens), lens)), ref, dtype, False)
    model.forward(ids, meta, cache)
    dmeta = StaticAttentionMetadata.decode(torch.tensor(lens, device=DEV), torch.tensor([2, 0, 5], device=DEV),
                                           cache.scratch_slot)
    dids = torch.tensor([1, 2, 3], device=DEV)
    ref = model.forward(dids, dmeta, cache.clone())
    close(model.forward_tbo(dids, dmeta, cache.clone(), f"{family}_decode", POLICY.plan(ForwardMode.DECODE, 3)),
          ref, dtype, False)


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("fmt", list(DispatchFormat))
def test_copy_engine_link_equals_local_backend_in_the_model(family, fmt):
    cap = 64 if fmt is DispatchFormat.MASKED else None
    config = MODELS[family](batch_invariant=False)
    local = ReferenceModel(config, LocalBackend(8, fmt, masked_capacity=cap), device=DEV)
    link = CopyEngineLink(LocalBackend(8, fmt, masked_capacity=cap), dispatch_bytes_per_token=57344,
                          combine_bytes_per_token=114688)
    linked = ReferenceModel(config, link, device=DEV)
    for (mode, ref_a, _, tbo_a), (_, ref_b, _, tbo_b) in zip(prefill_then_decode(local, family, [6, 11, 4]),
                                                             prefill_then_decode(linked, family, [6, 11, 4])):
        assert torch.equal(ref_b, ref_a) and torch.equal(tbo_b, tbo_a), mode
    assert link.in_flight == []


def _runner_setup(capture=True, link=True, buckets=(4, 8, 16), dtype="float32"):
    config = ModelConfig.deepseek_v3_tiny(batch_invariant=False, dtype=dtype)
    backend = CopyEngineLink(masked(max(buckets)), dispatch_bytes_per_token=57344) if link else masked(max(buckets))
    model = ReferenceModel(config, backend, device=DEV)
    cache = model.static_cache(max(buckets), 64)
    runner = model.graph_runner(cache, "deepseek_decode", list(buckets), policy=POLICY, capture=capture)
    return model, cache, runner


def decode_inputs(n, seed=0, slots=16, context=64):
    """``n`` requests in distinct slots (of ``slots``), at positions in ``[context // 2, context)``."""
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 256, (n,), generator=g).to(DEV),
            "positions": torch.randint(context // 2, context, (n,), generator=g).to(DEV),
            "slots": torch.randperm(slots, generator=g)[:n].to(DEV)}


@pytest.mark.parametrize("link", [False, True])
def test_graph_replay_equals_eager_every_bucket_single_and_tbo(link):
    model, cache, runner = _runner_setup(link=link)
    runner.capture_all(decode_inputs(1))
    step = model.decode_step(cache, "deepseek_decode")
    for tbo in (False, True):
        for n in (1, 3, 4, 5, 8, 13, 16):
            inputs = decode_inputs(n, seed=n)
            got = runner.run(inputs, tbo=tbo)
            assert runner.last.how == "graph"
            bucket = runner.last.bucket
            # the same computation eagerly: padded to the bucket, with the bucket's plan, sliced
            want = step(runner.pad(inputs, bucket), runner.plan_for(bucket) if tbo else None)[:n]
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            # and the unpadded eager step (other GEMM shapes: fast-mode rounding)
            unpadded = step(inputs, POLICY.plan(ForwardMode.DECODE, n) if tbo else None)
            torch.testing.assert_close(got, unpadded, rtol=1e-4, atol=1e-4)
    big = runner.run(decode_inputs(16), tbo=True)
    assert runner.last.how == "graph" and big.shape == (16, 256)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_decode_step_under_sync_debug_mode(dtype):
    """Eager capture-safe step and graph replay with every host sync an error (capture itself synchronises), single
    and TBO, each result checked (before, only the last pair was). bf16 takes the grouped-GEMM expert path on a
    Hopper-or-newer GPU, fp32 the batched one."""
    model, cache, runner = _runner_setup(link=True, dtype=dtype)
    eager = model.graph_runner(cache, "deepseek_decode", [4, 8, 16], policy=POLICY, capture=False)
    inputs = decode_inputs(6, seed=3)
    runner.capture_all(inputs)
    for tbo in (False, True):
        eager.run(inputs, tbo=tbo)  # warm: staging buffers, streams, the expert path's probe
    torch.cuda.synchronize()
    results = {}
    torch.cuda.set_sync_debug_mode("error")
    try:
        for tbo in (False, True):
            results[tbo] = (eager.run(inputs, tbo=tbo), runner.run(inputs, tbo=tbo))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert runner.last.how == "graph" and eager.last.how == "eager"
    for tbo, (a, b) in results.items():
        close(b, a, dtype, batch_invariant=False)
    close(results[True][1], results[False][1], dtype, batch_invariant=False)


def test_sync_debug_mode_catches_a_counted_format():
    """The check can fail: EXPANDED reads routed counts on the host."""
    model = ReferenceModel(ModelConfig.deepseek_v3_tiny(batch_invariant=False), LocalBackend(8), device=DEV)
    cache = model.static_cache(8, 16)
    step = model.decode_step(cache, "deepseek_decode")
    inputs = decode_inputs(4, slots=8, context=16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            step(inputs, None)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("backend", ["copy_engine_link", "local"])
def test_cuda_tracer_puts_everything_on_one_clock(backend):
    """Every span of the traced step lies inside the host interval the step ran in, on the trace's one clock, over the
    copy-engine link (its own events on its copy stream) and over a plain LocalBackend (events the tracer records
    as each _a starts and around each _b: a launch lies inside its _a op on the GPU's clock).

    Before, ops were CUDA-event milliseconds from the first op and transfers perf_counter seconds: a 27 ms step
    summarised as 35703 ms; and until issue 22 a backend other than the link was stamped with perf_counter."""
    config = ModelConfig.deepseek_v3_tiny(hidden_size=1024, num_heads=8, head_dim=64, num_layers=4,
                                          moe_intermediate=512, dense_intermediate=2048, batch_invariant=False)
    link = (CopyEngineLink(masked(256), dispatch_bytes_per_token=57344, combine_bytes_per_token=114688)
            if backend == "copy_engine_link" else masked(256))
    model = ReferenceModel(config, link, device=DEV)
    cache = model.static_cache(256, 512)
    inputs = decode_inputs(256, slots=256, context=512)
    meta = StaticAttentionMetadata.decode(inputs["positions"], inputs["slots"], cache.scratch_slot)
    plan = POLICY.plan(ForwardMode.DECODE, 256)
    for _ in range(3):
        model.forward_tbo(inputs["ids"], meta, cache, "deepseek_decode", plan)
    tracer = Tracer(cuda=True)
    model.use_backend(traced(link, tracer))
    tracer.begin("decode 256, TBO")  # synchronises
    t0 = time.perf_counter()
    model.forward_tbo(inputs["ids"], meta, cache, "deepseek_decode", plan, observer=tracer)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    origin = tracer._time.origin_host
    trace = tracer.finish()
    lo, hi, eps = t0 - origin, t1 - origin, 5e-4  # an ordering of instants: no duration is asserted
    for span in trace.spans:
        assert lo - eps <= span.start <= span.end <= hi + eps, span
    comm = trace.lane("comm")
    assert {sp.name for sp in comm} == {"dispatch", "combine"} and len(comm) == 2 * 2 * 3  # 3 MoE layers
    if backend == "copy_engine_link":
        assert all(sp.nbytes >= 128 * 57344 for sp in comm if sp.name == "dispatch")
    else:
        ops = trace.lane("compute")
        for sp in comm:
            assert any(o.name == f"{sp.name}_a" and o.mb == sp.mb and o.start - eps <= sp.start <= o.end + eps
                       for o in ops), sp
