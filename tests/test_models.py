"""The reference model: op path == forward() == TBO for every strategy, decode and prefill, 1 and 2 ranks."""

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tbo.strategies as S
from tbo import OperationsStrategy, StrategyError, Yield
from tbo.comm import DispatchFormat, LocalBackend, TorchDistributedBackend
from tbo.harness.launch import launch
from tbo.models import AttentionMetadata, KVCache, ModelConfig, ReferenceModel
from tbo.split import ForwardMode, SplitPolicy

from .split_witness import SplitWitness

POLICY = SplitPolicy(decode_token_threshold=2, prefill_token_threshold=2)
MODELS = {"deepseek": ModelConfig.deepseek_v3_tiny, "qwen3_moe": ModelConfig.qwen3_moe_tiny}


def step_inputs(lens, seed=0, vocab=256):
    ids = torch.randint(0, vocab, (sum(lens),), generator=torch.Generator().manual_seed(seed))
    return ids, AttentionMetadata.build(range(len(lens)), lens, [0] * len(lens))


def should_split(num_tokens):
    """POLICY's rule for these steps: both thresholds are 2, and any step of 2 tokens or more has a cut (between
    sequences, or inside one)."""
    return num_tokens >= 2


def prefill_then_decode(model, strategy_prefix, lens, seed=0):
    """Prefill, then two decode steps; each step via forward(), the unsplit op path, and TBO (own caches).

    Each TBO step is checked to have been split exactly when `should_split` says (its ops ran in microbatch 1 too):
    an equality with forward() alone would also hold if nothing were ever split."""
    caches = {k: KVCache() for k in ("forward", "ops", "tbo")}
    results = []
    ids, meta = step_inputs(lens, seed)
    steps = [("prefill", ids, meta)]
    ctx = list(lens)
    for d in range(2):
        dmeta = AttentionMetadata.build(range(len(lens)), [1] * len(lens), [c + d for c in ctx])
        steps.append(("decode", torch.arange(len(lens)) + d, dmeta))
    for mode, ids, meta in steps:
        fm = ForwardMode.EXTEND if mode == "prefill" else ForwardMode.DECODE
        plan = POLICY.plan(fm, meta.num_tokens, list(meta.extend_lens) if mode == "prefill" else None)
        name = f"{strategy_prefix}_{mode}"
        ref = model.forward(ids, meta, caches["forward"])
        ops = model.forward_tbo(ids, meta, caches["ops"], name, None)
        witness = SplitWitness()
        tbo = model.forward_tbo(ids, meta, caches["tbo"], name, plan, observer=witness)
        witness.expect(should_split(meta.num_tokens), f"{mode} of {list(meta.extend_lens)}")
        results.append((mode, plan, ref, ops, tbo))
    return results


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("lens", [[5, 9, 3], [17], [1, 1, 1, 1], [4, 0, 6, 2]])
def test_ops_and_tbo_equal_forward_bit_exact(model_name, lens):
    model = ReferenceModel(MODELS[model_name]())
    for mode, plan, ref, ops, tbo in prefill_then_decode(model, model_name, lens):
        assert torch.equal(ops, ref), f"{mode}: op path differs from forward()"
        assert torch.equal(tbo, ref), f"{mode}: TBO differs from forward() (plan: {plan})"


def test_two_chunk_prefill_splits_and_matches():
    model = ReferenceModel(ModelConfig.deepseek_v3_tiny())
    results = prefill_then_decode(model, "deepseek", [3, 30])
    mode, plan, ref, _, tbo = results[0]
    assert plan.two_chunk and plan.cut_extend_lens == (13, 17)
    assert torch.equal(tbo, ref)


def test_fast_mode_agrees_within_tolerance():
    """batch_invariant=False: GEMM blocking depends on the batch size, so only float rounding may differ."""
    model = ReferenceModel(ModelConfig.deepseek_v3_tiny(batch_invariant=False))
    for mode, plan, ref, ops, tbo in prefill_then_decode(model, "deepseek", [6, 11, 4]):
        assert torch.equal(ops, ref)
        torch.testing.assert_close(tbo, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", list(DispatchFormat))
def test_formats_all_equal_forward(fmt):
    model = ReferenceModel(ModelConfig.deepseek_v3_tiny(), LocalBackend(8, fmt))
    for mode, plan, ref, ops, tbo in prefill_then_decode(model, "deepseek", [4, 7]):
        assert torch.equal(tbo, ref)


def _two_ranks(rank, world, fmt):
    config = ModelConfig.deepseek_v3_tiny(num_experts=8)
    model = ReferenceModel(config, TorchDistributedBackend(8, DispatchFormat(fmt), timeout_s=30))
    lens = [[5, 9, 3], [2, 7]][rank]
    out = []
    for mode, plan, ref, ops, tbo in prefill_then_decode(model, "deepseek", lens, seed=rank):
        out.append((mode, torch.equal(ops, ref), torch.equal(tbo, ref), float((tbo - ref).abs().max())))
    return out


@pytest.mark.dist
@pytest.mark.parametrize("fmt", ["expanded", "normal"])
def test_two_ranks_expert_parallel(fmt):
    for rank_result in launch(_two_ranks, 2, fmt, timeout_s=120):
        for mode, ops_equal, tbo_equal, diff in rank_result:
            assert ops_equal and tbo_equal, f"{fmt} {mode}: max diff {diff}"


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(0, 12), min_size=1, max_size=5), seed=st.integers(0, 100),
       model_name=st.sampled_from(list(MODELS)))
def test_property_random_batches(lens, seed, model_name):
    if sum(lens) == 0:
        return
    model = ReferenceModel(MODELS[model_name](num_layers=3))
    for mode, plan, ref, ops, tbo in prefill_then_decode(model, model_name, lens, seed=seed):
        assert torch.equal(tbo, ref)


# ---- strategies ---------------------------------------------------------------------------------------------------
def test_strategy_stage_structure():
    def stages(name):
        return [list(s) for s in S.get(name).stage_names]

    assert stages("deepseek_decode") == [
        ["comm_prepare_attn", "attn_prepare"],
        ["attn_core", "comm_prepare_mlp", "gate", "select_experts"],
        ["dispatch_a", "shared_experts"],
        ["dispatch_b", "experts", "combine_a"],
        ["combine_b"],
        ["output", "comm_postprocess_layer"],
    ]
    assert S.get("deepseek_decode").delta_stages == 2
    assert stages("deepseek_prefill") == [
        ["comm_prepare_attn", "attn_prepare", "attn_core", "comm_prepare_mlp", "gate", "select_experts",
         "dispatch_a"],
        ["dispatch_b", "experts", "combine_a"],
        ["shared_experts", "combine_b", "output", "comm_postprocess_layer"],
    ]
    assert S.get("deepseek_prefill").delta_stages == 0
    assert S.get("deepseek_prefill").deep_gemm_num_sms is None  # no GPU here
    for name in ("qwen3_moe_decode", "qwen3_moe_prefill"):
        assert "shared_experts" not in [op for st_ in stages(name) for op in st_]
    assert len(stages("qwen3_moe_decode")) == 6 and len(stages("qwen3_moe_prefill")) == 3


def test_registry():
    assert S.names() == ["afd_attention_dbo", "deepseek_decode", "deepseek_prefill", "dense_tp_decode",
                         "dense_tp_prefill", "moe_tp_decode", "moe_tp_ep_decode", "moe_tp_ep_prefill",
                         "moe_tp_prefill", "qwen3_moe_decode",
                         "qwen3_moe_prefill"]
    mine = OperationsStrategy(operations=["a", Yield, "b"], delta_stages=1)
    S.register("mine", mine)
    try:
        assert S.get("mine").name == "mine" and "mine" in S.names()
        with pytest.raises(StrategyError, match="already registered"):
            S.register("mine", mine)
        S.register("mine", lambda: mine, overwrite=True)
        assert S.get("mine").stages == mine.stages
    finally:
        S.unregister("mine")
    with pytest.raises(StrategyError, match="no strategy named 'nope'; registered: afd_attention_dbo, deepseek"):
        S.get("nope")


def test_dense_layers_join_the_overlapped_region():
    model = ReferenceModel(ModelConfig.deepseek_v3_tiny(first_k_dense=2, num_layers=4))
    bound = model.bind("deepseek_decode")
    assert [layer.kind for layer in model.layers] == ["dense", "dense", "moe", "moe"]
    assert bound.delta_stages == 2 and bound.is_bound
    assert model.bind("deepseek_decode") is bound  # cached
    names = [op for s in bound.stage_names for op in s]
    assert names.count("mlp") == 2 and names.count("dispatch_a") == 2
    # and they run in both microbatches of a split step, which equals forward()
    witness = SplitWitness()
    ids, meta = step_inputs([3, 5])
    plan = POLICY.plan(ForwardMode.EXTEND, meta.num_tokens, [3, 5])
    got = model.forward_tbo(ids, meta, KVCache(), "deepseek_decode", plan, observer=witness)
    assert torch.equal(got, model.forward(ids, meta, KVCache()))
    witness.expect(True, "the prefill of [3, 5]")
    assert witness.names[0].count("mlp") == witness.names[1].count("mlp") == 2


def test_bind_errors_name_the_layer_kind():
    model = ReferenceModel(ModelConfig.deepseek_v3_tiny())
    with pytest.raises(StrategyError, match="no strategy for layer kind 'dense'"):
        S.bind_layers(model.layers, {"moe_only": S.get("deepseek_decode")})
    with pytest.raises(StrategyError, match="missing methods"):
        S.bind_layers(model.layers, OperationsStrategy(operations=["attn_core", "teleport"]))


def test_forward_input_errors():
    model = ReferenceModel(ModelConfig.qwen3_moe_tiny())
    ids, meta = step_inputs([3, 4])
    with pytest.raises(ValueError, match="input_ids has 6 tokens but the metadata describes 7"):
        model.forward(ids[:6], meta, KVCache())
    with pytest.raises(ValueError, match="the cache holds 0 tokens but this step expects a prefix of 5"):
        model.forward(ids[:2], AttentionMetadata.build([0], [2], [5]), KVCache())
    two_ranks = types.SimpleNamespace(rank=0, num_ranks=2, num_local_experts=4, num_experts=9)
    with pytest.raises(ValueError, match="num_experts=9 is not divisible by the backend's 2 ranks"):
        ReferenceModel(ModelConfig.qwen3_moe_tiny(num_experts=9), two_ranks)
    with pytest.raises(ValueError, match="top_k=9 must be in"):
        ModelConfig(top_k=9)


def test_scaled_config_follows_hidden_size():
    c = ModelConfig.scaled("qwen3_moe", 256, 3, head_dim=32, ffn_multiple=2, num_experts=12)
    assert (c.num_heads, c.head_dim, c.moe_intermediate, c.dense_intermediate) == (8, 32, 512, 1024)
    assert c.num_shared_experts == 0 and c.num_experts == 12 and c.num_layers == 3
    assert ModelConfig.scaled("deepseek", 8, 2).num_heads == 1  # at least one head
    with pytest.raises(KeyError):
        ModelConfig.scaled("llama", 64, 2)


class _OneUnreceivedBackend(LocalBackend):
    """LocalBackend declaring DeepEP low-latency's limit: one un-received transfer at a time, across microbatches."""

    from tbo.comm.deepep import LOW_LATENCY_LIMIT as in_flight_limit


def test_binding_checks_the_schedule_against_the_backend_limit():
    """Binding over a backend with an in-flight limit checks the compiled schedule (every microbatch, every layer
    boundary): prefill's delta 0 is refused up front, decode's delta 2 runs bit-exact with two microbatches, and a
    plan of three microbatches, which decode's lead cannot serve, is refused at the step instead of hanging."""
    config = ModelConfig.deepseek_v3_tiny(num_layers=3)
    model = ReferenceModel(config, _OneUnreceivedBackend(config.num_experts))
    with pytest.raises(StrategyError, match="deepseek_prefill cannot run over DeepEP low-latency with 2 microbatches"):
        model.bind("deepseek_prefill")
    ids, meta = step_inputs([2, 2, 2])
    ref = model.forward(ids, meta, KVCache())
    two = SplitPolicy(prefill_token_threshold=2).plan(ForwardMode.EXTEND, 6, [2, 2, 2])
    assert torch.equal(model.forward_tbo(ids, meta, KVCache(), "deepseek_decode", two), ref)
    three = SplitPolicy(prefill_token_threshold=3, decode_token_threshold=3, num_microbatches=3).plan(
        ForwardMode.EXTEND, 6, [2, 2, 2])
    assert len(three.microbatches) == 3
    with pytest.raises(StrategyError, match="with 3 microbatches and delta_stages=2: microbatch 0's 'dispatch_a'"):
        model.forward_tbo(ids, meta, KVCache(), "deepseek_decode", three)


def test_model_forward_takes_a_registered_name():
    """`tbo.model_forward_maybe_tbo(layers, inputs, "deepseek_decode", plan)` runs the registered strategy, as
    `ReferenceModel.forward_tbo` does; an unknown name or a wrong type is refused saying what to pass."""
    import tbo
    from tbo.runtime.forward import model_forward_maybe_tbo

    model = ReferenceModel(ModelConfig.deepseek_v3_tiny(num_layers=3))
    assert S.bind_layers(model.layers, "deepseek_decode").operations == S.bind_layers(
        model.layers, S.deepseek_decode()).operations
    assert S.bind_layers(model.layers, {"moe": "deepseek_decode"}).operations == S.bind_layers(
        model.layers, S.deepseek_decode()).operations
    ids, meta = step_inputs([2, 2, 2])
    ref = model.forward(ids, meta, KVCache())
    plan = SplitPolicy(prefill_token_threshold=2).plan(ForwardMode.EXTEND, 6, [2, 2, 2])
    cache = KVCache()
    seen: list = []

    def pinned(mb):
        seen.append(mb)
        return {"attn": meta if mb is None else meta.for_microbatch(mb), "cache": cache}

    out = tbo.model_forward_maybe_tbo(model.layers, {"hidden_states": model.embed(ids)}, "deepseek_decode", plan,
                                      pinned=pinned)
    assert len(seen) == 2 and None not in seen  # it split: two microbatches ran
    assert torch.allclose(model.head(out["hidden_states"]), ref, atol=1e-5, rtol=0)
    with pytest.raises(StrategyError, match="no strategy named 'deepseek_decod'; registered: .*deepseek_decode"):
        model_forward_maybe_tbo(model.layers, {"hidden_states": model.embed(ids)}, "deepseek_decod", plan)
    with pytest.raises(TypeError, match="a registered name.*got int"):
        model_forward_maybe_tbo(model.layers, {"hidden_states": model.embed(ids)}, 3, plan)


@pytest.mark.parametrize("width", [1, 3, 18, 33, 40, 66, 132])
@pytest.mark.parametrize("inner", [1, 7, 33, 40])
def test_a_batch_invariant_product_s_row_does_not_depend_on_its_place_in_the_batch(inner, width):
    """`functional.linear` in batch-invariant mode: every row of a 5-row product equals the same rows computed alone
    or in any slice, bit for bit, at odd widths too (a tensor-parallel shard of 33 or 66 columns; before the output
    rows were padded to 64 bytes, an AMD EPYC CPU gave rows 1 and 2 of 3 other last bits than alone)."""
    from tbo.models.functional import linear

    g = torch.Generator().manual_seed(inner * 1000 + width)
    x, w = torch.randn(5, inner, generator=g), torch.randn(inner, width, generator=g)
    full = linear(x, w, True)
    assert full.shape == (5, width)
    for rows in (1, 2, 3):
        for start in range(5 - rows + 1):
            assert torch.equal(linear(x[start:start + rows], w, True), full[start:start + rows]), (rows, start)
    torch.testing.assert_close(full, x @ w, rtol=1e-5, atol=1e-5)
