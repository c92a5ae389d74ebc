"""tbo's figures in an engine's own Prometheus ``/metrics``: the path from the processes that run the model to the
one that serves ``/metrics``, and the metric families built from what arrives (no engine is imported here).

Why a path at all: tbo counts into each worker's `StepStats`, in the process that runs the model, while vLLM's
``/metrics`` is served by the API server process (SGLang's by its tokenizer manager). The figures cross that gap
through one **slot** per worker: a fixed-size file mapped into memory (``/dev/shm`` where it exists), which the
worker's `MetricsPublisher` overwrites in place from a background thread every ``interval_s`` seconds (1 s by
default), and which the serving process reads when ``/metrics`` is scraped (`read_slots`, `families`). So:

* the hot path pays nothing: no step writes, locks or calls anything for it (the counters a step already keeps are
  what the thread reads); the thread's work, one JSON encoding of the stats every ``interval_s``, is the whole
  cost, measured by ``benchmarks/metrics_cost.py`` (docs/metrics.md has the figure);
* it is bounded: one slot of `SLOT_BYTES` per worker, rewritten in place (no file grows, none is created per
  step); a payload too large for it drops its adaptive detail and says so (``"truncated"``);
* a reader never sees half a write: each write is framed by a sequence number (odd while writing) and checked by a
  CRC32 of its payload, and a torn read is retried;
* it lags by at most ``interval_s``: the figures a scrape sees are those of the last publish, and the thread also
  publishes once when the engine closes.

The slot's payload is the worker's ``stats_file`` document (its `StepStats` and the engine's extra report) with
who wrote it (``labels``: the engine's own labels of that worker, vLLM's ``engine`` and tbo's ``rank``, SGLang's
``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank`` and ``dp_rank``) and tbo's ``info`` (version, strategies,
split policy). The labels become the samples' Prometheus labels as they are, after ``model_name``, so each engine's
families are labelled the way that engine labels its own.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

from tbo.integrations.engine.stats import STEP_SECONDS_BUCKETS

__all__ = ["SLOT_BYTES", "MetricsPublisher", "MetricsSlot", "SlotCollector", "families", "label_order", "metrics_dir",
           "read_slots", "sample_name", "tbo_version"]

logger = logging.getLogger("tbo.metrics")

SLOT_BYTES = 256 << 10  #: a slot's size: far above a worker's stats (a few KiB; adaptive buckets add ~0.5 KiB each)
_MAGIC = b"TBOSLOT1"
_HEADER = struct.Struct("<8sQII")  # magic, sequence (odd while a write is under way), payload length, CRC32
_SEQ_AT = 8
_SUFFIX = ".slot"


def tbo_version() -> str:
    """The installed distribution's version (``tbo:info``'s ``version``); ``"unknown"`` where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    from tbo.util.optional import DISTRIBUTION

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"


def metrics_dir(key: str, base: str | None = None) -> Path:
    """The folder of one served engine's slots: ``tbo-metrics-<key>`` under ``base`` (default ``/dev/shm`` where it
    is a writable folder, memory rather than disk, else the system's temporary folder). ``key`` is what every process
    of the engine knows alike (vLLM: the config's ``instance_id``; SGLang: its ``SGLANG_RUN_ID``)."""
    if not key or any(c in key for c in "/\\\0") or key in (".", ".."):
        raise ValueError(f"metrics key {key!r}: a non-empty name without path separators")
    if base is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return Path(base) / f"tbo-metrics-{key}"


class MetricsSlot:
    """One worker's slot: a file of `SLOT_BYTES` mapped into memory; `write` replaces its payload in place."""

    def __init__(self, path: str | os.PathLike[str], size: int = SLOT_BYTES) -> None:
        if size <= _HEADER.size:
            raise ValueError(f"a metrics slot of {size} bytes cannot hold its {_HEADER.size}-byte header")
        self.path, self.size, self._seq = Path(path), size, 0
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._map[:_HEADER.size] = _HEADER.pack(_MAGIC, 0, 0, 0)

    @property
    def capacity(self) -> int:
        """The largest payload a write takes."""
        return self.size - _HEADER.size

    def write(self, payload: bytes) -> None:
        """Replace the payload: the sequence number is odd while the bytes change, even once they are whole."""
        if len(payload) > self.capacity:
            raise ValueError(f"a metrics payload of {len(payload)} bytes exceeds the slot's {self.capacity}")
        m = self._map
        self._seq += 1
        m[_SEQ_AT:_SEQ_AT + 8] = struct.pack("<Q", self._seq)
        m[_HEADER.size:_HEADER.size + len(payload)] = payload
        self._seq += 1
        m[:_HEADER.size] = _HEADER.pack(_MAGIC, self._seq, len(payload), zlib.crc32(payload))

    def close(self, unlink: bool = True) -> None:
        self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)


def read_slot(path: str | os.PathLike[str], tries: int = 50) -> dict[str, Any] | None:
    """A slot's payload as a dict; None where it holds none yet, is not a slot, or stays torn over ``tries`` reads
    (a writer that died mid-write)."""
    try:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):  # gone meanwhile, or empty
        return None
    with m:
        for _ in range(tries):
            if len(m) < _HEADER.size:
                return None
            magic, seq, length, crc = _HEADER.unpack(m[:_HEADER.size])
            if magic != _MAGIC:
                return None
            if seq == 0:
                return None
            payload = m[_HEADER.size:_HEADER.size + length]
            if seq % 2 == 0 and _HEADER.unpack(m[:_HEADER.size])[1] == seq and zlib.crc32(payload) == crc:
                return json.loads(payload)
            time.sleep(0.001)
    return None


def read_slots(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every readable slot's payload in ``directory`` (none where it does not exist), ordered by engine and rank."""
    try:
        names = sorted(p for p in os.listdir(directory) if p.endswith(_SUFFIX))
    except FileNotFoundError:
        return []
    found = [doc for doc in (read_slot(Path(directory) / name) for name in names) if doc is not None]
    return sorted(found, key=lambda d: label_order(d["labels"]))


def label_order(labels: dict[str, Any]) -> tuple[Any, ...]:
    """A sort key of a worker's labels: vLLM's ``engine`` then ``rank``, SGLang's ``dp_rank`` then ``tp_rank``,
    numbers as numbers (so rank 10 follows rank 9), then the rest by name."""
    first = ("engine", "dp_rank", "rank", "tp_rank", "pp_rank", "moe_ep_rank")
    keys = [k for k in first if k in labels] + sorted(k for k in labels if k not in first)

    def value(v: Any) -> tuple[int, Any]:
        text = str(v)
        return (0, int(text)) if text.isdigit() else (1, text)

    return tuple((k, value(labels[k])) for k in keys)


class MetricsPublisher:
    """A worker's side: ``snapshot()`` (its ``stats_file`` document) published to its slot every ``interval_s`` by
    a daemon thread, and once more at `close`. ``labels`` (the engine's labels of this worker: vLLM ``engine`` and
    ``rank``, SGLang ``engine_type``, ``tp_rank``, ...; names and values without path separators, they name the
    slot's file) and ``info`` travel with it."""

    def __init__(self, directory: str | os.PathLike[str], labels: dict[str, Any], info: dict[str, Any],
                 snapshot: Callable[[], dict[str, Any]], interval_s: float = 1.0, size: int = SLOT_BYTES,
                 tick: Callable[[], None] | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"metrics interval_s={interval_s!r}: a positive number of seconds")
        self.labels = {k: str(v) for k, v in labels.items()}
        bad = [f"{k}={v!r}" for k, v in self.labels.items() if not k.isidentifier() or any(c in v for c in "/\\\0")]
        if bad:
            raise ValueError(f"metrics labels {', '.join(bad)}: label names are identifiers, values have no path "
                             "separators (they name the slot's file)")
        self.info, self.snapshot, self.interval_s = info, snapshot, interval_s
        #: called on the thread at each tick, before the publish (the live trace's poll: `tbo.integrations.engine.
        #: live_trace.LiveTrace.poll`)
        self.tick = tick
        name = "-".join(f"{k}-{v}" for k, v in sorted(self.labels.items())) or "worker"
        self.slot = MetricsSlot(Path(directory) / f"{name}{_SUFFIX}", size)
        self.publishes, self.skipped = 0, 0  #: publishes done; ticks whose snapshot raced a step and was retried
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsPublisher:
        self.publish()
        self._thread = threading.Thread(target=self._run, name="tbo-metrics", daemon=True)
        self._thread.start()
        return self

    def publish(self) -> None:
        """Encode the snapshot and write it to the slot (a snapshot that raced a step's dict update is skipped: the
        next tick takes it)."""
        try:
            stats = self.snapshot()
        except RuntimeError:  # "dictionary changed size during iteration": a step added an op name meanwhile
            self.skipped += 1
            return
        doc = {"labels": self.labels, "info": self.info, "time": time.time(), "stats": stats}
        payload = json.dumps(doc, separators=(",", ":")).encode()
        if len(payload) > self.slot.capacity:
            doc["stats"] = {k: v for k, v in stats.items() if k != "adaptive"}
            doc["truncated"] = True
            payload = json.dumps(doc, separators=(",", ":")).encode()
        self.slot.write(payload)
        self.publishes += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.tick is not None:
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 - a diagnostic never stops the engine, nor the publishes
                    logger.exception("tbo: the metrics thread's tick (the live trace's poll) failed")
            try:
                self.publish()
            except Exception:  # noqa: BLE001 - a diagnostic never stops the engine; logged, tried again next tick
                logger.exception("tbo: publishing metrics to %s failed", self.slot.path)

    def close(self, unlink: bool = True) -> None:
        """Stop the thread, publish the final figures, and (``unlink``) remove the slot: a closed engine's figures
        leave ``/metrics`` with it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1)
        try:
            self.publish()
        except Exception:  # noqa: BLE001 - a diagnostic: the engine's shutdown goes on
            logger.exception("tbo: the last publish of metrics to %s failed", self.slot.path)
        finally:
            self.slot.close(unlink)
            if unlink:
                try:
                    self.slot.path.parent.rmdir()  # the last worker's close removes the folder
                except OSError:
                    pass


# ---- the metric families ---------------------------------------------------------------------------------------

#: StepStats' dict fields and the label their keys become
_LABELLED = {"steps_by_mode": "mode", "split_steps_by_mode": "mode", "split_steps_by_strategy": "strategy",
             "unsplit_steps_by_reason": "reason",
             "op_seconds": "op", "op_calls": "op"}
#: StepStats fields that describe the engine (gauges, not counters)
_GAUGES = ("ep_size", "op_compile_bound")
_DOC = {
    "steps": "forward steps run through tbo", "split_steps": "steps split into microbatches",
    "microbatches": "microbatches run over the split steps", "tokens": "tokens of the counted steps",
    "split_tokens": "tokens of the split steps", "cut_requests": "split steps whose cut fell inside a request",
    "steps_by_mode": "steps by kind", "split_steps_by_mode": "split steps by kind",
    "split_steps_by_strategy": "split steps by the strategy that ran them",
    "unsplit_steps_by_reason": "steps run unsplit, by why (below_threshold, no_cut, engine_veto, adaptive, ...)",
    "op_seconds": "op_times: wall seconds per op (a *_b op's: a wait the overlap left exposed)",
    "op_calls": "op_times: calls per op", "layers_seconds": "op_times: wall seconds of the layer stacks",
    "graph_eager_steps": "steps run eager because their split differed from their size's CUDA graph",
    "verify_steps": "speculative decoding: target steps that verified draft tokens",
    "split_verify_steps": "speculative decoding: verify steps split",
    "split_verify_steps_varying_k": "split verify steps whose requests brought different draft counts",
    "verified_draft_tokens": "draft tokens the verify steps verified",
    "draft_steps": "MTP: forwards of the drafter's model run through tbo",
    "split_draft_steps": "MTP: drafter forwards split", "afd_stages_sent": "AFD: stages sent to the FFN server",
    "local_ffn_calls": "FFN or MoE computations on this side", "tp_reductions": "TP all-reduces run as tbo transfers",
    "ep_size": "the expert-parallel group's size", "remote_rows": "token rows dispatched to other ranks",
    "count_exchanges": "dispatches that waited on a row-count exchange",
    "peer_strategy_steps": "DP: steps that ran the strategy a peer needed",
    "idle_skipped": "DP: idle steps every rank ran at once, their layers skipped",
    "vllm_dp_all_reduces": "DP: forwards whose vLLM batch coordination all-reduced beside tbo's agreement",
    "graph_captures": "CUDA graphs captured of split decode steps", "graph_replays": "split steps replayed from a graph",
    "op_compiles": "graphs traced of tbo's compiled op functions",
    "op_compile_bound": "the most graphs tbo's compiled ops can make",
    "compiled_op_calls": "op calls that ran compiled", "guarded_op_calls": "compiled calls through dynamo's guards",
}


def sample_name(field: str) -> str:
    """The Prometheus name of a `StepStats` field: ``tbo:<field>`` (counters are exposed with ``_total``)."""
    return f"tbo:{field}"


class SlotCollector:
    """A prometheus_client collector of the slots in ``directory``: ``collect`` reads them at each scrape (vLLM's
    stat logger registers one in the registry its ``/metrics`` serves; SGLang's plugin in the one its
    ``--enable-metrics`` route builds)."""

    def __init__(self, directory: str | os.PathLike[str], model_name: str) -> None:
        self.directory, self.model_name = directory, model_name

    def collect(self) -> Iterator[Any]:
        return families(read_slots(self.directory), self.model_name)

    def describe(self) -> list[Any]:
        return []  # unchecked at registration: the families depend on the engine's run


def families(docs: list[dict[str, Any]], model_name: str) -> Iterator[Any]:
    """The Prometheus metric families of the slots' documents (`read_slots`), each sample labelled like the engine's
    own: ``model_name``, then the worker's labels as it published them (vLLM: ``engine``, ``rank``; SGLang:
    ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank`` and, under DP, ``dp_rank``). A family's label names
    are those of the first worker; a worker whose labels differ (an engine's workers all label alike) is skipped,
    logged. Needs ``prometheus_client`` (an engine's)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    names = list(docs[0]["labels"]) if docs else []
    base = ["model_name", *(n for n in names if n != "model_name")]
    made: dict[str, Any] = {}

    def family(kind: Any, name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
        if name not in made:
            made[name] = kind(name, doc, labels=[*base, *extra])
        return made[name]

    for d in docs:
        if sorted(d["labels"]) != sorted(names):
            logger.warning("tbo: a metrics slot labelled %s beside workers labelled %s: skipped", d["labels"], names)
            continue
        ids = [model_name, *(str(d["labels"][n]) for n in base[1:])]
        stats, info = d["stats"], d.get("info", {})
        keys = sorted(info)
        family(GaugeMetricFamily, "tbo:info", "tbo's version, strategies and split policy (always 1)",
               tuple(keys)).add_metric([*ids, *(str(info[k]) for k in keys)], 1)
        for field, value in stats.items():
            if field in _LABELLED:
                kind = CounterMetricFamily
                f = family(kind, sample_name(field), _DOC.get(field, field), (_LABELLED[field],))
                for key, v in sorted(value.items()):
                    f.add_metric([*ids, key], v)
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # extra reports (adaptive, link) have their own families below
            elif field in _GAUGES:
                family(GaugeMetricFamily, sample_name(field), _DOC.get(field, field)).add_metric(ids, value)
            else:
                family(CounterMetricFamily, sample_name(field), _DOC.get(field, field)).add_metric(ids, value)
        _step_seconds(family, ids, stats, HistogramMetricFamily)
        steps, split = stats.get("steps", 0), stats.get("split_steps", 0)
        family(GaugeMetricFamily, "tbo:split_ratio", "split steps over steps, since the engine started").add_metric(
            ids, split / steps if steps else 0.0)
        family(GaugeMetricFamily, "tbo:microbatches_per_split_step", "microbatches over split steps").add_metric(
            ids, stats.get("microbatches", 0) / split if split else 0.0)
        family(CounterMetricFamily, "tbo:fallback_steps", "steps that fell back from tbo's plan, by reason",
               ("reason",)).add_metric([*ids, "graph_eager"], stats.get("graph_eager_steps", 0))
        exposed = sum(v for k, v in stats.get("op_seconds", {}).items() if k.endswith("_b"))
        family(CounterMetricFamily, "tbo:exposed_wait_seconds", "op_times: seconds in *_b ops (waits on transfers "
               "the overlap left exposed)").add_metric(ids, exposed)
        link = stats.get("link")
        if isinstance(link, dict):  # the emulated links' report (`link_report`): busy, hidden and exposed time
            busy, exposed_s = link.get("busy_s", 0.0), link.get("exposed_s", 0.0)
            for name, doc, value in (
                    ("tbo:link_transfers", "link: transfers booked on the emulated interconnect", link.get("transfers", 0)),
                    ("tbo:link_busy_seconds", "link: seconds the emulated interconnect was busy", busy),
                    ("tbo:link_exposed_seconds", "link: busy seconds the overlap left exposed (waited for in a *_b op)",
                     exposed_s),
                    ("tbo:link_hidden_seconds", "link: busy seconds the overlap hid (busy minus exposed)",
                     max(busy - exposed_s, 0.0))):
                family(CounterMetricFamily, name, doc).add_metric(ids, value)
        _adaptive(family, ids, stats.get("adaptive") or [], GaugeMetricFamily, CounterMetricFamily)
    yield from made.values()


def _step_seconds(family: Callable[..., Any], ids: list[str], stats: dict[str, Any], histogram: Any) -> None:
    """``tbo:step_seconds``: the timed steps' wall time (`tbo.integrations.engine.stats.StepClock`) as a Prometheus
    histogram per step kind and split (labels ``mode``, ``split``: "split" or "unsplit"), buckets
    `STEP_SECONDS_BUCKETS`."""
    counts, sums, cumulative = (stats.get(f"step_seconds_{k}") or {} for k in ("count", "sum", "bucket"))
    for key in sorted(counts):
        mode, split = key.split("|")
        buckets = [(repr(le), cumulative.get(f"{key}|{le:g}", 0)) for le in STEP_SECONDS_BUCKETS]
        family(histogram, "tbo:step_seconds", "seconds a step took, from its layers' start to its results on the "
               "host, by kind and split", ("mode", "split")).add_metric(
            [*ids, mode, split], buckets=[*buckets, ("+Inf", counts[key])], sum_value=sums.get(key, 0.0))


def _adaptive(family: Callable[..., Any], ids: list[str], reports: list[dict[str, Any]], gauge: Any,
              counter: Any) -> None:
    """``split: "adaptive"``: per bucket, its current choice (a gauge of 1), the estimated gain of that choice over
    unsplit (unsplit's estimated seconds per token over the choice's; 1 where unsplit is the choice or either is
    unmeasured), its steps and those explored."""
    bucket = ("kind", "tokens")
    for report in reports:
        for row in report.get("buckets", []):
            where = [*ids, row["kind"], row["tokens"]]
            family(gauge, "tbo:adaptive_choice", "the adaptive split's current choice per bucket (always 1)",
                   (*bucket, "choice")).add_metric([*where, row["choice"]], 1)
            est = row.get("estimates", {})
            base, mine = est.get("unsplit"), est.get(row["choice"])
            gain = base / mine if base and mine and row["choice"] != "unsplit" else 1.0
            family(gauge, "tbo:adaptive_estimated_gain", "unsplit's estimated seconds per token over the choice's",
                   bucket).add_metric(where, gain)
            family(counter, "tbo:adaptive_steps", "steps per adaptive bucket", bucket).add_metric(where, row["steps"])
            family(counter, "tbo:adaptive_explored", "steps per adaptive bucket run to explore a choice",
                   bucket).add_metric(where, row["explored"])
