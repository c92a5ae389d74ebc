"""The split decision for one engine step, made by tbo's `SplitPolicy` from the engine's batch (each engine adapts its
own batch into `StepFacts`; `decide_facts` is a pure function of them).

A step is of kind `StepKind.DECODE` (every request past its prompt), ``PREFILL`` (none is) or ``MIXED`` (chunked
prefill beside decodes), and runs one of the engine's two strategies, its `Slot` (decode-like batches the decode
one). The policy sees it as DECODE when every request brings one token, else as EXTEND with each request's
scheduled tokens, so a step can be cut between requests or, when the boundaries are lopsided, inside a prefill
chunk (the later part then attends over the earlier part through the KV cache, which the earlier microbatch's
attention has written by then: microbatch 0 always runs a layer's attention first).

With speculative decoding a step verifies drafts: a request brings 1 + k tokens, k its own draft count (ngram
proposes a different k per request). Such a step, every request past its prompt, is TARGET_VERIFY to the policy:
decode-like, cut between requests only (uniform k: ``token_num_per_seq`` = 1 + k; varying k: the request boundary
that best balances tokens, `tbo.split.index.verify_cuts`). In a step that also prefills, a cut the policy put inside
a drafted request moves to that request's nearer boundary. vLLM's rejection sampling and spec-decode metadata see the
whole step, as without tbo: only the layers run in microbatches.

A forward of a drafter's model (vLLM's MTP: `tbo.integrations.vllm.runner.draft`) is decided alone
(`decide_draft`): decode-like, cut between requests only.

A step does not split when the policy says no, when the engine's prefix-cache rule forbids it (a request reading
blocks another request of the same step is writing now: vLLM's own rule, `readers_last` where a runner has none),
when it uses cascade attention, or when the runner padded it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Sequence

from tbo.split import ForwardMode, SplitPlan, SplitPolicy
from tbo.split.index import Cut
from tbo.split.kinds import Slot, StepKind
from tbo.split.plan import plan_from_cuts

__all__ = ["Step", "StepFacts", "UNSPLIT_REASONS", "decide", "decide_draft", "decide_facts", "microbatch_rows",
           "readers_last", "unsplit_reason"]

#: why a step runs unsplit: fewer tokens than its kind's threshold; no cut the policy accepts (too few requests for
#: the microbatches, lopsided boundaries where cuts fall between requests only, drafts kept whole); the engine's own
#: veto (vLLM's prefix-cache rule, its microbatching veto); a step the runner padded; cascade attention; the adaptive
#: split's choice; another data-parallel rank's (the agreement ran it whole); a step with no request; a dummy step;
#: "other": a step whose decision gave no reason (none of tbo's does; a counter that rises names a gap)
UNSPLIT_REASONS = ("below_threshold", "no_cut", "engine_veto", "padded", "cascade", "adaptive", "data_parallel",
                   "empty", "idle", "other")


@dataclass(frozen=True)
class Step:
    """One engine step as tbo sees it."""

    #: what the step is (`StepKind`): decode, prefill or mixed; with data parallelism also idle (a dummy step) or
    #: warmup; draft: one forward of a drafter's model (`decide_draft`)
    kind: StepKind
    forward_mode: ForwardMode
    num_tokens: int
    plan: SplitPlan | None  #: None: the step runs unsplit
    #: the slot the step runs, chosen by the data-parallel ranks' agreement or the adaptive split (None: its own,
    #: `own_slot`)
    agreed_slot: Slot | None = None
    #: the registry name of the strategy the adaptive split chose among its candidates (`slot` is the slot it runs
    #: in: its backend and forms); None: the slot's own strategy
    strategy_name: str | None = None
    #: data parallel: what the ranks agreed beyond the plan and the slot (`tbo.integrations.vllm.step.agree.DpStep`:
    #: an empty tail, every rank's rows); None: this engine decided alone
    dp: Any = None
    #: speculative decoding: the draft tokens this step verifies (0: none, not a verify step)
    draft_tokens: int = 0
    #: a verify step whose requests bring different draft counts (k varies between them)
    varying_drafts: bool = False
    #: why it runs unsplit (None: it splits): one of `UNSPLIT_REASONS`, counted by reason in ``stats()``
    unsplit_reason: str | None = None

    def __post_init__(self) -> None:  # a kind or slot given as its string: the member (one vocabulary downstream)
        object.__setattr__(self, "kind", StepKind(self.kind))
        if self.agreed_slot is not None:
            object.__setattr__(self, "agreed_slot", Slot(self.agreed_slot))

    @property
    def slot(self) -> Slot:
        """Which of the engine's strategies runs it: the agreed slot, else its own."""
        return self.agreed_slot if self.agreed_slot is not None else self.own_slot

    @property
    def own_slot(self) -> Slot:
        """The slot this step's own batch needs: decode for decode-like steps (a verify step too), prefill
        otherwise."""
        return Slot.of(self.forward_mode)

    @property
    def counted_reason(self) -> str:
        """Why it ran unsplit, as ``stats()`` counts it: its decision's reason, "idle" for a dummy step, else "other"
        (no decision of tbo's leaves it unset: a counter that rises names a gap)."""
        return self.unsplit_reason or ("idle" if self.kind == StepKind.IDLE else "other")

    @property
    def runner_split(self) -> bool:
        """Whether vLLM's runner builds this step in microbatches (the plan's token ranges)."""
        return self.plan is not None and not (self.dp is not None and self.dp.empty_tail)


def decide(policy: SplitPolicy, scheduled: Sequence[int], past_prompt: Sequence[bool], *, allowed: bool,
           padded_tokens: int, cascade: bool = False, drafts: Sequence[int] | None = None) -> Step:
    """The `Step` for requests with ``scheduled`` tokens each, ``past_prompt[i]`` True for a decoding request.

    ``allowed`` is False when vLLM's own microbatching veto applies; ``padded_tokens`` is the token count the
    runner will run (a padded step is not split: its microbatches would not be the plan's token ranges).
    ``cascade``: the step uses cascade attention, whose shared-prefix metadata spans every request of the step;
    vLLM's DBO turns it off while microbatching, and a step that has it is not split here. (vLLM 0.32 removed
    cascade attention: its integration passes none; the rule stays for an engine whose runner still has it.)
    ``drafts``: speculative decoding, each request's draft tokens to verify this step (None or all 0: none).
    """
    lens = [int(n) for n in scheduled]
    decoding = sum(bool(p) for p in past_prompt)
    kind = StepKind.DECODE if decoding == len(lens) else StepKind.PREFILL if decoding == 0 else StepKind.MIXED
    num_tokens = sum(lens)
    k = [int(d) for d in drafts] if drafts is not None else [0] * len(lens)
    if len(k) != len(lens):
        raise ValueError(f"drafts gives {len(k)} requests' draft counts for a step of {len(lens)} requests")
    draft_tokens = sum(k)
    if draft_tokens and kind is StepKind.DECODE:  # a verify step: 1 + k tokens per request
        fmode = ForwardMode.TARGET_VERIFY
    else:
        fmode = ForwardMode.DECODE if all(n == 1 for n in lens) else ForwardMode.EXTEND
    plan = None
    if allowed and not cascade and padded_tokens == num_tokens and len(lens) > 0:
        plan = _plan(policy, fmode, lens)
        if plan is not None and draft_tokens and plan.two_chunk:
            plan = _keep_drafts_whole(policy, plan, lens, k)
    varying = draft_tokens > 0 and len({d for d, p in zip(k, past_prompt) if p}) > 1
    why = None if plan is not None else "empty" if not lens else "engine_veto" if not allowed else \
        "cascade" if cascade else "padded" if padded_tokens != num_tokens else unsplit_reason(policy, fmode, lens)
    return Step(kind, fmode, num_tokens, plan, draft_tokens=draft_tokens, varying_drafts=varying,
                unsplit_reason=why)


def unsplit_reason(policy: SplitPolicy, fmode: ForwardMode, lens: Sequence[int]) -> str:
    """Why ``policy`` found no plan for requests of ``lens`` tokens: below its threshold, or no acceptable cut."""
    return "below_threshold" if sum(lens) < policy.threshold_for(fmode, lens) else "no_cut"


def decide_draft(policy: SplitPolicy, query_lens: Sequence[int], *, padded_tokens: int) -> Step:
    """The `Step` of one forward of a drafter's model (MTP), whose requests bring ``query_lens`` tokens each.

    A draft pass is decode-like and cut between requests only: its first forward runs over the target step's tokens
    (a verify step's 1 + k per request, a prefill's prompts), each later one over one token per request. So it is
    DECODE when every request brings one token, else TARGET_VERIFY with each request's own count (the boundary that
    best balances tokens, `tbo.split.index.verify_cuts`; ``token_num_per_seq`` when they are all equal). A pass the
    drafter padded (``padded_tokens`` differs from the requests' tokens) is not split."""
    lens = [int(n) for n in query_lens]
    num_tokens = sum(lens)
    fmode = ForwardMode.DECODE if all(n == 1 for n in lens) else ForwardMode.TARGET_VERIFY
    plan = _plan(policy, fmode, lens) if lens and padded_tokens == num_tokens else None
    why = None if plan is not None else "empty" if not lens else "padded" if padded_tokens != num_tokens else \
        unsplit_reason(policy, fmode, lens)
    return Step(StepKind.DRAFT, fmode, num_tokens, plan, unsplit_reason=why)


def _plan(policy: SplitPolicy, fmode: ForwardMode, lens: list[int]) -> SplitPlan | None:
    """The policy's plan for requests of ``lens`` tokens in mode ``fmode``."""
    num_tokens = sum(lens)
    if fmode is ForwardMode.TARGET_VERIFY and len(set(lens)) == 1:
        return policy.plan(fmode, num_tokens, None, lens[0])  # uniform k: token_num_per_seq
    return policy.plan(fmode, num_tokens, None if fmode is ForwardMode.DECODE else lens)


def _keep_drafts_whole(policy: SplitPolicy, plan: SplitPlan, lens: list[int], drafts: list[int]) -> SplitPlan | None:
    """``plan`` with every cut that falls inside a request verifying drafts moved to that request's nearer boundary
    (a prefill chunk may still be cut); None where that leaves a microbatch empty."""
    starts = [0, *accumulate(lens)]
    cuts = []
    for cut in plan.cuts:
        if cut.inside and drafts[cut.seq_index]:
            lo, hi = starts[cut.seq_index], starts[cut.seq_index + 1]
            left = lo > 0 and (cut.token_index - lo <= hi - cut.token_index or hi == starts[-1])
            cut = Cut(lo, cut.seq_index, False) if left else Cut(hi, cut.seq_index + 1, False)
        cuts.append(cut)
    bounds = [0, *(c.token_index for c in cuts), starts[-1]]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        return None
    return plan_from_cuts(plan.mode, lens, cuts, policy.pad_to_multiple)


def microbatch_rows(plan: SplitPlan | None, num_tokens: int, num_microbatches: int) -> tuple[int, ...]:
    """The token rows of each of ``num_microbatches`` microbatches should this step split: ``plan``'s, or (no plan of
    its own) every token in the first and none in the others."""
    if plan is None:
        return (num_tokens,) + (0,) * (num_microbatches - 1)
    return tuple(mb.tokens_end - mb.tokens_start for mb in plan.microbatches)




@dataclass(frozen=True)
class StepFacts:
    """What a runner knows of one step before deciding it, in one frozen value: each runner adapts its own facts to it
    (vLLM's V1 batch, Model Runner V2's ``BatchReqState`` and descriptor: `tbo.integrations.vllm.runner.v2.v2_facts`)
    and `decide_facts` decides it, a pure function of it."""

    scheduled: tuple[int, ...]  #: each request's scheduled tokens, in the runner's batch order
    past_prompt: tuple[bool, ...]  #: each request is decoding (past its prompt)
    padded_tokens: int  #: the tokens the runner will run (a padded step is not split)
    #: each request's tokens already in the KV cache (None: unknown, and the prefix-cache rule is the runner's own,
    #: given as ``allowed``)
    computed: tuple[int, ...] | None = None
    drafts: tuple[int, ...] | None = None  #: speculative decoding: each request's draft tokens to verify
    allowed: bool = True  #: the runner's own veto (False: no split)


def readers_last(scheduled: Sequence[int], computed: Sequence[int]) -> bool:
    """The prefix-cache rule where the runner has none of its own (Model Runner V2): a request that reads KV cache
    blocks (``computed`` > 0) while it prefills (more than one token) may have been admitted on a cache hit against
    blocks another request of the same step is writing now. Unsplit, every write precedes every read; split,
    microbatch 0 runs each layer's attention first, so a reader is safe only where no request follows it. True (a
    split is allowed) when every such reader is the batch's last request."""
    last = len(scheduled) - 1
    return all(i == last for i, (n, c) in enumerate(zip(scheduled, computed)) if int(n) > 1 and int(c) > 0)


def decide_facts(policy: SplitPolicy, facts: StepFacts) -> Step:
    """The `Step` for ``facts`` (`decide`), the prefix-cache rule `readers_last` applied where ``computed`` is known."""
    allowed = facts.allowed and (facts.computed is None or readers_last(facts.scheduled, facts.computed))
    return decide(policy, facts.scheduled, facts.past_prompt, allowed=allowed, padded_tokens=facts.padded_tokens,
                  drafts=facts.drafts)
