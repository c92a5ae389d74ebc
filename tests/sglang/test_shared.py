"""A MoE block with a shared expert inside a real SGLang engine: Qwen2-MoE, whose every MoE block has a shared expert
gated by the sigmoid of its ``shared_expert_gate``. tbo admits it by structure and runs the shared expert as its own
op (``strategy: "auto"`` picks ``deepseek_decode``/``deepseek_prefill``, which run it while the dispatch is in
flight); greedy tokens equal plain SGLang's over prefill, decode and a prompt cut across microbatches, and tbo's
counters show the steps split and the ``shared_experts`` op run in each microbatch of each layer.

At tensor parallel 2 the shared expert is sharded like the routed experts, and its output is a partial sum too:
``moe_tp_decode``/``moe_tp_prefill`` sum it as tbo's own all-reduce (``shared_reduce_a``/``_b``) beside the routed
output's, where SGLang sums the two in one. A third engine runs tbo at TP = 2, judged by plain SGLang's tokens at
TP = 1 (the sums round differently from SGLang's own TP = 2, the logits are far apart).

Plain SGLang adds the gated shared expert with a Triton kernel on this CPU: both engines run with
tests/triton_site on their processes' path (Triton's interpreter; see its sitecustomize). One plain engine
and one tbo engine, each started once for the module, one after the other. The weights are drawn large
(``initializer_range`` 0.2): a tbo that dropped the shared expert, or its gate, would not give the same tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .helpers import BATCH, LONG, TRITON_ENV, counted_runs, engine, greedy, read_stats, save_qwen2_moe

N = 2  #: microbatches
LAYERS = 2  #: save_qwen2_moe's layers, each a MoE block with a shared expert
DECODE_TOKENS = 5
RUNS = {"prefill": (BATCH, 1), "decode": (BATCH, DECODE_TOKENS), "cut": (LONG, 3)}


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory) -> Path:
    return save_qwen2_moe(tmp_path_factory.mktemp("qwen2_moe") / "qwen2_moe")


@pytest.fixture(scope="module")
def reference(qwen2_moe) -> dict[str, Any]:
    """Plain SGLang's tokens (its engine shut down before tbo's starts)."""
    with engine(qwen2_moe, env=TRITON_ENV) as e:
        return {kind: greedy(e, prompts, new) for kind, (prompts, new) in RUNS.items()}


@pytest.fixture(scope="module")
def tbo_runs(qwen2_moe, reference, tmp_path_factory) -> dict[str, Any]:
    """tbo's tokens per run, with its counters before and after each."""
    stats_file = tmp_path_factory.mktemp("stats") / "shared.json"
    config = {"num_microbatches": N, "decode_token_threshold": N, "prefill_token_threshold": N,
              "stats_file": str(stats_file), "op_times": True, "link": "5,50"}
    with engine(qwen2_moe, config, env=TRITON_ENV) as e:
        return counted_runs(e, RUNS, stats_file)


def _grew(before: dict[str, Any], after: dict[str, Any], key: str, name: str | None = None) -> int:
    """How much counter ``key`` (or entry ``name`` of the dict counter ``key``) grew over a run."""
    if name is None:
        return after.get(key, 0) - before.get(key, 0)
    return after.get(key, {}).get(name, 0) - before.get(key, {}).get(name, 0)


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_tokens_equal_plain_sglang_and_the_steps_split(tbo_runs, reference, kind):
    tokens, before, after = tbo_runs[kind]
    assert tokens == reference[kind]
    mode = "decode" if kind == "decode" else "prefill"
    split = _grew(before, after, "split_steps_by_mode", mode)
    assert split >= (DECODE_TOKENS - 1 if kind == "decode" else 1), (before, after)
    if kind == "cut":
        assert _grew(before, after, "cut_requests") >= 1, (before, after)


def test_the_shared_expert_ran_as_its_own_op_in_every_microbatch(tbo_runs):
    """Each split step ran ``shared_experts`` once per microbatch and layer, beside the dispatch and combine that
    the link booked: the op the strategy overlaps is the one that ran the shared expert."""
    _, before, after = tbo_runs["decode"]
    microbatches = _grew(before, after, "microbatches")
    assert microbatches >= N * (DECODE_TOKENS - 1), (before, after)
    assert _grew(before, after, "op_calls", "shared_experts") >= LAYERS * microbatches, (before, after)
    assert _grew(before, after, "op_calls", "dispatch_a") >= LAYERS * microbatches, (before, after)


@pytest.fixture(scope="module")
def tp_runs(qwen2_moe, reference, tmp_path_factory) -> dict[str, Any]:
    """tbo at TP = 2: its tokens per run and both ranks' counters before and after each."""
    stats = tmp_path_factory.mktemp("tp-stats")
    files = [stats / f"shared-{rank}.json" for rank in range(2)]
    config = {"num_microbatches": N, "decode_token_threshold": N, "prefill_token_threshold": N,
              "stats_file": str(stats / "shared-{rank}.json"), "op_times": True}
    runs = {}
    with engine(qwen2_moe, config, env=TRITON_ENV, tp_size=2) as e:
        for kind, (prompts, new) in RUNS.items():
            before = [read_stats(f) for f in files]
            runs[kind] = (greedy(e, prompts, new), before, [read_stats(f) for f in files])
    return runs


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_at_tp2_tokens_equal_plain_sglang_and_the_shared_sums_are_tbos(tp_runs, reference, kind):
    """TP = 2: the tokens are plain SGLang's; on each rank the steps split with ``moe_tp_*``, and every layer of
    every microbatch (and unsplit step) launched three all-reduces of its own, attention's, the routed output's and
    the shared expert's, each reaching SGLang's TP group, and ran the shared expert."""
    tokens, before, after = tp_runs[kind]
    assert tokens == reference[kind]
    for rank in range(2):
        b, a = before[rank], after[rank]
        mode = "decode" if kind == "decode" else "prefill"
        assert _grew(b, a, "split_steps_by_mode", mode) >= (DECODE_TOKENS - 1 if kind == "decode" else 1), (b, a)
        assert set(a["split_steps_by_strategy"]) <= {"moe_tp_decode", "moe_tp_prefill"}, a
        microbatches = _grew(b, a, "microbatches")
        unsplit = _grew(b, a, "steps") - _grew(b, a, "split_steps")
        assert _grew(b, a, "tp_reductions") == (microbatches + unsplit) * LAYERS * 3, (b, a)
        assert a["tp"]["launched"] == a["tp_reductions"] and a["tp"]["attn_sums_by_sglang"] == 0, a["tp"]
        assert _grew(b, a, "op_calls", "shared_reduce_a") == (microbatches + unsplit) * LAYERS, (b, a)
        assert _grew(b, a, "op_calls", "shared_experts") == (microbatches + unsplit) * LAYERS, (b, a)
