"""AFD as a ping-pong pipeline: how many microbatches keep the attention side busy across a network round trip.

In attention-FFN disaggregation each layer of a microbatch goes out and back: the attention side computes its stage,
sends the hidden states to the FFN side (link latency + bytes / bandwidth), the FFN computes, and the answer comes
back the same way; only then can that microbatch's next layer start. With ``m`` microbatches the attention side fills
that round trip with the other ``m - 1`` microbatches' stages, so it stays busy when

    2 x (latency + bytes / bandwidth) + FFN(t / m)  <=  (m - 1) x attention(t / m)

(MegaScale-Infer's ping-pong condition, per layer, with the stage times at a microbatch's ``t / m`` tokens); and the
FFN side stays busy when its own compute is the longer one. More microbatches cover a longer round trip, but each
stage reads the same weights for fewer tokens (fragmentation), so past the count that covers it they cost. The
condition alone does not say which count is fastest: `choose_count` replays each count in an event model (the
attention side in the executor's order, the FFN side serving in arrival order, each direction of the link FIFO on
its bandwidth with latencies overlapping, as `tbo.comm.emulated.EmulatedLink` books them) and picks the fastest,
saying why in the condition's terms.

`estimate` turns the replay into `tbo.split.adaptive.Estimate`, the prior by which the adaptive split spares
exploring counts predicted to lose. ``tbo simulate --afd COSTS.json`` and ``tbo predict afd`` print it. This is a
tool: the library never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field

from tbo.split.adaptive import Choice, Estimate
from tbo.tools.simulate import Cost, NonNegative, Positive, split_tokens

__all__ = ["AFDCosts", "AFDCount", "AFDChoice", "AFDRun", "choose_count", "estimate", "parse_counts", "report",
           "simulate_afd"]


class AFDCosts(BaseModel):
    """One layer's costs on each side of an AFD pair, and the link between them (``costs.json`` for ``tbo simulate
    --afd``): ``attention`` and ``ffn`` price a microbatch of ``t`` tokens (`tbo.tools.simulate.Cost`); each way a
    microbatch puts ``bytes_fixed + bytes_per_token * t`` bytes on the link (the hidden states: hidden x dtype bytes
    per token, and a header)."""

    model_config = ConfigDict(extra="forbid")

    attention: Cost
    ffn: Cost
    num_layers: int = Field(default=1, ge=1, le=1024)
    bytes_per_token: NonNegative = 0.0
    bytes_fixed: NonNegative = 0.0
    latency_s: NonNegative = 0.0
    bandwidth: Positive = 1e12  #: bytes per second, each direction

    def link_s(self, tokens: int) -> float:
        """One transfer's time, one way: latency + bytes / bandwidth."""
        return self.latency_s + (self.bytes_fixed + self.bytes_per_token * tokens) / self.bandwidth


@dataclass(frozen=True)
class AFDRun:
    """One replayed step: its time, and each side's busy time (the attention side's idle time is its wait)."""

    tokens: tuple[int, ...]
    step_s: float
    attention_busy_s: float
    ffn_busy_s: float

    @property
    def microbatches(self) -> int:
        return len(self.tokens)

    @property
    def attention_idle_s(self) -> float:
        return self.step_s - self.attention_busy_s


def simulate_afd(costs: AFDCosts, tokens: Sequence[int]) -> AFDRun:
    """Replay one step of ``costs.num_layers`` layers for microbatches of ``tokens`` (one entry each; one entry is
    the unsplit step). The attention side runs stage (layer, microbatch) in the executor's order, each once its
    microbatch's previous answer is back; the FFN side serves requests in arrival order."""
    if not tokens or min(tokens) < 0:
        raise ValueError(f"simulate_afd needs one token count >= 0 per microbatch, got {list(tokens)}")
    attn_free = ffn_free = 0.0
    out_free = back_free = float("-inf")  # each direction of the link: when its queued bytes are through
    ready = [0.0] * len(tokens)  # when each microbatch's input to its next layer is on the attention side
    attn_busy = ffn_busy = 0.0
    for _ in range(costs.num_layers):
        for i, t in enumerate(tokens):
            a, f = costs.attention(t), costs.ffn(t)
            occupancy = costs.link_s(t) - costs.latency_s
            attn_free = max(attn_free, ready[i]) + a
            out_free = max(attn_free, out_free) + occupancy
            ffn_free = max(ffn_free, out_free + costs.latency_s) + f
            back_free = max(ffn_free, back_free) + occupancy
            ready[i] = back_free + costs.latency_s
            attn_busy, ffn_busy = attn_busy + a, ffn_busy + f
    return AFDRun(tuple(tokens), max(ready), attn_busy, ffn_busy)


@dataclass(frozen=True)
class AFDCount:
    """One microbatch count at a step's token count: its replay and the ping-pong condition's terms, per layer."""

    run: AFDRun
    speedup: float  #: the unsplit step's time over this count's
    stage_s: float  #: one attention stage (the largest microbatch's)
    ffn_s: float  #: one FFN call (the largest microbatch's)
    round_trip_s: float  #: out and back on the link, with the FFN call between

    @property
    def microbatches(self) -> int:
        return self.run.microbatches

    @property
    def covered(self) -> bool:
        """The condition: the other ``m - 1`` microbatches' stages cover a microbatch's round trip."""
        return self.round_trip_s <= (self.microbatches - 1) * self.stage_s * (1 + 1e-9)

    def describe(self) -> str:
        cover = (self.microbatches - 1) * self.stage_s
        verdict = ("covers it" if self.covered else
                   f"the attention side idles {(self.round_trip_s - cover) * 1e3:.3f} ms per layer")
        return (f"{self.microbatches} microbatches: {self.run.step_s * 1e3:.3f} ms, {self.speedup:.2f}x; round trip "
                f"{self.round_trip_s * 1e3:.3f} ms vs (m-1) x attention stage {cover * 1e3:.3f} ms: {verdict}")


@dataclass(frozen=True)
class AFDChoice:
    """Which microbatch count pays at a step's token count, and why."""

    num_tokens: int
    unsplit: AFDRun
    counts: tuple[AFDCount, ...]
    best: int  #: the fastest count (1: none is faster than unsplit)
    reason: str

    def count(self, m: int) -> AFDCount:
        return next(c for c in self.counts if c.microbatches == m)


def _count(costs: AFDCosts, num_tokens: int, m: int, unsplit: AFDRun) -> AFDCount:
    parts = split_tokens(num_tokens, m)
    run = simulate_afd(costs, parts)
    t = max(parts)
    speedup = unsplit.step_s / run.step_s if run.step_s > 0 else 1.0
    return AFDCount(run, speedup, costs.attention(t), costs.ffn(t), 2 * costs.link_s(t) + costs.ffn(t))


def choose_count(costs: AFDCosts, num_tokens: int, counts: Sequence[int] = (2, 3, 4),
                 margin: float = 0.01) -> AFDChoice:
    """The fastest of ``counts`` microbatches (or unsplit) for a step of ``num_tokens``, replayed, with the reason in
    the ping-pong condition's terms. A count with more microbatches than tokens is left out; a count within
    ``margin`` of the fastest that has fewer microbatches is chosen instead (fewer, larger calls: a near-tie is not
    worth the fragmentation a cost model may underestimate)."""
    bad = [m for m in counts if m < 2]
    if bad or not counts:
        raise ValueError(f"microbatch counts must be >= 2, got {list(counts)}")
    unsplit = simulate_afd(costs, [num_tokens])
    rows = tuple(_count(costs, num_tokens, m, unsplit) for m in sorted(set(counts)) if m <= num_tokens)
    if not rows:
        return AFDChoice(num_tokens, unsplit, (), 1, f"{num_tokens} token(s): too few to split")
    quickest = min(c.run.step_s for c in rows)
    fastest = next(c for c in rows if c.run.step_s <= quickest * (1 + margin))
    if fastest.run.step_s >= unsplit.step_s:
        return AFDChoice(num_tokens, unsplit, rows, 1, f"no count is faster than unsplit "
                         f"({unsplit.step_s * 1e3:.3f} ms): splitting fragments more than it hides -> run unsplit")
    fewer = [c for c in rows if c.microbatches < fastest.microbatches]
    why = []
    if fewer:
        short = fewer[-1]
        why.append(f"{short.microbatches} leave the attention side idle {short.run.attention_idle_s * 1e3:.3f} ms "
                   f"per step" + ("" if short.covered else
                                  f" (round trip {short.round_trip_s * 1e3:.3f} ms > {short.microbatches - 1} x "
                                  f"stage {short.stage_s * 1e3:.3f} ms)"))
    more = [c for c in rows if c.microbatches > fastest.microbatches]
    if more:
        m = more[0]
        why.append(f"{m.microbatches} fragment more than they hide ({m.run.step_s * 1e3:.3f} ms)"
                   if m.run.step_s >= fastest.run.step_s else
                   f"{m.microbatches} gain less than {margin:.0%} more ({m.run.step_s * 1e3:.3f} ms)")
    run = fastest.run
    cover = ("covers its round trip" if fastest.covered else
             f"is bound by the FFN side (busy {run.ffn_busy_s / run.step_s:.0%} of the step)"
             if run.ffn_busy_s >= 0.95 * run.step_s else
             f"comes closest to covering its round trip (the attention side idles {run.attention_idle_s * 1e3:.3f} "
             "ms per step)")
    return AFDChoice(num_tokens, unsplit, rows, fastest.microbatches,
                     f"best count: {fastest.microbatches} ({fastest.speedup:.2f}x): it {cover}"
                     + (f"; {'; '.join(why)}" if why else ""))


def estimate(costs: AFDCosts, strategy: str, counts: Sequence[int] = (2, 3)) -> Estimate:
    """The adaptive split's prior for AFD (`tbo.split.adaptive.AdaptiveSplit`'s ``estimate``): each
    ``Choice(strategy, m)``'s replayed step time relative to unsplit, at the bucket's token count. ``costs`` prices
    decode and prefill alike: build one estimate per kind where they differ."""

    def predicted(kind: str, num_tokens: int) -> dict[Choice, float]:
        unsplit = simulate_afd(costs, [num_tokens]).step_s
        if unsplit <= 0:
            return {}
        return {Choice(strategy, m): simulate_afd(costs, split_tokens(num_tokens, m)).step_s / unsplit
                for m in counts if m <= num_tokens}

    return predicted


def parse_counts(text: str) -> tuple[int, ...]:
    """``"2,3,4"`` as microbatch counts, each 2..64 (the AFD wire's limit); a ValueError naming the text."""
    try:
        counts = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"microbatch counts must be integers separated by commas (e.g. '2,3,4'), got {text!r}") from None
    if not counts or not all(2 <= m <= 64 for m in counts):
        raise ValueError(f"microbatch counts must each be 2..64, got {text!r}")
    return counts


def report(costs: AFDCosts, num_tokens: int, counts: Sequence[int] = (2, 3, 4)) -> list[str]:
    """``tbo simulate --afd`` and ``tbo predict afd``'s lines: the link, unsplit, each count, and the count that
    pays (``best_microbatches: N``) with the reason."""
    choice = choose_count(costs, num_tokens, counts)
    link = (f"link {costs.latency_s * 1e6:g} us + {costs.bandwidth / 1e9:g} GB/s each way, "
            f"{costs.bytes_fixed + costs.bytes_per_token * num_tokens:.0f} bytes per unsplit transfer")
    lines = [f"AFD, {costs.num_layers} layers, {num_tokens} tokens; {link}",
             f"unsplit: {choice.unsplit.step_s * 1e3:.3f} ms"]
    lines += [c.describe() for c in choice.counts]
    lines += [f"best_microbatches: {choice.best}", choice.reason]
    return lines
