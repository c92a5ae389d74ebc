"""`StepFacts` and `decide_facts`: the one frozen value each vLLM runner adapts its step to (V1's batch, Model Runner
V2's ``BatchReqState``), decided by a pure function of it, and the prefix-cache rule for a runner without its own
(`readers_last`). No vLLM here."""

from __future__ import annotations

import dataclasses

import pytest

from tbo.integrations.engine.step import StepFacts, decide, decide_facts, readers_last
from tbo.split import ForwardMode, SplitPolicy

POLICY = SplitPolicy(num_microbatches=2, decode_token_threshold=2, prefill_token_threshold=12)


@pytest.mark.parametrize("scheduled, computed, allowed", [
    ([1, 1, 9], [5, 6, 0], True),  # decodes read nothing new; the prefill reads nothing cached
    ([1, 1, 9], [5, 6, 32], True),  # a reader, but last: everything it may read is written first
    ([9, 9], [32, 0], False),  # a reader (cache hit) before a writer: split, it could read an unwritten block
    ([1, 9, 9], [4, 0, 32], True),
    ([9, 9, 1], [0, 32, 4], False),  # a reader before the last request
    ([], [], True),
])
def test_readers_last(scheduled, computed, allowed):
    assert readers_last(scheduled, computed) is allowed


def test_decide_facts_is_decide_on_the_facts():
    facts = StepFacts(scheduled=(9, 8, 7), past_prompt=(False,) * 3, padded_tokens=24)
    step = decide_facts(POLICY, facts)
    assert step == decide(POLICY, [9, 8, 7], [False] * 3, allowed=True, padded_tokens=24)
    assert step.plan is not None and step.plan.num_microbatches == 2 and step.mode == "prefill"
    decode = decide_facts(POLICY, StepFacts(scheduled=(1,) * 6, past_prompt=(True,) * 6, padded_tokens=6))
    assert decode.forward_mode is ForwardMode.DECODE and decode.plan is not None
    # a reader before a writer, the runner's own veto, a padded step: each runs whole
    assert decide_facts(POLICY, dataclasses.replace(facts, computed=(32, 0, 0))).plan is None
    assert decide_facts(POLICY, dataclasses.replace(facts, computed=(0, 0, 32))).plan is not None
    assert decide_facts(POLICY, dataclasses.replace(facts, allowed=False)).plan is None
    assert decide_facts(POLICY, dataclasses.replace(facts, padded_tokens=32)).plan is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.allowed = False  # type: ignore[misc]
