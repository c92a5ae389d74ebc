"""``"split": "adaptive"``: the engine's steps split where `tbo.split.adaptive.AdaptiveSplit` measured that it pays.

The static thresholds decide a step by its token count alone; here each step's kind (decode, prefill, mixed) and
token bucket pick, from measured step times, among unsplit and the strategies the model admits: for decode both the
family's decode strategy and its prefill-shaped one (which wins decode on some deployments), for steps with prefill
the prefill strategy. The measurement is the step's wall time from ``execute_model``'s entry to the end of
``sample_tokens``, where vLLM's runner waits for the step's sampled tokens anyway: no extra device sync and no
per-op timing.

The plan of a step the policy splits is `SplitPolicy`'s with the lowest thresholds (every microbatch gets a token):
the adaptive choice replaces the thresholds, nothing else. With ``adaptive: {"microbatches": [2, 3]}`` the choices
include the microbatch count: every strategy at every count, the step planned again with the chosen count's policy
(one engine; under data parallelism the count stays ``num_microbatches``, refused otherwise at engine start). An
engine with no transfer to hide (one rank, no link, no AFD) gives the policy the prior that no split can gain
(`tbo.split.adaptive.nothing_to_hide`): it does not warm splits up, and explores them only at its longest interval. A choice that finds no acceptable cut (vLLM's prefix-cache
veto, a lopsided batch with cuts between requests only) runs unsplit and is measured as unsplit.

With data parallelism (`agreed`) every rank must run the same choice, with no collective of its own: each rank keeps
a replica of the policy, the step's agreement carries every rank's wall time of the previous step
(`tbo.split.agree.StepVote.measured_ns`), and every rank observes their mean for the previous step's agreed kind and
size, then chooses for this step's (the agreed strategy's kind, the largest rank's tokens). The replicas see the
same observations in the same order, so they stay equal, and so do their choices. A rank's time includes its wait
for its peers; an idle rank's dummy step measures nothing (its peers' times count).

With tensor parallelism (`shared`) the same holds over the TP workers, which run the same steps: before each
choice they exchange their times of the previous step (`tbo.integrations.vllm.step.tp.TpStepTimes`), and every
replica observes their mean, so every worker splits the same steps the same way and their all-reduces pair.

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

from tbo.integrations.vllm.config import StrategyNames, TboVllmConfig
from tbo.integrations.engine.step import Step
from tbo.split import SplitPolicy
from tbo.split.adaptive import UNSPLIT, AdaptiveSplit, Choice, nothing_to_hide, prior_from_policy
from tbo.split.agree import StepAgreement

__all__ = ["AdaptiveSteps"]


class AdaptiveSteps:
    """Per engine: chooses each step's split from measured costs, and measures the step it chose.

    ``transfers``: whether a step has communication splitting could hide (expert or tensor parallelism, data
    parallelism, AFD, an emulated link); without, every split is predicted not to gain (`nothing_to_hide`), so the
    policy spares the warm-up that would cost a short run."""

    def __init__(self, config: TboVllmConfig, names: StrategyNames, transfers: bool = True) -> None:
        adaptive = config.adaptive
        counts = sorted(adaptive.microbatches if adaptive is not None and adaptive.microbatches
                        else (config.num_microbatches,))
        choices: dict[str, list[Choice]] = {"decode": [], "prefill": [], "mixed": []}
        for n in counts:  # the fewest first: unpredicted, a count above the fewest waits until fewer pay
            decode, prefill = Choice(names.decode, n), Choice(names.prefill, n)
            choices["decode"] += [decode, prefill]
            choices["prefill"].append(prefill)
            choices["mixed"].append(prefill)
        #: the split's shape once a choice of ``n`` microbatches splits: every threshold at its lowest
        self.policies = {n: SplitPolicy(num_microbatches=n, decode_token_threshold=n, prefill_token_threshold=n,
                                        token_distribution_threshold=config.token_distribution_threshold,
                                        allow_cut_sequences=config.allow_cut_sequences,
                                        pad_to_multiple=config.pad_to_multiple) for n in counts}
        #: the decider's policy: the most microbatches (one attention metadata builder each), so every count fits
        self.policy = self.policies[counts[-1]]
        # thresholds the user set (tbo predict's, say) seed the policy; unset, every bucket starts unsplit
        seeded = {"decode_token_threshold", "prefill_token_threshold"} & config.model_fields_set
        prior = prior_from_policy(config.split_policy(), choices) if seeded else None
        self.split = AdaptiveSplit(choices, adaptive, prior, None if transfers else nothing_to_hide(choices))
        self._mode_of = {names.decode: "decode", names.prefill: "prefill"}
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
        #: the previous step for the workers' mean, before each choice (`tbo.integrations.vllm.step.tp.TpStepTimes`);
        #: None: this engine's own times are observed as they are measured
        self.shared: Callable[[str, int, int], float | None] | None = None

    def decide(self, step: Step, replan: Callable[[SplitPolicy], Step] | None = None) -> Step:
        """``step`` (decided with `policy`) as the adaptive choice runs it: its plan kept, planned again with the
        chosen count's policy (``replan``) where it has another count or none, or dropped; and the strategy it runs.
        Starts the step's clock. With `shared` times, the previous step's are exchanged and observed first."""
        self._running = None
        if self.shared is not None:
            self._observe_agreed(self.shared(step.mode, step.num_tokens, self.measured_ns))
        choice = self.split.choose(step.mode, step.num_tokens)
        planned = None if step.plan is None else step.plan.num_microbatches
        # planned again with the chosen count's policy where the count differs, or where the decider's policy (the
        # most microbatches) found no plan: a step too small for three microbatches may still split into two
        if choice.split and planned != choice.num_microbatches and (planned is not None or replan is not None):
            if replan is None:
                raise RuntimeError(f"the adaptive split chose {choice}, but the step was planned with "
                                   f"{step.plan.num_microbatches} microbatches and nothing can plan it again")
            step = replan(self.policies[choice.num_microbatches])
        if choice.split and step.plan is not None:
            ran, step = choice, replace(step, agreed_strategy=self._mode_of[choice.strategy])
        else:
            ran, step = UNSPLIT, replace(step, plan=None)
        wire0 = None if self.wire is None else self.wire()
        self._running = (step.mode, step.num_tokens, ran, time.perf_counter(), wire0)
        if self.shared is not None:  # observed at the next exchange, with every worker's time of it
            self._agreed = (step.mode, step.num_tokens, ran)
        return step

    def _observe_agreed(self, measured_s: float | None) -> None:
        """Observe the last agreed step (data or tensor parallel) at ``measured_s``, the ranks' mean time of it
        (None: no rank measured it, a dummy step); the next one is this rank's to measure."""
        if self._agreed is not None and measured_s is not None:
            self.split.observe(*self._agreed, measured_s, self._wire_s)  # None under DP: no wire is read there
        self._agreed, self.measured_ns, self._wire_s = None, -1, None

    def agreed(self, agreement: StepAgreement) -> tuple[Choice, str]:
        """Data parallel: observe the previous agreed step's mean time, then choose for this one. Returns what runs
        (unsplit where the agreement does not split) and the strategy mode it runs with. Called by every rank in
        every agreement but those where every rank runs a dummy step (profiling, warm-up: nothing is chosen)."""
        self._observe_agreed(agreement.measured_s)
        kind, tokens = agreement.strategy_mode, agreement.tokens
        choice = self.split.choose(kind, tokens)
        ran = choice if choice.split and agreement.split else UNSPLIT
        self._agreed = (kind, tokens, ran)
        self._running = (kind, tokens, ran, time.perf_counter(), None)
        return ran, self._mode_of[ran.strategy] if ran.split else agreement.strategy_mode

    def step_done(self) -> None:
        """The step's sampled tokens are on the host: its wall time is measured."""
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
        return {"buckets": self.split.stats(), "summary": self.split.summary()}
