"""The device-ready model on a CPU: static KV cache == growing cache, TBO == single with it (bit-exact when batch
invariant), the batched attention path vs the reference, bf16, and the capture-safe decode step on ``meta`` tensors
(where any host read or data-dependent shape raises), single and TBO, eager and through a `GraphRunner`."""

import pytest
import torch

from tbo.comm import CopyEngineLink, DispatchFormat, LocalBackend
from tbo.models import (AttentionMetadata, KVCache, ModelConfig, ReferenceModel, StaticAttentionMetadata,
                        StaticKVCache)
from tbo.runtime.cuda_graph import EagerCapturer
from tbo.split import ForwardMode, SplitPolicy

MODELS = {"deepseek": ModelConfig.deepseek_v3_tiny, "qwen3_moe": ModelConfig.qwen3_moe_tiny}
POLICY = SplitPolicy(decode_token_threshold=2, prefill_token_threshold=2)
#: static vs growing cache: the same math, but softmax and sums run over max_len (masked) instead of exactly the
#: visible keys, so float rounding may differ (fp32)
STATIC_TOL = dict(rtol=1e-5, atol=1e-5)


def masked(capacity=64):
    return LocalBackend(8, DispatchFormat.MASKED, masked_capacity=capacity)


def prompt(lens, seed=0):
    return torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_static_cache_equals_growing_cache_prefill_then_decode(family, batch_invariant):
    model = ReferenceModel(MODELS[family](batch_invariant=batch_invariant), masked())
    lens = [5, 9, 3, 7]
    slots = [3, 0, 2, 1]  # sequence i lives in slot slots[i]
    grow, static = KVCache(), model.static_cache(num_slots=4, max_len=24)
    ids = prompt(lens)
    a = model.forward(ids, AttentionMetadata.build(range(4), lens, [0] * 4), grow)
    b = model.forward(ids, StaticAttentionMetadata.build(slots, lens, [0] * 4, static.scratch_slot), static)
    torch.testing.assert_close(b, a, **STATIC_TOL)
    ctx = list(lens)
    for step in range(3):
        ids = torch.arange(4) + step
        a = model.forward(ids, AttentionMetadata.build(range(4), [1] * 4, ctx), grow)
        meta = StaticAttentionMetadata.decode(torch.tensor(ctx), torch.tensor(slots), static.scratch_slot)
        b = model.forward(ids, meta, static)
        torch.testing.assert_close(b, a, **STATIC_TOL)
        ctx = [c + 1 for c in ctx]


@pytest.mark.parametrize("family", list(MODELS))
def test_static_cache_tbo_equals_single_bit_exact(family):
    """Batch-invariant: with the static cache too, the op path and TBO equal forward() exactly (decode and a
    two-chunk prefill, whose second chunk reads the first chunk's keys from the cache)."""
    model = ReferenceModel(MODELS[family](), masked())
    lens = [3, 30]
    cache = model.static_cache(4, 40)
    ids = prompt(lens, 1)
    meta = StaticAttentionMetadata.build([0, 1], lens, [0, 0], cache.scratch_slot)
    plan = POLICY.plan(ForwardMode.EXTEND, sum(lens), lens)
    assert plan.two_chunk
    ref = model.forward(ids, meta, cache.clone())
    assert torch.equal(model.forward_tbo(ids, meta, cache.clone(), f"{family}_prefill", None), ref)
    assert torch.equal(model.forward_tbo(ids, meta, cache.clone(), f"{family}_prefill", plan), ref)
    model.forward(ids, meta, cache)
    dmeta = StaticAttentionMetadata.decode(torch.tensor(lens), torch.tensor([0, 1]), cache.scratch_slot)
    dids = torch.tensor([7, 9])
    ref = model.forward(dids, dmeta, cache.clone())
    for plan in (None, POLICY.plan(ForwardMode.DECODE, 2)):
        assert torch.equal(model.forward_tbo(dids, dmeta, cache.clone(), f"{family}_decode", plan), ref)


def test_padded_microbatches_use_the_scratch_slot():
    model = ReferenceModel(ModelConfig.deepseek_v3_tiny(), masked())
    cache = model.static_cache(8, 16)
    policy = SplitPolicy(pad_to_multiple=4)
    plan = policy.plan(ForwardMode.DECODE, 6)
    assert [mb.padding for mb in plan.microbatches] == [1, 1]
    meta = StaticAttentionMetadata.decode(torch.arange(6) + 2, torch.arange(6), cache.scratch_slot)
    before = cache.clone()
    ref = model.forward(torch.arange(6), meta, cache.clone())
    out = model.forward_tbo(torch.arange(6), meta, cache, "deepseek_decode", plan)
    assert torch.equal(out, ref)
    view = meta.for_microbatch(plan.microbatches[0])
    assert view.slots.tolist() == [0, 1, 2, cache.scratch_slot] and view.position_ids.tolist()[-1] == 0
    assert torch.equal(cache.k[:, :6, :2], before.k[:, :6, :2])  # real slots: only their new positions changed


@pytest.mark.parametrize("fast_attention", ["padded", "per_sequence"])
def test_batched_attention_vs_reference_within_tolerance(fast_attention):
    """Fast mode attends every sequence in one padded call (or loops over sequences); the reference loops over
    sequences and queries. Both fast paths agree with it within float rounding."""
    lens = [4, 0, 9, 1, 6]
    fast = ReferenceModel(ModelConfig.qwen3_moe_tiny(batch_invariant=False, fast_attention=fast_attention))
    ref = ReferenceModel(ModelConfig.qwen3_moe_tiny())
    ids = prompt(lens, 2)
    for prefix in ([0] * 5, [3, 2, 5, 1, 0]):
        caches = KVCache(), KVCache()
        if any(prefix):
            warm = AttentionMetadata.build(range(5), prefix, [0] * 5)
            fast.forward(prompt(prefix, 3), warm, caches[0])
            ref.forward(prompt(prefix, 3), warm, caches[1])
        meta = AttentionMetadata.build(range(5), lens, prefix)
        torch.testing.assert_close(fast.forward(ids, meta, caches[0]), ref.forward(ids, meta, caches[1]),
                                   rtol=1e-4, atol=1e-4)


def test_auto_attention_is_padded_off_the_cpu_only():
    """The padded call copies every cache into one tensor: worth it where launches cost (a GPU), not on a CPU."""
    layer = ReferenceModel(ModelConfig.qwen3_moe_tiny(batch_invariant=False)).layers[0]
    assert not layer._padded_attention(torch.device("cpu"))
    assert layer._padded_attention(torch.device("cuda")) and layer._padded_attention(torch.device("meta"))


def test_device_argument_builds_the_same_weights_and_bf16_runs():
    config = ModelConfig.deepseek_v3_tiny()
    a, b = ReferenceModel(config), ReferenceModel(config, device="cpu")
    assert torch.equal(a.layers[1].experts_w[0], b.layers[1].experts_w[0]) and b.device == torch.device("cpu")
    lens = [5, 9]
    meta = AttentionMetadata.build(range(2), lens, [0, 0])
    fp32 = ReferenceModel(ModelConfig.deepseek_v3_tiny(batch_invariant=False)).forward(prompt(lens), meta, KVCache())
    half = ReferenceModel(ModelConfig.deepseek_v3_tiny(batch_invariant=False, dtype="bfloat16"))
    out = half.forward(prompt(lens), meta, KVCache())
    assert out.dtype == torch.bfloat16
    # bf16 weights and activations: about 2-3 significant digits of the fp32 logits
    assert (out.float() - fp32).abs().max() < 0.05 * fp32.abs().max()


def test_meta_and_cache_must_match():
    model = ReferenceModel(ModelConfig.deepseek_v3_tiny(), masked())
    cache = model.static_cache(2, 8)
    ids = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="StaticKVCache needs StaticAttentionMetadata"):
        model.forward(ids, AttentionMetadata.build(range(2), [1, 1], [0, 0]), cache)
    with pytest.raises(TypeError, match="needs a StaticKVCache"):
        model.forward(ids, StaticAttentionMetadata.decode(torch.zeros(2, dtype=torch.long),
                                                          torch.arange(2), 2), KVCache())
    with pytest.raises(ValueError, match="must be the same 1-D shape"):
        StaticAttentionMetadata.decode(torch.zeros(3, dtype=torch.long), torch.arange(2), 2)
    with pytest.raises(ValueError, match="sizes must be positive"):
        StaticKVCache(2, 0, 8, 4, 16)
    with pytest.raises(ValueError, match="num_experts=8 differs from 16"):
        ReferenceModel(ModelConfig.deepseek_v3_tiny(num_experts=16)).use_backend(LocalBackend(8))


def test_static_cache_loads_a_growing_cache():
    model = ReferenceModel(ModelConfig.qwen3_moe_tiny(), masked())
    lens = [6, 2]
    grow = KVCache()
    model.forward(prompt(lens), AttentionMetadata.build(range(2), lens, [0, 0]), grow)
    static = model.static_cache(2, 8).load(grow, [1, 0])
    assert torch.equal(static.k[2, 1, :6], grow._k[(2, 0)]) and torch.equal(static.v[0, 0, :2], grow._v[(0, 1)])
    a = model.forward(torch.tensor([3, 4]), AttentionMetadata.build(range(2), [1, 1], lens), grow)
    b = model.forward(torch.tensor([3, 4]), StaticAttentionMetadata.decode(torch.tensor(lens), torch.tensor([1, 0]),
                                                                           2), static)
    torch.testing.assert_close(b, a, **STATIC_TOL)
    with pytest.raises(ValueError, match="more than max_len=4"):
        model.static_cache(2, 4).load(grow, [0, 1])


# ---- capture safety: the decode step on meta tensors ----------------------------------------------------------------
def meta_inputs(n):
    return {k: torch.zeros(n, dtype=torch.long, device="meta") for k in ("ids", "positions", "slots")}


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("link", [False, True])
@pytest.mark.parametrize("dtype,experts", [("float32", "batched"), ("bfloat16", "grouped")])
@pytest.mark.parametrize("in_order", [False, True])
def test_decode_step_runs_on_meta_tensors_single_and_tbo(family, link, dtype, experts, in_order):
    """Every expert path a GPU takes (one batched GEMM chain in fp32, a grouped GEMM over the routed rows in bf16)
    and the cache read by a view (``slots_in_order``) are free of host reads."""
    from tbo.experts import masked_path

    backend = masked(16) if not link else CopyEngineLink(masked(16), dispatch_bytes_per_token=57344)
    model = ReferenceModel(MODELS[family](batch_invariant=False, dtype=dtype), backend, device="meta")
    moe = next(layer for layer in model.layers if layer.kind == "moe")
    assert masked_path(torch.empty(8, 16, 64, device="meta", dtype=model.config.torch_dtype),
                       moe.stacked_experts) == experts
    cache = model.static_cache(16, 64)
    assert cache.k.device.type == "meta"
    eager = model.graph_runner(cache, f"{family}_decode", [4, 16], capture=False, slots_in_order=in_order)
    for tbo in (False, True):
        out = eager.run(meta_inputs(11), tbo=tbo)
        assert out.shape == (11, 256) and out.device.type == "meta"
        assert eager.last.how == "eager" and (eager.last.plan is not None) == tbo
    graphs = model.graph_runner(cache, f"{family}_decode", [4, 16], capturer=EagerCapturer(),
                                slots_in_order=in_order)
    for tbo in (False, True):  # padded to the 16 bucket, static buffers, sliced back
        assert graphs.run(meta_inputs(11), tbo=tbo).shape == (11, 256) and graphs.last.bucket == 16


def test_meta_catches_a_counted_format():
    """The meta proof can fail: the same step over EXPANDED (routed counts read on the host) raises there."""
    model = ReferenceModel(ModelConfig.deepseek_v3_tiny(batch_invariant=False), LocalBackend(8), device="meta")
    cache = model.static_cache(4, 8)
    with pytest.raises((NotImplementedError, RuntimeError)):
        model.graph_runner(cache, "deepseek_decode", [4], capture=False).run(meta_inputs(4))


# ---- the graph runner over the model, on a CPU ---------------------------------------------------------------------
@pytest.mark.parametrize("tbo", [False, True])
def test_graph_runner_over_the_model_equals_eager_every_bucket(tbo):
    """`EagerCapturer` replays by re-running the step on the static buffers: the padding (scratch slot), the
    per-bucket plans and the slicing are what CUDA graphs get; logits equal an unpadded eager step."""
    model = ReferenceModel(ModelConfig.deepseek_v3_tiny(), masked(16))
    cache = model.static_cache(16, 32)
    lens = torch.randint(1, 20, (16,), generator=torch.Generator().manual_seed(0))
    runner = model.graph_runner(cache, "deepseek_decode", [4, 8, 16], capturer=EagerCapturer(), policy=POLICY)
    eager = model.graph_runner(cache, "deepseek_decode", [4, 8, 16], capture=False, policy=POLICY)
    for n in (1, 3, 4, 7, 16):
        inputs = {"ids": torch.arange(n), "positions": lens[:n], "slots": torch.arange(n)}
        want = eager.run(inputs, tbo=tbo)
        got = runner.run(inputs, tbo=tbo)
        assert runner.last.how == "graph" and runner.last.bucket == runner.bucket_for(n)
        assert torch.equal(got, want), f"{n} requests, bucket {runner.last.bucket}"


# ---- issue 22: the eager fallback, the capacity a graph runner needs, the cache read by a view -----------------------
def test_eager_fallback_above_the_largest_bucket_at_top8_of_16_sizes_for_its_tokens():
    """Defect 1: above the largest bucket the runner goes eager with the capacity sized for that bucket. At top-8 of
    16 an expert averages half the tokens, so at twice the bucket an overflow was near certain: a ValueError here,
    a sticky device assert on a GPU. Now the eager step's slabs hold its own tokens; it equals the counted route."""
    config = ModelConfig.deepseek_v3_tiny(num_experts=16, top_k=8)
    model = ReferenceModel(config, LocalBackend(16, DispatchFormat.MASKED, masked_capacity=8))
    counted = ReferenceModel(config, LocalBackend(16))  # EXPANDED: exactly the routed rows, counts read on the host
    cache = model.static_cache(16, 32)
    runner = model.graph_runner(cache, "deepseek_decode", [4, 8], capturer=EagerCapturer(), policy=POLICY)
    inputs = {"ids": torch.arange(16) * 7 % 256, "positions": torch.arange(16) + 3, "slots": torch.arange(16)}
    for tbo in (False, True):
        want = counted.decode_step(cache.clone(), "deepseek_decode")(inputs, POLICY.plan(ForwardMode.DECODE, 16)
                                                                      if tbo else None)
        got = runner.run(inputs, tbo=tbo)
        assert runner.last.how == "eager" and "exceed the largest bucket 8" in runner.last.reason
        assert torch.equal(got, want)


def test_graph_runner_refuses_buckets_above_the_masked_capacity():
    model = ReferenceModel(ModelConfig.deepseek_v3_tiny(), CopyEngineLink(masked(8)))
    cache = model.static_cache(16, 16)
    with pytest.raises(ValueError, match=r"largest bucket \(16 requests\) exceeds the backend's masked_capacity=8"):
        model.graph_runner(cache, "deepseek_decode", [4, 16])
    assert model.graph_runner(cache, "deepseek_decode", [4, 16], capture=False).batch_sizes == [4, 16]


def _shares_storage(view, cache_tensor):
    return view.untyped_storage().data_ptr() == cache_tensor.untyped_storage().data_ptr()


def test_cache_read_by_a_view_when_the_slots_are_in_order():
    """Defect 9: a gather copies every slot's whole max_len before attention reads it again. Slots in order are read
    by a view, with the same logits (decode, TBO with a padded microbatch, and prefill)."""
    cache = StaticKVCache(2, 6, 8, 2, 4)
    cache.k.normal_(generator=torch.Generator().manual_seed(0))
    k, _ = cache.read(1, torch.tensor([2, 3, 4]), first=2)
    assert _shares_storage(k, cache.k) and torch.equal(k, cache.k[1, 2:5])
    k, _ = cache.read(1, torch.tensor([2, 3, 4]))
    assert not _shares_storage(k, cache.k)
    k, _ = cache.read(1, torch.tensor([5, 6, 6]), first=5)  # the run would leave the cache: gathered instead
    assert not _shares_storage(k, cache.k) and k.shape == (3, 8, 2, 4)

    model = ReferenceModel(ModelConfig.deepseek_v3_tiny(), masked(16))
    static = model.static_cache(8, 24)
    lens = [5, 9, 3]
    meta = StaticAttentionMetadata.build([0, 1, 2], lens, [0, 0, 0], static.scratch_slot)
    assert meta.slot_offset == 0
    assert StaticAttentionMetadata.build([2, 0, 1], lens, [0] * 3, static.scratch_slot).slot_offset is None
    gathered = StaticAttentionMetadata.build([3, 4, 5], lens, [0] * 3, static.scratch_slot)
    assert gathered.slot_offset == 3
    ref = model.forward(prompt(lens), meta, static.clone())
    plan = POLICY.plan(ForwardMode.EXTEND, sum(lens), lens)
    assert torch.equal(model.forward_tbo(prompt(lens), meta, static.clone(), "deepseek_prefill", plan), ref)
    model.forward(prompt(lens), meta, static)
    policy = SplitPolicy(pad_to_multiple=4)
    for n in (3, 6):
        ids, pos = torch.arange(n) + 1, torch.tensor([5, 9, 3, 2, 2, 2][:n])
        view = StaticAttentionMetadata.decode(pos, torch.arange(n), static.scratch_slot, slot_offset=0)
        copy = StaticAttentionMetadata.decode(pos, torch.arange(n), static.scratch_slot)
        for plan in (None, policy.plan(ForwardMode.DECODE, n)):
            assert torch.equal(model.forward_tbo(ids, view, static.clone(), "deepseek_decode", plan),
                               model.forward_tbo(ids, copy, static.clone(), "deepseek_decode", plan))
    mb = policy.plan(ForwardMode.DECODE, 6).microbatches[1]
    assert view.for_microbatch(mb).slot_offset == mb.tokens_start
    padded = StaticAttentionMetadata.decode(torch.zeros(4, dtype=torch.long), torch.tensor([0, 1, 8, 8]), 8, 0)
    assert padded.slot_offset == 0  # padding rows may name the scratch slot
    with pytest.raises(ValueError, match=r"slot_offset=0 promises token 1 sits in slot 1, but slots\[1\] = 3"):
        StaticAttentionMetadata.decode(torch.zeros(3, dtype=torch.long), torch.tensor([0, 3, 2]), 8, 0)


def test_decode_step_with_slots_in_order_reads_views_and_equals_the_gather(monkeypatch):
    model = ReferenceModel(ModelConfig.qwen3_moe_tiny(), masked(16))
    cache = model.static_cache(16, 32)
    reads = []
    original = StaticKVCache.read

    def observed(self, layer, slots, first=None):  # the real read, and whether it returned a view
        k, v = original(self, layer, slots, first)
        reads.append(_shares_storage(k, self.k))
        return k, v

    inputs = {"ids": torch.arange(6), "positions": torch.arange(6) + 4, "slots": torch.arange(6)}
    want = model.graph_runner(cache.clone(), "qwen3_moe_decode", [8], capturer=EagerCapturer()).run(inputs)
    monkeypatch.setattr(StaticKVCache, "read", observed)
    got = model.graph_runner(cache.clone(), "qwen3_moe_decode", [8], capturer=EagerCapturer(),
                             slots_in_order=True).run(inputs)
    assert reads and all(reads)
    assert torch.equal(got, want)
