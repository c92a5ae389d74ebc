"""Fuzzing: random strategies over the reference model's op order, random batches; overlapped == forward().

Hypothesis draws Yield placements (any subset of the gaps between ops), delta_stages, the model (DeepSeek with a
dense first layer, or Qwen3-MoE), and a two-step workload: a prefill (lengths 0..40, long single prefills
included), then a mixed step whose sequences add 0 (zero-length extend), 1 (decode) or several tokens. One rank
here; the 2-rank variant replays seeded random cases on real gloo. Counterexamples found so far are pinned below
with @example.
"""

import random

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tbo import OperationsStrategy, Yield
from tbo.comm import TorchDistributedBackend
from tbo.harness.launch import launch
from tbo.models import AttentionMetadata, KVCache, ModelConfig, ReferenceModel
from tbo.split import ForwardMode, SplitPolicy, agree_to_split

from .split_witness import SplitWitness

MOE_OPS = ["comm_prepare_attn", "attn_prepare", "attn_core", "comm_prepare_mlp", "gate", "select_experts",
           "dispatch_a", "shared_experts", "dispatch_b", "experts", "combine_a", "combine_b", "output",
           "comm_postprocess_layer"]
POLICY = SplitPolicy(decode_token_threshold=2, prefill_token_threshold=2)


def fuzz_strategy(cuts, delta_frac):
    ops = []
    for i, name in enumerate(MOE_OPS):
        if i in cuts:
            ops.append(Yield)
        ops.append(name)
    stages = len(cuts) + 1
    return OperationsStrategy(operations=ops, delta_stages=min(int(delta_frac * stages), stages - 1), name="fuzzed")


def run_case(model, strategy, prompt_lens, step_lens, seed):
    """Prefill, then a mixed step; each through forward() and overlapped TBO from equal caches.

    Returns, per step, the max diff, the step's token count on this rank, and whether it was split (its ops ran in
    two microbatches): POLICY splits every step of 2 tokens or more, when every rank has one."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    caches = KVCache(), KVCache()
    diffs = []
    n = len(prompt_lens)
    steps = [(prompt_lens, [0] * n), (step_lens, list(prompt_lens))]
    for extend, prefix in steps:
        meta = AttentionMetadata.build(range(n), extend, prefix)
        ids = torch.randint(0, vocab, (meta.num_tokens,), generator=g)
        mode = ForwardMode.EXTEND if any(e != 1 for e in extend) else ForwardMode.DECODE
        plan = POLICY.plan(mode, meta.num_tokens, list(extend) if mode is ForwardMode.EXTEND else None)
        if not agree_to_split(plan):  # every rank splits, or none: a step with zero tokens still joins in
            plan = None
        ref = model.forward(ids, meta, caches[0])
        witness = SplitWitness()
        got = model.forward_tbo(ids, meta, caches[1], {"moe": strategy}, plan, observer=witness)
        diffs.append((float((got - ref).abs().max()) if ref.numel() else 0.0, meta.num_tokens,
                      witness.every_step_split))
    return diffs


def check_steps(steps, tokens_per_rank, where="one rank"):
    """Every step equals forward(), and was split exactly when every rank had 2 tokens or more."""
    for (diff, _, split), tokens in zip(steps, tokens_per_rank):
        assert diff == 0.0, f"{where}: {steps}"
        if split != (min(tokens) >= 2):
            raise AssertionError(f"{where}: a step of {tokens} tokens per rank was {'' if split else 'not '}split")


batches = st.integers(1, 5).flatmap(lambda n: st.tuples(
    st.lists(st.one_of(st.integers(0, 12), st.just(40)), min_size=n, max_size=n),
    st.lists(st.sampled_from([0, 1, 1, 1, 3, 7]), min_size=n, max_size=n)))


@settings(max_examples=100, deadline=None)
@given(cuts=st.sets(st.integers(1, len(MOE_OPS) - 1)), delta_frac=st.floats(0, 0.99), batch=batches,
       deepseek=st.booleans(), seed=st.integers(0, 1000))
@example(cuts={2, 6, 8, 11, 12}, delta_frac=0.5, batch=([1, 1, 1, 1], [1, 1, 1, 1]), deepseek=True, seed=0)  # gemv row
@example(cuts={7}, delta_frac=0.0, batch=([9, 2, 9], [1, 1, 1]), deepseek=True, seed=3)  # sigmoid tail lanes
@example(cuts=set(), delta_frac=0.0, batch=([40], [0]), deepseek=False, seed=1)  # one stage, long single prefill
def test_fuzz_overlapped_equals_forward(cuts, delta_frac, batch, deepseek, seed):
    make = ModelConfig.deepseek_v3_tiny if deepseek else ModelConfig.qwen3_moe_tiny
    model = ReferenceModel(make(num_layers=3, seed=seed % 7))
    steps = run_case(model, fuzz_strategy(cuts, delta_frac), *batch, seed)
    check_steps(steps, [[tokens] for _, tokens, _ in steps])


def _two_rank_cases(rank, world, cases):
    out = []
    for case_seed in range(cases):
        rng = random.Random(case_seed)  # the same strategy on both ranks; each rank its own batch
        cuts = set(rng.sample(range(1, len(MOE_OPS)), rng.randint(0, 6)))
        strategy = fuzz_strategy(cuts, rng.random())
        brng = random.Random(1000 * case_seed + rank)
        n = brng.randint(1, 4)
        prompt = [brng.choice([0, 1, 5, 11, 40]) for _ in range(n)]
        step = [brng.choice([0, 1, 1, 4]) for _ in range(n)]
        config = ModelConfig.deepseek_v3_tiny(num_layers=3) if case_seed % 2 else ModelConfig.qwen3_moe_tiny(
            num_layers=3)
        model = ReferenceModel(config, TorchDistributedBackend(config.num_experts, timeout_s=30))
        out.append((case_seed, run_case(model, strategy, prompt, step, case_seed)))
    return out


@pytest.mark.dist
def test_fuzz_two_ranks():
    ranks = launch(_two_rank_cases, 2, 20, timeout_s=300)
    split = 0
    for (case_seed, steps0), (_, steps1) in zip(*ranks):
        tokens = [[a[1], b[1]] for a, b in zip(steps0, steps1)]
        for steps in (steps0, steps1):
            check_steps(steps, tokens, f"case {case_seed}")
        split += sum(s[2] for s in steps0)
    assert split >= 10, f"only {split} of 40 steps were split: the cases hardly test overlap"
