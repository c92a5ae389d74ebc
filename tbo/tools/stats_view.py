"""``tbo stats``: what tbo did in an engine, as a table, from a worker's ``stats_file`` or a served engine's
``/metrics`` (the ``tbo:*`` families of `tbo.integrations.engine.metrics`); ``--watch`` refreshes it.

Why a command: an engineer who turned tbo on asks first "does it split, and does it pay?"; the JSON file and the
Prometheus text answer that only to someone who already knows their fields. Both sources become the same documents
(a worker's labels and its ``stats_file`` fields), so one table shows either. The exposition text is parsed here (its
line format is small) so that the command needs no ``prometheus_client``.
"""

from __future__ import annotations

import glob
import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["docs_from_files", "docs_from_metrics", "load", "parse_exposition", "render"]

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?\s*')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_LABELLED = {"mode": ("steps_by_mode", "split_steps_by_mode"), "strategy": ("split_steps_by_strategy",),
             "reason": ("unsplit_steps_by_reason",),
             "op": ("op_seconds", "op_calls")}
_HISTOGRAM = ("step_seconds_count", "step_seconds_sum", "step_seconds_bucket")
_DERIVED = ("split_ratio", "microbatches_per_split_step", "exposed_wait_seconds", "fallback_steps")
MODES = ("decode", "prefill", "mixed", "idle")


def parse_exposition(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition: (name, labels, value); comments and blank lines skipped."""
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"line {n} of the metrics text is not a sample: {line[:120]!r}")
        labels = {k: re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], v)
                  for k, v in _LABEL.findall(m.group(2) or "")}
        out.append((m.group(1), labels, float(m.group(3))))
    return out


#: the labels that say which worker a sample is from (vLLM's, SGLang's), not what tbo runs
_WORKER_LABELS = ("model_name", "engine", "rank", "engine_type", "dp_rank", "tp_rank", "pp_rank", "moe_ep_rank")


def docs_from_metrics(samples: list[tuple[str, dict[str, str], float]]) -> list[dict[str, Any]]:
    """One document per worker (vLLM's ``engine`` and ``rank``; SGLang's ``dp_rank`` and ``tp_rank`` in their place)
    from the ``tbo:*`` samples: its ``stats_file`` fields back from their families (a counter's ``_total`` dropped),
    ``info`` from ``tbo:info``."""
    docs: dict[tuple[str, str], dict[str, Any]] = {}
    for name, labels, value in samples:
        if not name.startswith("tbo:") or name.endswith("_created"):
            continue
        key = (labels.get("engine", labels.get("dp_rank", "0")), labels.get("rank", labels.get("tp_rank", "0")))
        doc = docs.setdefault(key, {"labels": {"engine": key[0], "rank": key[1]}, "info": {}, "stats": {}})
        field = name[4:].removesuffix("_total")
        stats = doc["stats"]
        if field == "info":
            doc["info"] = {k: v for k, v in labels.items() if k not in _WORKER_LABELS}
        elif field.startswith("step_seconds_"):  # the histogram: _count, _sum, _bucket per mode and split
            part, key = field[13:], f"{labels['mode']}|{labels['split']}"
            if part == "bucket" and labels["le"] != "+Inf" and value:  # the stats_file keeps no empty bucket
                stats.setdefault("step_seconds_bucket", {})[f"{key}|{float(labels['le']):g}"] = _number(value)
            elif part in ("count", "sum"):
                stats.setdefault(f"step_seconds_{part}", {})[key] = value if part == "sum" else _number(value)
        elif field.startswith("adaptive_"):
            row = stats.setdefault("buckets", {}).setdefault((labels["kind"], labels["tokens"]), {})
            row["choice" if field == "adaptive_choice" else field[9:]] = labels.get("choice", value)
        elif any(field in fields for fields in _LABELLED.values()):
            label = next(lab for lab, fields in _LABELLED.items() if field in fields)
            stats.setdefault(field, {})[labels[label]] = _number(value)
        elif field not in _DERIVED:
            stats[field] = _number(value)
    for doc in docs.values():
        if doc["stats"]:  # a labelled family with no sample is an empty mapping in the stats_file (none split yet)
            for field in (*(f for fields in _LABELLED.values() for f in fields), *_HISTOGRAM):
                doc["stats"].setdefault(field, {})
        buckets = doc["stats"].pop("buckets", None)
        if buckets:
            doc["stats"]["adaptive"] = [{"buckets": [{"kind": k, "tokens": t, **row}
                                                     for (k, t), row in buckets.items()]}]
    return sorted(docs.values(), key=lambda d: (_int(d["labels"]["engine"]), _int(d["labels"]["rank"])))


def docs_from_files(patterns: list[str]) -> list[dict[str, Any]]:
    """One document per ``stats_file`` (``{rank}`` in a path stands for every rank's file)."""
    docs = []
    for pattern in patterns:
        paths = sorted(glob.glob(pattern.replace("{rank}", "*"))) if "{rank}" in pattern else [pattern]
        if not paths:
            raise FileNotFoundError(f"no stats file matches {pattern!r}")
        for path in paths:
            try:
                stats = json.loads(Path(path).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"stats file {path!r}: {e}") from None
            if not isinstance(stats, dict) or "steps" not in stats:
                raise ValueError(f"stats file {path!r} holds no tbo stats (no 'steps' key)")
            rank = re.findall(r"\d+", Path(path).stem)
            docs.append({"labels": {"engine": "-", "rank": rank[-1] if rank else "-", "file": path}, "info": {},
                         "stats": stats})
    return docs


def load(sources: list[str], timeout_s: float = 10) -> list[dict[str, Any]]:
    """The documents of ``sources``: ``http(s)://`` URLs are scraped (``/metrics`` appended to a bare host), the
    rest are ``stats_file`` paths."""
    urls = [s for s in sources if s.startswith(("http://", "https://"))]
    docs = docs_from_files([s for s in sources if s not in urls]) if len(urls) < len(sources) else []
    for url in urls:
        if not urllib.request.urlparse(url).path.strip("/"):
            url = url.rstrip("/") + "/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, OSError) as e:
            raise ConnectionError(f"cannot scrape {url}: {getattr(e, 'reason', e)}") from None
        found = docs_from_metrics(parse_exposition(text))
        if not found:
            raise ValueError(f"{url} shows no tbo:* metrics (is tbo on, and its stat logger installed? "
                             "docs/metrics.md)")
        docs.extend(found)
    return docs


def render(docs: list[dict[str, Any]]) -> str:
    """The table: one row per worker, then its op times and its adaptive buckets where it has them."""
    head = ("engine", "rank", "steps", "split", "ratio", "mb/split", "tokens", "split tok",
            *(f"{m} s/n" for m in MODES[:3]), "exposed s")
    rows = [head]
    for d in docs:
        s = d["stats"]
        steps, split = s.get("steps", 0), s.get("split_steps", 0)
        by, split_by = s.get("steps_by_mode", {}), s.get("split_steps_by_mode", {})
        exposed = sum(v for k, v in s.get("op_seconds", {}).items() if k.endswith("_b"))
        rows.append((d["labels"]["engine"], d["labels"]["rank"], _fmt(steps), _fmt(split),
                     f"{split / steps:.1%}" if steps else "-", f"{s.get('microbatches', 0) / split:.2f}" if split
                     else "-", _fmt(s.get("tokens", 0)), _fmt(s.get("split_tokens", 0)),
                     *(f"{_fmt(split_by.get(m, 0))}/{_fmt(by.get(m, 0))}" for m in MODES[:3]),
                     f"{exposed:.4f}" if s.get("op_seconds") else "-"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in rows]
    for d in docs:
        lines.extend(_details(d))
    return "\n".join(lines)


def _details(d: dict[str, Any]) -> list[str]:
    s, who = d["stats"], f"engine {d['labels']['engine']} rank {d['labels']['rank']}"
    out = []
    if d.get("info"):
        out.append(f"\n{who}: " + ", ".join(f"{k} {v}" for k, v in sorted(d["info"].items())))
    ops = s.get("op_seconds", {})
    if ops:
        out.append(f"\n{who}, op times (layers {s.get('layers_seconds', 0):.4f} s):")
        for op, secs in sorted(ops.items(), key=lambda kv: -kv[1]):
            out.append(f"  {op:<24} {secs:10.4f} s  {_fmt(s.get('op_calls', {}).get(op, 0)):>8} calls")
    counts, sums = s.get("step_seconds_count") or {}, s.get("step_seconds_sum") or {}
    if counts:
        out.append(f"\n{who}, mean step time (split against unsplit: did splitting pay?):")
        for mode in sorted({key.split("|")[0] for key in counts}):
            mean = {sp: sums.get(f"{mode}|{sp}", 0.0) / counts[f"{mode}|{sp}"] * 1e3
                    for sp in ("split", "unsplit") if counts.get(f"{mode}|{sp}")}
            out.append(f"  {mode:<8} " + ", ".join(f"{sp} {ms:.2f} ms ({_fmt(counts[f'{mode}|{sp}'])} steps)"
                                                  for sp, ms in mean.items()))
    for report in s.get("adaptive") or []:
        out.append(f"\n{who}, adaptive buckets:")
        for row in report.get("buckets", []):
            gain = row.get("estimated_gain")
            if gain is None:
                est = row.get("estimates", {})
                base, mine = est.get("unsplit"), est.get(row["choice"])
                gain = base / mine if base and mine and row["choice"] != "unsplit" else 1.0
            out.append(f"  {row['kind']} {row['tokens']}: {row['choice']} ({gain:.2f}x est.; "
                       f"{_fmt(row.get('explored', 0))} of {_fmt(row.get('steps', 0))} steps explored)")
    return out


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def _int(text: str) -> int:
    return int(text) if text.isdigit() else -1


def _fmt(value: Any) -> str:
    return str(_number(value)) if isinstance(value, (int, float)) else str(value)
