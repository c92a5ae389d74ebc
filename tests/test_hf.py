"""Hugging Face DeepseekV3 and Qwen3-MoE through tbo: logits and greedy tokens equal HF's own."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers 5.x) is not installed")

from tbo.comm import TorchDistributedBackend  # noqa: E402
from tbo.integrations import transformers as tbo_hf  # noqa: E402
from tbo.integrations.hf_tiny import MODELS, tiny_model  # noqa: E402
from tbo.harness.launch import launch  # noqa: E402
from tbo.split import SplitPolicy  # noqa: E402

from .split_witness import SplitWitness  # noqa: E402

SPLIT = SplitPolicy(decode_token_threshold=2, prefill_token_threshold=2)
TOL = dict(rtol=1e-5, atol=1e-5)  # float32; our combine sums the top-k slots in another order than HF's experts


def batch(seed=0, rows=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (rows, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[rows - 1, :1] = 0
    return ids, mask


@pytest.mark.parametrize("name", MODELS)
def test_prefill_and_decode_logits_equal_hf(name):
    model = tiny_model(name)
    ids, mask = batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        mask2 = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        kv = {tbo_hf.cache_kwarg(model): tbo_hf.output_cache(out)}  # cache= or past_key_values=, by version
        ref_decode = model(input_ids=nxt, attention_mask=mask2, **kv).logits
    prefill, decode = SplitWitness(), SplitWitness()
    logits, cache = tbo_hf.forward(model, ids, mask, policy=SPLIT, observer=prefill)
    torch.testing.assert_close(logits, out.logits, **TOL)
    prefill.expect(True, "the prefill of 4 rows")
    decode_logits, _ = tbo_hf.forward(model, nxt, mask2, cache, policy=SPLIT, observer=decode)
    torch.testing.assert_close(decode_logits, ref_decode, **TOL)
    decode.expect(True, "the decode step of 4 rows")


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_equals_hf(name):
    model = tiny_model(name)
    ids, mask = batch(seed=1)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    witness = SplitWitness()
    assert torch.equal(tbo_hf.generate(model, ids, mask, max_new_tokens=12, policy=SPLIT, observer=witness), expected)
    witness.expect(True, "every generation step of 4 rows")


def test_batch_below_threshold_runs_unsplit():
    model = tiny_model("qwen3_moe")
    ids, mask = batch(rows=1)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert tbo_hf._rows_plan(SplitPolicy(prefill_token_threshold=100), 1, 7, 0) is None
    assert torch.equal(tbo_hf.generate(model, ids, mask, max_new_tokens=6,
                                       policy=SplitPolicy(prefill_token_threshold=100)), expected)


def _rows(plan):
    return tuple(mb.requests_start for mb in plan.microbatches) + (plan.num_requests,)


def test_rows_are_split_for_tbo():
    assert _rows(tbo_hf._rows_plan(SPLIT, 4, 7, 0)) == (0, 2, 4)
    assert _rows(tbo_hf._rows_plan(SPLIT, 5, 1, 9)) == (0, 2, 5)
    padded = tbo_hf._rows_plan(SPLIT.model_copy(update={"pad_to_multiple": 8}), 4, 7, 0)
    assert [mb.tokens_len for mb in padded.microbatches] == [14, 14]  # a padded row would not be a row
    assert tbo_hf._rows_plan(SPLIT, 1, 40, 0) is None  # one row: the policy would cut inside it; HF cannot


def test_unsupported_layer_class_is_named():
    model = tiny_model("qwen3_moe")
    with pytest.raises(TypeError, match="unsupported decoder layer class Qwen3MoeRMSNorm; supported: "
                                        "DeepseekV3DecoderLayer, Qwen3MoeDecoderLayer"):
        tbo_hf.TboDecoderLayer(model.model.norm, None, 0)


def test_unsupported_attention_implementation_raises_at_wrap_time():
    model = tiny_model("qwen3_moe", attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="unsupported attention implementation 'flex_attention'.*eager, sdpa"):
        tbo_hf.forward(model, *batch())


def _two_ranks(rank, world, name):
    model = tiny_model(name)
    ids, mask = batch(seed=10 + rank)  # each rank its own batch; experts split across the ranks
    backend = TorchDistributedBackend(8, timeout_s=30)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask).logits
    witness = SplitWitness()
    logits, _ = tbo_hf.forward(model, ids, mask, policy=SPLIT, backend=backend, observer=witness)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    tokens = tbo_hf.generate(model, ids, mask, max_new_tokens=6, policy=SPLIT, backend=backend, observer=witness)
    return float((logits - reference).abs().max()), bool(torch.equal(tokens, expected)), dict(witness.ops)


@pytest.mark.dist
@pytest.mark.parametrize("name", MODELS)
def test_two_ranks_expert_parallel(name):
    for rank, (diff, tokens_equal, ops) in enumerate(launch(_two_ranks, 2, name, timeout_s=180)):
        assert diff < 1e-5 and tokens_equal
        assert sorted(ops) == [0, 1] and ops[0] == ops[1], f"rank {rank}: the steps were not split: {ops}"


def test_older_transformers_is_refused_naming_the_supported_range():
    with pytest.raises(ImportError, match=r"supports transformers >=5.17,<6 .* but 4.57.1 is installed"):
        tbo_hf.check_transformers_version("4.57.1")
    with pytest.raises(ImportError, match="but 5.16.1 is installed"):
        tbo_hf.check_transformers_version("5.16.1")
    for ok in ("5.17.0", "5.24.0", "5.25.0.dev0", transformers.__version__):
        tbo_hf.check_transformers_version(ok)


def test_the_cache_keyword_is_found_by_signature():
    def before(hidden_states, attention_mask, past_key_values=None, **kwargs):
        return past_key_values

    def after(hidden_states, attention_mask, cache=None, **kwargs):
        return cache

    assert tbo_hf.cache_kwarg(before) == "past_key_values" and tbo_hf.cache_kwarg(after) == "cache"
    with pytest.raises(TypeError, match="takes neither cache= nor past_key_values="):
        tbo_hf.cache_kwarg(lambda hidden_states, **kwargs: None)
    model = tiny_model("qwen3_moe")  # the installed version's own modules and output, whichever name it uses
    name = tbo_hf.cache_kwarg(model)
    assert name == tbo_hf.cache_kwarg(model.model.layers[0].self_attn)
    with torch.no_grad():
        out = model(input_ids=torch.ones(1, 3, dtype=torch.long), use_cache=True)
    assert tbo_hf.output_cache(out).get_seq_length() == 3
