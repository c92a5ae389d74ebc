"""Real SGLang engines at tensor parallel 2 (two scheduler processes, gloo on this CPU), tbo on, against plain SGLang
at TP = 2: greedy tokens equal for a MoE model (Qwen3-MoE) and a dense one (Qwen3), with the TP all-reduces after
attention and after the MLP/MoE run as tbo's transfers (``moe_tp_*`` / ``dense_tp_*``, chosen by ``strategy:
"auto"``), and both ranks splitting the same steps.

What each rank did comes back through its own ``stats_file`` (``{rank}`` in the path): its split steps (the same
on both ranks: the split is a function of the batch, which SGLang hands every rank alike), the all-reduces its
``*_reduce_a`` ops launched over SGLang's TP group (``tp.launched``: real collectives, the same count on both
ranks), and that SGLang summed none of the attention outputs itself (``tp.attn_sums_by_sglang``: every sum the
layers consumed was tbo's). Engines are started one at a time: per model plain SGLang first, then tbo.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from .helpers import BATCH, LONG, engine, greedy, read_stats, save_qwen3_dense, save_qwen3_moe

TP = 2
DECODE_TOKENS = 5
MODELS = {"qwen3_moe": save_qwen3_moe,
          "qwen3_dense": functools.partial(save_qwen3_dense, num_layers=2, initializer_range=0.2)}
#: each model's layers, and the all-reduces a layer of it launches per microbatch (attention's and the FFN's)
LAYERS = {"qwen3_moe": 3, "qwen3_dense": 2}
REDUCTIONS_PER_LAYER = 2


def _runs(e: Any) -> dict[str, Any]:
    """The batch prefilled and decoded (four requests: the prefill split between requests, decode steps of four
    tokens), and one long prompt alone (its prefill cut inside the request)."""
    return {"decode": greedy(e, BATCH, DECODE_TOKENS), "cut": greedy(e, LONG, 3)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def run(request, tmp_path_factory) -> dict[str, Any]:
    """Per model: plain SGLang's tokens at TP = 2, then tbo's at TP = 2 with both ranks' counters after each run."""
    name = request.param
    path = MODELS[name](tmp_path_factory.mktemp(name) / name)
    with engine(path, tp_size=TP) as e:
        reference = _runs(e)
    stats = tmp_path_factory.mktemp("stats")
    config = {"num_microbatches": 2, "decode_token_threshold": 2, "prefill_token_threshold": 2,
              "stats_file": str(stats / "stats-{rank}.json")}
    files = [stats / f"stats-{rank}.json" for rank in range(TP)]
    runs: dict[str, Any] = {}
    with engine(path, config, tp_size=TP) as e:
        for kind, (prompts, new) in {"decode": (BATCH, DECODE_TOKENS), "cut": (LONG, 3)}.items():
            before = [read_stats(f) for f in files]
            runs[kind] = (greedy(e, prompts, new), before, [read_stats(f) for f in files])
    return {"name": name, "reference": reference, "runs": runs, "closed": [read_stats(f) for f in files]}


def _split(before: dict[str, Any], after: dict[str, Any], mode: str) -> int:
    return after["split_steps_by_mode"].get(mode, 0) - before["split_steps_by_mode"].get(mode, 0)


def test_decode_tokens_equal_plain_sglang_at_tp2_and_both_ranks_split(run):
    tokens, before, after = run["runs"]["decode"]
    assert tokens == run["reference"]["decode"]
    for rank in range(TP):
        assert _split(before[rank], after[rank], "prefill") >= 1, (rank, before[rank], after[rank])
        # four requests decode together: every decode step has 4 tokens, over the threshold
        assert _split(before[rank], after[rank], "decode") >= DECODE_TOKENS - 1, (rank, before[rank], after[rank])


def test_a_prompt_cut_across_microbatches_gives_plain_sglangs_tokens_at_tp2(run):
    tokens, before, after = run["runs"]["cut"]
    assert tokens == run["reference"]["cut"]
    for rank in range(TP):
        assert after[rank]["cut_requests"] - before[rank]["cut_requests"] >= 1, (rank, before[rank], after[rank])


def test_both_ranks_split_the_same_steps(run):
    """The split is a function of the batch, and both ranks get the same batch: their counters agree step for
    step (a rank that split otherwise would have hung or summed the wrong rows)."""
    last = run["closed"]
    for key in ("steps", "split_steps", "microbatches", "tokens", "split_tokens", "cut_requests",
                "split_steps_by_mode", "tp_reductions"):
        assert last[0][key] == last[1][key], (key, last[0][key], last[1][key])
    assert last[0]["split_steps"] >= DECODE_TOKENS, last[0]


def test_every_reduction_is_tbos_all_reduce_over_sglangs_tp_group(run):
    """Each layer's attention and FFN sums ran as tbo's transfers: one ``*_reduce_a`` launch per layer, microbatch
    and reduction, each a real all-reduce over SGLang's TP group (``launched``), none made by SGLang instead."""
    layers = LAYERS[run["name"]]
    for rank in range(TP):
        _, before, after = run["runs"]["decode"]
        b, a = before[rank], after[rank]
        tp = a["tp"]
        assert tp["size"] == TP and tp["rank"] == rank and tp["group"] == "gloo", tp
        assert tp["attn_sums_by_sglang"] == 0, tp
        assert tp["launched"] == a["tp_reductions"], (tp, a["tp_reductions"])  # every launch reached the group
        microbatches = a["microbatches"] - b["microbatches"]
        unsplit = (a["steps"] - b["steps"]) - (a["split_steps"] - b["split_steps"])
        expected = (microbatches + unsplit) * layers * REDUCTIONS_PER_LAYER
        assert a["tp_reductions"] - b.get("tp_reductions", 0) == expected, (rank, b, a)
        assert microbatches >= 2 * (DECODE_TOKENS - 1)


def test_shutdown_closes_tbo_on_both_ranks(run):
    """SGLang's shutdown reaches each rank's scheduler: both close tbo and leave their summary."""
    for rank, closed in enumerate(run["closed"]):
        assert closed.get("summary", [""])[0].startswith(f"tbo: {closed['split_steps']} of "), (rank, closed)
