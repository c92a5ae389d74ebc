"""What every engine integration takes from the kit (`tbo.integrations.engine`), without an engine: the one error
type and message shape each room raises under its own name, the one config schema, and the adaptive driver's
contract (the caller must be able to plan a step again; a choice of another count runs planned with that count).
The kit inside real engines: tests/vllm/test_adaptive.py and tests/sglang/test_tokens.py."""

from __future__ import annotations

import pytest

from tbo.integrations.engine.adaptive import AdaptiveSteps
from tbo.integrations.engine.config import TboConfig
from tbo.integrations.engine.errors import ON, TboEngineError
from tbo.integrations.engine.step import Step
from tbo.integrations.sglang.config import parse_config as sglang_config
from tbo.integrations.sglang.errors import TboSglangError
from tbo.integrations.sglang.errors import refuse as sglang_refuse
from tbo.integrations.vllm.config import TboVllmConfig
from tbo.integrations.vllm.config import parse_config as vllm_config
from tbo.integrations.vllm.errors import TboConfigError
from tbo.integrations.vllm.errors import refuse as vllm_refuse
from tbo.split import ForwardMode
from tbo.split.adaptive import Choice


@pytest.mark.parametrize("refuse, error, source", [(vllm_refuse, TboConfigError, "additional_config['tbo']"),
                                                   (sglang_refuse, TboSglangError, "TBO_SGLANG_CONFIG")])
def test_each_room_raises_the_kits_error_in_the_one_shape(refuse, error, source):
    with pytest.raises(TboEngineError) as info:
        refuse({"afd": ON, "tp": 2}, "tp=1", "one rank")
    assert type(info.value) is error
    assert str(info.value) == f"{source} with afd and tp=2: not supported (one rank); accepted: tp=1"


def test_both_engines_read_the_one_schema():
    raw = {"split": "adaptive", "adaptive": {"microbatches": [2, 3]}, "link": "5,50"}
    assert TboVllmConfig is TboConfig
    assert vllm_config({"tbo": raw}) == sglang_config(raw) == TboConfig(**raw)


def _decode(policy, tokens: int) -> Step:
    return Step("decode", ForwardMode.DECODE, tokens, policy.plan(ForwardMode.DECODE, tokens))


def test_the_adaptive_driver_requires_a_replan_and_runs_the_chosen_count():
    """``decide`` without ``replan`` is refused; with it, every split step runs planned with its choice's count
    (here the prediction makes 3 the first choice and 2 a challenger warmed up, so both run in a few steps)."""
    config = TboConfig(split="adaptive", adaptive={"microbatches": [2, 3], "warmup_samples": 1})
    steps = AdaptiveSteps(config, config.strategy_names(shared_experts=False))
    with pytest.raises(TypeError, match="replan"):
        steps.decide(_decode(steps.policy, 64))  # type: ignore[call-arg]
    three, two = Choice("qwen3_moe_decode", 3), Choice("qwen3_moe_decode", 2)
    steps.split.estimate = lambda kind, tokens: {three: 0.5, two: 0.6}
    asked, ran = [], []
    for _ in range(6):
        def replan(policy):
            asked.append(policy.num_microbatches)
            return _decode(policy, 64)

        step = steps.decide(_decode(steps.policy, 64), replan)
        ran.append(1 if step.plan is None else step.plan.num_microbatches)
        steps.step_done()
    assert ran[0] == 3 and 2 in ran, ran
    assert asked == [2] * ran.count(2), (asked, ran)  # planned again exactly where the count differed
    (row,) = steps.report()["buckets"]
    assert sum(n for c, n in row["samples"].items() if c.endswith(" x3")) == ran.count(3), (row, ran)


def test_the_step_histogram_counts_each_step_once_under_its_kind_and_split_cumulatively():
    """`StepStats.observe_step` keeps Prometheus's cumulative ``le`` buckets per "kind|split"; a `StepClock` observes
    a started step once, and a start with no stop (a dummy step samples nothing) is dropped by the next start."""
    from tbo.integrations.engine.stats import STEP_SECONDS_BUCKETS, StepClock, StepStats

    s = StepStats()
    for seconds in (0.0625, 0.25, 0.25):
        s.observe_step("decode", True, seconds)
    s.observe_step("prefill", False, 100.0)  # beyond every bucket: only in the count (+Inf) and the sum
    assert s.step_seconds_count == {"decode|split": 3, "prefill|unsplit": 1}
    assert s.step_seconds_sum == {"decode|split": 0.5625, "prefill|unsplit": 100.0}
    assert s.step_seconds_bucket["decode|split|0.075"] == 1 and s.step_seconds_bucket["decode|split|0.3"] == 3
    assert "decode|split|0.05" not in s.step_seconds_bucket and not any(k.startswith("prefill") for k in
                                                                        s.step_seconds_bucket)
    assert sum(k.startswith("decode|split|") for k in s.step_seconds_bucket) == \
        sum(le >= 0.0625 for le in STEP_SECONDS_BUCKETS)
    clock = StepClock(s)
    assert not clock.stop()  # nothing running
    clock.start("idle", False)
    clock.start("mixed", True)  # the idle step never stopped: dropped
    assert clock.stop() and not clock.stop()
    assert s.step_seconds_count["mixed|split"] == 1 and "idle|unsplit" not in s.step_seconds_count
    total = s.copy()
    total.add(s)
    assert total.step_seconds_count["decode|split"] == 6 and total.step_seconds_bucket["decode|split|0.3"] == 6


def test_a_step_the_adaptive_choice_runs_whole_says_so():
    """With nothing to hide (no transfers) the driver runs a plannable step whole, and `Step.unsplit_reason` names
    the adaptive choice, not the thresholds (which would have split it)."""
    config = TboConfig(split="adaptive")
    steps = AdaptiveSteps(config, config.strategy_names(shared_experts=False), transfers=False)
    planned = _decode(steps.policy, 64)
    assert planned.plan is not None
    step = steps.decide(planned, lambda policy: _decode(policy, 64))
    assert step.plan is None and step.unsplit_reason == "adaptive"


def test_the_kits_layer_loop_runs_times_traces_and_counts_a_step(tmp_path, caplog):
    """`EngineLayerLoop`, the loop both engines' (and the small engine's) build on, over the reference model's
    layers: a split prefill step runs the adaptive split's candidate where one is named (tokens equal unsplit, bit
    for bit), is counted with its strategy, op times, the live trace an armed request asked for and the engine's own
    counting; an unsplit step counts its reason; a ``stats_file`` that cannot be written is logged, counted, never
    raised."""
    import time

    import torch

    import tbo.strategies as S
    from tbo.integrations.engine.live_trace import LiveTrace, TraceRequest, read_trace_files, write_request
    from tbo.integrations.engine.loop import EngineLayerLoop
    from tbo.integrations.engine.stats import StatsFile
    from tbo.models import AttentionMetadata, KVCache, ModelConfig, ReferenceModel
    from tbo.split import SplitPolicy
    from tbo.split.kinds import Slot

    model = ReferenceModel(ModelConfig.qwen3_moe_tiny(num_layers=3))
    bound = {slot: S.bind_layers(model.layers, "qwen3_moe_decode") for slot in Slot}
    bound["qwen3_moe_prefill"] = S.bind_layers(model.layers, "qwen3_moe_prefill")
    ran: list = []

    class Loop(EngineLayerLoop):
        def count_more(self, run):
            ran.append((run.step.kind, run.microbatches, run.strategy))

    (tmp_path / "a_dir").mkdir()
    loop = Loop(model.layers, bound, None, op_times=True, stats_file=StatsFile(str(tmp_path / "a_dir")))
    loop.live_trace = live = LiveTrace(tmp_path, {"rank": 0})
    write_request(tmp_path, TraceRequest(id="ab" * 8, steps=1, deadline=time.time() + 60))
    live.poll()
    assert live.armed
    lens = [3, 1, 5]
    ids = torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.build(range(len(lens)), lens, [0] * len(lens))
    hidden = model.embed(ids)
    plan = SplitPolicy(prefill_token_threshold=2).plan(ForwardMode.EXTEND, sum(lens), lens)

    def pinned_for(cache):
        return lambda mb: {"attn": meta if mb is None else meta.for_microbatch(mb), "cache": cache}

    split = Step("prefill", ForwardMode.EXTEND, sum(lens), plan, strategy_name="qwen3_moe_prefill")
    run = loop.run(split, hidden, pinned=pinned_for(KVCache()), counted=True)
    whole = Step("prefill", ForwardMode.EXTEND, sum(lens), None, unsplit_reason="below_threshold")
    ref = loop.run(whole, hidden, pinned=pinned_for(KVCache()), counted=False)
    assert torch.equal(run.out["hidden_states"], ref.out["hidden_states"])
    assert run.microbatches == 2 and run.strategy == "qwen3_moe_prefill" and ref.strategy == "qwen3_moe_decode"
    loop.count(run)
    loop.count(ref)
    s = loop.stats
    assert s.split_steps_by_mode["prefill"] == 1 and s.steps_by_mode["prefill"] == 2, s.as_dict()
    assert s.split_steps_by_strategy == {"qwen3_moe_prefill": 1} and s.unsplit_steps_by_reason["below_threshold"] == 1
    assert s.op_calls["dispatch_a"] == 2 * 3, s.op_calls  # 2 microbatches, 3 layers; the uncounted run untimed
    assert ran == [("prefill", 2, "qwen3_moe_prefill"), ("prefill", 1, "qwen3_moe_decode")]
    assert loop.stats_file_failures == 2 and "stats_file" in caplog.text
    live.poll()
    [doc] = read_trace_files(tmp_path, "ab" * 8, 1 << 20)
    assert [x["label"] for x in doc["steps"]] == ["prefill step, split"] and doc["steps"][0]["tokens"] == [4, 5]
