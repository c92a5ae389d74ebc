"""Tensor parallelism (TP = 2) and adaptive splitting on vLLM's Model Runner V2, run here under Triton's interpreter.

Each engine runs two V2 workers in processes of their own (gloo, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``), started one
after the other from one V2 process (tests/vllm/v2_engine.py, the Triton shims on its path only), all shared by the
tests here through the module-scoped `v2_tp` fixture: plain V2 and tbo on a dense model (Qwen2) and on a MoE one
(Qwen3-MoE), and tbo's adaptive split on the dense one. Every prompt of a run goes in one ``generate`` call, so that
the scheduler makes the same steps with and without tbo: a prefill step cut between requests, a long prompt chunked
beside decodes (mixed steps, cut inside it), decode steps. The MoE engine's tbo runs over an emulated ``link``,
which under TP carries the all-reduces (each worker's link booked). Greedy tokens must equal plain V2 TP = 2's
exactly (fp32); each worker's counters must show split steps, the same on both workers (on V2 each worker's runner
decides its own steps: the same batch, the same decision, or their all-reduces would not pair), and every reduction
of those steps through tbo's transfers. The interpreter costs about 0.15 s a step, so the runs are short.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import ENGINE, _prompt, _save_dense, needs_vllm

pytestmark = [needs_vllm, pytest.mark.dist]

#: a 24-token prefill step of three requests beside the start of a 70-token prompt chunked over the next steps
#: (max_num_batched_tokens 32), then decode steps of four requests (tests/vllm/test_dense_tp.py's)
PROMPTS = [_prompt(9, 1), _prompt(8, 2), _prompt(7, 3), _prompt(70, 11)]
TOKENS = 6
#: tbo's thresholds: a decode step of four requests splits, so does every prefill chunk of 12 tokens or more
TP_TBO = {"decode_token_threshold": 2, "prefill_token_threshold": 12}
#: the MoE engine's tbo runs over an emulated link (5 us, 50 GB/s), which under TP carries the all-reduces too
MOE_TBO = {**TP_TBO, "link": "5,50"}
#: eight requests decoding long enough for the adaptive policy to measure every choice of their bucket, at 2 and 3
#: microbatches (every strategy at every count)
ADAPTIVE_PROMPTS = [_prompt(5 + i, 30 + i) for i in range(8)]
ADAPTIVE_TOKENS = 16
ADAPTIVE = {"split": "adaptive", "adaptive": {"warmup_samples": 1, "explore_share": 0.2, "microbatches": [2, 3]}}


@pytest.fixture(scope="module")
def v2_tp(qwen3_moe: Path, tmp_path_factory) -> dict[str, dict]:
    """Every TP = 2 V2 engine of this module, run once: ``"dense"``, ``"dense_tbo"``, ``"dense_adaptive"``,
    ``"moe"``, ``"moe_tbo"``."""
    from .v2_engine import run_v2

    root = tmp_path_factory.mktemp("v2_tp")
    dense = {**ENGINE, "model": str(_save_dense(root / "qwen2", "qwen2", 2)), "tensor_parallel_size": 2,
             "dtype": "float32"}
    moe = {**ENGINE, "model": str(qwen3_moe), "tensor_parallel_size": 2, "dtype": "float32"}
    run = {"prompts": PROMPTS, "max_tokens": TOKENS}
    adaptive_run = {"prompts": ADAPTIVE_PROMPTS, "max_tokens": ADAPTIVE_TOKENS}
    items = {"dense": {"engine": dense, "tbo": None, "runs": [run, adaptive_run]},
             "dense_tbo": {"engine": dense, "tbo": TP_TBO, "runs": [run]},
             "dense_adaptive": {"engine": dense, "tbo": ADAPTIVE, "runs": [adaptive_run]},
             "moe": {"engine": moe, "tbo": None, "runs": [run]},
             "moe_tbo": {"engine": moe, "tbo": MOE_TBO, "runs": [run]}}
    return dict(zip(items, run_v2(root, list(items.values()), timeout_s=1500)))


def _ok(result: dict) -> dict:
    assert "error" not in result, result["error"]
    return result


def _on_v2(result: dict, tbo: bool) -> None:
    for w in result["workers"]:
        assert w["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner", result["workers"]
        assert w["tbo"] is tbo, result["workers"]


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_v2_tp_2_splits_on_both_workers_alike_with_tokens_equal_plain_v2(v2_tp, model):
    """Dense (Qwen2) and MoE (Qwen3-MoE) at TP = 2 on V2: tokens equal plain V2 TP = 2's; both workers split the
    same steps the same way (prefill, mixed, decode; a chunk of the long prompt cut inside it), and each ran two
    all-reduces per layer and microbatch through tbo's transfer (``strategy: "auto"``: a dense model's attention and
    MLP reductions, a MoE model's ``moe_tp_*``), none left to vLLM's modules there."""
    plain, tbo = _ok(v2_tp[model]), _ok(v2_tp[f"{model}_tbo"])
    _on_v2(plain, False)
    _on_v2(tbo, True)
    assert tbo["runs"][0]["tokens"] == plain["runs"][0]["tokens"]
    per_worker = tbo["runs"][0]["stats"]
    assert len(per_worker) == 2
    for s in per_worker:
        split = s["split_steps_by_mode"]
        assert split["prefill"] > 0 and split["mixed"] > 0 and split["decode"] > 0, s
        assert s["cut_requests"] > 0, s
        layers = len(tbo["workers"][0]["deferred"])
        # two reductions per layer and microbatch of every split step; the dense engine's unsplit steps ran vLLM's
        # own forward (op_times off, no link), whose projections reduce as ever; over the MoE engine's link they ran
        # tbo's layers, one microbatch each, so that their all-reduces cross the link too
        unsplit = s["steps"] - s["split_steps"] if model == "moe" else 0
        assert s["tp_reductions"] == 2 * layers * (s["microbatches"] + unsplit) > 0, s
    keys = ("steps", "split_steps", "microbatches", "split_steps_by_mode", "cut_requests", "tp_reductions")
    assert [{k: s[k] for k in keys} for s in per_worker][0] == {k: per_worker[1][k] for k in keys}, per_worker
    for w in tbo["workers"]:  # every layer's reductions are tbo's; the MoE model's MoE layers reduce once, as tbo's
        kinds = {kind for kind, _ in w["deferred"]}
        assert kinds == ({"dense"} if model == "dense" else {"moe", "dense"}), w["deferred"]
        assert all(d == (["attn", "moe"] if kind == "moe" else ["attn", "mlp"]) for kind, d in w["deferred"]), w
    if model == "moe":  # over the link: each worker's reducer booked its all-reduces on it
        for w in tbo["workers"]:
            assert "EmulatedLink" in w["links"] and w["booked_s"] > 0, w


def test_v2_adaptive_at_tp_2_makes_every_choice_alike_on_both_workers(v2_tp):
    """``split: "adaptive"`` with 2 and 3 microbatches on V2 at TP = 2: V2's runner plans each step again with the
    count the choice made (``replan``), and the TP workers exchange their step times before every choice, so both
    run the same choice in every step. Tokens equal plain V2 TP = 2's; both workers ran the same split steps at the
    same counts; their policies' tables (estimates, samples, choices, explorations) are equal."""
    plain, adaptive = _ok(v2_tp["dense"]), _ok(v2_tp["dense_adaptive"])
    _on_v2(adaptive, True)
    assert adaptive["runs"][0]["tokens"] == plain["runs"][1]["tokens"]
    per_worker = adaptive["runs"][0]["stats"]
    for s in per_worker:
        assert s["split_steps"] > 0 and 2 * s["split_steps"] <= s["microbatches"] <= 3 * s["split_steps"], s
    keys = ("steps", "split_steps", "microbatches", "split_steps_by_mode", "tp_reductions")
    assert {k: per_worker[0][k] for k in keys} == {k: per_worker[1][k] for k in keys}, per_worker
    tables = [w["adaptive"]["buckets"] for w in adaptive["workers"]]
    assert tables[0] == tables[1], tables
    # which choices a short run measures depends on this machine's step times (one run here split at both counts,
    # another at 2 only): what must hold whatever they are is that both workers made the same ones
