"""What the SGLang tests share: tiny random fp32 checkpoints and real SGLang engines, started one at a time under a
deadline and always shut down.

The checkpoints are saved with transformers' ``save_pretrained``, their weights drawn with a large
``initializer_range`` so that the next-token logits are far apart: a wrong result cannot pass as a tie. An engine
runs its model in SGLang's scheduler process, which reads ``TBO_SGLANG_CONFIG`` when it starts: the variable is set
for the start only, and tbo's counters come back through ``stats_file``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any, Iterator

ENGINE_DEADLINE_S = 240  #: an engine that has not started by then fails its test (2 busy cores: ~20-40 s each)
ENGINE_ARGS = dict(device="cpu", skip_tokenizer_init=True, attention_backend="torch_native", disable_cuda_graph=True,
                   max_total_tokens=2048, mem_fraction_static=0.05, dtype="float32", log_level="error")

#: more variables for an engine whose processes run SGLang's Triton kernels (its Triton attention backend, Qwen2-MoE's
#: gated shared-expert add) in Triton's interpreter: tests/triton_site on their path (see its sitecustomize)
TRITON_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1] / "triton_site"),
                                                        os.environ.get("PYTHONPATH")) if p)}

#: the requests every token test runs: a batch of four prompts of different lengths (prefill split between
#: requests, then decode steps of four tokens), and one long prompt alone (its prefill cut inside the request)
BATCH = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 27)), [200, 201]]
LONG = [list(range(30, 75))]


def save_qwen3_moe(path: Path, top_k: int = 2) -> Path:
    """Qwen3-MoE: SGLang's model calls ``model_forward_stages`` under SGLang's own TBO; attention in two ops. Four
    experts, ``top_k`` of them per token."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=top_k,
        max_position_embeddings=512, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def save_mixtral(path: Path) -> Path:
    """Mixtral: SGLang's model has no ``model_forward_stages`` seam; its MoE block is ``block_sparse_moe``, odd
    top-k 3 of 5 experts."""
    import torch
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_local_experts=5, num_experts_per_tok=3, max_position_embeddings=512,
        initializer_range=0.2)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(path)
    return path


def save_qwen2_moe(path: Path) -> Path:
    """Qwen2-MoE: every MoE block has a shared expert gated by the sigmoid of its ``shared_expert_gate``; its
    attention is one op (no ``forward_prepare``). Two KV heads: with one, plain SGLang 0.5.23 at TP = 2 on a CPU
    writes half-width keys into its KV cache and fails (in ``set_kv_buffer``), with or without tbo."""
    import torch
    import transformers

    config = transformers.Qwen2MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=512, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(path)
    return path


def save_deepseek_v3(path: Path) -> Path:
    """A tiny DeepSeek-V3 (MLA, a shared expert, routed scaling 2.5, a dense first layer) that SGLang 0.5.23 runs on a
    CPU with its Triton attention backend in Triton's interpreter: its CPU rotary takes only ``deepseek_yarn`` from
    ``rope_scaling`` (transformers 5 writes ``rope_parameters``; at factor 1 it is plain rotary, which transformers
    computes for `hf_copy`), its config reader wants ``topk_method``, ``scoring_func`` and ``moe_layer_freq``: added
    to the saved config. ``kv_lora_rank`` 256 with a rotary width of 32: the latent cache's width, 288, is one SGLang's
    MLA decode kernel has tiles for (at other widths the kernel fails in Triton's interpreter)."""
    import json
    import torch
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=256, q_lora_rank=None, qk_rope_head_dim=32,
        qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=512, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    saved.update(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, rope_scaling={
        "rope_type": "deepseek_yarn", "type": "deepseek_yarn", "factor": 1.0, "original_max_position_embeddings": 512,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    (path / "config.json").write_text(json.dumps(saved))
    return path


def hf_copy(path: Path, to: Path) -> Path:
    """``path``'s checkpoint as transformers reads it: the ``rope_scaling`` added for SGLang removed (transformers has
    no ``deepseek_yarn``; at factor 1 it is the plain rotary transformers computes without it)."""
    import json
    import shutil

    shutil.copytree(path, to)
    saved = json.loads((to / "config.json").read_text())
    saved.pop("rope_scaling", None)
    (to / "config.json").write_text(json.dumps(saved))
    return to


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt alone, in fp32 (the oracle where plain SGLang needs a check)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
            out.append(ids[0, len(prompt):].tolist())
    return out


def save_qwen3_dense(path: Path, num_layers: int = 1, initializer_range: float = 0.02) -> Path:
    """A dense Qwen3: no MoE layer, so nothing for tbo to overlap at TP = 1 (refused at load); at TP = 2 its
    all-reduces are (``num_layers`` 2 and ``initializer_range`` 0.2 there: logits far apart)."""
    import torch
    import transformers

    config = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=32, max_position_embeddings=512, initializer_range=initializer_range)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    return path


@contextlib.contextmanager
def _deadline(seconds: int, what: str) -> Iterator[None]:
    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"{what} did not start within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def engine(model: Path, tbo: dict[str, Any] | None = None, env: dict[str, str] | None = None,
           **args: Any) -> Iterator[Any]:
    """A real SGLang engine on ``model`` (tbo on with config ``tbo``, off for None), shut down on exit. ``env``: more
    variables for the engine's processes (set while it starts: SGLang spawns them then), restored after; ``args``:
    more of ``sgl.Engine``'s arguments (``tp_size=2``: one scheduler process per rank, each bound to its core)."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's CPU engine (read when sglang is imported)
    import sglang as sgl

    tp = int(args.get("tp_size", 1))
    start = {"TBO_SGLANG_CONFIG": None if tbo is None else json.dumps(tbo), **(env or {})}
    if tp > 1:  # one core per rank's scheduler process (SGLang's CPU engine needs it at TP >= 2)
        start["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(tp)))
    before = {key: os.environ.pop(key, None) for key in start}
    os.environ.update({key: value for key, value in start.items() if value is not None})
    try:
        with _deadline(ENGINE_DEADLINE_S, f"SGLang engine on {model.name}"):
            e = sgl.Engine(model_path=str(model), **{**ENGINE_ARGS, **args})
    finally:
        for key, value in before.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
    try:
        yield e
    finally:
        e.shutdown()


def greedy(e: Any, prompts: list[list[int]], max_new_tokens: int, **sampling: Any) -> list[list[int]]:
    """Greedy tokens for token-id prompts (``sampling``: more of SGLang's sampling params, ``ignore_eos``, ...)."""
    out = e.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens,
                                                         **sampling})
    return [o["output_ids"] for o in out]


def counted_runs(e: Any, runs: dict[str, tuple[list[list[int]], int]], stats_file: Path) -> dict[str, tuple]:
    """Each run of ``runs`` (name: prompts and tokens to generate) on engine ``e``: its greedy tokens, and tbo's
    counters from ``stats_file`` before and after it."""
    out = {}
    for kind, (prompts, new) in runs.items():
        before = read_stats(stats_file)
        out[kind] = (greedy(e, prompts, new), before, read_stats(stats_file))
    return out


@contextlib.contextmanager
def logged(name: str) -> Iterator[list[str]]:
    """The messages logger ``name`` of this process emits at INFO and above while the block runs (SGLang's engine
    sets the root logger to its ``log_level``, ERROR here: the logger's own level is lowered for the block)."""
    import logging

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger, handler = logging.getLogger(name), Collect(logging.INFO)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def read_stats(path: Path) -> dict[str, Any]:
    """tbo's counters of the engine's scheduler process, from its ``stats_file`` (empty before its first step)."""
    if path.exists():
        return json.loads(path.read_text())
    return {"steps": 0, "split_steps": 0, "microbatches": 0, "cut_requests": 0, "split_steps_by_mode": {}}


def start_failure(model: Path, tbo: dict[str, Any], timeout_s: int = ENGINE_DEADLINE_S) -> str:
    """Start an engine on ``model`` with ``tbo`` in a child process that must fail; returns its output (the
    scheduler's traceback is there: SGLang's own error only says that the scheduler died)."""
    import subprocess
    import sys

    script = ("import sglang as sgl, sys\n"
              "if __name__ == '__main__':\n"
              f"    sgl.Engine(model_path=sys.argv[1], **{ENGINE_ARGS!r})\n")
    env = {**os.environ, "TBO_SGLANG_CONFIG": json.dumps(tbo), "SGLANG_USE_CPU_ENGINE": "1"}
    done = subprocess.run([sys.executable, "-c", script, str(model)], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode != 0, "the engine started though tbo should have refused it"
    return done.stdout + done.stderr
