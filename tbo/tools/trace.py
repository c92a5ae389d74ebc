"""See the overlap: a tracer for real runs, one trace type for real and simulated runs, metrics and exporters.

A `Tracer` is an executor observer: it records every op's start and end with its microbatch and stage, and puts
every op with a communication role (``X_a``/``X_b``, ``afd_send``/``afd_recv``, see `comm_role`) on the
communication lane: a launch op starts a transfer, a wait op's time is the wait. Wrapping an EP backend with `traced`
sharpens this: it reports each transfer's bytes, its completion when known (an `EmulatedLink` knows it exactly), and
the exact time the ``_b`` blocked. The simulator produces the same `Trace`, so the same
exporters (Perfetto JSON, PNG) and the same `summary` serve both.

Times are seconds from ``perf_counter``; on a GPU, ``Tracer(cuda=True)`` times ops with CUDA events instead.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tbo.core.observer import Observer
from tbo.core.operations import comm_role
from tbo.comm.types import BackendWrapper
from tbo.util.intervals import interval_union

__all__ = ["Span", "Trace", "Tracer", "TraceSummary", "summary", "traced", "to_chrome_json", "save_png"]


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

    def lane(self, lane: str) -> list[Span]:
        return [s for s in self.spans if s.lane == lane]

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "tokens": self.tokens, "spans": [asdict(s) for s in self.spans]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trace":
        return cls([Span(**s) for s in data["spans"]], list(data.get("tokens", [])), data.get("label", ""))


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


class Tracer(Observer):
    """Records ops (from the executor) and transfers (from comm ops, or `traced` backends) into a `Trace`."""

    def __init__(self, cuda: bool = False, label: str = "") -> None:
        self.trace = Trace(label=label)
        self.cuda = cuda
        self._clock = time.perf_counter
        self._open: dict[int, tuple[int, str, Any]] = {}
        self._events: list[tuple[Span, Any, Any]] = []
        self._current = (0, 0)
        self._pending_comm: dict[tuple[int, str], deque[Span]] = defaultdict(deque)
        self._reported = False  # did a traced backend report the current op's transfer itself?
        self._generic: list[tuple[Span, tuple[str, str]]] = []  # comm ops whose transfers only the op shows

    # ---- executor callbacks -------------------------------------------------------------------------------------
    def on_op_start(self, mb: int, stage: int, name: str) -> None:
        self._current = (mb, stage)
        self._reported = False
        self._open[mb] = (stage, name, self._now_or_event())

    def on_op_end(self, mb: int, stage: int, name: str) -> None:
        stage, name, start = self._open.pop(mb)
        span = Span("compute", mb, stage, name, 0.0, 0.0)
        if self.cuda:
            end = self._now_or_event()
            self._events.append((span, start, end))
        else:
            span.start, span.end = start, self._clock()
        self.trace.spans.append(span)
        role = comm_role(name)
        if role is not None and not self._reported:  # e.g. AFD send/recv: the op itself is the launch or the wait
            if self.cuda:
                self._generic.append((span, role))
            else:
                self._comm_from_op(span, role)

    def _comm_from_op(self, op: Span, role: tuple[str, str]) -> None:
        """A launch op starts a transfer when it ends; a wait op's whole duration is the wait."""
        self._current = (op.mb, op.stage)
        if role[0] == "launch":
            self._launch(role[1], 0, None, at=op.end)
        else:
            self._wait(role[1], op.start, op.end)

    def _now_or_event(self) -> Any:
        if not self.cuda:
            return self._clock()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finish(self) -> Trace:
        """Resolve CUDA event timings (a no-op on CPU) and return the trace."""
        if self._events:
            import torch

            torch.cuda.synchronize()
            first = self._events[0][1]
            for span, start, end in self._events:
                span.start = first.elapsed_time(start) / 1e3
                span.end = first.elapsed_time(end) / 1e3
            self._events.clear()
        for span, role in self._generic:
            self._comm_from_op(span, role)
        self._generic.clear()
        return self.trace

    # ---- backend callbacks --------------------------------------------------------------------------------------
    def on_comm_launch(self, kind: str, nbytes: int, complete: float | None) -> None:
        """A traced backend launched a ``kind`` transfer in the current op (``complete``: when the link finishes)."""
        self._reported = True
        self._launch(kind, nbytes, complete, at=self._clock())

    def on_comm_wait(self, kind: str, start: float, end: float) -> None:
        """A traced backend blocked from ``start`` to ``end`` waiting for the oldest ``kind`` transfer."""
        self._reported = True
        self._wait(kind, start, end)

    def _launch(self, kind: str, nbytes: int, complete: float | None, at: float) -> None:
        mb, stage = self._current
        span = Span("comm", mb, stage, kind, at, complete if complete is not None else at, nbytes)
        self._pending_comm[(mb, kind)].append(span)
        self.trace.spans.append(span)

    def _wait(self, kind: str, start: float, end: float) -> None:
        mb, stage = self._current
        queue = self._pending_comm[(mb, kind)]
        span = queue.popleft() if queue else None  # transfers of one kind complete in launch order per microbatch
        if span is not None and span.end <= span.start:  # completion unknown: it was done by the time the wait ended
            span.end = max(span.start, end)
        if end > start:
            self.trace.spans.append(Span("wait", mb, stage, f"{kind}_wait", start, end))


class _Traced(BackendWrapper):
    """An `EPBackend` wrapper reporting launches and waits to a tracer."""

    def __init__(self, inner: Any, tracer: Tracer) -> None:
        super().__init__(inner)
        self.tracer = tracer

    def _launch(self, kind: str, state: Any) -> Any:
        transfer = getattr(state, "transfer", None)  # an EmulatedLink knows when its transfer completes
        self.tracer.on_comm_launch(kind, getattr(transfer, "nbytes", getattr(state, "nbytes", 0)),
                                   getattr(transfer, "complete", None))
        return state

    def _wait(self, kind: str, state: Any, fn: Any) -> Any:
        start = time.perf_counter()
        out = fn(state)
        transfer = getattr(state, "transfer", None)
        if transfer is not None and transfer.wait_start is not None:  # the link knows exactly how long it blocked
            self.tracer.on_comm_wait(kind, transfer.wait_start, transfer.wait_end)
        else:
            self.tracer.on_comm_wait(kind, start, time.perf_counter())
        return out

    def dispatch_a(self, hidden: Any, topk_idx: Any, topk_weights: Any) -> Any:
        return self._launch("dispatch", self.inner.dispatch_a(hidden, topk_idx, topk_weights))

    def dispatch_b(self, state: Any) -> Any:
        return self._wait("dispatch", state, self.inner.dispatch_b)

    def combine_a(self, expert_out: Any, handle: Any) -> Any:
        return self._launch("combine", self.inner.combine_a(expert_out, handle))

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
        raise ImportError("save_png needs matplotlib: pip install 'tbo[plot]'") from exc
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
