"""The reference model at tensor parallel 2 over gloo: each rank holds half the heads and half of every FFN width,
the row-parallel outputs are summed by `TPAllReduce` as transfers, and TBO equals ``forward()`` bit for bit at 2
and 3 microbatches, every split step counted and every reduction seen in flight beside another microbatch's."""

import pytest
import torch

import tbo.strategies as S
from tbo import StrategyError
from tbo.comm import TPAllReduce
from tbo.comm.types import BackendWrapper
from tbo.harness.launch import launch
from tbo.models import AttentionMetadata, KVCache, ModelConfig, ReferenceModel
from tbo.split import ForwardMode, SplitPolicy

from .split_witness import SplitWitness

#: odd widths: hidden 40, 6 heads of 8, intermediates 66 (dense) and 18 per expert
BASE = dict(hidden_size=40, num_heads=6, head_dim=8, num_layers=3, dense_intermediate=66, moe_intermediate=18,
            num_experts=4, top_k=3)
CONFIGS = {
    "dense": ModelConfig(**{**BASE, "first_k_dense": 3, "num_shared_experts": 0}),
    "qwen3_moe": ModelConfig.qwen3_moe_tiny(**BASE),
    "deepseek": ModelConfig.deepseek_v3_tiny(**BASE),  # a dense first layer, then MoE layers with a shared expert
}
STRATEGIES = {"dense": "dense_tp", "qwen3_moe": "moe_tp", "deepseek": "moe_tp"}


class Counting(BackendWrapper):
    """Counts the reductions launched and the most in flight at once (two microbatches' overlap)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.launched, self.open, self.peak = 0, 0, 0

    def reduce_a(self, x, what="all-reduce"):
        self.launched += 1
        self.open += 1
        self.peak = max(self.peak, self.open)
        return self.inner.reduce_a(x, what)

    def reduce_b(self, state):
        self.open -= 1
        return self.inner.reduce_b(state)


def _steps(lens):
    ids = torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(sum(lens)))
    steps = [("prefill", ids, AttentionMetadata.build(range(len(lens)), lens, [0] * len(lens)))]
    for d in range(2):
        meta = AttentionMetadata.build(range(len(lens)), [1] * len(lens), [n + d for n in lens])
        steps.append(("decode", torch.arange(len(lens)) + d, meta))
    return steps


def _tp_rank(rank, world, family, lens):
    counting = Counting(TPAllReduce(timeout_s=60))
    model = ReferenceModel(CONFIGS[family], reducer=counting)
    shapes = {"wq": tuple(model.layers[0].wq.shape), "wo": tuple(model.layers[-1].wo.shape)}
    layers = len(model.layers)
    out = []
    for microbatches in (2, 3):
        policy = SplitPolicy(num_microbatches=microbatches, decode_token_threshold=microbatches,
                             prefill_token_threshold=microbatches)
        caches = {k: KVCache() for k in ("forward", "tbo")}
        for mode, ids, meta in _steps(lens):
            fm = ForwardMode.EXTEND if mode == "prefill" else ForwardMode.DECODE
            plan = policy.plan(fm, meta.num_tokens, list(meta.extend_lens) if mode == "prefill" else None)
            before = counting.launched
            ref = model.forward(ids, meta, caches["forward"])
            blocking = counting.launched - before
            witness = SplitWitness()
            counting.peak, before = 0, counting.launched
            strategy = "auto" if microbatches == 3 else f"{STRATEGIES[family]}_{mode}"
            got = model.forward_tbo(ids, meta, caches["tbo"], strategy, plan, observer=witness)
            out.append((microbatches, mode, plan.num_microbatches if plan else 1, dict(witness.ops), ref, got,
                        blocking, counting.launched - before, counting.peak, model.auto_strategy(meta)))
    return shapes, layers, out


def _per_layer_reductions(family):
    c = CONFIGS[family]
    dense, moe = c.first_k_dense, c.num_layers - c.first_k_dense
    return 2 * dense + (3 if c.num_shared_experts else 2) * moe


@pytest.mark.dist
@pytest.mark.parametrize("family", list(CONFIGS))
def test_tp2_tbo_equals_forward_bit_exact(family):
    lens = [5, 8, 3]
    per_rank = launch(_tp_rank, 2, family, lens, timeout_s=240)
    full = ReferenceModel(CONFIGS[family])  # one rank, whole weights: the split must be the same model
    reductions = _per_layer_reductions(family)
    for rank, (shapes, layers, results) in enumerate(per_rank):
        assert shapes == {"wq": (40, 24), "wo": (24, 40)}, "each rank holds 3 of the 6 heads"
        cache = KVCache()
        for microbatches, mode, planned, ops, ref, got, blocking, launched, peak, auto in results:
            where = f"rank {rank}, {family}, {mode}, {microbatches} microbatches"
            assert planned == microbatches and len(ops) == microbatches, f"{where}: not split ({ops})"
            assert len(set(ops.values())) == 1, f"{where}: microbatches ran different ops: {ops}"
            assert torch.equal(got, ref), f"{where}: TBO differs from forward()"
            assert blocking == reductions and launched == reductions * microbatches, where
            assert peak >= 2, f"{where}: no reduction was ever in flight beside another microbatch's"
            assert auto == f"{STRATEGIES[family]}_{mode}"
        for r in range(2):
            torch.testing.assert_close(per_rank[r][2][0][4], per_rank[0][2][0][4], rtol=0, atol=0)
    # the TP = 2 model is the one-rank model up to float rounding (sums of halves): the split is right
    ids, meta = _steps(lens)[0][1:]
    torch.testing.assert_close(per_rank[0][2][0][4], full.forward(ids, meta, cache), rtol=1e-4, atol=1e-4)


def test_strategies_by_structure_and_refusals():
    one = ReferenceModel(CONFIGS["dense"])
    meta = AttentionMetadata.build([0], [1], [4])
    with pytest.raises(StrategyError, match="nothing to overlap"):
        one.auto_strategy(meta)
    assert ReferenceModel(CONFIGS["deepseek"]).auto_strategy(meta) == "deepseek_decode"
    assert S.auto_names(moe=True, shared_experts=False) == ("qwen3_moe_decode", "qwen3_moe_prefill")
    assert S.auto_names(moe=False, tensor_parallel=True) == ("dense_tp_decode", "dense_tp_prefill")
    assert S.auto_names(moe=True, tensor_parallel=True) == ("moe_tp_decode", "moe_tp_prefill")
    # experts spread whole over the TP ranks (SGLang's --ep-size = --tp-size): the rows travel too
    assert S.auto_names(moe=True, tensor_parallel=True, expert_parallel=True) == ("moe_tp_ep_decode",
                                                                                  "moe_tp_ep_prefill")
    assert S.auto_names(moe=False, tensor_parallel=True, expert_parallel=True) == ("dense_tp_decode",
                                                                                   "dense_tp_prefill")
    # a one-rank model has no reducer: a TP strategy says which op needs one
    ids, meta = _steps([3])[0][1:]
    with pytest.raises(Exception, match="attn_reduce_a needs the layer's tensor-parallel reducer"):
        one.forward_tbo(ids, meta, KVCache(), "dense_tp_prefill", None)
    # and a TP = 1 reducer is the identity: the TP lists run, equal to forward()
    ident = ReferenceModel(CONFIGS["deepseek"], reducer=TPAllReduce())
    want = ident.forward(ids, meta, KVCache())
    assert torch.equal(ident.forward_tbo(ids, meta, KVCache(), "moe_tp_prefill", None), want)


def _sharded_layer_refuses_a_strategy_without_reductions(rank, world):
    model = ReferenceModel(CONFIGS["deepseek"], reducer=TPAllReduce(timeout_s=30))
    errors = []
    for name in ("deepseek_prefill", "dense_tp_decode"):
        try:
            model.bind(name)
        except StrategyError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.dist
def test_sharded_layers_refuse_strategies_that_would_leave_partial_sums():
    for errors in launch(_sharded_layer_refuses_a_strategy_without_reductions, 2, timeout_s=90):
        assert len(errors) == 2
        assert "has no op attn_reduce_a, attn_reduce_b, mlp_reduce_a, mlp_reduce_b" in errors[0]  # the dense layer
        assert "dense_tp_decode has no op moe_reduce_a, moe_reduce_b, shared_reduce_a" in errors[1], errors[1]
