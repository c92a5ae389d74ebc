"""Real SGLang engines at tensor parallel 2 (two scheduler processes, gloo on this CPU), tbo on, against plain SGLang
at TP = 2: greedy tokens equal for a MoE model (Qwen3-MoE) and a dense one (Qwen3), with the TP all-reduces after
attention and after the MLP/MoE run as tbo's transfers (``moe_tp_*`` / ``dense_tp_*``, chosen by ``strategy:
"auto"``), and both ranks splitting the same steps.

The MoE model also runs with SGLang's expert parallelism (``ep_size=2``: each rank holds two whole experts of four,
top-3, so a rank holds fewer experts than a token picks), which SGLang itself cannot run on a CPU: tbo's all-to-all
carries each rank's slice of the rows to the experts' ranks over SGLang's expert-parallel group (``moe_tp_ep_*``),
and its tokens must equal plain SGLang's at TP = 2.

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
MODELS = {"qwen3_moe": functools.partial(save_qwen3_moe, top_k=3),
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
    with engine(path, config, tp_size=TP) as e:
        runs = _counted(e, files)
    out = {"name": name, "reference": reference, "runs": runs, "closed": [read_stats(f) for f in files]}
    if name == "qwen3_moe":  # and with SGLang's expert parallelism over the TP ranks, tbo's all-to-all carrying it
        ep_stats = tmp_path_factory.mktemp("ep-stats")
        ep_files = [ep_stats / f"stats-{rank}.json" for rank in range(TP)]
        with engine(path, {**config, "stats_file": str(ep_stats / "stats-{rank}.json")}, tp_size=TP, ep_size=TP) as e:
            out["ep"] = _counted(e, ep_files)
        out["ep_closed"] = [read_stats(f) for f in ep_files]
    return out


def _counted(e: Any, files: list[Any]) -> dict[str, Any]:
    """`_runs` with both ranks' counters before and after each."""
    runs: dict[str, Any] = {}
    for kind, (prompts, new) in {"decode": (BATCH, DECODE_TOKENS), "cut": (LONG, 3)}.items():
        before = [read_stats(f) for f in files]
        runs[kind] = (greedy(e, prompts, new), before, [read_stats(f) for f in files])
    return runs


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


def _ep(run: dict[str, Any]) -> dict[str, Any]:
    if "ep" not in run:
        pytest.skip("expert parallelism: the MoE model only")
    return run


def test_expert_parallel_tokens_equal_plain_sglang_at_tp2_and_rows_cross_ranks(run):
    """EP = TP = 2: tbo's tokens are plain SGLang's at TP = 2 (which shards each expert instead), decode and a
    prompt cut across microbatches; both ranks split the same steps with the ``moe_tp_ep_*`` strategies, and each
    dispatched rows to the other rank and computed rows it received (the all-to-all ran, not a local stand-in)."""
    run = _ep(run)
    for kind in ("decode", "cut"):
        tokens, before, after = run["ep"][kind]
        assert tokens == run["reference"][kind], kind
        for rank in range(TP):
            b, a = before[rank], after[rank]
            assert a["split_steps"] - b.get("split_steps", 0) >= 1, (kind, rank, a)
            assert a["remote_rows"] > b.get("remote_rows", 0), (kind, rank, b, a)
            assert a["ep"]["rows_from_peers"] > b.get("ep", {}).get("rows_from_peers", 0), (kind, rank, b, a)
    closed = run["ep_closed"]
    for key in ("steps", "split_steps", "microbatches", "tokens", "split_tokens", "split_steps_by_mode",
                "split_steps_by_strategy", "tp_reductions", "count_exchanges"):
        assert closed[0][key] == closed[1][key], (key, closed[0][key], closed[1][key])
    assert set(closed[0]["split_steps_by_strategy"]) == {"moe_tp_ep_decode", "moe_tp_ep_prefill"}, closed[0]
    # every rank knows every rank's slice: the dispatches sent them as agreed rows, no row counts exchanged
    assert closed[0]["count_exchanges"] == 0, closed[0]
    for rank, stats in enumerate(closed):
        assert stats["ep_size"] == TP and stats["ep"]["size"] == TP and stats["ep"]["rank"] == rank, stats
        assert stats["ep"]["group"] == "gloo", stats["ep"]
        assert stats["summary"][0].startswith(f"tbo: {stats['split_steps']} of "), stats
    # the rows of each rank's slices add up to every row of every MoE layer: 3 layers, tokens counted once a step
    layers = LAYERS["qwen3_moe"]
    assert closed[0]["ep"]["rows_dispatched"] + closed[1]["ep"]["rows_dispatched"] == closed[0]["tokens"] * layers


def test_expert_parallel_steps_reduce_over_the_tp_group_and_one_row_steps_run_unsplit(run):
    """Under EP each layer still sums attention's output and the routed output (each rank's slice in zeros) as
    tbo's all-reduces; the cut prompt's one-token decode steps run unsplit, where the first rank's slice of one row
    is empty (it dispatches nothing and still joins every exchange)."""
    run = _ep(run)
    _, before, after = run["ep"]["cut"]
    for rank in range(TP):
        b, a = before[rank], after[rank]
        assert a["tp"]["launched"] == a["tp_reductions"] and a["tp"]["attn_sums_by_sglang"] == 0, a["tp"]
        microbatches = a["microbatches"] - b["microbatches"]
        unsplit = (a["steps"] - b["steps"]) - (a["split_steps"] - b["split_steps"])
        assert unsplit >= 1, (b, a)
        assert a["tp_reductions"] - b.get("tp_reductions", 0) == (microbatches + unsplit) * LAYERS["qwen3_moe"] * 2
