"""``"split": "adaptive"`` in any engine: the steps split where `tbo.split.adaptive.AdaptiveSplit` measured it pays.

The static thresholds decide a step by its token count alone; here each step's kind (decode, prefill, mixed) and
token bucket pick, from measured step times, among unsplit and the strategies the model admits: for decode both the
family's decode strategy and its prefill-shaped one (which wins decode on some deployments), for steps with prefill
the prefill strategy. The measurement is the step's wall time from `AdaptiveSteps.decide` to `AdaptiveSteps.step_done`,
which the engine calls where it waits for the step's results anyway (vLLM: the end of ``sample_tokens``; SGLang: the
end of the layer loop): no extra device sync and no per-op timing.

The driver's contract with its engine (`AdaptiveSteps.decide`): the engine decides each step with `policy` (the
most microbatches), hands the `Step` and a way to decide it again, ``replan(policy)``, and runs the `Step` it gets
back. The plan of a step the choice splits is `SplitPolicy`'s with the lowest thresholds (every microbatch gets a
token): the adaptive choice replaces the thresholds, nothing else. With ``adaptive: {"microbatches": [2, 3]}`` the
choices include the microbatch count: every strategy at every count, the step planned again (``replan``) with the
chosen count's policy. An engine with no transfer to hide (one rank, no link, no AFD) gives the policy the prior
that no split can gain (`tbo.split.adaptive.nothing_to_hide`): it does not warm splits up, and explores them only at
its longest interval. A choice that finds no acceptable cut (an engine's veto, a lopsided batch with cuts between
requests only) runs unsplit and is measured as unsplit.

With data parallelism (`agreed`) every rank must run the same choice, with no collective of its own: each rank keeps
a replica of the policy, the step's agreement carries every rank's wall time of the previous step
(`tbo.split.agree.StepVote.measured_ns`), and every rank observes their mean for the previous step's agreed kind and
size, then chooses for this step's (the agreed strategy's kind, the largest rank's tokens). The replicas see the
same observations in the same order, so they stay equal, and so do their choices. A rank's time includes its wait
for its peers; an idle rank's dummy step measures nothing (its peers' times count). The count stays the engine's
``num_microbatches`` there (an engine refuses several counts with data parallelism at its start).

With tensor parallelism (`shared`) the same holds over the TP workers, which run the same steps: before each
choice they exchange their times of the previous step (the engine's exchange), and every replica observes their
mean, so every worker splits the same steps the same way and their all-reduces pair.

Over an emulated link (`wire`), each step's wire time (what its transfers booked on the link) is observed with its
wall time, so that a new bucket is predicted from the buckets measured unsplit (`tbo.split.adaptive`'s wire prior):
a bucket seen once, a prefill size, starts on the split where the wire is a large share of the step. The TP workers'
wire times are equal (the same bytes over the same link); under data parallelism the ranks' differ, so none is
observed there.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

from tbo import strategies
from tbo.integrations.engine.config import StrategyNames, TboConfig
from tbo.integrations.engine.price import split_price
from tbo.integrations.engine.step import Step
from tbo.split import SplitPolicy
from tbo.split.adaptive import (STEP_KINDS, UNSPLIT, AdaptiveConfig, AdaptiveSplit, Choice, nothing_to_hide,
                                prior_from_policy)
from tbo.split.agree import StepAgreement
from tbo.split.kinds import Slot, StepKind

__all__ = ["AdaptiveSteps"]


def _schedule_price(names: list[str]) -> Callable[[Choice, float, float], float | None]:
    """``AdaptiveSplit``'s ``price``: each candidate's split priced by its own schedule (`split_price`), the
    registry's strategy of its name; cached per (choice, compute share), as every new bucket asks."""
    found = {name: strategies.get(name) for name in names}
    cache: dict[tuple[Choice, float], float | None] = {}

    def price(choice: Choice, compute: float, wire: float) -> float | None:
        strategy = found.get(choice.strategy) if choice.strategy is not None else None
        if strategy is None or compute + wire <= 0:
            return None
        key = (choice, round(compute / (compute + wire), 6))
        if key not in cache:
            cache[key] = split_price(strategy, choice.num_microbatches, compute, wire)
        return cache[key]

    return price


class AdaptiveSteps:
    """Per engine: chooses each step's split from measured costs, and measures the step it chose.

    ``transfers``: whether a step has communication splitting could hide (expert or tensor parallelism, data
    parallelism, AFD, an emulated link); without, every split is predicted not to gain (`nothing_to_hide`), so the
    policy spares the warm-up that would cost a short run."""

    def __init__(self, config: TboConfig, names: StrategyNames, transfers: bool = True) -> None:
        adaptive = config.adaptive
        counts = sorted(adaptive.microbatches if adaptive is not None and adaptive.microbatches
                        else (config.num_microbatches,))
        #: each step kind's candidate strategies (``adaptive.strategies``, else the engine's decode and prefill
        #: strategies for decode steps and its prefill strategy for the others)
        own = {kind: (names.decode, names.prefill) if kind == StepKind.DECODE else (names.prefill,)
               for kind in STEP_KINDS}
        self.candidates = {kind: (adaptive or AdaptiveConfig()).candidates(kind, own[kind]) for kind in STEP_KINDS}
        choices: dict[str, list[Choice]] = {kind: [] for kind in STEP_KINDS}
        for n in counts:  # the fewest first: unpredicted, a count above the fewest waits until fewer pay
            for kind, candidates in self.candidates.items():
                choices[kind] += [Choice(name, n) for name in candidates]
        #: the split's shape once a choice of ``n`` microbatches splits: every threshold at its lowest
        self.policies = {n: SplitPolicy(num_microbatches=n, decode_token_threshold=n, prefill_token_threshold=n,
                                        token_distribution_threshold=config.token_distribution_threshold,
                                        allow_cut_sequences=config.allow_cut_sequences,
                                        pad_to_multiple=config.pad_to_multiple) for n in counts}
        #: the policy each step is first decided with: the most microbatches (an engine sizes per-microbatch state,
        #: vLLM's attention metadata builders, by it), so every count fits
        self.policy = self.policies[counts[-1]]
        # thresholds the user set (tbo predict's, say) seed the policy; unset, every bucket starts unsplit
        seeded = {"decode_token_threshold", "prefill_token_threshold"} & config.model_fields_set
        prior = prior_from_policy(config.split_policy(), choices) if seeded else None
        self.split = AdaptiveSplit(choices, adaptive, prior, None if transfers else nothing_to_hide(choices),
                                   price=_schedule_price(self.strategy_names()))
        #: the engine's decode strategy: the one candidate a decode step runs in the decode slot (its backend, its
        #: fixed shapes); every other candidate runs in the prefill slot, whose forms serve any step
        self._decode_name = names.decode
        self._own = {Slot.DECODE: names.decode, Slot.PREFILL: names.prefill}
        #: the step in flight: its kind, tokens, what ran, when it started, and the wire time booked on the links by
        #: then (None: no link to read); None: no step to measure
        self._running: tuple[str, int, Choice, float, float | None] | None = None
        #: ``wire() -> seconds``: the wire time the engine's emulated links booked so far
        #: (`tbo.comm.emulated.LinkTimeline.booked_s`); None: no link, or data parallel
        self.wire: Callable[[], float] | None = None
        self._wire_s: float | None = None  #: tensor parallel: the wire time of the step to observe next
        #: data parallel: the last agreed step (kind, tokens, what ran), observed at the next agreement with every
        #: rank's time of it; ``measured_ns`` is this rank's (-1: none)
        self._agreed: tuple[str, int, Choice] | None = None
        self.measured_ns = -1
        #: tensor parallel: ``shared(kind, tokens, measured_ns) -> seconds | None`` exchanges this worker's time of
        #: the previous step for the workers' mean, before each choice (the engine's exchange over its TP group);
        #: None: this engine's own times are observed as they are measured
        self.shared: Callable[[str, int, int], float | None] | None = None

    def decide(self, step: Step, replan: Callable[[SplitPolicy], Step]) -> Step:
        """``step`` (decided with `policy`) as the adaptive choice runs it: its plan kept, planned again with the
        chosen count's policy where it has another count or none, or dropped; and the strategy it runs. Starts the
        step's clock. With `shared` times, the previous step's are exchanged and observed first.

        ``replan(policy)`` is required: the same step decided again with ``policy`` (the engine's own decision, with
        everything it vetoes), a `Step` whose plan is that policy's or None. Without it a choice of another count
        could not run, so a caller that cannot plan again cannot use this driver."""
        if not callable(replan):
            raise TypeError(f"AdaptiveSteps.decide needs replan(policy) -> Step, the step decided again with the "
                            f"chosen count's policy; got {replan!r}")
        self._running = None
        if self.shared is not None:
            self._observe_agreed(self.shared(step.kind, step.num_tokens, self.measured_ns))
        choice = self.split.choose(step.kind, step.num_tokens)
        planned = None if step.plan is None else step.plan.num_microbatches
        # planned again with the chosen count's policy where the count differs, or where the decider's policy (the
        # most microbatches) found no plan: a step too small for three microbatches may still split into two
        if choice.split and planned != choice.num_microbatches:
            step = replan(self.policies[choice.num_microbatches])
        if choice.split and step.plan is not None:
            slot = self.slot_of(step.kind, choice.strategy)
            ran, step = choice, replace(step, agreed_slot=slot, strategy_name=self.bound_name(slot, choice))
        else:
            # the choice ran it whole, or its count's plan found no cut (the replanned step says why)
            ran, step = UNSPLIT, replace(step, plan=None, unsplit_reason="adaptive" if not choice.split or
                                         step.unsplit_reason is None else step.unsplit_reason)
        wire0 = None if self.wire is None else self.wire()
        self._running = (step.kind, step.num_tokens, ran, time.perf_counter(), wire0)
        if self.shared is not None:  # observed at the next exchange, with every worker's time of it
            self._agreed = (step.kind, step.num_tokens, ran)
        return step

    def strategy_names(self) -> list[str]:
        """Every candidate strategy's registry name, once each: what an engine binds at its start (beside its
        decode and prefill strategies), so that a name that cannot run its layers is refused there, by name."""
        return list(dict.fromkeys(n for names in self.candidates.values() for n in names))

    def slot_of(self, kind: str, name: str) -> Slot:
        """The slot a ``kind`` step runs candidate ``name`` in: decode for the engine's decode strategy on a decode
        step (unless it is the prefill strategy too: one name for both runs in the prefill slot, as before
        candidates were configurable), prefill otherwise (the forms any step can take: counted routes, the prefill
        backend)."""
        own = kind == StepKind.DECODE and name == self._decode_name != self._own[Slot.PREFILL]
        return Slot.DECODE if own else Slot.PREFILL

    def bound_name(self, slot: Slot, choice: Choice) -> str | None:
        """The `Step.strategy_name` of a split ``choice`` run in ``slot``: None where it is that slot's own strategy
        (the engine's ``strategies[slot]``), else its name (bound at the engine's start under that name:
        `extra_strategies`)."""
        return None if not choice.split or choice.strategy == self._own[slot] else choice.strategy

    def extra_strategies(self) -> list[str]:
        """The candidates an engine binds beside its decode and prefill strategies, each under its name and for the
        prefill slot (the slot every candidate but the engine's own decode strategy runs in: `slot_of`)."""
        return list(dict.fromkeys(n for kind, names in self.candidates.items() for n in names
                                  if n != self._own[self.slot_of(kind, n)]))

    def _observe_agreed(self, measured_s: float | None) -> None:
        """Observe the last agreed step (data or tensor parallel) at ``measured_s``, the ranks' mean time of it
        (None: no rank measured it, a dummy step); the next one is this rank's to measure."""
        if self._agreed is not None and measured_s is not None:
            self.split.observe(*self._agreed, measured_s, self._wire_s)  # None under DP: no wire is read there
        self._agreed, self.measured_ns, self._wire_s = None, -1, None

    def agreed(self, agreement: StepAgreement) -> tuple[Choice, Slot]:
        """Data parallel: observe the previous agreed step's mean time, then choose for this one. Returns what runs
        (unsplit where the agreement does not split; its ``strategy`` the candidate to run) and the slot it runs in
        (the agreed slot is the bucket's kind: a mixed step agrees on prefill). Called by every rank in every
        agreement but those where every rank runs a dummy step (profiling, warm-up: nothing is chosen)."""
        self._observe_agreed(agreement.measured_s)
        kind, tokens = StepKind(agreement.slot), agreement.tokens
        choice = self.split.choose(kind, tokens)
        ran = choice if choice.split and agreement.split else UNSPLIT
        self._agreed = (kind, tokens, ran)
        self._running = (kind, tokens, ran, time.perf_counter(), None)
        return ran, self.slot_of(kind, ran.strategy) if ran.split else agreement.slot

    def step_done(self) -> None:
        """The step's results are on the host (the engine waits for them anyway): its wall time is measured."""
        if self._running is None:
            return
        kind, tokens, ran, t0, wire0 = self._running
        self._running = None
        seconds = time.perf_counter() - t0
        wire_s = None if wire0 is None or self.wire is None else self.wire() - wire0
        if self._agreed is not None:  # data or tensor parallel: every rank observes the ranks' mean at the next one
            self.measured_ns, self._wire_s = int(seconds * 1e9), wire_s
        else:
            self.split.observe(kind, tokens, ran, seconds, wire_s)

    def report(self) -> dict[str, Any]:
        """The buckets (`AdaptiveSplit.stats`) and their summary lines: the engine's ``stats()["adaptive"]``."""
        return {"buckets": self.split.stats(), "summary": self.split.summary()}
