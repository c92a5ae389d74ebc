"""DeepSeek-V3 in SGLang through tbo: multi-head latent attention, a shared expert, routed scaling and a dense first
layer, split with the mission's ``deepseek_decode`` / ``deepseek_prefill`` strategies.

SGLang runs the tiny DeepSeek-V3 here on its Triton attention backend (its MLA kernels in Triton's interpreter,
tests/triton_site on the engines' ``PYTHONPATH``; its torch-native backend fails on MLA's extend on a CPU, with or
without tbo). Three runs of the same requests: transformers (fp32, each prompt alone), plain SGLang, and tbo at 2
microbatches. Greedy tokens are equal over a prefill of four requests, their decode and a prompt cut across
microbatches; tbo's counters show those steps split with the DeepSeek strategies, every microbatch planned on an MLA
attention backend of its own, and the shared expert run once per MoE layer and microbatch of every split step. A tbo
that left out the routed scaling (2.5 here) gives other tokens for one of the four requests (tried by hand). A third
tbo engine runs at TP = 2 with expert parallelism (``--ep-size 2``: each rank holds two of the four experts, their
rows carried by tbo's all-to-all, ``moe_tp_ep_*``; attention's, the routed and the shared expert's sums tbo's
all-reduces), judged by the same transformers tokens (plain SGLang at TP = 2 gives them too, and tbo at TP = 2
without expert parallelism, ``moe_tp_*``: tried by hand).
"""

from __future__ import annotations

from typing import Any

import pytest

from .helpers import (BATCH, LONG, TRITON_ENV, counted_runs, engine, greedy, hf_copy, hf_greedy, read_stats,
                      save_deepseek_v3)

RUNS = {"batch": (BATCH, 6), "cut": (LONG, 3)}
MOE_LAYERS = 1  #: of its two layers, the first is dense (``first_k_dense_replace``)


@pytest.fixture(scope="module")
def deepseek_runs(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("deepseek_v3")
    path = save_deepseek_v3(root / "deepseek_v3")
    hf = hf_copy(path, root / "hf")
    oracle = {kind: hf_greedy(hf, prompts, new) for kind, (prompts, new) in RUNS.items()}
    with engine(path, env=TRITON_ENV, attention_backend="triton") as e:
        plain = {kind: greedy(e, prompts, new) for kind, (prompts, new) in RUNS.items()}
    stats_file = root / "stats.json"
    config = {"decode_token_threshold": 2, "prefill_token_threshold": 2, "op_times": True,
              "stats_file": str(stats_file)}
    with engine(path, config, env=TRITON_ENV, attention_backend="triton") as e:
        runs = counted_runs(e, RUNS, stats_file)
    closed = read_stats(stats_file)
    tp_file = root / "tp_stats_{rank}.json"
    with engine(path, {**config, "op_times": False, "stats_file": str(tp_file)}, env=TRITON_ENV,
                attention_backend="triton", tp_size=2, ep_size=2) as e:
        tp = {kind: greedy(e, prompts, new) for kind, (prompts, new) in RUNS.items()}
    ranks = [read_stats(root / f"tp_stats_{rank}.json") for rank in (0, 1)]
    return {"oracle": oracle, "plain": plain, "runs": runs, "closed": closed, "tp": tp, "tp_ranks": ranks}


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_tokens_equal_transformers_and_plain_sglang(deepseek_runs, kind):
    tokens = deepseek_runs["runs"][kind][0]
    assert deepseek_runs["plain"][kind] == deepseek_runs["oracle"][kind]  # SGLang's MLA on a CPU, judged first
    assert tokens == deepseek_runs["oracle"][kind]


@pytest.mark.parametrize("kind, modes", [("batch", ("prefill", "decode")), ("cut", ("prefill",))])
def test_the_steps_split_with_the_deepseek_strategies(deepseek_runs, kind, modes):
    _, before, after = deepseek_runs["runs"][kind]
    for mode in modes:
        assert after["split_steps_by_mode"][mode] > before["split_steps_by_mode"].get(mode, 0), (mode, after)
    if kind == "cut":
        assert after["cut_requests"] > before["cut_requests"]
    strategies = deepseek_runs["closed"]["split_steps_by_strategy"]
    assert set(strategies) == {"deepseek_decode", "deepseek_prefill"}, strategies


def test_each_microbatch_attends_on_its_own_mla_backend_and_runs_the_shared_expert(deepseek_runs):
    stats = deepseek_runs["closed"]
    assert stats["attention"]["backend"] == "TritonAttnBackend"
    assert stats["attention"]["planned"] == stats["microbatches"] > 0
    # op_times counts the shared expert's op on the MoE layer of every microbatch of every step tbo's layers ran
    # (split ones: 2 microbatches each; unsplit ones ran SGLang's own forward)
    assert stats["op_calls"]["shared_experts"] == MOE_LAYERS * stats["microbatches"] + (
        stats["steps"] - stats["split_steps"] - stats.get("own_forward_steps", 0)), stats["op_calls"]


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_at_ep2_tokens_equal_transformers_and_both_ranks_split_with_tbos_transfers(deepseek_runs, kind):
    assert deepseek_runs["tp"][kind] == deepseek_runs["oracle"][kind]
    first, second = deepseek_runs["tp_ranks"]
    assert first["split_steps_by_strategy"] == second["split_steps_by_strategy"] and first["split_steps"] > 0
    assert set(first["split_steps_by_strategy"]) == {"moe_tp_ep_decode", "moe_tp_ep_prefill"}
    for rank in (first, second):
        assert rank["tp"]["launched"] == rank["tp_reductions"] > 0 and rank["tp"]["attn_sums_by_sglang"] == 0
        assert rank["ep"]["size"] == 2 and rank["ep"]["rows_from_peers"] > 0 and rank["remote_rows"] > 0
