"""Counters of what TBO did in an engine, the registry that sums a process's engines, and the one line logged at
shutdown; shared by every engine integration (no engine is imported here).

Without them nobody, a test included, could tell a run that overlapped from one that silently never split. Each
engine counts into its own `StepStats`, held by its components (one object each: nothing fans a count out on a
per-op path), and a process's figures are the sum over its `StatsRegistry`: two engines of one process each report
their own, and the process reports both.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from tbo.split.kinds import StepKind

__all__ = ["MODES", "PROPERTIES", "STEP_SECONDS_BUCKETS", "StatsFile", "StatsRegistry", "StepClock", "StepStats",
           "link_report", "summary_line"]

#: the step kinds counted by kind (idle: a data-parallel rank's dummy step beside its peers')
MODES = (StepKind.DECODE, StepKind.PREFILL, StepKind.MIXED, StepKind.IDLE)
#: `StepStats` fields that describe the engine rather than count what it did: a reset keeps them, a sum of engines
#: takes the largest expert-parallel group and adds the compile bounds
PROPERTIES = ("ep_size", "op_compile_bound")
#: the step-time histogram's upper bounds in seconds (Prometheus's ``le``): vLLM's per-decode-step buckets
#: (``vllm.v1.metrics.buckets.INTER_TOKEN_LATENCY_BUCKETS``, from 10 ms), with three below them for the millisecond
#: steps of a small model on a GPU
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                        2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass
class StepStats:
    """Forward steps the engine ran through tbo (profiling and warm-up runs are not counted)."""

    steps: int = 0
    split_steps: int = 0
    microbatches: int = 0  #: microbatches run, over the split steps
    tokens: int = 0
    split_tokens: int = 0
    steps_by_mode: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODES, 0))
    split_steps_by_mode: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODES, 0))
    #: steps run unsplit, by why (`tbo.integrations.engine.step.UNSPLIT_REASONS`: below the threshold, no cut, the
    #: engine's veto, padded, the adaptive choice, another DP rank, ...): what an operator asks when the ratio is low
    unsplit_steps_by_reason: dict[str, int] = field(default_factory=dict)
    #: split steps by the registry name of the strategy that ran them (the adaptive split chooses among candidates)
    split_steps_by_strategy: dict[str, int] = field(default_factory=dict)
    #: each timed step's wall time (`StepClock`) as a histogram by its kind and whether it split, under the key
    #: ``"decode|split"`` (or ``"prefill|unsplit"``, ...): how many, their seconds, and per bucket the steps at most
    #: that long (``"decode|split|0.05"``: cumulative, as Prometheus's ``le``; the ``+Inf`` bucket is the count)
    step_seconds_count: dict[str, int] = field(default_factory=dict)
    step_seconds_sum: dict[str, float] = field(default_factory=dict)
    step_seconds_bucket: dict[str, int] = field(default_factory=dict)
    cut_requests: int = 0  #: split steps whose cut fell inside a request (a prefill chunk in two microbatches)
    #: speculative decoding: target steps that verified draft tokens, those split (never inside a request's 1 + k
    #: tokens), those of them whose requests brought different draft counts, and the draft tokens they verified
    verify_steps: int = 0
    split_verify_steps: int = 0
    split_verify_steps_varying_k: int = 0
    verified_draft_tokens: int = 0
    #: speculative decoding with a drafter that runs a model (MTP): the forwards of its model that ran through tbo
    #: (each draft pass is 1 + (k - 1) of them: one over the target step's tokens, one per further draft token), and
    #: those split (decode-like, between requests: `tbo.integrations.engine.step.decide_draft`)
    draft_steps: int = 0
    split_draft_steps: int = 0
    #: AFD: stages (one layer of one microbatch) sent to the FFN server; this and the next count every forward
    afd_stages_sent: int = 0
    local_ffn_calls: int = 0  #: FFN or MoE computations on this side (0 under AFD: the FFN server makes them)
    #: tensor parallelism: all-reduces of row-parallel partial sums (attention, MLP, MoE output) tbo ran as its own
    #: transfers (``*_reduce_a``: one per microbatch per deferred reduction), vLLM's modules leaving them to it
    tp_reductions: int = 0
    ep_size: int = 1  #: the expert-parallel group's size (data parallel + expert parallel; 1 otherwise)
    remote_rows: int = 0  #: token rows this rank's dispatches sent to other ranks, over the counted steps
    #: dispatches that waited on a blocking row-count exchange with the peers (none where the step agreed every
    #: rank's rows: `tbo.split.agree`), over the counted steps
    count_exchanges: int = 0
    #: data parallel: steps with work of its own that ran the strategy a peer needed (it decoded, a peer prefilled)
    peer_strategy_steps: int = 0
    #: data parallel: ``idle`` steps every rank ran at once (a wave's end), whose layer stacks were skipped
    idle_skipped: int = 0
    #: data parallel: forwards (profiling and warm-up included) whose vLLM DP batch coordination ran its own
    #: all-reduce beside tbo's agreement: 0 unless CUDA graphs pad the steps (`tbo.integrations.vllm.step.agree`)
    vllm_dp_all_reduces: int = 0
    #: CUDA graphs of split decode steps (`tbo.integrations.vllm.step.graphs`): graphs captured split, steps replayed
    #: from one (counted in ``steps`` and ``split_steps`` too), and steps run eager because their split differed
    #: from their size's graph's
    graph_captures: int = 0
    graph_replays: int = 0
    graph_eager_steps: int = 0
    #: ``op_times``: wall seconds and calls per op name (layers and microbatches summed), over the counted steps,
    #: and the wall seconds of their layer stacks (what the ops do not cover is the executor's and tbo's own time)
    op_seconds: dict[str, float] = field(default_factory=dict)
    op_calls: dict[str, int] = field(default_factory=dict)
    layers_seconds: float = 0.0
    #: a compiled engine (`tbo.integrations.vllm.model.compute`): graphs traced of tbo's compiled op functions (warm-up
    #: included: a step that recompiled grows it), the most they can be (the engines' graph keys; 0 for an eager
    #: engine), the calls that ran compiled, and those of them that went through dynamo's guards (each caller's
    #: first call, at warm-up; a serving step makes none: its calls run the graph their caller settled on)
    op_compiles: int = 0
    op_compile_bound: int = 0
    compiled_op_calls: int = 0
    guarded_op_calls: int = 0

    def record(self, mode: str, num_tokens: int, num_microbatches: int, cut_request: bool,
               unsplit_reason: str | None = None) -> None:
        """Count one step; ``num_microbatches`` is 1 for a step that ran unsplit, and ``unsplit_reason`` says why
        (`tbo.integrations.engine.step.Step.unsplit_reason`; "idle" for a dummy step; None: not counted by reason)."""
        if num_microbatches == 1 and unsplit_reason is not None:
            self.unsplit_steps_by_reason[unsplit_reason] = self.unsplit_steps_by_reason.get(unsplit_reason, 0) + 1
        self.steps += 1
        self.tokens += num_tokens
        self.steps_by_mode[mode] += 1
        if num_microbatches > 1:
            self.split_steps += 1
            self.microbatches += num_microbatches
            self.split_tokens += num_tokens
            self.split_steps_by_mode[mode] += 1
            self.cut_requests += int(cut_request)

    def observe_step(self, mode: str, split: bool, seconds: float) -> None:
        """Add one step's wall time to the histogram of its kind and split (`STEP_SECONDS_BUCKETS`)."""
        key = f"{mode}|{'split' if split else 'unsplit'}"
        self.step_seconds_count[key] = self.step_seconds_count.get(key, 0) + 1
        self.step_seconds_sum[key] = self.step_seconds_sum.get(key, 0.0) + seconds
        for le in STEP_SECONDS_BUCKETS:
            if seconds <= le:
                bucket = f"{key}|{le:g}"
                self.step_seconds_bucket[bucket] = self.step_seconds_bucket.get(bucket, 0) + 1

    def record_strategy(self, name: str) -> None:
        """Count one split step (after `record`) as run by the strategy registered as ``name``."""
        self.split_steps_by_strategy[name] = self.split_steps_by_strategy.get(name, 0) + 1

    def record_verify(self, draft_tokens: int, split: bool, varying: bool) -> None:
        """Count one target step that verified ``draft_tokens`` draft tokens (after `record`)."""
        self.verify_steps += 1
        self.verified_draft_tokens += draft_tokens
        self.split_verify_steps += int(split)
        self.split_verify_steps_varying_k += int(split and varying)

    def record_draft(self, split: bool) -> None:
        """Count one forward of the drafter's model (not a target step: `record` does not count it)."""
        self.draft_steps += 1
        self.split_draft_steps += int(split)

    def add_op_times(self, seconds: dict[str, float], calls: dict[str, int], layers_seconds: float) -> None:
        """Add one step's `tbo.runtime.op_times.OpTimes` figures and its layer stack's wall time."""
        self.layers_seconds += layers_seconds
        for name, s in seconds.items():
            self.op_seconds[name] = self.op_seconds.get(name, 0.0) + s
            self.op_calls[name] = self.op_calls.get(name, 0) + calls[name]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def add(self, other: StepStats, sign: int = 1) -> None:
        """Add ``other``'s counters to these (``sign`` -1: subtract them); ``ep_size`` is the larger of the two (a
        subtraction leaves it)."""
        for name, value in vars(other).items():
            mine = getattr(self, name)
            if name == "ep_size":
                if sign > 0:
                    self.ep_size = max(mine, value)
            elif isinstance(value, dict):
                for key, v in value.items():
                    mine[key] = mine.get(key, 0) + sign * v
            else:
                setattr(self, name, mine + sign * value)

    def copy(self) -> StepStats:
        """A copy whose later changes do not touch these."""
        out = StepStats()
        out.add(self)
        out.ep_size = self.ep_size
        return out

    def write(self, path: str) -> None:
        """Write `as_dict` as JSON, atomically: a reader sees the previous file or this one, never a part."""
        _write_json(path, self.as_dict())


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):  # a failed write leaves nothing beside the file
            os.unlink(tmp)
        raise


class StepClock:
    """Times a counted step for `StepStats.observe_step`: `start` where its layers begin, `stop` where the engine
    waits for its results anyway (vLLM: its ``sample_tokens`` returned, the tokens on the host; an engine without
    such a seat stops at the end of its layer loop), so the clock adds no device sync. A step started but never
    stopped (a data-parallel dummy step, which samples nothing) is dropped by the next start."""

    def __init__(self, stats: StepStats) -> None:
        self.stats = stats
        self._running: tuple[str, bool, float] | None = None

    def start(self, mode: str, split: bool) -> None:
        self._running = (mode, split, time.perf_counter())

    def stop(self) -> bool:
        """Observe the running step, if any; True where one was observed."""
        if self._running is None:
            return False
        mode, split, t0 = self._running
        self._running = None
        self.stats.observe_step(mode, split, time.perf_counter() - t0)
        return True


class StatsFile:
    """``stats_file``: a worker's stats written after every counted step, not only at shutdown.

    A worker's shutdown is not a safe place for the only write: vLLM stops engine processes with a short grace (data
    parallel ranks, the API server's engine core), and a process killed inside it leaves no file, half of one, or
    (were the writes spaced out) stale counts. So every counted step replaces the file whole: a small JSON write from
    counters kept on the host (no device sync), paid only when ``stats_file`` is set, a diagnostic option.
    """

    def __init__(self, path: str, extra: Callable[[], dict[str, Any]] | None = None) -> None:
        self.path, self.extra = path, extra  #: ``extra()``: more of the engine's state beside the counters
        #: `write_or_log` writes that failed, and the last failure's message (logged when it first appears)
        self.failures, self._error = 0, ""

    def write(self, stats: StepStats) -> None:
        _write_json(self.path, stats.as_dict() if self.extra is None else {**stats.as_dict(), **self.extra()})

    def write_or_log(self, stats: StepStats, logger: logging.Logger) -> None:
        """`write`, as a diagnostic: a failure (a directory, a full disk, a missing folder) is logged on the engine's
        ``logger`` (each distinct error once) and counted in `failures`, never raised, so that it cannot fail the
        step or the shutdown that writes it."""
        try:
            self.write(stats)
        except Exception as e:  # noqa: BLE001 - whatever the write raises, the engine goes on
            self.failures += 1
            message = f"{type(e).__name__}: {e}"
            if message != self._error:
                self._error = message
                logger.warning("tbo: cannot write stats_file %r (%s); the engine goes on without it",
                               self.path, message)


def link_report(links: list[Any]) -> dict[str, Any] | None:
    """``stats_file``'s ``link`` for an engine's emulated links (`tbo.comm.emulated.LinkTimeline`s: ``link`` set):
    the transfers booked on them, their busy seconds, and the seconds of those the overlap left exposed (waited for
    in a ``*_b`` op), summed; None without a link. Proof that the link ran, and what the metrics' ``tbo:link_*``
    families (hidden = busy - exposed) read."""
    if not links:
        return None
    stats = [link.stats for link in links]
    return {"transfers": sum(s.count for s in stats), "busy_s": sum(s.comm_s for s in stats),
            "exposed_s": sum(s.exposed_s for s in stats)}


def summary_line(s: StepStats) -> str:
    """``"tbo: 37 of 52 forward steps overlapped (...)"``: what the engine logs when it shuts down."""
    by_mode = ", ".join(f"{m} {s.split_steps_by_mode[m]}/{s.steps_by_mode[m]}" for m in MODES if s.steps_by_mode[m])
    draft = f"; draft forwards {s.split_draft_steps}/{s.draft_steps}" if s.draft_steps else ""
    return (f"tbo: {s.split_steps} of {s.steps} forward steps overlapped ({s.microbatches} microbatches"
            f"{'; ' + by_mode if by_mode else ''}{draft})")


class StatsRegistry:
    """The `StepStats` of a process's live engines, and what closed ones counted: `total` is their sum since the
    process started or since `reset` (which keeps the `PROPERTIES`, and each engine's own counters, behind its
    shutdown line, untouched). An engine `register`s its stats when it starts; what that returns retires them (an
    engine's undo at shutdown, or when its start is refused)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: id of a live engine's stats -> (those stats, what they held at the last reset, the engine's extra report)
        self._live: dict[int, tuple[StepStats, StepStats, Callable[[], Any] | None]] = {}
        self._retired = StepStats()  #: what closed engines counted since the last reset

    def register(self, stats: StepStats, report: Callable[[], Any] | None = None) -> Callable[[], None]:
        """Count ``stats`` (one engine's) in `total`, and ``report()`` in `reports`; returns what retires them."""
        with self._lock:
            self._live[id(stats)] = (stats, _baseline(StepStats()), report)

        def retire() -> None:
            with self._lock:
                entry = self._live.pop(id(stats), None)
                if entry is not None:
                    self._retired.add(_since(entry[0], entry[1]))

        return retire

    def total(self) -> StepStats:
        """The sum over the engines, live and closed (a copy)."""
        with self._lock:
            out = self._retired.copy()
            for stats, baseline, _ in self._live.values():
                out.add(_since(stats, baseline))
            return out

    def snapshot(self) -> dict[str, Any]:
        """What an engine room's ``stats()`` returns: `total` as a dict, and under ``"adaptive"`` the `reports`
        where there are any. A copy: later steps do not change it."""
        out = self.total().as_dict()
        reports = self.reports()
        if reports:
            out["adaptive"] = reports
        return out

    def reports(self) -> list[Any]:
        """The live engines' extra reports (``split: "adaptive"``: their buckets), in the order they started."""
        with self._lock:
            makers = [report for _, _, report in self._live.values() if report is not None]
        return [report() for report in makers]

    def reset(self) -> None:
        """Zero `total`'s counters from now on (the `PROPERTIES` stay)."""
        with self._lock:
            self._retired = StepStats(**{name: getattr(self._retired, name) for name in PROPERTIES})
            self._live = {key: (stats, _baseline(stats.copy()), report)
                          for key, (stats, _, report) in self._live.items()}

    def __len__(self) -> int:
        return len(self._live)


def _baseline(stats: StepStats) -> StepStats:
    """``stats`` as a reset's baseline: what is subtracted of an engine's counters (its `PROPERTIES` never are)."""
    for name in PROPERTIES:
        setattr(stats, name, 0)
    stats.ep_size = 1
    return stats


def _since(stats: StepStats, baseline: StepStats) -> StepStats:
    """``stats`` less ``baseline``'s counters."""
    out = stats.copy()
    out.add(_baseline(baseline.copy()), -1)
    return out
