"""Real SGLang engines, tbo on, against plain SGLang: greedy tokens equal over prefill, decode and a prompt cut across
microbatches, at 2 and 3 microbatches, for Qwen3-MoE (whose SGLang model calls ``model_forward_stages``) and Mixtral
(whose model does not). Every test also asserts from tbo's counters that the steps it ran split: a tbo that never
split would give the same tokens. The tbo engines run over the emulated ``link``, whose figures show every
microbatch's dispatch and combine booked on it.

Engines are started one at a time and shared by the module's tests: per model, plain SGLang's reference tokens
first (its engine shut down before the next starts), then one tbo engine per microbatch count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .helpers import BATCH, LONG, engine, greedy, read_stats, save_mixtral, save_qwen3_moe

MODELS = {"qwen3_moe": save_qwen3_moe, "mixtral": save_mixtral}
MICROBATCHES = (2, 3)
DECODE_TOKENS = 6
#: every tbo engine runs over the emulated link (5 us, 50 GB/s: a few microseconds a transfer on these tiny models),
#: so that the ``link`` key is exercised by the token tests themselves: no engine of its own
LINK = "5,50"


def _runs(e: Any) -> dict[str, Any]:
    """What each test compares: the batch prefilled alone (1 token), the batch decoded, the long prompt alone."""
    return {"prefill": greedy(e, BATCH, 1), "decode": greedy(e, BATCH, DECODE_TOKENS), "cut": greedy(e, LONG, 3)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory) -> tuple[str, Path, dict[str, Any]]:
    """A tiny checkpoint and plain SGLang's tokens on it (that engine shut down before tbo's start)."""
    name = request.param
    path = MODELS[name](tmp_path_factory.mktemp(name) / name)
    with engine(path) as e:
        reference = _runs(e)
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
    return {"name": name, "n": n, "reference": reference, "runs": runs}


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
