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

#: the requests every token test runs: a batch of four prompts of different lengths (prefill split between
#: requests, then decode steps of four tokens), and one long prompt alone (its prefill cut inside the request)
BATCH = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 27)), [200, 201]]
LONG = [list(range(30, 75))]


def save_qwen3_moe(path: Path) -> Path:
    """Qwen3-MoE: SGLang's model calls ``model_forward_stages`` under SGLang's own TBO; attention in two ops."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
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


def save_qwen3_dense(path: Path) -> Path:
    """A dense Qwen3: no MoE layer, so nothing for tbo to overlap (refused at load)."""
    import transformers

    config = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=512)
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
def engine(model: Path, tbo: dict[str, Any] | None = None) -> Iterator[Any]:
    """A real SGLang engine on ``model`` (tbo on with config ``tbo``, off for None), shut down on exit."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's CPU engine (read when sglang is imported)
    import sglang as sgl

    before = os.environ.pop("TBO_SGLANG_CONFIG", None)
    if tbo is not None:
        os.environ["TBO_SGLANG_CONFIG"] = json.dumps(tbo)
    try:
        with _deadline(ENGINE_DEADLINE_S, f"SGLang engine on {model.name}"):
            e = sgl.Engine(model_path=str(model), **ENGINE_ARGS)
    finally:
        os.environ.pop("TBO_SGLANG_CONFIG", None)
        if before is not None:
            os.environ["TBO_SGLANG_CONFIG"] = before
    try:
        yield e
    finally:
        e.shutdown()


def greedy(e: Any, prompts: list[list[int]], max_new_tokens: int, **sampling: Any) -> list[list[int]]:
    """Greedy tokens for token-id prompts (``sampling``: more of SGLang's sampling params, ``ignore_eos``, ...)."""
    out = e.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens,
                                                         **sampling})
    return [o["output_ids"] for o in out]


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
