"""A live trace on demand: the next N steps' overlap timeline recorded on every worker of a served engine, asked for
by the process that serves HTTP and returned as one Perfetto trace in ``tbo trace``'s format (no engine is imported
here; vLLM's route is `tbo.integrations.vllm.trace_route`).

Why this path: the ops run in the workers, the route in the API server. The request and the answers cross that gap
through the engine's metrics folder (`tbo.integrations.engine.metrics.metrics_dir`), never through the network
and never pickled:

* the route writes one small JSON **request file** (``trace.request``: an id, N, a deadline, a byte cap; at most
  `REQUEST_BYTES`, written to a temporary name and renamed, so a reader sees all of it or none);
* each worker's metrics publisher thread polls it once per tick (`LiveTrace.poll`: one ``stat`` of a file, the
  whole cost while nobody traces) and arms the worker's `LiveTrace`;
* while armed, and only then, each step of the layer loop runs with one more observer (`StepRecorder`: two clock
  reads per op) and hands its spans over when it ends; when N steps are in, or the deadline passed, or the byte
  cap is reached, the thread writes the worker's **trace file** (``trace-<id>-<worker>.json``, JSON, at most the
  request's byte cap: steps that do not fit are dropped and the file says ``"truncated"``);
* the route reads the workers' files (each read capped), merges them with `chrome_trace` and removes them.

A step-less engine (no request in flight) still answers: at the deadline each worker writes what it has, with its
``reason``. Times are seconds since the epoch (each worker maps ``perf_counter`` onto ``time.time`` once, when it
arms), so the ranks of one host line up.

What an HTTP route does with a request is engine-neutral too, and lives here: `parse_params` checks its query
(a bad parameter is named), `run_trace` writes the request, waits for the workers and merges their answers. vLLM's
route (`tbo.integrations.vllm.trace_route`) and SGLang's (`tbo.integrations.sglang.trace_route`) only adapt them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tbo.core.observer import Observer
from tbo.core.operations import comm_role
from tbo.integrations.engine.metrics import label_order, read_slots

__all__ = ["DEFAULT_STEPS", "MAX_BYTES", "MAX_STEPS", "MAX_TIMEOUT_S", "REQUEST_BYTES", "ROUTE", "LiveTrace",
           "StepRecorder", "TraceParams", "TraceRequest", "chrome_trace", "parse_params", "read_request",
           "read_trace_files", "remove_request", "run_trace", "trace_file_name", "worker_name", "write_request"]

logger = logging.getLogger("tbo.trace")

MAX_STEPS = 64  #: the most steps one request may ask for
DEFAULT_STEPS = 4
MAX_TIMEOUT_S = 120.0  #: the longest a request may wait for its steps
DEFAULT_TIMEOUT_S = 10.0
MAX_BYTES = 16 << 20  #: the most bytes one worker's trace file may hold (the route's default cap)
REQUEST_BYTES = 4096  #: a request file larger than this is not read
REQUEST_NAME = "trace.request"
_ID = re.compile(r"^[0-9a-f]{8,32}$")
_SPAN_BYTES = 120  #: about what one span costs in a worker's file (its JSON object): the recorder's estimate
_SPANS_PER_OP = 1.3  #: spans per op, about: every op, and a transfer and a wait for some
ROUTE = "/tbo/trace"  #: the HTTP route, in every engine
_INT = re.compile(r"^[0-9]{1,9}$")
_NUMBER = re.compile(r"^[0-9]{1,6}(\.[0-9]{1,6})?$")


@dataclass(frozen=True)
class TraceRequest:
    """What the route asks of every worker: record ``steps`` steps, answer by ``deadline`` (seconds since the epoch)
    with at most ``max_bytes``."""

    id: str
    steps: int
    deadline: float
    max_bytes: int = MAX_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not _ID.match(self.id):
            raise ValueError(f"trace request id {self.id!r}: 8 to 32 lowercase hex digits")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or not 1 <= self.steps <= MAX_STEPS:
            raise ValueError(f"trace request steps={self.steps!r}: an int from 1 to {MAX_STEPS}")
        if isinstance(self.deadline, bool) or not isinstance(self.deadline, (int, float)):
            raise ValueError(f"trace request deadline={self.deadline!r}: seconds since the epoch")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or \
                not 1024 <= self.max_bytes <= MAX_BYTES:
            raise ValueError(f"trace request max_bytes={self.max_bytes!r}: an int from 1024 to {MAX_BYTES}")


def write_request(directory: str | os.PathLike[str], request: TraceRequest) -> Path:
    """Write ``request`` as the folder's request file (a temporary name renamed: readers see it whole)."""
    path = Path(directory) / REQUEST_NAME
    tmp = path.with_name(f".{REQUEST_NAME}.{request.id}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"id": request.id, "steps": request.steps, "deadline": request.deadline,
                   "max_bytes": request.max_bytes}, f)
    os.replace(tmp, path)
    return path


def remove_request(directory: str | os.PathLike[str], request_id: str) -> None:
    """Remove the request file if it is still ``request_id``'s, and any trace file left for it."""
    current = read_request(directory)
    if current is not None and current.id == request_id:
        (Path(directory) / REQUEST_NAME).unlink(missing_ok=True)
    for name in _listdir(directory):
        if name.startswith(f"trace-{request_id}-"):
            (Path(directory) / name).unlink(missing_ok=True)


def read_request(directory: str | os.PathLike[str]) -> TraceRequest | None:
    """The folder's request (None where there is none, or it is not a valid request: too large, not JSON, a
    field out of range; logged once per reason by the caller's choice)."""
    data = _read_capped(Path(directory) / REQUEST_NAME, REQUEST_BYTES)
    if data is None:
        return None
    try:
        doc = json.loads(data)
        return TraceRequest(doc["id"], doc["steps"], doc["deadline"], doc.get("max_bytes", MAX_BYTES))
    except (ValueError, KeyError, TypeError) as e:
        logger.warning("tbo: ignoring the trace request in %s: %s", directory, e)
        return None


def _read_capped(path: Path, cap: int) -> bytes | None:
    """At most ``cap`` bytes of ``path``; None where it is missing or larger."""
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError:
        return None
    return data if len(data) <= cap else None


def _listdir(directory: str | os.PathLike[str]) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


def trace_file_name(request_id: str, labels: dict[str, str]) -> str:
    """A worker's trace file for ``request_id``: ``trace-<id>-engine-<e>-rank-<r>.json``."""
    worker = "-".join(f"{k}-{v}" for k, v in sorted(labels.items())) or "worker"
    return f"trace-{request_id}-{worker}.json"


class StepRecorder(Observer):
    """One step's ops, recorded as ``tbo trace``'s spans (``Trace.to_dict``'s ``spans``: lane, mb, stage, name,
    start, end, nbytes) on the host clock: every op on the compute lane; an op with a communication role (see
    `comm_role`) puts its transfer on the comm lane as `tbo.tools.trace.Tracer` does without a traced backend (a
    launch op starts it when it ends, the matching wait op's end completes it) and a wait op's whole time on the
    wait lane. Two clock reads per op."""

    def __init__(self) -> None:
        self.ops: list[tuple[int, int, str, float, float]] = []
        self._started: dict[int, float] = {}

    def on_op_start(self, mb: int, stage: int, name: str) -> None:
        self._started[mb] = time.perf_counter()

    def on_op_end(self, mb: int, stage: int, name: str) -> None:
        self.ops.append((mb, stage, name, self._started.pop(mb), time.perf_counter()))

    def close(self) -> None:
        self._started.clear()

    def spans(self, offset: float = 0.0) -> list[dict[str, Any]]:
        """The spans, their times plus ``offset`` (seconds)."""
        return _spans(self.ops, offset)


def _spans(ops: list[tuple[int, int, str, float, float]], offset: float) -> list[dict[str, Any]]:
    """`StepRecorder.spans` of recorded ``ops`` (built on the publisher thread, not in the step)."""
    out: list[dict[str, Any]] = []
    pending: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for mb, stage, name, start, end in ops:
        start, end = start + offset, end + offset
        out.append(_span("compute", mb, stage, name, start, end))
        role = comm_role(name)
        if role is None:
            continue
        if role[0] == "launch":
            comm = _span("comm", mb, stage, role[1], end, end)
            pending.setdefault((mb, role[1]), []).append(comm)
            out.append(comm)
        else:
            queue = pending.get((mb, role[1]))
            if queue:
                comm = queue.pop(0)
                comm["end"] = max(comm["start"], end)
            if end > start:
                out.append(_span("wait", mb, stage, f"{role[1]}_wait", start, end))
    return out


def _span(lane: str, mb: int, stage: int, name: str, start: float, end: float) -> dict[str, Any]:
    return {"lane": lane, "mb": mb, "stage": stage, "name": name, "start": start, "end": end, "nbytes": 0}


class LiveTrace:
    """A worker's side: `poll` (the publisher thread, each tick) arms it on a new request and writes its trace
    file when done; while `armed`, the layer loop asks `recorder` for an observer and hands the step over with
    `record`. ``armed`` is the one thing a step reads while nobody traces."""

    def __init__(self, directory: str | os.PathLike[str], labels: dict[str, Any]) -> None:
        self.directory = Path(directory)
        self.labels = {k: str(v) for k, v in labels.items()}
        self.armed = False
        self.answered = 0  #: trace files written
        self._lock = threading.Lock()
        self._request: TraceRequest | None = None
        self._seen: tuple[float, int] | None = None  # the request file's (mtime, size) last read
        self._done_ids: set[str] = set()
        self._steps: list[dict[str, Any]] = []
        self._estimate = 0
        self._offset = 0.0
        self._reason = ""

    # ---- the step's side (only while armed) -------------------------------------------------------------------
    def recorder(self) -> StepRecorder | None:
        """An observer for this step (None once the request is complete)."""
        return StepRecorder() if self.armed else None

    def record(self, recorder: StepRecorder, label: str, tokens: list[int]) -> None:
        """Hand a recorded step over; the request is complete at its N-th step, or where its byte cap is reached."""
        ops = recorder.ops  # the step hands its raw ops over; the publisher thread makes them spans
        with self._lock:
            request = self._request
            if not self.armed or request is None:
                return
            self._steps.append({"label": label, "tokens": tokens, "ops": ops})
            self._estimate += _SPAN_BYTES * _SPANS_PER_OP * len(ops) + 100
            if len(self._steps) >= request.steps:
                self.armed, self._reason = False, "steps"
            elif self._estimate >= request.max_bytes:
                self.armed, self._reason = False, f"byte cap: {request.max_bytes} bytes reached"

    # ---- the publisher thread's side --------------------------------------------------------------------------
    def poll(self) -> None:
        """Arm on a new request; write the trace file of a request that is complete or past its deadline."""
        self._check_request()
        with self._lock:
            request = self._request
            if request is None:
                return
            late = time.time() >= request.deadline
            if self.armed and not late:
                return
            if self.armed:
                self.armed = False
            if not self._reason:
                self._reason = (f"deadline: {len(self._steps)} of {request.steps} steps ran before it "
                                "(an engine without requests runs none)")
            steps, reason, offset = self._steps, self._reason, self._offset
            self._request, self._steps, self._estimate, self._reason = None, [], 0, ""
        steps = [{"label": x["label"], "tokens": x["tokens"], "spans": _spans(x["ops"], offset)} for x in steps]
        self._write(request, steps, reason)

    def _check_request(self) -> None:
        path = self.directory / REQUEST_NAME
        try:
            st = os.stat(path)
        except OSError:
            self._seen = None
            return
        seen = (st.st_mtime, st.st_size)
        if seen == self._seen:
            return
        self._seen = seen
        request = read_request(self.directory)
        if request is None or request.id in self._done_ids or time.time() >= request.deadline:
            return
        with self._lock:
            if self._request is not None and self._request.id == request.id:
                return
            self._done_ids.add(request.id)
            self._request, self._steps, self._estimate, self._reason = request, [], 0, ""
            self._offset = time.time() - time.perf_counter()
            self.armed = True

    def _write(self, request: TraceRequest, steps: list[dict[str, Any]], reason: str) -> None:
        """The worker's trace file, at most ``request.max_bytes``: steps that do not fit are dropped."""
        doc = {"id": request.id, "labels": self.labels, "asked": request.steps, "reason": reason,
               "complete": reason == "steps", "truncated": False, "steps": steps}
        payload = json.dumps(doc, separators=(",", ":")).encode()
        while len(payload) > request.max_bytes and doc["steps"]:
            doc["steps"] = doc["steps"][:-1]
            doc["truncated"] = True
            payload = json.dumps(doc, separators=(",", ":")).encode()
        if len(payload) > request.max_bytes:
            return  # not even the header fits (a cap below ~200 bytes cannot be asked for)
        path = self.directory / trace_file_name(request.id, self.labels)
        tmp = path.with_name("." + path.name)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
        self.answered += 1


def read_trace_files(directory: str | os.PathLike[str], request_id: str, max_bytes: int) -> list[dict[str, Any]]:
    """The workers' answers to ``request_id`` (each read capped at ``max_bytes``; a larger or unreadable one is
    skipped), ordered by engine and rank."""
    docs = []
    for name in sorted(_listdir(directory)):
        if not (name.startswith(f"trace-{request_id}-") and name.endswith(".json")):
            continue
        data = _read_capped(Path(directory) / name, max_bytes)
        try:
            doc = json.loads(data) if data is not None else None
        except ValueError:
            doc = None
        if isinstance(doc, dict) and doc.get("id") == request_id and isinstance(doc.get("steps"), list):
            docs.append(doc)
    return sorted(docs, key=lambda d: label_order(d["labels"]))


_LANES = {"compute": 0, "wait": 0, "comm": 1}


def worker_name(labels: dict[str, Any]) -> str:
    """A worker's name on a trace: vLLM's ``engine E rank R``; another engine's labels as ``name value`` pairs in
    `label_order` (SGLang: ``tp_rank 0 pp_rank 0 ...``)."""
    if set(labels) <= {"engine", "rank"}:
        return f"engine {labels.get('engine', '0')} rank {labels.get('rank', '0')}"
    return " ".join(f"{k} {v[1]}" for k, v in label_order(labels))


def chrome_trace(docs: list[dict[str, Any]], missing: list[str] = ()) -> dict[str, Any]:
    """The workers' answers as one Chrome / Perfetto trace in ``tbo trace``'s layout (`tbo.tools.trace.
    to_chrome_json`): per worker a process (``engine E rank R``), per microbatch a compute track (tid ``2 mb``) and
    a communication track (``2 mb + 1``), every span an ``X`` event in microseconds from the first span, its args the
    microbatch, the stage and the step; each step's extent on a ``steps`` track (tid 1000). ``otherData`` says per
    worker how many steps it recorded, why it stopped, and which workers did not answer (``missing``)."""
    events: list[dict[str, Any]] = []
    starts = [s["start"] for d in docs for step in d["steps"] for s in step["spans"]]
    t0 = min(starts, default=0.0)
    workers = []
    for pid, doc in enumerate(docs):
        name = worker_name(doc["labels"])
        mbs = sorted({s["mb"] for step in doc["steps"] for s in step["spans"]})
        for mb in mbs:
            for lane, tid_off in (("compute", 0), ("comm", 1)):
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 2 * mb + tid_off,
                               "args": {"name": f"microbatch {chr(65 + mb)} {lane}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1000, "args": {"name": "steps"}})
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        for k, step in enumerate(doc["steps"]):
            spans = step["spans"]
            for s in spans:
                events.append({
                    "name": s["name"], "cat": s["lane"], "ph": "X", "pid": pid, "tid": 2 * s["mb"] + _LANES[s["lane"]],
                    "ts": (s["start"] - t0) * 1e6, "dur": max(s["end"] - s["start"], 0.0) * 1e6,
                    "args": {"microbatch": s["mb"], "stage": s["stage"], "step": k,
                             **({"bytes": s["nbytes"]} if s.get("nbytes") else {})},
                })
            if spans:
                first, last = min(s["start"] for s in spans), max(s["end"] for s in spans)
                events.append({"name": step["label"], "cat": "step", "ph": "X", "pid": pid, "tid": 1000,
                               "ts": (first - t0) * 1e6, "dur": (last - first) * 1e6,
                               "args": {"step": k, "tokens": step["tokens"]}})
        workers.append({"worker": name, "steps": len(doc["steps"]), "asked": doc.get("asked"),
                        "complete": doc.get("complete", False), "reason": doc.get("reason", ""),
                        "truncated": doc.get("truncated", False)})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"tokens": [step["tokens"] for d in docs for step in d["steps"]], "workers": workers,
                          "missing": list(missing)}}


# ---- what an HTTP route does with a request (every engine's) ------------------------------------------------------


class TraceParams:
    """A route's checked query: ``steps`` (1..`MAX_STEPS`), ``timeout_s`` (0 < t <= `MAX_TIMEOUT_S`), ``max_bytes``
    per worker (1024..`MAX_BYTES`)."""

    def __init__(self, steps: int = DEFAULT_STEPS, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_bytes: int = MAX_BYTES) -> None:
        self.steps, self.timeout_s, self.max_bytes = steps, timeout_s, max_bytes


def parse_params(query: Any) -> TraceParams:
    """``query`` (a mapping of query parameters to their values) checked; a ValueError names the culprit."""
    known = {"steps", "timeout_s", "max_bytes"}
    unknown = sorted(set(query) - known)
    if unknown:
        raise ValueError(f"unknown query parameter(s) {unknown}: the route takes {sorted(known)}")
    params = TraceParams()
    if "steps" in query:
        raw = query["steps"]
        if not _INT.match(raw) or not 1 <= int(raw) <= MAX_STEPS:
            raise ValueError(f"steps={raw!r}: an integer from 1 to {MAX_STEPS}")
        params.steps = int(raw)
    if "timeout_s" in query:
        raw = query["timeout_s"]
        if not _NUMBER.match(raw) or not 0 < float(raw) <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s={raw!r}: seconds, more than 0 and at most {MAX_TIMEOUT_S:g}")
        params.timeout_s = float(raw)
    if "max_bytes" in query:
        raw = query["max_bytes"]
        if not _INT.match(raw) or not 1024 <= int(raw) <= MAX_BYTES:
            raise ValueError(f"max_bytes={raw!r}: an integer from 1024 to {MAX_BYTES}")
        params.max_bytes = int(raw)
    return params


async def run_trace(directory: Path, params: TraceParams, interval_s: float) -> tuple[int, dict[str, Any]]:
    """Ask every worker publishing a slot in ``directory`` for the next ``params.steps`` steps and wait for their
    answers (each notices within one publisher tick of ``interval_s`` and answers within one tick of the deadline):
    (200, the merged Perfetto trace), (503, error) no worker publishing, (504, error) none answered in time. The
    caller holds one trace at a time per folder."""
    import asyncio
    import secrets

    workers = [d["labels"] for d in read_slots(directory)]
    if not workers:
        return 503, {"error": f"no tbo worker publishes to {directory} (has the engine started?)"}
    request_id = secrets.token_hex(8)
    deadline = time.time() + params.timeout_s
    names = {trace_file_name(request_id, w): w for w in workers}
    write_request(directory, TraceRequest(request_id, params.steps, deadline, params.max_bytes))
    grace = 2 * interval_s + 1.0
    try:
        while time.time() < deadline + grace:
            if all((Path(directory) / name).exists() for name in names):
                break
            await asyncio.sleep(0.05)
        docs = await asyncio.to_thread(read_trace_files, directory, request_id, params.max_bytes)
    finally:
        remove_request(directory, request_id)
    answered = {trace_file_name(request_id, d["labels"]) for d in docs}
    missing = [worker_name(w) for n, w in names.items() if n not in answered]
    if not docs:
        return 504, {"error": f"timeout: no tbo worker answered within timeout_s={params.timeout_s:g} s (and "
                              f"{grace:g} s of grace); missing: {', '.join(missing)}"}
    logger.info("tbo: a live trace of %d step(s) from %d worker(s)", params.steps, len(docs))
    return 200, chrome_trace(docs, missing)
