"""Render the Grafana dashboard's panels (docs/grafana/tbo-dashboard.json) from recorded scrapes of a served engine,
without Grafana: what docs/metrics.md shows as the dashboard over a real run.

The recording is what ``tests/vllm/test_metrics.py`` scrapes while its clients run (it writes it where
``TBO_METRICS_RECORD`` names, when set): a JSON list of ``[unix time, {family: [[sample, labels, value], ...]}]``.
Each panel computes its dashboard query's meaning in Python, as ``rate()`` over a sliding window of scrapes:

    python scripts/render_metrics_panels.py scrapes.json docs/images/metrics-dashboard.png
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def _total(frame: dict, family: str, **labels: str) -> float:
    return sum(v for _, got, v in frame.get(family, []) if labels.items() <= got.items())


def _sample(frame: dict, family: str, sample: str, **labels: str) -> float:
    """A histogram's ``sample`` (``..._sum``, ``..._count``) of ``family``, over the samples whose labels match."""
    return sum(v for name, got, v in frame.get(family, []) if name == sample and labels.items() <= got.items())


def _keys(frames: list, family: str, label: str) -> list[str]:
    return sorted({got[label] for _, f in frames for _, got, _ in f.get(family, []) if label in got})


def _rates(frames: list, window_s: float, num: Any, den: Any = None) -> tuple[list[float], list[float]]:
    """(times, Δnum / Δden) over ``window_s`` windows, or Δnum per second without ``den``; gaps where Δden is 0."""
    xs, ys, t0 = [], [], frames[0][0]
    j = 0
    for i, (t, frame) in enumerate(frames):
        while frames[j + 1][0] <= t - window_s:
            j += 1
        if t - frames[j][0] < window_s * 0.5:
            continue
        d_num = num(frame) - num(frames[j][1])
        d_den = (den(frame) - den(frames[j][1])) if den is not None else t - frames[j][0]
        xs.append(t - t0)
        ys.append(d_num / d_den if d_den else float("nan"))
    return xs, ys


def render(frames: list, out: str, window_s: float = 1.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(20, 7.5))
    kinds = sorted({(got["mode"], got["split"]) for _, f in frames for name, got, _ in f.get("tbo:step_seconds", [])
                    if name == "tbo:step_seconds_count"})
    panels = [
        ("Split ratio (split steps / steps)", [("split ratio", lambda f: _total(f, "tbo:split_steps"),
                                                lambda f: _total(f, "tbo:steps"))]),
        ("Steps and split steps by kind (per s)",
         [(f"{m} {what}", (lambda m, fam: lambda f: _total(f, fam, mode=m))(m, fam), None)
          for m in _keys(frames, "tbo:steps_by_mode", "mode") if m != "idle"
          for what, fam in (("steps", "tbo:steps_by_mode"), ("split", "tbo:split_steps_by_mode"))]),
        ("Exposed wait vs layer stack, s per step",
         [("exposed wait", lambda f: _total(f, "tbo:exposed_wait_seconds"), lambda f: _total(f, "tbo:steps")),
          ("layer stack", lambda f: _total(f, "tbo:layers_seconds"), lambda f: _total(f, "tbo:steps"))]),
        ("Op seconds per s, by op (top 6)",
         [(op, (lambda op: lambda f: _total(f, "tbo:op_seconds", op=op))(op), None)
          for op in sorted(_keys(frames, "tbo:op_seconds", "op"),
                           key=lambda op: -_total(frames[-1][1], "tbo:op_seconds", op=op))[:6]]),
        ("Microbatches per split step", [("microbatches / split step", lambda f: _total(f, "tbo:microbatches"),
                                          lambda f: _total(f, "tbo:split_steps"))]),
        ("Tokens per s", [("all", lambda f: _total(f, "tbo:tokens"), None),
                          ("split", lambda f: _total(f, "tbo:split_tokens"), None)]),
        ("Step time by kind, split vs unsplit (mean s)",
         [(f"{m} {sp}", (lambda m, sp: lambda f: _sample(f, "tbo:step_seconds", "tbo:step_seconds_sum", mode=m,
                                                          split=sp))(m, sp),
           (lambda m, sp: lambda f: _sample(f, "tbo:step_seconds", "tbo:step_seconds_count", mode=m,
                                            split=sp))(m, sp)) for m, sp in kinds]),
    ]
    for ax, (title, series) in zip(axes.flat, panels):
        for label, num, den in series:
            xs, ys = _rates(frames, window_s, num, den)
            ax.plot(xs, ys, label=label, marker=".")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("s into the run")
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=7)
        else:  # a recording without the family (taken before it existed): say so rather than draw an empty legend
            ax.text(0.5, 0.5, "not in this recording", ha="center", va="center", transform=ax.transAxes)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    info = frames[-1][1].get("tbo:info", [[None, {}, 1]])[0][1]
    fig.suptitle(f"tbo's panels over a served vLLM run ({len(frames)} scrapes of /metrics, {window_s:g} s windows); "
                 f"{info.get('decode_strategy', '?')} / {info.get('prefill_strategy', '?')}, split "
                 f"{info.get('split', '?')}, tbo {info.get('version', '?')}", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scrapes", help="the recording (JSON)")
    parser.add_argument("out", help="the PNG to write")
    parser.add_argument("--window", type=float, default=1.0, help="seconds per rate window (default 1)")
    args = parser.parse_args()
    with open(args.scrapes) as f:
        frames = json.load(f)
    if len(frames) < 3:
        raise SystemExit(f"{args.scrapes}: {len(frames)} scrapes; the panels need at least 3")
    render(frames, args.out, args.window)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
