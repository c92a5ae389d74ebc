"""Predict the overlap: replay a compiled schedule on a compute stream and a communication link, with modelled costs.

Two streams gain from hiding communication and lose from fragmenting compute (two half-size GEMMs cost more than one
full one: weights are read twice, small GEMMs run less efficiently). The simulator weighs both before anything runs:

* ``X_a`` books transfer ``X`` on the link after earlier transfers (FIFO on bandwidth, latencies overlapping, as in
  `EmulatedLink`) and never blocks compute;
* ``X_b`` blocks compute until transfer ``X`` of its microbatch has arrived;
* a transfer with an epilogue that takes the whole device (DeepEP V2's copy and reduce epilogues run on every SM)
  costs that much compute on arrival: ``CostModel.epilogues``, charged at the wait as a ``X_epilogue`` span, since
  no other kernel runs beside it.

It returns the same `Trace` type as real runs, so `summary`, the Perfetto and PNG exporters, `fit_costs` and the
examples' printouts all apply. `recommend`, `find_threshold` and `tune` build on it.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Annotated, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from tbo.core.errors import StrategyError
from tbo.core.inflight import InFlightLimit, in_flight_violations
from tbo.core.operations import Yield, comm_role
from tbo.core.strategy import OperationsStrategy
from tbo.tools.trace import Span, Trace, summary

#: a cost, a size or a latency: finite and not negative (NaN would print a speedup of "nanx")
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
#: a rate (FLOP/s, bytes/s): finite and positive (0 would divide by zero)
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]

__all__ = ["Cost", "TransferCost", "CostModel", "SimResult", "Comparison", "Recommendation", "simulate",
           "compare", "recommend", "find_threshold", "tune", "fit_costs"]


class Cost(BaseModel):
    """Compute time of one op for a microbatch of ``t`` tokens, in seconds.

    ``constant``: ``seconds``; ``linear``: ``seconds + per_token * t``; ``roofline``:
    ``seconds + max(flops_per_token * t / peak_flops, (weight_bytes + bytes_per_token * t) / mem_bw)``, where the
    weight bytes, read once per call, are what splitting a batch pays twice; ``table``: measured ``points``,
    interpolated linearly between them and extrapolated along the nearest segment (small batches are not linear).
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["constant", "linear", "roofline", "table"] = "linear"
    seconds: NonNegative = 0.0
    points: list[tuple[NonNegative, NonNegative]] = Field(default_factory=list)  #: table: (tokens, seconds), sorted by tokens
    per_token: NonNegative = 0.0
    flops_per_token: NonNegative = 0.0
    weight_bytes: NonNegative = 0.0
    bytes_per_token: NonNegative = 0.0
    peak_flops: Positive = 1e12
    mem_bw: Positive = 1e11

    def describe(self) -> str:
        """``constant 5e-06 s``, ``linear 3e-05 s + 4e-07 s/token``, ...: for messages."""
        if self.kind == "constant":
            return f"constant {self.seconds:g} s"
        if self.kind == "linear":
            return f"linear {self.seconds:g} s + {self.per_token:g} s/token"
        return f"{self.kind} ({len(self.points)} points)" if self.kind == "table" else self.kind

    def __call__(self, tokens: int) -> float:
        return _finite(self._seconds(tokens), f"the cost {self.describe()} at {tokens} tokens")

    def _seconds(self, tokens: int) -> float:
        if self.kind == "constant":
            return self.seconds
        if self.kind == "linear":
            return self.seconds + self.per_token * tokens
        if self.kind == "table":
            return max(_interpolate(self.points, tokens), 0.0)
        return self.seconds + max(self.flops_per_token * tokens / self.peak_flops,
                                  (self.weight_bytes + self.bytes_per_token * tokens) / self.mem_bw)


def _finite(value: float, what: str) -> float:
    """``value``, or a ValueError naming ``what``: each field is finite on its own (`NonNegative`), but a product of
    two of them can overflow to infinity, which the trace cannot place (``int(inf)``) and a speedup cannot divide."""
    if not math.isfinite(value):
        raise ValueError(f"{what} is {value}: a coefficient of the costs file overflows; use a realistic value")
    return value


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    if not points:
        return 0.0
    if len(points) == 1:
        return points[0][1]
    i = 1
    while i < len(points) - 1 and points[i][0] < x:
        i += 1
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y1


class TransferCost(BaseModel):
    """Bytes one transfer of a microbatch of ``t`` tokens puts on the link: ``bytes_fixed + bytes_per_token * t``.

    ``seconds``: the link's time for the transfer by tokens, where it is not ``bytes / bandwidth`` (a tensor-parallel
    all-reduce switches algorithm by message size: one-shot below a cut-off, two-shot above, each with its own
    latency and bytes per rank; `tbo.tools.predict.tensor_parallel`). It then replaces ``bytes / bandwidth`` as the
    link's occupancy, its latency included (the model's ``latency_s`` still comes after it).
    """

    model_config = ConfigDict(extra="forbid")

    bytes_per_token: NonNegative = 0.0
    bytes_fixed: NonNegative = 0.0
    seconds: Cost | None = None

    def nbytes(self, tokens: int) -> float:
        return _finite(self.bytes_fixed + self.bytes_per_token * tokens,
                       f"a transfer's size (bytes_per_token {self.bytes_per_token:g}) at {tokens} tokens")


class CostModel(BaseModel):
    """Per-op compute costs, per-transfer sizes, and the link. Serialises to the ``costs.json`` the CLI reads.

    Ops named ``X_a`` launch transfer ``X`` and ``X_b`` wait for it (`comm_role`); ``launches``/``waits`` add other
    names.
    """

    model_config = ConfigDict(extra="forbid")

    ops: dict[str, Cost] = Field(default_factory=dict)
    default: Cost = Field(default_factory=lambda: Cost(kind="constant"))
    transfers: dict[str, TransferCost] = Field(default_factory=dict)
    latency_s: NonNegative = 0.0
    bandwidth: Positive = 1e12  #: bytes per second
    launches: dict[str, str] = Field(default_factory=dict)
    waits: dict[str, str] = Field(default_factory=dict)
    #: an op's costs when microbatches interleave, for the first microbatch and for later ones; where given they
    #: replace ``ops``. Interleaving changes what is warm in caches: a later microbatch runs an op right after
    #: another ran it on the same weights, and the first one finds them evicted by the other's different op.
    overlapped: dict[str, tuple[Cost, Cost]] = Field(default_factory=dict)
    #: per transfer kind, device-wide work each transfer ends with (DeepEP V2's epilogues, on every SM): it hides
    #: behind nothing, so it is compute time, spent when the transfer is waited for
    epilogues: dict[str, Cost] = Field(default_factory=dict)

    def epilogue(self, kind: str, tokens: int) -> float:
        return self.epilogues[kind](tokens) if kind in self.epilogues else 0.0

    def op(self, name: str, tokens: int, mb: int = 0, overlapped: bool = False) -> float:
        if overlapped and name in self.overlapped:
            return self.overlapped[name][1 if mb else 0](tokens)
        return self.ops.get(name, self.default)(tokens)

    def unpriced(self, strategy: OperationsStrategy) -> list[str]:
        """The ops of ``strategy`` that this model prices neither in ``ops`` nor in ``overlapped``: each is charged
        ``default``, which `tbo simulate` warns about, naming them."""
        names = dict.fromkeys(name for stage in strategy.stage_names for name in stage)
        return [name for name in names if name not in self.ops and name not in self.overlapped]

    def role(self, name: str) -> tuple[str, str] | None:
        """("launch" | "wait", transfer kind) for a communication op, None for compute."""
        return comm_role(name, self.launches, self.waits)

    def transfer(self, kind: str, tokens: int) -> tuple[float, float]:
        """(bytes, link occupancy in seconds) of one transfer."""
        if kind not in self.transfers:
            return 0.0, 0.0
        cost = self.transfers[kind]
        nbytes = cost.nbytes(tokens)
        return nbytes, cost.seconds(tokens) if cost.seconds is not None else nbytes / self.bandwidth


@dataclass(frozen=True)
class SimResult:
    trace: Trace
    step_s: float


def simulate(strategy: OperationsStrategy, costs: CostModel, tokens: Sequence[int],
             delta_stages: int | Sequence[int] | None = None) -> SimResult:
    """Replay ``strategy`` for microbatches of ``tokens`` (one entry per microbatch) under ``costs``."""
    trace = Trace(tokens=list(tokens), label=f"simulated {strategy.name or 'strategy'}")
    t, link_free = 0.0, float("-inf")
    in_flight: dict[tuple[int, str], deque[Span]] = defaultdict(deque)
    for visit in strategy.walk(len(tokens), delta_stages, role=costs.role):
        mb, stage, name, role, n = visit.mb, visit.stage, visit.op, visit.role, tokens[visit.mb]
        start = t
        if role is not None and role[0] == "wait":
            queue = in_flight[(mb, role[1])]
            if not queue:
                raise ValueError(f"microbatch {mb}, stage {stage}: {name} waits for a {role[1]!r} transfer that "
                                 "was never launched")
            arrival = queue.popleft().end
            if arrival > t:
                trace.spans.append(Span("wait", mb, stage, f"{role[1]}_wait", t, arrival))
                t = arrival
            epilogue = costs.epilogue(role[1], n)
            if epilogue > 0:  # inside the op's span, as its wait is: the op's compute time excludes only the wait
                trace.spans.append(Span("compute", mb, stage, f"{role[1]}_epilogue", t, t + epilogue))
                t += epilogue
        t += costs.op(name, n, mb, len(tokens) > 1)
        trace.spans.append(Span("compute", mb, stage, name, start, t))
        if role is not None and role[0] == "launch":
            nbytes, occupancy = costs.transfer(role[1], n)
            link_start = max(t, link_free)
            link_free = link_start + occupancy
            span = Span("comm", mb, stage, role[1], t, link_free + costs.latency_s, int(nbytes))
            in_flight[(mb, role[1])].append(span)
            trace.spans.append(span)
    return SimResult(trace, summary(trace).step_s)


@dataclass(frozen=True)
class Comparison:
    single: SimResult
    tbo: SimResult
    lower_bound_s: float  #: max(total compute, total link time) of the overlapped run

    @property
    def speedup(self) -> float:
        return self.single.step_s / self.tbo.step_s if self.tbo.step_s > 0 else 1.0


def split_tokens(num_tokens: int, parts: int = 2) -> list[int]:
    return [num_tokens * (i + 1) // parts - num_tokens * i // parts for i in range(parts)]


def compare(strategy: OperationsStrategy, costs: CostModel, num_tokens: int, microbatches: int = 2) -> Comparison:
    """Single batch vs ``microbatches`` overlapped microbatches of ``num_tokens`` in total."""
    single = simulate(strategy, costs, [num_tokens], 0)
    tbo = simulate(strategy, costs, split_tokens(num_tokens, microbatches))
    transfers = tbo.trace.lane("comm")
    occupancy = sum(costs.transfer(sp.name, tbo.trace.tokens[sp.mb])[1] for sp in transfers)
    link = occupancy + costs.latency_s if transfers else 0.0
    return Comparison(single, tbo, max(summary(tbo.trace).compute_s, link))


@dataclass(frozen=True)
class Recommendation:
    split: bool
    predicted_speedup: float
    single_s: float
    tbo_s: float
    reason: str


def recommend(strategy: OperationsStrategy, costs: CostModel, num_tokens: int, mode: str = "decode",
              min_gain: float = 1.0) -> Recommendation:
    """Split or not, the predicted speedup, and why (hidden communication vs fragmented compute)."""
    if num_tokens < 2:
        return Recommendation(False, 1.0, 0.0, 0.0, f"{num_tokens} token(s): nothing to split")
    c = compare(strategy, costs, num_tokens)
    single, tbo = summary(c.single.trace), summary(c.tbo.trace)
    hidden = tbo.comm_s - tbo.exposed_s
    extra_compute = tbo.compute_s - single.compute_s
    split = c.speedup > min_gain
    reason = (f"{mode}, {num_tokens} tokens: TBO hides {hidden * 1e3:.3f} ms of {tbo.comm_s * 1e3:.3f} ms "
              f"communication and adds {extra_compute * 1e3:.3f} ms of compute (fragmentation); "
              f"predicted {c.speedup:.2f}x -> {'split' if split else 'run unsplit'}")
    return Recommendation(split, c.speedup, c.single.step_s, c.tbo.step_s, reason)


def find_threshold(strategy: OperationsStrategy, costs: CostModel, mode: str = "decode", max_tokens: int = 1 << 16,
                   min_gain: float = 1.0) -> int | None:
    """The smallest token count from which TBO is predicted faster (assumed to stay so); None if never up to max."""
    def pays(n: int) -> bool:
        return recommend(strategy, costs, n, mode, min_gain).split

    hi = 2
    while hi <= max_tokens and not pays(hi):
        hi *= 2
    if hi > max_tokens:
        return max_tokens if pays(max_tokens) else None
    lo = hi // 2 + 1 if hi > 2 else 2
    while lo < hi:  # first n in [lo, hi] that pays
        mid = (lo + hi) // 2
        if pays(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def _candidates(layer_ops: Sequence[str], costs: CostModel, max_yields: int) -> list[list[object]]:
    n = len(layer_ops)
    out = []
    for k in range(0, min(max_yields, n - 1) + 1):
        for cuts in itertools.combinations(range(1, n), k):
            ops: list[object] = []
            launched_in: dict[str, int] = {}  # transfer kind -> stage of its launch
            ok, stage = True, 0
            for i, name in enumerate(layer_ops):
                if i in cuts:
                    ops.append(Yield)
                    stage += 1
                ops.append(name)
                role = costs.role(name)
                if role and role[0] == "launch":
                    launched_in[role[1]] = stage
                elif role and launched_in.get(role[1]) == stage:
                    ok = False  # a launch and its wait in one stage leave nothing to overlap
            if ok:
                out.append(ops)
    return out


def tune(layer_ops: Sequence[str], costs: CostModel, num_tokens: int, num_layers: int = 2,
         max_yields: int | None = None, name: str = "tuned", in_flight_limit: InFlightLimit | None = None,
         microbatches: int = 2) -> OperationsStrategy:
    """The Yield placement (same op order) and ``delta_stages`` with the lowest simulated TBO step time.

    ``in_flight_limit``: the backend's limit on transfers in flight (`tbo.comm.deepep.LOW_LATENCY_LIMIT` for DeepEP
    low-latency); a schedule that breaks it, at any layer boundary, is never proposed. StrategyError if none fits.
    """
    best: tuple[float, OperationsStrategy] | None = None
    tokens = split_tokens(num_tokens, microbatches)
    refused = 0
    for ops in _candidates(layer_ops, costs, len(layer_ops) - 1 if max_yields is None else max_yields):
        layer = OperationsStrategy(operations=ops)
        joined = OperationsStrategy.concat([layer] * max(num_layers, 2 if in_flight_limit else 1))
        for delta in range(layer.num_stages):  # a strategy's lead is less than its stage count
            if in_flight_limit is not None and in_flight_violations(joined, in_flight_limit, microbatches, delta):
                refused += 1
                continue
            step = simulate(joined, costs, tokens, delta).step_s
            if best is None or step < best[0] - 1e-15:
                best = (step, OperationsStrategy(operations=ops, delta_stages=delta, name=name))
    if best is None:
        raise StrategyError(f"tune: every placement of {list(layer_ops)} breaks {in_flight_limit.backend}'s limit "
                            f"of {in_flight_limit.max_unreceived} transfer(s) in flight ({refused} refused)"
                            if in_flight_limit else f"tune: no placement of {list(layer_ops)} to try")
    return best[1]


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Intercept and slope of y = a + b x, both clipped at zero (costs are not negative).

    Token counts too close together (less than 20% apart) cannot tell a slope from noise: the fit is then the mean,
    which is right at those sizes and makes no claim about others.
    """
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    if max(xs) - min(xs) <= 0.2 * max(max(xs), 1e-30):
        return max(my, 0.0), 0.0
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


def _fit_cost(pts: Sequence[tuple[int, float]], kind: Literal["linear", "table"]) -> Cost:
    """One op's cost from (tokens, seconds) samples: the median per token count, then a table or a line."""
    by_tokens: dict[int, list[float]] = defaultdict(list)
    for tokens, seconds in pts:
        by_tokens[tokens].append(seconds)
    xs = sorted(by_tokens)
    ys = [statistics.median(by_tokens[x]) for x in xs]
    if kind == "table":
        return Cost(kind="table", points=list(zip(map(float, xs), ys)))
    a, b = _least_squares(xs, ys)
    return Cost(kind="linear", seconds=a, per_token=b)


def fit_costs(traces: Sequence[Trace], latency_s: float | None = None, bandwidth: float | None = None,
              kind: Literal["linear", "table"] = "linear") -> CostModel:
    """Per-op costs and per-transfer sizes fitted from real traces: ``linear`` (seconds + per_token * t) or
    ``table`` (the measured medians, interpolated: better where small batches are not linear).

    Single-batch traces give ``ops``; overlapped traces, if any, give ``overlapped``: each op's costs in the first
    and in later microbatches when they interleave, fitted the same way.

    Traces at several token counts are needed for the slopes; an op's compute time excludes its ``_b`` wait. Within
    a trace an op's calls (one per layer) are averaged, so the costs add up to the step; across traces the samples
    at one token count are reduced to their median before the fit, so a slow step (an allocation, a noisy
    neighbour) cannot tilt the line. The link's latency and bandwidth are fitted from transfer durations unless
    given.
    """
    samples: dict[str, list[tuple[int, float]]] = defaultdict(list)
    overlapped: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
    sizes: dict[str, list[tuple[int, float]]] = defaultdict(list)
    durations: list[tuple[float, float]] = []
    for trace in traces:
        wait_spans = trace.lane("wait")
        calls: dict[tuple[str, int], list[float]] = defaultdict(list)  # (op, microbatch) -> its calls' seconds
        for s in trace.lane("compute"):
            waited = sum(w.duration for w in wait_spans if w.mb == s.mb and w.start >= s.start and w.end <= s.end)
            calls[(s.name, s.mb)].append(s.duration - waited)
        for (name, mb), seconds in calls.items():
            # one sample per trace: the mean call. The same op differs by layer (the first layer runs cold), and
            # the simulator calls it once per layer, so the mean keeps the sum that a median of calls would lose.
            sample = (trace.tokens[mb], sum(seconds) / len(seconds))
            if len(trace.tokens) == 1:
                samples[name].append(sample)
            else:
                overlapped[(name, min(mb, 1))].append(sample)
        for s in trace.lane("comm"):
            sizes[s.name].append((trace.tokens[s.mb], float(s.nbytes)))
            durations.append((float(s.nbytes), s.duration))
    only_overlapped = {name for name, _ in overlapped if not samples.get(name)}
    for (name, _), pts in overlapped.items():
        if name in only_overlapped:  # an op that only runs overlapped: its overlapped cost is its cost
            samples[name].extend(pts)
    ops = {name: _fit_cost(pts, kind) for name, pts in samples.items()}
    overlapped_ops = {name: (_fit_cost(overlapped.get((name, 0)) or overlapped[(name, 1)], kind),
                             _fit_cost(overlapped.get((name, 1)) or overlapped[(name, 0)], kind))
                      for name in {name for name, _ in overlapped}}
    transfers = {}
    for transfer_kind, pts in sizes.items():
        a, b = _least_squares([p[0] for p in pts], [p[1] for p in pts])
        transfers[transfer_kind] = TransferCost(bytes_fixed=a, bytes_per_token=b)
    if (latency_s is None or bandwidth is None) and durations:
        lat, per_byte = _least_squares([d[0] for d in durations], [d[1] for d in durations])
        latency_s = lat if latency_s is None else latency_s
        bandwidth = (1.0 / per_byte if per_byte > 0 else 1e12) if bandwidth is None else bandwidth
    return CostModel(ops=ops, transfers=transfers, latency_s=latency_s or 0.0, bandwidth=bandwidth or 1e12,
                     overlapped=overlapped_ops)
