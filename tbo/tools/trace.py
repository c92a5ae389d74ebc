"""See the overlap: a tracer for real runs, one trace type for real and simulated runs, metrics and exporters.

A `Tracer` is an executor observer: it records every op's start and end with its microbatch and stage, and puts
every op with a communication role (``X_a``/``X_b``, ``afd_send``/``afd_recv``, see `comm_role`) on the
communication lane: a launch op starts a transfer, a wait op's time is the wait. Wrapping an EP backend with `traced`
sharpens this: it reports each transfer's bytes, its completion when known (an `EmulatedLink` knows it exactly), and
the exact time the ``_b`` blocked. The simulator produces the same `Trace`, so the same
exporters (Perfetto JSON, PNG) and the same `summary` serve both.

Times are seconds from ``perf_counter``; on a GPU, ``Tracer(cuda=True)`` times every op, the start of every ``_a``
and both ends of every ``_b`` of a `traced` backend whatever the backend, with CUDA events on the current stream (a
wait is then how long the stream stalled, not how long the Python call took), a `CopyEngineLink`'s copies with its
own events on its copy stream, and maps the few host-timed stamps left (an `EmulatedLink`'s completion) onto the
same clock: seconds since one origin, taken again at each `Tracer.begin`, so all lanes line up.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from tbo.core.observer import Observer
from tbo.core.operations import comm_role
from tbo.comm.types import BackendWrapper
from tbo.util.intervals import interval_union
from tbo.util.optional import extra_hint

__all__ = ["Span", "Trace", "Tracer", "TraceSummary", "summary", "traced", "to_chrome_json", "save_chrome_json", "save_png"]


@dataclass
class Span:
    """One interval on a lane. ``lane`` is "compute" (ops), "wait" (a ``_b`` op blocked) or "comm" (a transfer)."""

    lane: str
    mb: int
    stage: int
    name: str
    start: float
    end: float
    nbytes: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Trace:
    """A step's spans, and the token count of each microbatch (what cost models are fitted against)."""

    spans: list[Span] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    label: str = ""
    #: named instants on the trace's clock (`Tracer.mark`), e.g. when a parked GPU woke up
    marks: dict[str, float] = field(default_factory=dict)

    def lane(self, lane: str) -> list[Span]:
        return [s for s in self.spans if s.lane == lane]

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "tokens": self.tokens, "spans": [asdict(s) for s in self.spans],
                "marks": dict(self.marks)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trace":
        return cls([Span(**s) for s in data["spans"]], list(data.get("tokens", [])), data.get("label", ""),
                   dict(data.get("marks", {})))


def _union(spans: Iterable[Span]) -> float:
    return interval_union((s.start, s.end) for s in spans)


@dataclass(frozen=True)
class TraceSummary:
    """Step time, compute busy time, communication time, exposed communication, and the hidden fraction."""

    step_s: float
    compute_s: float
    comm_s: float
    exposed_s: float

    @property
    def hidden_fraction(self) -> float:
        """1 - exposed / communication: how much of the transfers' time compute covered (1.0 with no transfers)."""
        return 1.0 - self.exposed_s / self.comm_s if self.comm_s > 0 else 1.0

    def __str__(self) -> str:
        return (f"step {self.step_s * 1e3:.2f} ms, compute {self.compute_s * 1e3:.2f} ms, comm {self.comm_s * 1e3:.2f}"
                f" ms, exposed {self.exposed_s * 1e3:.2f} ms, hidden {self.hidden_fraction:.0%}")


def summary(trace: Trace) -> TraceSummary:
    """The step's metrics. Compute busy time is op time minus the time ``_b`` ops spent waiting."""
    if not trace.spans:
        return TraceSummary(0.0, 0.0, 0.0, 0.0)
    step = max(s.end for s in trace.spans) - min(s.start for s in trace.spans)
    waits = sum(s.duration for s in trace.lane("wait"))
    compute = _union(trace.lane("compute")) - waits
    return TraceSummary(step, compute, _union(trace.lane("comm")), waits)


class _HostClock:
    """Host time: ``perf_counter`` seconds. Every stamp is already a time."""

    cuda = False

    def stamp(self) -> float:
        return time.perf_counter()

    def host(self, t: float) -> float:
        return t

    def resolve(self, stamp: Any) -> float:
        if _is_time(stamp):
            return float(stamp)
        raise ValueError("a device event reached a host-clock Tracer: trace GPU work (e.g. a CopyEngineLink on "
                         "CUDA) with Tracer(cuda=True)")

    def sync(self) -> None:
        pass

    def calibrate(self) -> None:
        pass


class _CudaClock:
    """GPU time from CUDA events, and host stamps mapped onto it: both are seconds since one origin.

    The origin is an event recorded on an idle device and waited for, paired with the host time right after: an
    event's time is its ``elapsed_time`` from the origin, a host stamp ``t`` is ``t - origin_host``. Recalibrated
    at each `Tracer.begin` (before a traced step, which is when a caller synchronises anyway) and after each
    `Tracer.finish`, so host stamps never drift far from the device clock, and a step never pays a synchronisation
    for it. ``event_factory``/``synchronize`` default to CUDA's, ``host_clock`` to ``time.perf_counter`` (tests
    pass host-time event stand-ins and a clock they move themselves).
    """

    cuda = True

    def __init__(self, event_factory: Any = None, synchronize: Any = None,
                 host_clock: Callable[[], float] = time.perf_counter) -> None:
        self._host_clock = host_clock
        if event_factory is None:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("Tracer(cuda=True) needs a CUDA device; use Tracer() to trace on the host")
            event_factory, synchronize = (lambda: torch.cuda.Event(enable_timing=True)), torch.cuda.synchronize
        self._event, self._synchronize = event_factory, synchronize
        self.calibrate()

    def calibrate(self) -> None:
        self._synchronize()
        origin = self._event()
        origin.record()
        origin.synchronize()
        self.origin, self.origin_host = origin, self._host_clock()

    def stamp(self) -> Any:
        event = self._event()
        event.record()
        return event

    def host(self, t: float) -> float:
        return t - self.origin_host

    def resolve(self, stamp: Any) -> float:
        if _is_time(stamp):
            return self.host(float(stamp))
        return self.origin.elapsed_time(stamp) / 1e3

    def sync(self) -> None:
        self._synchronize()


def _is_time(stamp: Any) -> bool:
    return isinstance(stamp, (int, float))


class Tracer(Observer):
    """Records ops (from the executor) and transfers (from comm ops, or `traced` backends) into a `Trace`.

    Host tracer (default): every time is a ``perf_counter`` second. ``cuda=True``: ops, the start of every ``_a``
    and both ends of every ``_b`` of any `traced` backend are CUDA events on the current stream; transfers of a
    `tbo.comm.copy_engine.CopyEngineLink` by its events on its copy stream; the host-timed stamps left (an
    `EmulatedLink`'s completion) are mapped onto the same clock: every span is seconds since one origin (see
    `_CudaClock`), so a step's spans line up and its length is the GPU's. Event times are read in `finish`, which
    synchronises the device. Call `begin` before each traced step (a new trace, and the origin taken again).
    """

    def __init__(self, cuda: bool = False, label: str = "") -> None:
        self.trace = Trace(label=label)
        self.cuda = cuda
        self._time: Any = _CudaClock() if cuda else _HostClock()
        self._reset()

    def _reset(self) -> None:
        self._open: dict[int, tuple[int, str, Any]] = {}
        self._unresolved: list[tuple[Span, Any, Any, str]] = []  # (span, start stamp, end stamp, which to set)
        self._deferred: set[int] = set()  # ids of spans whose start waits for `finish`
        self._marks: list[tuple[str, Any]] = []
        self._current = (0, 0)
        #: per (microbatch, kind), transfers launched and not yet waited, and whether their completion is known
        self._pending_comm: dict[tuple[int, str], deque[tuple[Span, bool]]] = defaultdict(deque)
        self._reported = False  # did a traced backend report the current op's transfer itself?
        self._generic: list[tuple[Span, tuple[str, str]]] = []  # comm ops whose transfers only the op shows

    def begin(self, label: str = "", tokens: Iterable[int] = ()) -> None:
        """Start a new trace: the one-clock origin is taken again now (a device synchronisation on CUDA, none on
        the host), so a long-lived tracer's host stamps do not drift from the device clock."""
        self.trace = Trace(tokens=list(tokens), label=label)
        self._reset()
        self._time.calibrate()

    def stamp(self) -> Any:
        """Now on this tracer's clock, as a stamp: a CUDA event recorded on the current stream (``cuda=True``), or
        a ``perf_counter`` time."""
        return self._time.stamp()

    def mark(self, name: str, stamp: Any = None) -> None:
        """Name an instant (``stamp``, default now); `finish` puts its time on the trace's clock in ``marks``."""
        self._marks.append((name, self.stamp() if stamp is None else stamp))

    def _clock(self) -> float:
        """Now, as a host time on this tracer's clock."""
        return self._time.host(time.perf_counter())

    def _place(self, span: Span, start: Any, end: Any, which: str = "both") -> Span:
        """Give ``span`` its times from stamps: now when they are host times, in `finish` when they are events."""
        if which == "both" and _is_time(start) and _is_time(end):
            span.start, span.end = self._time.resolve(start), self._time.resolve(end)
        elif which == "end" and _is_time(end) and id(span) not in self._deferred:
            span.end = max(span.start, self._time.resolve(end))
        else:
            if not self._time.cuda:
                self._time.resolve(start if which == "both" and not _is_time(start) else end)  # raises
            if which == "both":
                self._deferred.add(id(span))
            self._unresolved.append((span, start, end, which))
        return span

    # ---- executor callbacks -------------------------------------------------------------------------------------
    def on_op_start(self, mb: int, stage: int, name: str) -> None:
        self._current = (mb, stage)
        self._reported = False
        self._open[mb] = (stage, name, self._time.stamp())

    def on_op_end(self, mb: int, stage: int, name: str) -> None:
        stage, name, start = self._open.pop(mb)
        span = self._place(Span("compute", mb, stage, name, 0.0, 0.0), start, self._time.stamp())
        self.trace.spans.append(span)
        role = comm_role(name)
        if role is not None and not self._reported:  # e.g. AFD send/recv: the op itself is the launch or the wait
            if self._time.cuda:
                self._generic.append((span, role))
            else:
                self._comm_from_op(span, role)

    def _comm_from_op(self, op: Span, role: tuple[str, str]) -> None:
        """A launch op starts a transfer when it ends; a wait op's whole duration is the wait."""
        self._current = (op.mb, op.stage)
        if role[0] == "launch":
            self._launch(role[1], 0, None, at=op.end)
        else:
            self._wait(role[1], op.start, op.end, resolved=True)

    def finish(self) -> Trace:
        """Resolve event timings (synchronising the device; a no-op on a host tracer) and return the trace."""
        if self._unresolved or self._marks:
            self._time.sync()
            for name, stamp in self._marks:
                self.trace.marks[name] = self._time.resolve(stamp)
            self._marks.clear()
            for span, start, end, which in self._unresolved:
                if which == "both":
                    span.start = self._time.resolve(start)
                    span.end = self._time.resolve(end)
                else:
                    span.end = max(span.start, self._time.resolve(end))
            self._unresolved.clear()
            self._deferred.clear()
            self.trace.spans[:] = [s for s in self.trace.spans if s.lane != "wait" or s.end > s.start]
        for span, role in self._generic:
            self._comm_from_op(span, role)
        self._generic.clear()
        self._time.calibrate()
        return self.trace

    # ---- backend callbacks --------------------------------------------------------------------------------------
    def on_comm_launch(self, kind: str, nbytes: int, complete: float | None, at: Any = None) -> None:
        """A traced backend launched a ``kind`` transfer in the current op, at stamp ``at`` (default now), that
        completes at ``complete`` (a host time; None: unknown, it was done by the time it was waited for)."""
        start = time.perf_counter() if at is None else at
        self._comm_span(kind, nbytes, start, start if complete is None else complete, complete is not None)

    def on_comm_span(self, kind: str, nbytes: int, start: Any, end: Any) -> None:
        """A traced backend launched a ``kind`` transfer whose start and end it stamped (CUDA events on its copy
        stream, or host times)."""
        self._comm_span(kind, nbytes, start, end, True)

    def _comm_span(self, kind: str, nbytes: int, start: Any, end: Any, known: bool) -> None:
        self._reported = True
        mb, stage = self._current
        span = self._place(Span("comm", mb, stage, kind, 0.0, 0.0, nbytes), start, end)
        self._pending_comm[(mb, kind)].append((span, known))
        self.trace.spans.append(span)

    def on_comm_wait(self, kind: str, start: Any, end: Any) -> None:
        """A traced backend waited from ``start`` to ``end`` for the oldest ``kind`` transfer (host times, or CUDA
        events around a stream wait: then it is how long the stream stalled)."""
        self._reported = True
        self._wait(kind, start, end)

    def _launch(self, kind: str, nbytes: int, complete: float | None, at: float) -> None:
        """A transfer launched at ``at`` (on this tracer's clock), completing at ``complete`` if known."""
        mb, stage = self._current
        span = Span("comm", mb, stage, kind, at, complete if complete is not None else at, nbytes)
        self._pending_comm[(mb, kind)].append((span, complete is not None))
        self.trace.spans.append(span)

    def _wait(self, kind: str, start: Any, end: Any, resolved: bool = False) -> None:
        """A wait from ``start`` to ``end``: stamps, or (``resolved``) times already on this tracer's clock."""
        mb, stage = self._current
        queue = self._pending_comm[(mb, kind)]
        pending = queue.popleft() if queue else None  # transfers of one kind complete in launch order per microbatch
        wait = Span("wait", mb, stage, f"{kind}_wait", 0.0, 0.0)
        deferred = not resolved and not (_is_time(start) and _is_time(end))  # events: timed in finish()
        if resolved:
            wait.start, wait.end = start, end
        else:
            self._place(wait, start, end)
        if pending is not None and not pending[1]:  # completion unknown: it was done by the time the wait ended
            span = pending[0]
            if resolved:
                span.end = max(span.start, end)
            else:
                self._place(span, None, end, "end")
        if deferred or wait.end > wait.start:  # a deferred zero-length wait is dropped in finish()
            self.trace.spans.append(wait)


class _Traced(BackendWrapper):
    """An `EPBackend` wrapper reporting launches and waits to a tracer, stamped on the tracer's clock (CUDA events on
    the current stream under ``Tracer(cuda=True)``, whatever the backend): a launch when its ``_a`` starts, a wait
    from before its ``_b`` to after it (on a stream, how long the stream stalled)."""

    def __init__(self, inner: Any, tracer: Tracer) -> None:
        super().__init__(inner)
        self.tracer = tracer

    def _launch(self, kind: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = self.tracer.stamp()
        state = fn(*args, **kwargs)
        transfer = getattr(state, "transfer", None)
        nbytes = getattr(transfer, "nbytes", getattr(state, "nbytes", 0))
        if getattr(transfer, "start", None) is not None and hasattr(transfer, "end"):  # a CopyEngineLink, timed
            self.tracer.on_comm_span(kind, nbytes, transfer.start, transfer.end)
        else:  # an EmulatedLink knows when its transfer completes; others complete when waited
            self.tracer.on_comm_launch(kind, nbytes, getattr(transfer, "complete", None), at=start)
        return state

    def _wait(self, kind: str, state: Any, fn: Any) -> Any:
        start = self.tracer.stamp()
        out = fn(state)
        end = self.tracer.stamp()
        transfer = getattr(state, "transfer", None)
        if getattr(transfer, "wait_start", None) is not None:  # the link knows exactly how long it blocked
            self.tracer.on_comm_wait(kind, transfer.wait_start, transfer.wait_end)
        else:
            self.tracer.on_comm_wait(kind, start, end)
        return out

    def dispatch_a(self, hidden: Any, topk_idx: Any, topk_weights: Any, **agreed: Any) -> Any:
        return self._launch("dispatch", self.inner.dispatch_a, hidden, topk_idx, topk_weights, **agreed)

    def dispatch_b(self, state: Any) -> Any:
        return self._wait("dispatch", state, self.inner.dispatch_b)

    def combine_a(self, expert_out: Any, handle: Any) -> Any:
        return self._launch("combine", self.inner.combine_a, expert_out, handle)

    def combine_b(self, state: Any) -> Any:
        return self._wait("combine", state, self.inner.combine_b)


def traced(backend: Any, tracer: Tracer) -> _Traced:
    """Wrap an EP backend so that its transfers appear on the tracer's communication lane."""
    return _Traced(backend, tracer)


# ---- exporters ----------------------------------------------------------------------------------------------------
_LANES = {"compute": 0, "wait": 0, "comm": 1}


def to_chrome_json(trace: Trace) -> dict[str, Any]:
    """Chrome / Perfetto trace events: per microbatch a compute track and a communication track."""
    events: list[dict[str, Any]] = []
    t0 = min((s.start for s in trace.spans), default=0.0)
    mbs = sorted({s.mb for s in trace.spans})
    for mb in mbs:
        for lane, tid_off in (("compute", 0), ("comm", 1)):
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": 2 * mb + tid_off,
                           "args": {"name": f"microbatch {chr(65 + mb)} {lane}"}})
    events.append({"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": trace.label or "tbo"}})
    for s in trace.spans:
        events.append({
            "name": s.name, "cat": s.lane, "ph": "X", "pid": 0, "tid": 2 * s.mb + _LANES[s.lane],
            "ts": (s.start - t0) * 1e6, "dur": max(s.duration, 0.0) * 1e6,
            "args": {"microbatch": s.mb, "stage": s.stage, **({"bytes": s.nbytes} if s.nbytes else {})},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"tokens": trace.tokens}}


def save_chrome_json(trace: Trace, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_chrome_json(trace)))
    return path


def save_png(trace: Trace, path: str | Path, title: str | None = None) -> Path:
    """A timeline: both microbatches' ops on a compute lane above their transfers on a communication lane.

    Every bar wide enough for its name is labelled with it (the op, or the transfer's kind). Exposed waits, the time a
    ``_b`` op sat blocked, are drawn over their op as white bars with red hatching and a red edge, labelled "wait",
    so that waiting cannot be read as compute; an op that mostly waited keeps only that label.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - the plot extra is missing
        raise ImportError(f"save_png needs matplotlib: {extra_hint('plot')}") from exc
    colors = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]
    wait_style = dict(facecolor="white", edgecolor="#D62728", hatch="////", linewidth=0.8)
    t0 = min((s.start for s in trace.spans), default=0.0)
    t1 = max((s.end for s in trace.spans), default=t0 + 1e-3)
    fig, ax = plt.subplots(figsize=(14, 3.2))
    rows = {"compute": 1.0, "comm": 0.0}
    bars: list[tuple[float, float, float, str, str]] = []  # (start ms, width ms, y centre, label, text colour)
    waits: dict[tuple[int, int], list[Span]] = {}  # (microbatch, stage) -> its waits, each inside its op's bar
    for s in trace.lane("wait"):
        waits.setdefault((s.mb, s.stage), []).append(s)
    for s in trace.spans:
        x, width = (s.start - t0) * 1e3, max(s.duration, 1e-9) * 1e3
        if s.lane == "wait":
            ax.broken_barh([(x, width)], (rows["compute"] - 0.4, 0.8), zorder=3, **wait_style)
            bars.append((x, width, rows["compute"], "wait", "#D62728"))
            continue
        y = rows[s.lane] + (0.05 * s.mb if s.lane == "comm" else 0.0)
        height = 0.8 - (0.1 if s.lane == "comm" else 0.0)
        ax.broken_barh([(x, width)], (y - 0.4, height), facecolors=colors[s.mb % len(colors)], edgecolors="white",
                       linewidth=0.3, alpha=0.9 if s.lane == "compute" else 0.6, zorder=2)
        waited = sum(max(0.0, min(w.end, s.end) - max(w.start, s.start)) for w in waits.get((s.mb, s.stage), ()))
        mostly_waiting = s.lane == "compute" and waited > s.duration / 2
        if not mostly_waiting:
            bars.append((x, width, y, s.name, "white" if s.lane == "compute" else "black"))
    ax.set_xlim(0, (t1 - t0) * 1e3 * 1.005)
    ax.set_ylim(-0.6, 1.6)
    ax.set_yticks([0, 1], ["comm", "compute"])
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[mb % len(colors)]) for mb in sorted({s.mb for s in
                                                                                            trace.spans})]
    ax.legend(handles + [plt.Rectangle((0, 0), 1, 1, **wait_style)],
              [f"microbatch {chr(65 + i)}" for i in range(len(handles))] + ["exposed wait (a _b op blocked)"],
              loc="upper right", fontsize=8, ncol=len(handles) + 1)
    ax.set_title(title or trace.label or "tbo timeline")
    fig.tight_layout()
    # label the bars whose on-screen width fits the name (fontsize 6.5: about 5.5 px per character at 110 dpi)
    px_per_ms = ax.get_window_extent().width / max(ax.get_xlim()[1], 1e-9)
    char_px = 0.6 * 6.5 * 110 / 72
    for x, width, y, label, color in bars:
        if width * px_per_ms >= (len(label) + 1) * char_px:
            ax.text(x + width / 2, y, label, ha="center", va="center", fontsize=6.5, color=color, clip_on=True,
                    zorder=4)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
