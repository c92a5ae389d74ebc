"""SGLang's Triton attention backend through tbo: each microbatch attends on its own backend, planned for its batch.

The Triton backend plans per batch (``init_forward_metadata``: KV index arrays, split counts) and its kernels read
that plan back; a microbatch attending on the step's plan reads the whole batch's rows (tried: the kernels read out
of bounds and the scheduler dies). Its kernels run here in Triton's interpreter (tests/triton_site on the engines'
``PYTHONPATH``, as for tests/sglang/test_shared.py). One plain SGLang engine on the Triton backend gives the
reference tokens, then one tbo engine on it at 3 microbatches: tokens equal over prefill, decode and a prompt cut
across microbatches, and tbo's counters show that those steps split and that every microbatch of every split step
was planned on a backend of its own, of the runner's class. (The torch-native backend takes the same path in
tests/sglang/test_tokens.py.)
"""

from __future__ import annotations

from typing import Any

import pytest

from .helpers import BATCH, LONG, TRITON_ENV, counted_runs, engine, greedy, read_stats, save_qwen3_moe

MICROBATCHES = 3
RUNS = {"prefill": (BATCH, 1), "decode": (BATCH, 5), "cut": (LONG, 3)}


@pytest.fixture(scope="module")
def triton_runs(tmp_path_factory) -> dict[str, Any]:
    """Plain SGLang's tokens and tbo's (with its counters after each run), both on the Triton backend."""
    path = save_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe") / "qwen3_moe")
    with engine(path, env=TRITON_ENV, attention_backend="triton") as e:
        reference = {kind: greedy(e, prompts, new) for kind, (prompts, new) in RUNS.items()}
    stats_file = tmp_path_factory.mktemp("stats") / "stats.json"
    n = MICROBATCHES
    config = {"num_microbatches": n, "decode_token_threshold": n, "prefill_token_threshold": n,
              "stats_file": str(stats_file)}
    with engine(path, config, env=TRITON_ENV, attention_backend="triton") as e:
        runs = counted_runs(e, RUNS, stats_file)
    return {"reference": reference, "runs": runs, "closed": read_stats(stats_file)}


@pytest.mark.parametrize("kind, mode", [("prefill", "prefill"), ("decode", "decode"), ("cut", "prefill")])
def test_tokens_on_the_triton_backend_equal_plain_sglangs_and_the_steps_split(triton_runs, kind, mode):
    tokens, before, after = triton_runs["runs"][kind]
    assert tokens == triton_runs["reference"][kind]
    split = after["split_steps_by_mode"].get(mode, 0) - before["split_steps_by_mode"].get(mode, 0)
    assert split >= 1, (kind, before, after)
    if kind == "cut":
        assert after["cut_requests"] > before["cut_requests"]


def test_every_microbatch_was_planned_on_a_triton_backend_of_its_own(triton_runs):
    stats = triton_runs["closed"]
    assert stats["attention"]["backend"] == "TritonAttnBackend"
    assert stats["attention"]["microbatch_backends"] == MICROBATCHES
    # each split step planned each of its microbatches (every one holds a request), and no other step planned any
    assert stats["split_steps"] >= 3 and stats["attention"]["planned"] == stats["microbatches"]
