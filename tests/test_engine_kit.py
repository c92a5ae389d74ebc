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
