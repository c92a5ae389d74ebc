"""Real SGLang engines, tbo on, against plain SGLang: greedy tokens equal over prefill, decode and a prompt cut across
microbatches, at 2 and 3 microbatches, for Qwen3-MoE (whose SGLang model calls ``model_forward_stages``) and Mixtral
(whose model does not). Every test also asserts from tbo's counters that the steps it ran split: a tbo that never
split would give the same tokens. The tbo engines run over the emulated ``link``, whose figures show every
microbatch's dispatch and combine booked on it.

Engines are started one at a time and shared by the module's tests: per model, plain SGLang's reference tokens
first (its engine shut down before the next starts), then one tbo engine per microbatch count, and for Qwen3-MoE one
with ``split: "adaptive"`` over microbatches [2, 3]. Each tbo engine's shutdown is checked too: SGLang kills its
scheduler processes, so tbo closes there first (the plugin's shutdown hook) and leaves its summary in
``stats_file``.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from tbo.integrations.engine.stats import StepStats, summary_line

from .helpers import BATCH, LONG, engine, greedy, logged, read_stats, save_mixtral, save_qwen3_moe

MODELS = {"qwen3_moe": save_qwen3_moe, "mixtral": save_mixtral}
MICROBATCHES = (2, 3)
DECODE_TOKENS = 6
#: every tbo engine runs over the emulated link (5 us, 50 GB/s: a few microseconds a transfer on these tiny models),
#: so that the ``link`` key is exercised by the token tests themselves: no engine of its own
LINK = "5,50"


#: the adaptive engine's run: the batch decoded this long (EOS ignored), so that its decode bucket (4 tokens a step)
#: has the steps to warm up and to explore a choice that waits the longest interval (8 x 4 challengers / 0.5)
ADAPTIVE_TOKENS = 80
#: decode steps choose between the engine's decode strategy and a lead-1 one given by value (``adaptive.strategies``,
#: issue 62: bound at the engine's start under its name, run by the loop where chosen)
LEAD1 = {"delta_stages": 1, "operations": [
    "comm_prepare_attn", "attn_prepare", "Yield",
    "attn_core", "comm_prepare_mlp", "gate", "select_experts", "dispatch_a", "Yield",
    "dispatch_b", "experts", "combine_a", "Yield",
    "combine_b", "output", "comm_postprocess_layer"]}
ADAPTIVE = {"split": "adaptive", "strategies": {"adaptive_lead1": LEAD1},
            "adaptive": {"microbatches": [2, 3], "warmup_samples": 1, "explore_share": 0.5,
                         "strategies": {"decode": ["qwen3_moe_decode", "adaptive_lead1"]}}}


def _runs(e: Any, name: str) -> dict[str, Any]:
    """What each test compares: the batch prefilled alone (1 token), the batch decoded, the long prompt alone; for
    Qwen3-MoE the adaptive engine's long decode too."""
    runs = {"prefill": greedy(e, BATCH, 1), "decode": greedy(e, BATCH, DECODE_TOKENS), "cut": greedy(e, LONG, 3)}
    if name == "qwen3_moe":
        runs["adaptive"] = greedy(e, BATCH, ADAPTIVE_TOKENS, ignore_eos=True)
    return runs


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory) -> tuple[str, Path, dict[str, Any]]:
    """A tiny checkpoint and plain SGLang's tokens on it (that engine shut down before tbo's start)."""
    name = request.param
    path = MODELS[name](tmp_path_factory.mktemp(name) / name)
    with engine(path) as e:
        reference = _runs(e, name)
    return name, path, reference


@pytest.fixture(scope="module", params=MICROBATCHES, ids=lambda n: f"{n}mb")
def tbo_run(request, model, tmp_path_factory) -> dict[str, Any]:
    """One tbo engine per model and microbatch count: each run's tokens and tbo's counters before and after it."""
    name, path, reference = model
    n = request.param
    stats_file = tmp_path_factory.mktemp("stats") / "stats.json"
    config = {"num_microbatches": n, "decode_token_threshold": n, "prefill_token_threshold": n,
              "stats_file": str(stats_file), "link": LINK}
    runs: dict[str, Any] = {}
    with engine(path, config) as e:
        for kind, (prompts, new) in {"prefill": (BATCH, 1), "decode": (BATCH, DECODE_TOKENS),
                                     "cut": (LONG, 3)}.items():
            before = read_stats(stats_file)
            tokens = greedy(e, prompts, new)
            runs[kind] = (tokens, before, read_stats(stats_file))
        last = read_stats(stats_file)
    return {"name": name, "n": n, "reference": reference, "runs": runs, "last": last,
            "closed": read_stats(stats_file)}


def _split(before: dict[str, Any], after: dict[str, Any], mode: str) -> int:
    return after["split_steps_by_mode"].get(mode, 0) - before["split_steps_by_mode"].get(mode, 0)


def test_prefill_tokens_equal_plain_sglang_and_the_step_split(tbo_run):
    tokens, before, after = tbo_run["runs"]["prefill"]
    assert tokens == tbo_run["reference"]["prefill"]
    assert _split(before, after, "prefill") >= 1, (before, after)
    assert after["microbatches"] - before["microbatches"] >= tbo_run["n"]


def test_decode_tokens_equal_plain_sglang_and_decode_steps_split(tbo_run):
    tokens, before, after = tbo_run["runs"]["decode"]
    assert tokens == tbo_run["reference"]["decode"]
    # four requests decode together: every decode step has 4 tokens, at or over the threshold (n)
    assert _split(before, after, "decode") >= DECODE_TOKENS - 1, (before, after)


def test_the_link_carries_every_microbatch_s_dispatch_and_combine(tbo_run):
    """``link`` ran: each MoE layer of each microbatch booked its dispatch and its combine on the emulated link, and
    the microbatches' ``*_b`` waits were timed (the link's figures are in ``stats_file``)."""
    _, before, after = tbo_run["runs"]["decode"]
    link, link_before = after["link"], before.get("link", {"transfers": 0})
    microbatches = after["microbatches"] - before["microbatches"]
    assert microbatches >= tbo_run["n"] * (DECODE_TOKENS - 1), (before, after)
    assert link["transfers"] - link_before["transfers"] >= 2 * microbatches, (link_before, link)
    assert link["busy_s"] > 0 and link["exposed_s"] >= 0, link


def test_a_prompt_cut_across_microbatches_gives_plain_sglangs_tokens(tbo_run):
    tokens, before, after = tbo_run["runs"]["cut"]
    assert tokens == tbo_run["reference"]["cut"]
    assert after["cut_requests"] - before["cut_requests"] >= 1, (before, after)  # one prompt: cut inside it
    assert _split(before, after, "prefill") >= 1


def test_each_microbatch_attends_on_a_torch_native_backend_of_its_own(tbo_run):
    """Every microbatch of every split step was planned on its own attention backend, of the runner's class
    (tests/sglang/test_attention.py: the Triton backend, whose plans matter)."""
    attention = tbo_run["last"]["attention"]
    assert attention["backend"] == "TorchNativeAttnBackend" and attention["microbatch_backends"] == tbo_run["n"]
    assert attention["planned"] == tbo_run["last"]["microbatches"] > 0


def test_shutdown_closes_tbo_and_leaves_its_summary(tbo_run):
    """SGLang's shutdown kills the scheduler; tbo closed there first: its last ``stats_file`` write carries the
    summary line, whose counts are the engine's."""
    last, closed = tbo_run["last"], tbo_run["closed"]
    assert "summary" not in last, last  # not before the shutdown
    counted = StepStats(**{f.name: last[f.name] for f in fields(StepStats)})
    assert closed["summary"] == [summary_line(counted)], (closed.get("summary"), last)
    assert closed["summary"][0].startswith(f"tbo: {last['split_steps']} of {last['steps']} forward steps overlapped")
    assert last["split_steps"] >= DECODE_TOKENS  # the counts it summed are a run that split


@pytest.fixture(scope="module")
def adaptive_run(model, tmp_path_factory) -> dict[str, Any]:
    """Qwen3-MoE under ``split: "adaptive"`` with microbatches [2, 3]: the tokens, tbo's counters before the
    shutdown and after it, and what the engine's own process logged at shutdown."""
    name, path, reference = model
    if name != "qwen3_moe":
        pytest.skip("one adaptive engine, on Qwen3-MoE: its reference is the one model's")
    stats_file = tmp_path_factory.mktemp("stats") / "adaptive.json"
    with logged("sglang.tbo") as lines:
        with engine(path, {**ADAPTIVE, "stats_file": str(stats_file), "link": LINK}) as e:
            tokens = greedy(e, BATCH, ADAPTIVE_TOKENS, ignore_eos=True)
            last = read_stats(stats_file)
            logged_before = list(lines)
    return {"tokens": tokens, "reference": reference["adaptive"], "last": last, "closed": read_stats(stats_file),
            "logged_before": logged_before, "logged": lines}


def _count(choice: str) -> int:
    """A choice's microbatch count from its name (``unsplit``, ``split, NAME``, ``split, NAME x3``)."""
    if choice == "unsplit":
        return 1
    return int(choice.rsplit(" x", 1)[1]) if " x" in choice else 2


def test_adaptive_with_two_counts_gives_plain_sglangs_tokens_and_runs_both(adaptive_run):
    """Each step runs the count the adaptive split chose, planned again with that count's policy: over the run both
    counts ran, and tbo's counters are exactly what the adaptive samples say ran (every split step's microbatches)."""
    assert adaptive_run["tokens"] == adaptive_run["reference"]
    last = adaptive_run["last"]
    (report,) = last["adaptive"]
    samples: dict[int, int] = {}
    for bucket in report["buckets"]:
        for choice, n in bucket["samples"].items():
            samples[_count(choice)] = samples.get(_count(choice), 0) + n
    assert samples.get(2, 0) >= 1 and samples.get(3, 0) >= 1, report["summary"]
    assert last["steps"] == sum(samples.values()), (last, samples)
    assert last["split_steps"] == samples[2] + samples[3], (last, samples)
    assert last["microbatches"] == 2 * samples[2] + 3 * samples[3], (last, samples)


def test_adaptive_runs_each_chosen_candidate_strategy(adaptive_run):
    """The loop runs the strategy the adaptive split chose (issue 62): tbo's split steps by strategy are exactly the
    samples of each candidate, the by-value one among them, and decode steps ran no strategy outside their
    candidates (the engine's prefill strategy runs the prefill steps only)."""
    last = adaptive_run["last"]
    (report,) = last["adaptive"]
    by_name: dict[str, int] = {}
    for bucket in report["buckets"]:
        for choice, n in bucket["samples"].items():
            if choice != "unsplit" and n:
                name = choice.removeprefix("split, ").rsplit(" x", 1)[0]
                by_name[name] = by_name.get(name, 0) + n
    assert by_name.get("adaptive_lead1", 0) >= 1, report["summary"]
    assert last["split_steps_by_strategy"] == by_name, (last["split_steps_by_strategy"], by_name)
    decode = [b for b in report["buckets"] if b["kind"] == "decode"]
    assert all("qwen3_moe_prefill" not in c for b in decode for c in b["samples"]), decode


def test_adaptive_engine_shutdown_logs_its_summary_in_the_engines_process(adaptive_run):
    """The schedulers' summary (the counts, then each adaptive bucket's line) comes back to the process that made
    the engine and is logged there at shutdown, and written to ``stats_file``."""
    last, closed, lines = adaptive_run["last"], adaptive_run["closed"], adaptive_run["logged"]
    assert adaptive_run["logged_before"] == [] and lines == closed["summary"], (lines, closed.get("summary"))
    assert lines[0].startswith(f"tbo: {last['split_steps']} of {last['steps']} forward steps overlapped")
    assert [line.removeprefix("tbo adaptive: ") for line in lines[1:]] == last["adaptive"][0]["summary"]


def test_unsplit_steps_run_sglangs_own_forward_and_split_ones_tbos_with_plain_sglangs_tokens(model, tmp_path_factory):
    """Without a link or ``op_times`` (`sglang_runs_unsplit`), a step tbo does not split runs SGLang's own forward (what
    it costs without tbo), counted as tbo's; the split ones run tbo's layers. Decode steps (4 tokens) stay under
    their threshold here, prefills split: the tokens equal plain SGLang's, and every unsplit step was SGLang's."""
    name, path, reference = model
    if name != "qwen3_moe":
        pytest.skip("one engine, on Qwen3-MoE: the path does not depend on the family")
    stats_file = tmp_path_factory.mktemp("stats") / "own.json"
    config = {"num_microbatches": 2, "decode_token_threshold": 100, "prefill_token_threshold": 2,
              "stats_file": str(stats_file)}
    with engine(path, config) as e:
        tokens = {"prefill": greedy(e, BATCH, 1), "decode": greedy(e, BATCH, DECODE_TOKENS)}
        stats = read_stats(stats_file)
    assert tokens == {k: reference[k] for k in tokens}
    assert stats["split_steps_by_mode"].get("prefill", 0) >= 1 and stats["split_steps_by_mode"].get("decode", 0) == 0
    unsplit = stats["steps"] - stats["split_steps"]
    assert stats["own_forward_steps"] == unsplit >= DECODE_TOKENS - 1, stats
    assert stats["unsplit_steps_by_reason"]["below_threshold"] == unsplit, stats
