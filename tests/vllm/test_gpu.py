"""tbo in a real vLLM engine on a GPU: CUDA graphs of split decode steps (issue 37, item 3). Marked ``gpu``: they run
where torch sees a CUDA device and a CUDA build of vLLM 0.32 is importable, and skip everywhere else (this project's
CI and its CPU machines: they have never run). Not in scripts/gpu_check.sh's budget: that script installs no vLLM,
and a vLLM engine's start and graph capture alone outlast its 150 s test step; run ``pytest -m gpu
tests/vllm/test_gpu.py`` on a GPU machine with vLLM installed.

What they check, with a tiny Qwen3-MoE in float32 and ``cudagraph_mode`` FULL_DECODE_ONLY over capture sizes 8 and
16 (tbo's decode threshold 4: both sizes captured split):

* greedy tokens equal the same engine's without tbo, decode steps replayed from tbo's split graphs
  (``graph_captures`` 2, ``graph_replays`` > 0), and no op of tbo's layer loop runs in a replayed step (a hook on a
  layer's attention sees only the eager steps);
* a decode step below the threshold, padded to a captured split size, runs eager (``graph_eager_steps``) and still
  gives vLLM's tokens;
* FULL_AND_PIECEWISE: the same tokens, prefill steps on vLLM's piecewise graphs.
"""

from __future__ import annotations

import gc
import importlib.util
import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs a CUDA build of vLLM")]

GRAPHS = {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [8, 16]}
TBO = {"decode_token_threshold": 4, "prefill_token_threshold": 12}
ENGINE = dict(skip_tokenizer_init=True, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256,
              gpu_memory_utilization=0.3, dtype="float32", enable_prefix_caching=False)


def _prompt(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 250 + 1 for i in range(n)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        pytest.skip("vLLM's platform is not CUDA (a CPU build of vLLM)")
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, mlp_only_layers=[1])
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpu") / "qwen3_moe"
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def _generate(model: Path, prompts: list[list[int]], tbo: dict | None, compilation: dict, max_tokens: int = 12):
    """Greedy tokens of ``prompts`` and what tbo counted meanwhile (with ``tbo``), and the LayerLoop calls seen by a
    hook on layer 0's attention during the generation."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tbo.integrations.vllm import stats

    extra = {} if tbo is None else {"additional_config": {"tbo": tbo}}
    llm = LLM(model=str(model), compilation_config=compilation, **ENGINE, **extra)
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        calls: list[int] = []
        hook = None
        if tbo is not None:
            hook = runner.tbo.layers[0].attn.attn.register_forward_hook(
                lambda m, args, out: calls.append(args[0].shape[0]))
        before = stats()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        after = stats()
        if hook is not None:
            hook.remove()
        delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
        return [list(o.outputs[0].token_ids) for o in outs], delta, calls
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def test_split_decode_steps_replay_tbos_graphs_and_equal_vllm(model):
    prompts = [_prompt(5 + k, 3 * k) for k in range(6)]  # 6 decodes: padded to the 8-token split graph
    want, _, _ = _generate(model, prompts, None, GRAPHS)
    got, delta, calls = _generate(model, prompts, TBO, GRAPHS)
    assert got == want
    assert delta["graph_captures"] == 2, delta  # sizes 8 and 16, both at or above the decode threshold
    assert delta["graph_replays"] >= 10 and delta["graph_eager_steps"] == 0, delta
    # a replayed step runs no Python of tbo's: layer 0's attention ran for the prefill steps only (eager, unsplit
    # below the prefill threshold or split), never for a 4-token microbatch of a decode step
    assert 4 not in calls and calls, calls


def test_a_step_whose_split_differs_from_its_graphs_runs_eager_and_equals_vllm(model):
    prompts = [_prompt(9, 40), _prompt(7, 41), _prompt(6, 42)]  # 3 decodes: below the threshold, padded to 8
    want, _, _ = _generate(model, prompts, None, GRAPHS)
    got, delta, _ = _generate(model, prompts, TBO, GRAPHS)
    assert got == want
    assert delta["graph_eager_steps"] >= 10 and delta["graph_replays"] == 0, delta


def test_full_and_piecewise_equals_vllm(model):
    compilation = {"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [8, 16]}
    prompts = [_prompt(20 + k, 5 * k) for k in range(6)]
    want, _, _ = _generate(model, prompts, None, compilation)
    got, delta, _ = _generate(model, prompts, TBO, compilation)
    assert got == want
    assert delta["graph_captures"] == 2 and delta["graph_replays"] > 0, delta
