"""`AdaptiveSplit`: split a step only where splitting has been measured to pay, on this deployment.

Static thresholds (vLLM DBO's 32 decode and 512 prefill tokens, SGLang's fixed ones) are right for few deployments:
whether TBO pays depends on the GPU, the link, the EP size, the model and the context length, and nobody tunes them
per deployment. This policy learns it from what an engine already measures, a step's wall time, which it waits for
anyway when it samples: no device sync and no per-op timing in the hot path.

Per step kind (``decode``, ``prefill``, ``mixed``) and token-count bucket (powers of two) it keeps, for each `Choice`
(unsplit, or a strategy with a microbatch count), its last ``window`` times per token, and estimates the choice's
cost as their lower median. A moving average would not do: wall times on a shared host have outliers that only
ever slow a step (a page fault, a neighbour's burst, a peer's late arrival), and a challenger is sampled only every
twentieth step or so, so one outlier in its average would stand for a hundred steps, and so would the wrong choice
it caused (an engine test over an emulated link kept splitting 2-token decode steps at 0.98x that way). The lower
median of five ignores two such outliers, and a cost that really changes shows in it after three samples.

It runs the cheapest choice of the bucket (the incumbent), explores the others a bounded share of the steps (a
challenger measured much slower less often, so that exploring costs a bounded share of the time), and
lets a challenger take over only when it is cheaper by a margin (hysteresis), so that near-ties do not flap and a
cost that changes mid-run is followed within a bounded number of steps. The margin is one-sided toward not
splitting: a split must beat unsplit by it to be taken, and gives way as soon as unsplit is measured no slower, so
that a split is never kept where it does not pay (the band is as wide as a symmetric one, so ties do not flap). It starts from a prior when given one (the predictor's
`tbo.tools.predict.split_policy` for a named GPU and EP size, or any `SplitPolicy`), and from unsplit otherwise.

More choices must not mean more exploring: every choice it warms up costs its steps wherever it loses, and a short run
(a few dozen steps of a bucket) is all warm-up. So it uses what is known before anything runs, an `Estimate`: each
choice's predicted time relative to unsplit (the simulator's, `tbo.tools.afd_pipeline.estimate` for AFD's counts, or
the structural `nothing_to_hide`: a step with no transfer to hide cannot gain by splitting). A choice is *doubtful*
when its prediction says it cannot gain (>= 1) or is slower than the predicted best by more than ``prior_slack``, and,
without a prediction, when it splits into more microbatches than a split already measured not to pay (a third
microbatch hides more of a transfer, but fragments compute more: it can pay only where splitting pays at all). A
doubtful choice is not warmed up; it is explored only at the longest interval (every ``8 x`` its even share) until
measured to pay, so a prior that is wrong is still corrected, within a bounded number of steps. A choice predicted
slower than the incumbent but not doubtful is warmed up once, not ``warmup_samples`` times.

Over a link whose wire time is known (an emulated link books every transfer: ``observe``'s ``wire_s``), a new bucket
is predicted before it runs from what other buckets measured: an unsplit step waits for each transfer in turn, so
its time per token is compute plus wire, and the nearest bucket measured unsplit (of the same kind first) gives both
per token, hence their ratio. A split is predicted to hide `WIRE_HIDDEN` of the smaller of the two (the measured
splits hid 0.5-0.6 of it where compute and wire were equal). That names the new bucket's starting incumbent: a split
where the wire is a large share of the step, so that a bucket run once (a prefill size seen once) or a few times
does not spend its steps on unsplit first. Unsplit is still measured once and takes over where the split does not
pay; but not in the warm-up where the prediction is *trusted*: where it was checked (the nearest bucket that measured
unsplit and a predicted split; how far off it was there corrects it here) and still says the split takes at most
``trust_below`` of unsplit's time. Such a bucket runs its split from the first step and measures unsplit by rationed
exploring, at the even share (`_interval`): a trusted split that does not pay gives way at unsplit's first sample. A
bucket run a few times (a prefill size run once a wave) spent a third of its steps on an unsplit warm-up sample 1.3-1.5
times slower than its split.

The strategy is a choice too: a split step may run any of its kind's candidate strategies (``strategies``: by
default the engine's decode and prefill strategies for decode steps, its prefill strategy for the others), at each
microbatch count. Candidates differ in what their schedule puts between a transfer's launch and its wait: the
decode strategy's lead of two stages waits for a microbatch's dispatch after one stage of the other microbatch (its
layer output and next attention projection), the prefill strategy's lead 0 after the other's whole attention.
Which pays is the deployment's (issue 62's run over a link found the prefill strategy's split far ahead on decode
steps), so it is measured like the rest. Over a link each candidate is first priced from the measured compute and
wire by its own schedule (``price``: `tbo.integrations.engine.price.split_price`) in place of the generic
`WIRE_HIDDEN`, so that one priced far slower than the best is doubtful: not warmed up, explored only at the longest
interval within the rationed share until measured to pay.

It is deterministic: exploration is scheduled by counters, never drawn at random, and a decision is a function of
the measurements observed so far. That is how data-parallel ranks make the same choice with no collective of its own:
each keeps a replica of one table, every rank's measurement of a step travels in the next step's agreement, and every
rank observes their mean for the step's agreed kind and size (`tbo.integrations.vllm.step.agree`), so the replicas stay
equal and so do their choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tbo.split.kinds import StepKind
from tbo.split.plan import SplitPolicy

__all__ = ["AdaptiveConfig", "AdaptiveSplit", "CANNOT_GAIN", "Choice", "Estimate", "STEP_KINDS", "UNSPLIT",
           "WIRE_HIDDEN", "bucket_of", "bucket_label", "nothing_to_hide", "prior_from_policy"]

#: the step kinds a table is kept for: a decode-only step, a prefill-only step, and chunked prefill beside decodes
STEP_KINDS = (StepKind.DECODE, StepKind.PREFILL, StepKind.MIXED)


@dataclass(frozen=True)
class Choice:
    """One way to run a step: unsplit (``strategy`` None), or split into ``num_microbatches`` with ``strategy``."""

    strategy: str | None = None
    num_microbatches: int = 1

    def __post_init__(self) -> None:
        if self.strategy is None and self.num_microbatches != 1:
            raise ValueError(f"an unsplit Choice has one microbatch, got num_microbatches={self.num_microbatches}")
        if self.strategy is not None and self.num_microbatches < 2:
            raise ValueError(f"Choice({self.strategy!r}) splits: num_microbatches must be >= 2, got "
                             f"{self.num_microbatches}")

    @property
    def split(self) -> bool:
        return self.strategy is not None

    def __str__(self) -> str:
        if self.strategy is None:
            return "unsplit"
        return f"split, {self.strategy}" + ("" if self.num_microbatches == 2 else f" x{self.num_microbatches}")


UNSPLIT = Choice()

#: a challenger is explored at least every this many times its even interval (`AdaptiveSplit._interval`)
_MAX_BACKOFF = 8


def bucket_of(num_tokens: int) -> int:
    """The bucket of a step of ``num_tokens`` tokens: ``b`` holds ``2**b`` to ``2**(b + 1) - 1`` tokens (0 for one
    token or none). Powers of two, because a step's cost per token changes with its size on a log scale."""
    return max(int(num_tokens), 1).bit_length() - 1


def bucket_label(bucket: int) -> str:
    return f"{1 << bucket}-{(2 << bucket) - 1} tokens" if bucket else "1 token"


class AdaptiveConfig(BaseModel):
    """How `AdaptiveSplit` explores and decides. The defaults explore at most 5% of a bucket's steps after its warm-up
    and follow a cost that changes within tens of the bucket's steps."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    warmup_samples: int = Field(default=2, description="steps of each challenger a bucket runs before exploration "
                                                       "is rationed by explore_share")
    explore_share: float = Field(default=0.05, description="after warm-up, at most this share of a bucket's steps "
                                                           "run a choice other than its incumbent")
    explore_cost: float = Field(default=0.01, description="after warm-up, exploring a challenger may cost at most "
                                                          "this share of the bucket's time: one measured slower than "
                                                          "the incumbent by a share x runs at most explore_cost / x "
                                                          "of the steps (its even part of explore_share at most, "
                                                          "an eighth of it at least)")
    hysteresis: float = Field(default=0.05, description="a challenger replaces the incumbent only when its time per "
                                                        "token is lower by this share")
    window: int = Field(default=5, description="a choice's cost is the lower median of its last `window` times per "
                                               "token: robust to (window - 1) // 2 outliers")
    microbatches: tuple[int, ...] = Field(default=(), description="the microbatch counts an engine's split steps "
                                                                  "choose among, e.g. (2, 3) (empty: the engine's "
                                                                  "num_microbatches alone); AdaptiveSplit itself "
                                                                  "takes its choices as given")
    prior_slack: float = Field(default=0.25, description="with an estimate: a choice predicted slower than the "
                                                         "predicted best by more than this share is not warmed up "
                                                         "(explored only at the longest interval until measured)")
    warmup_slack: float = Field(default=0.25, description="a challenger whose first sample measured slower than "
                                                          "the incumbent's by more than this share is warmed up no "
                                                          "further: its later samples are rationed exploring")
    trust_below: float = Field(default=0.85, description="a bucket whose starting split is predicted at most this "
                                                         "share of unsplit's time, the prediction corrected by how "
                                                         "far off it was where it was checked, skips unsplit's "
                                                         "warm-up sample (unsplit is measured by rationed exploring "
                                                         "instead); 0: unsplit is always warmed up")
    strategies: tuple[str, ...] | dict[str, tuple[str, ...]] = Field(
        default=(), description="the candidate strategies a split step chooses among, by registered name (your own, "
                                "by value: the engine config's 'strategies' key): one list for every step kind, or "
                                "{kind: list} for some of 'decode', 'prefill', 'mixed' (empty, or a kind left out: the "
                                "engine's default, its decode and prefill strategies for decode steps and its prefill "
                                "strategy for the others); the engine binds and checks each at its start")

    @model_validator(mode="after")
    def _check(self) -> "AdaptiveConfig":
        if self.warmup_samples < 0:
            raise ValueError(f"warmup_samples must be >= 0, got {self.warmup_samples}")
        if not 0 <= self.explore_share <= 0.5:
            raise ValueError(f"explore_share must be in [0, 0.5], got {self.explore_share}")
        if not 0 <= self.explore_cost <= 1:
            raise ValueError(f"explore_cost must be in [0, 1], got {self.explore_cost}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if any(not 2 <= m <= 16 for m in self.microbatches) or len(set(self.microbatches)) != len(self.microbatches):
            raise ValueError(f"microbatches must be distinct counts in 2..16, got {list(self.microbatches)}")
        lists = self.strategies.items() if isinstance(self.strategies, dict) else [("", self.strategies)]
        for kind, names in lists:
            where = f"strategies[{kind!r}]" if kind else "strategies"
            if kind and kind not in STEP_KINDS:
                raise ValueError(f"strategies: unknown step kind {kind!r}; accepted: {', '.join(STEP_KINDS)}")
            if kind and not names:
                raise ValueError(f"{where} is empty: name at least one strategy, or leave the kind out for the "
                                 "engine's default")
            bad = [n for n in names if not n or not isinstance(n, str)]
            if bad or len(set(names)) != len(names):
                raise ValueError(f"{where} must list distinct strategy names, got {list(names)}")
        if not self.prior_slack >= 0:
            raise ValueError(f"prior_slack must be >= 0, got {self.prior_slack}")
        if not self.warmup_slack >= 0:
            raise ValueError(f"warmup_slack must be >= 0, got {self.warmup_slack}")
        if not 0 <= self.trust_below < 1:
            raise ValueError(f"trust_below must be in [0, 1), got {self.trust_below}")
        return self

    def candidates(self, kind: str, default: Sequence[str]) -> tuple[str, ...]:
        """The strategy names a split ``kind`` step chooses among: ``strategies``' for that kind, else ``default``
        (the engine's)."""
        given = self.strategies.get(kind, ()) if isinstance(self.strategies, dict) else self.strategies
        return tuple(given) if given else tuple(dict.fromkeys(default))

    def strategy_names(self) -> list[str]:
        """Every strategy name ``strategies`` gives, once each, in order."""
        lists = self.strategies.values() if isinstance(self.strategies, dict) else [self.strategies]
        return list(dict.fromkeys(n for names in lists for n in names))


Prior = Callable[[str, int], Choice]
#: ``price(choice, compute, wire)``: a split choice's predicted step time relative to unsplit's, for a step whose
#: unsplit run computes for ``compute`` and waits ``wire`` (per token); None: no prediction of its own (the generic
#: `WIRE_HIDDEN` one stands). What tells one candidate strategy from another over a link: its schedule
#: (`tbo.integrations.engine.price.split_price`). It must be deterministic (data-parallel replicas call it).
Price = Callable[[Choice, float, float], "float | None"]
#: ``estimate(kind, num_tokens)``: each choice's predicted step time relative to unsplit's (1.0); a choice left out
#: has no prediction. It must be deterministic (data-parallel replicas call it on every rank).
Estimate = Callable[[str, int], Mapping[Choice, float]]
#: a split's estimate where nothing can make it pay: no transfer to hide, only compute to fragment
CANNOT_GAIN = 1.0
#: the share of the smaller of a step's compute and its wire time that a split is predicted to hide (module
#: docstring): 1 would be a perfect pipeline; splitting also fragments compute and fills and drains the pipeline
WIRE_HIDDEN = 0.5


def nothing_to_hide(choices: Mapping[str, Sequence[Choice]]) -> Estimate:
    """The estimate of a deployment with no transfer to hide (one rank, no expert parallelism, no AFD, no link):
    splitting only fragments compute, so every split is predicted `CANNOT_GAIN`."""

    def estimate(kind: str, num_tokens: int) -> Mapping[Choice, float]:
        return {c: CANNOT_GAIN for c in choices.get(kind, ()) if c.split}

    return estimate


def prior_from_policy(policy: SplitPolicy, choices: Mapping[str, Sequence[Choice]]) -> Prior:
    """A prior from a threshold policy (`tbo.tools.predict.split_policy`'s, or a deployment's tuned one): a bucket
    whose smallest step reaches the policy's threshold starts on the kind's first split choice, else unsplit."""

    def prior(kind: str, num_tokens: int) -> Choice:
        threshold = policy.decode_token_threshold if kind == StepKind.DECODE else policy.prefill_token_threshold
        split = [c for c in choices[kind] if c.split and c.num_microbatches <= num_tokens]
        return split[0] if split and num_tokens >= threshold else UNSPLIT

    return prior


@dataclass
class _Table:
    """One bucket's measurements and decision state; ``cost[i]`` is choice ``i``'s estimated seconds per token
    (None: never measured), the lower median of ``recent[i]``, its last ``window`` measurements."""

    choices: tuple[Choice, ...]
    incumbent: int
    predicted: list[float | None] = field(default_factory=list)  #: the estimate's, relative to unsplit (1.0)
    cost: list[float | None] = field(default_factory=list)
    recent: list[list[float]] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    tried: list[int] = field(default_factory=list)  #: steps each choice was chosen for
    last: list[int] = field(default_factory=list)  #: the step each choice was last chosen at
    steps: int = 0
    #: seconds per token the link carried in this bucket's last unsplit step (None: no wire time observed)
    wire: float | None = None
    explored: int = 0  #: steps that ran a choice other than the incumbent
    rationed: int = 0  #: exploring steps after warm-up (those explore_share bounds)
    key: tuple[str, int] = (StepKind.DECODE, 0)  #: its step kind and bucket

    def __post_init__(self) -> None:
        k = len(self.choices)
        self.predicted = (self.predicted or [None] * k)
        self.cost, self.samples, self.tried, self.last = [None] * k, [0] * k, [0] * k, [-1] * k
        self.recent = [[] for _ in range(k)]


class AdaptiveSplit:
    """The per-step split decision, learned from step times. `choose` before a step, `observe` after it.

    ``choices`` maps each step kind to what a step of that kind may run (`UNSPLIT` is always one of them; a kind
    not given gets unsplit only). ``prior(kind, tokens)`` names the starting incumbent of a new bucket;
    ``estimate(kind, tokens)`` predicts each choice's cost (module docstring: what it spares exploring), and names the
    starting incumbent where no ``prior`` does (the predicted cheapest, a split only when predicted cheaper than
    unsplit by the hysteresis margin).
    """

    def __init__(self, choices: Mapping[str, Iterable[Choice]], config: AdaptiveConfig | None = None,
                 prior: Prior | None = None, estimate: Estimate | None = None, price: Price | None = None) -> None:
        unknown = set(choices) - set(STEP_KINDS)
        if unknown:
            raise ValueError(f"unknown step kind(s) {sorted(unknown)}; accepted: {', '.join(STEP_KINDS)}")
        self.choices: dict[str, tuple[Choice, ...]] = {}
        for kind in STEP_KINDS:
            given = tuple(dict.fromkeys(choices.get(kind, ())))
            for c in given:
                if not isinstance(c, Choice):
                    raise TypeError(f"choices[{kind!r}] holds {c!r}: expected tbo.split.adaptive.Choice")
            self.choices[kind] = (UNSPLIT, *(c for c in given if c != UNSPLIT))
        self.config = config if config is not None else AdaptiveConfig()
        self.prior = prior
        self.estimate = estimate
        self.price = price
        self.tables: dict[tuple[str, int], _Table] = {}

    def _table(self, kind: str, num_tokens: int) -> _Table:
        if kind not in STEP_KINDS:
            raise ValueError(f"step kind {kind!r} is not one of {', '.join(STEP_KINDS)}")
        key = (kind, bucket_of(num_tokens))
        table = self.tables.get(key)
        if table is None:
            choices = self.choices[kind]
            predicted = self._predicted(kind, key[1], choices)
            if self.prior is not None:
                start = self.prior(kind, 1 << key[1])
                inc = choices.index(start) if start in choices else 0
            else:  # the predicted cheapest of those every step of the bucket can run (a token per microbatch)
                no = float("inf")
                inc = min((i for i, c in enumerate(choices) if c.num_microbatches <= 1 << key[1]), key=lambda i: (
                    (no if predicted[i] is None else predicted[i]) if i else 1 - self.config.hysteresis, i))
            table = self.tables[key] = _Table(choices, inc, predicted, key=key)
        return table

    def _predicted(self, kind: str, bucket: int, choices: tuple[Choice, ...]) -> list[float | None]:
        """The estimate for a bucket, at its middle size, per choice (unsplit 1.0); a split the estimate leaves out
        (or every split, without one) predicted from the wire time other buckets measured (`_wire_costs`, priced
        per choice by ``price`` where given: `_wire_price`); None
        where neither predicts."""
        costs = self._wire_costs(kind, bucket)
        wire = {} if costs is None else {c: self._wire_price(c, *costs) for c in choices[1:]}
        if self.estimate is None:
            return [None if costs is None else 1.0] + [wire.get(c) for c in choices[1:]]
        got = {**wire, **self.estimate(kind, (3 << bucket) >> 1)}
        out: list[float | None] = [1.0]
        for c in choices[1:]:
            value = got.get(c)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"the estimate of {c} for {kind} steps is {value!r}: expected a finite time "
                                 "relative to unsplit, >= 0")
            out.append(None if value is None else float(value))
        return out

    def _wire_costs(self, kind: str, bucket: int) -> tuple[float, float] | None:
        """Compute ``c`` and wire ``w`` per token of an unsplit step, for a new ``kind`` bucket: the nearest bucket's
        measured unsplit with its wire time (the same kind first, then the nearer size, then the smaller). None
        where no bucket measured both, or where the wire is nothing (nothing to hide: no prediction, the warm-up
        decides)."""
        measured = [(k != kind, abs(b - bucket), b, t) for (k, b), t in self.tables.items()
                    if t.cost[0] is not None and t.wire is not None]
        if not measured:
            return None
        t = min(measured, key=lambda m: m[:3])[3]
        w = t.wire
        c = max(t.cost[0] - w, 0.0)
        if w <= 0 or c + w <= 0:
            return None
        return c, w

    def _wire_price(self, choice: Choice, c: float, w: float) -> float:
        """A split ``choice``'s time relative to unsplit's where an unsplit step computes ``c`` and waits ``w``:
        ``price``'s for it (its strategy's schedule), else the split hiding `WIRE_HIDDEN` of the smaller."""
        got = self.price(choice, c, w) if self.price is not None else None
        if got is not None:
            if not (got >= 0 and math.isfinite(got)):
                raise ValueError(f"the price of {choice} is {got!r}: expected a finite time relative to unsplit, >= 0")
            return float(got)
        return (max(c, w) + (1 - WIRE_HIDDEN) * min(c, w)) / (c + w)

    def _doubtful(self, table: _Table, i: int, fits: Sequence[int]) -> bool:
        """Whether choice ``i`` is spared the warm-up and explored only at the longest interval until measured: its
        prediction says it cannot gain or is far slower than the predicted best; or, unpredicted, it splits into more
        microbatches than a split already measured not to pay, or than every split measured so far (module
        docstring)."""
        choice, pred = table.choices[i], table.predicted
        if not choice.split:
            return False
        if pred[i] is not None:
            best = min(pred[j] for j in fits if pred[j] is not None)
            return pred[i] >= CANNOT_GAIN or pred[i] > best * (1 + self.config.prior_slack)
        fewest = min(c.num_microbatches for c in table.choices if c.split)
        if choice.num_microbatches == fewest:
            return False
        unsplit = table.cost[0]
        return unsplit is None or not any(
            table.cost[j] is not None and table.cost[j] < unsplit for j in fits
            if table.choices[j].split and table.choices[j].num_microbatches < choice.num_microbatches)

    # ---- the decision -----------------------------------------------------------------------------------------

    def choose(self, kind: str, num_tokens: int) -> Choice:
        """What a step of ``kind`` with ``num_tokens`` tokens runs. Counted as one of its bucket's steps."""
        table = self._table(kind, num_tokens)
        return table.choices[self._pick(table, num_tokens)]

    def _pick(self, table: _Table, num_tokens: int) -> int:
        """Settle the incumbent, pick this step's choice and count it."""
        cfg = self.config
        inc = self._settled(table)
        fits = [i for i, c in enumerate(table.choices) if c.num_microbatches <= max(num_tokens, 1)]
        steps = table.steps + 1
        pick, rationed = inc if inc in fits else 0, table.rationed
        challengers = [i for i in fits if i != pick]
        # warm-up in rounds: each round samples every choice once, the incumbent first, so that a challenger measured
        # cheaper takes over before the next round (a bucket of few steps, a prefill size seen once per wave, runs
        # its winner from its third step, not after the incumbent's own warm-up); a round explores each challenger
        # once, so the warm-up explores each other choice at most warmup_samples times in the bucket's life
        doubtful = {i for i in challengers if self._doubtful(table, i, fits)}
        warming = [i for i in fits if table.tried[i] < self._warmup(table, i, pick) and i not in doubtful]
        if warming:
            pick = min(warming, key=lambda i: (table.tried[i], i != pick, i))
        elif challengers and rationed + 1 <= cfg.explore_share * steps:
            due = [i for i in challengers
                   if steps - table.last[i] >= self._interval(table, i, pick, len(challengers), i in doubtful)]
            if due:
                pick, rationed = min(due, key=lambda i: (table.last[i], i)), rationed + 1
        table.incumbent, table.steps, table.rationed = inc, steps, rationed
        table.explored += pick != inc
        table.tried[pick] += 1
        table.last[pick] = steps
        return pick

    def _warmup(self, table: _Table, i: int, inc: int) -> int:
        """Warm-up samples of choice ``i``: ``warmup_samples``; none for unsplit where the split incumbent's
        prediction is trusted (`_trusted`); one where the estimate predicts it slower than the
        incumbent (its one sample checks the prediction; unsplit's is the reference a split must beat), or where its
        first sample measured slower than the incumbent's by more than ``warmup_slack``. A short run is mostly
        warm-up: a second sample of a split that lost by a quarter costs a step's quarter to learn what the
        rationed exploring (bounded by ``explore_cost``) learns too; a noisy first sample is corrected there."""
        cfg, pred = self.config, table.predicted
        if i == 0 and self._trusted(table, inc):
            return 0
        slower = i != inc and pred[i] is not None and pred[inc] is not None and pred[i] > pred[inc]
        mine, theirs = table.cost[i], table.cost[inc]
        lost = i != inc and mine is not None and bool(theirs) and mine > theirs * (1 + cfg.warmup_slack)
        return min(cfg.warmup_samples, 1) if slower or lost else cfg.warmup_samples

    def _trusted(self, table: _Table, inc: int) -> bool:
        """Whether the bucket's split incumbent ``inc`` is predicted to pay beyond doubt, so that unsplit's warm-up
        sample is spared (module docstring): its prediction, times the error of the predictions where they were
        checked (`_prediction_error`), is at most ``trust_below``. Never without a check: a prediction that was
        never compared with a measurement is not trusted."""
        pred = table.predicted[inc]
        if not inc or pred is None or table.cost[0] is not None or not self.config.trust_below:
            return False
        error = self._prediction_error(*table.key)
        return error is not None and pred * error <= self.config.trust_below

    def _prediction_error(self, kind: str, bucket: int) -> float | None:
        """How far off the predictions were where they were checked: in the nearest bucket (by size, then the same
        kind, then the smaller) that measured unsplit and a predicted split, its cheapest such split's measured time
        relative to unsplit over its prediction (above 1: the prediction was optimistic). None where none was
        checked."""
        checked = []
        for (k, b), t in self.tables.items():
            if not t.cost[0]:
                continue
            splits = [j for j in range(1, len(t.choices)) if t.cost[j] is not None and t.predicted[j]]
            if splits:
                j = min(splits, key=lambda j: (t.cost[j], j))
                checked.append((abs(b - bucket), k != kind, b, t.cost[j] / t.cost[0] / t.predicted[j]))
        return min(checked)[3] if checked else None

    def _interval(self, table: _Table, i: int, inc: int, challengers: int, doubtful: bool = False) -> float:
        """Steps between two explorations of challenger ``i`` (against incumbent ``inc``): ``challengers`` share the
        ``explore_share`` of steps evenly, and one measured slower than the incumbent by a share ``x`` runs at most
        ``explore_cost / x`` of them, so that what exploring costs stays within ``explore_cost`` of the time
        (exploring a split that doubles a step every twentieth step would cost 5%). It is revisited at least every
        eight times the even interval, so that a cost that changes is still followed within a bounded number of
        steps (three samples turn the lower median of five). A doubtful challenger waits the longest interval until
        measured cheaper than the incumbent; one with a prediction is judged by it against the incumbent's until
        measured, except unsplit: the reference a split must beat, unmeasured only where a trusted prediction spared
        its warm-up (`_trusted`), is measured at the even share. A challenger predicted cheaper than the incumbent
        but measured slower in its one sample is sampled again at the even share too: one sample against a
        prediction does not earn the stretched interval."""
        cfg = self.config
        even = challengers / cfg.explore_share
        mine, theirs = table.cost[i], table.cost[inc]
        if doubtful and (mine is None or (theirs and mine > theirs)):  # not measured to pay: the longest interval
            return _MAX_BACKOFF * even
        pred = table.predicted
        if mine is None and i and pred[i] is not None and pred[inc]:  # the prediction stands in for a measurement
            mine, theirs = pred[i], pred[inc]
        # one sample that contradicts the prediction (a first step at a new shape, a neighbour's burst) is checked
        # at the even share, not trusted for the stretched interval
        contradicted = table.samples[i] == 1 and None not in (pred[i], pred[inc]) and pred[i] < pred[inc]
        if mine is None or not theirs or mine <= theirs or contradicted:  # unmeasured, not slower or contradicted
            return even
        slower = mine / theirs - 1
        if slower * cfg.explore_share <= cfg.explore_cost:
            return even
        return min(_MAX_BACKOFF * even, challengers * slower / cfg.explore_cost if cfg.explore_cost else float("inf"))

    def _settled(self, table: _Table) -> int:
        """The incumbent after this table's measurements: the cheapest measured choice when it beats the incumbent
        by the hysteresis margin (an unmeasured incumbent, the prior's, stays until it has run); and unsplit (choice
        0), once measured, in place of a split that is not cheaper than it (the margin is one-sided: module
        docstring)."""
        inc, cost = table.incumbent, table.cost
        measured = [i for i, c in enumerate(cost) if c is not None]
        if not measured or cost[inc] is None:
            return inc
        best = min(measured, key=lambda i: (cost[i], i != inc, i))
        settled = best if cost[best] < cost[inc] * (1 - self.config.hysteresis) else inc
        unsplit = cost[0]
        return 0 if settled and unsplit is not None and unsplit <= cost[settled] else settled

    def observe(self, kind: str, num_tokens: int, choice: Choice, seconds: float,
                wire_s: float | None = None) -> None:
        """A step of ``kind`` with ``num_tokens`` ran ``choice`` (what ran: unsplit when the chosen split found no
        cut) in ``seconds`` of wall time, its wait for data-parallel peers included. ``wire_s``: the wire time its
        transfers booked on a link (module docstring: an unsplit step's predicts new buckets); None: not known."""
        if not seconds >= 0 or seconds == float("inf"):
            raise ValueError(f"seconds must be a finite time >= 0, got {seconds!r}")
        if wire_s is not None and not (wire_s >= 0 and math.isfinite(wire_s)):
            raise ValueError(f"wire_s must be a finite time >= 0, got {wire_s!r}")
        table = self._table(kind, num_tokens)
        if choice not in table.choices:
            raise ValueError(f"{choice} is not one of the {kind} choices: {', '.join(map(str, table.choices))}")
        i = table.choices.index(choice)
        recent = table.recent[i]
        recent.append(seconds / max(num_tokens, 1))
        del recent[:-self.config.window]
        table.cost[i] = sorted(recent)[(len(recent) - 1) // 2]
        table.samples[i] += 1
        if wire_s is not None and not choice.split:
            table.wire = wire_s / max(num_tokens, 1)

    # ---- what it decided, for stats() and a log line ----------------------------------------------------------

    def stats(self) -> list[dict]:
        """Per bucket: its estimates (seconds per token per choice), samples, the incumbent, steps and explored."""
        out = []
        for (kind, bucket), t in sorted(self.tables.items(), key=lambda kv: (STEP_KINDS.index(kv[0][0]), kv[0][1])):
            out.append({"kind": kind, "tokens": bucket_label(bucket), "choice": str(t.choices[self._settled(t)]),
                        "steps": t.steps, "explored": t.explored,
                        "estimates": {str(c): t.cost[i] for i, c in enumerate(t.choices)},
                        "predicted": {str(c): t.predicted[i] for i, c in enumerate(t.choices)
                                      if t.predicted[i] is not None},
                        "samples": {str(c): t.samples[i] for i, c in enumerate(t.choices)}})
        return out

    def summary(self) -> list[str]:
        """One line per bucket, e.g. ``decode 32-63 tokens: split, qwen3_moe_prefill, 1.40x (6 of 120 steps
        explored)``: the speedup is unsplit's time per token over the choice's, where both were measured."""
        lines = []
        for row in self.stats():
            choice, est = row["choice"], row["estimates"]
            base, mine = est.get(str(UNSPLIT)), est.get(choice)
            ratio = f", {base / mine:.2f}x" if choice != str(UNSPLIT) and base and mine else ""
            lines.append(f"{row['kind']} {row['tokens']}: {choice}{ratio} ({row['explored']} of {row['steps']} "
                         "steps explored)")
        return lines
