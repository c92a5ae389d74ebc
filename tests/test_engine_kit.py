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
