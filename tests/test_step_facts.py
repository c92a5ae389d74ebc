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
    assert step.plan is not None and step.plan.num_microbatches == 2 and step.kind == "prefill"
    decode = decide_facts(POLICY, StepFacts(scheduled=(1,) * 6, past_prompt=(True,) * 6, padded_tokens=6))
    assert decode.forward_mode is ForwardMode.DECODE and decode.plan is not None
    # a reader before a writer, the runner's own veto, a padded step: each runs whole
    assert decide_facts(POLICY, dataclasses.replace(facts, computed=(32, 0, 0))).plan is None
    assert decide_facts(POLICY, dataclasses.replace(facts, computed=(0, 0, 32))).plan is not None
    assert decide_facts(POLICY, dataclasses.replace(facts, allowed=False)).plan is None
    assert decide_facts(POLICY, dataclasses.replace(facts, padded_tokens=32)).plan is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.allowed = False  # type: ignore[misc]


@pytest.mark.parametrize("facts, why", [
    (StepFacts(scheduled=(1,), past_prompt=(True,), padded_tokens=1), "below_threshold"),  # 1 token < 2
    (StepFacts(scheduled=(5, 4), past_prompt=(False, False), padded_tokens=9), "below_threshold"),  # 9 < 12
    (StepFacts(scheduled=(9, 8), past_prompt=(False, False), padded_tokens=17, allowed=False), "engine_veto"),
    (StepFacts(scheduled=(9, 8), past_prompt=(False, False), padded_tokens=32), "padded"),
    (StepFacts(scheduled=(9, 9), past_prompt=(False, False), padded_tokens=18, computed=(32, 0)), "engine_veto"),
    (StepFacts(scheduled=(), past_prompt=(), padded_tokens=0), "empty"),
    (StepFacts(scheduled=(9, 8), past_prompt=(False, False), padded_tokens=17), None),  # it splits
])
def test_a_step_run_unsplit_says_why(facts, why):
    """`Step.unsplit_reason`: what `stats()` and the metrics count unsplit steps by (None where the step splits)."""
    step = decide_facts(POLICY, facts)
    assert step.unsplit_reason == why and (step.plan is None) == (why is not None)


def test_no_acceptable_cut_is_named_apart_from_the_threshold():
    """Cuts between requests only, one request holding almost every token: above the threshold, no cut."""
    whole = SplitPolicy(num_microbatches=2, decode_token_threshold=2, prefill_token_threshold=12,
                        allow_cut_sequences=False)
    step = decide(whole, [30, 1], [False, False], allowed=True, padded_tokens=31)
    assert step.plan is None and step.unsplit_reason == "no_cut"
    assert decide(whole, [], [], allowed=True, padded_tokens=0).unsplit_reason == "empty"


def test_a_step_s_kind_and_slot_are_the_vocabulary_s_members_and_read_as_their_strings():
    """One vocabulary (issue 58): `Step.kind` is a `StepKind`, `Step.slot` a `Slot`, given as members or as their
    strings; a mixed step runs the prefill slot, a verify step the decode one; members and strings are the same key
    (the stats file's, the metrics' and the config's), print and dump as the strings, and a bad word is named."""
    import json

    from tbo.integrations.engine.step import Step
    from tbo.split import Slot, StepKind

    mixed = decide(POLICY, [1, 1, 9], [True, True, False], allowed=True, padded_tokens=11)
    assert mixed.kind is StepKind.MIXED and mixed.slot is Slot.PREFILL and mixed.own_slot is Slot.PREFILL
    verify = decide(POLICY, [3, 3], [True, True], allowed=True, padded_tokens=6, drafts=[2, 2])
    assert verify.kind is StepKind.DECODE and verify.forward_mode is ForwardMode.TARGET_VERIFY
    assert verify.slot is Slot.DECODE
    given = Step("idle", ForwardMode.DECODE, 0, None, agreed_slot="prefill")
    assert given.kind is StepKind.IDLE and given.slot is Slot.PREFILL and given.own_slot is Slot.DECODE
    # why each ran unsplit, as stats() counts it: the decision's reason, a dummy step's "idle", else "other"
    assert (mixed.counted_reason, given.counted_reason) == (mixed.unsplit_reason or "other", "idle")
    assert Step("decode", ForwardMode.DECODE, 4, None, unsplit_reason="padded").counted_reason == "padded"
    assert Step("decode", ForwardMode.DECODE, 4, None).counted_reason == "other"
    counts = {StepKind.DECODE: 1}
    counts["mixed"] = 2
    assert counts["decode"] == 1 and counts[StepKind.MIXED] == 2 and "prefill" not in counts
    assert json.dumps({Slot.DECODE: [StepKind.MIXED]}) == '{"decode": ["mixed"]}'
    assert f"{StepKind.PREFILL} / {Slot.DECODE!s} / {Slot.DECODE!r}" == "prefill / decode / 'decode'"
    assert [k.samples for k in StepKind] == [True, True, True, False, False, False]
    with pytest.raises(ValueError, match="'decoding' is not a valid StepKind"):
        Step("decoding", ForwardMode.DECODE, 1, None)
