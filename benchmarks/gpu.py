"""TBO on one GPU: single batch vs TBO, eager vs CUDA graph, decode and prefill, and what the simulator predicts.

A DeepSeek-shaped reference model (hidden 4096, 8 layers, KV context 2048; see `tbo.harness.gpu.GpuShape`) with its
experts behind a `CopyEngineLink` carrying FP8-dispatch / BF16-combine bytes of top-8 at hidden 7168. Per row:

* milliseconds per step (CUDA events, median) of eager single, eager TBO, graph single, graph TBO, and the speedups;
* the exposed communication share of a TBO step (time the compute stream stalled in ``_b`` / step time, from a
  ``Tracer(cuda=True)`` trace): eager, and front-loaded (the GPU's own timeline, what a graph replays);
* the simulator's prediction of TBO/single: `fit_costs` on this benchmark's CUDA-event traces (eager traces for the
  eager columns, front-loaded ones for the graph columns; decode and prefill fitted apart), `simulate` with each
  row's split plan, against the measured ratio.

Targets, reported and not asserted: graph TBO >= 1.15x single at 512 decode tokens; eager TBO no slower than eager
single at 512; every predicted TBO/single within 10% of the measured one. Then the GPU's name and torch's version.

On a machine without CUDA it says so and exits 0. ``--quick`` (scripts/gpu_check.sh) measures fewer sizes and
repeats; ``--smoke`` runs the whole pipeline on the CPU with a tiny model (graphs re-run by `EagerCapturer`), to
check the script itself, not to measure anything.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from tbo.harness.gpu import GpuShape, GpuWorkload
from tbo.tools.simulate import fit_costs, simulate
from tbo.tools.trace import summary

DECODE = [64, 128, 256, 512, 1024]
PREFILL = [(4, 512), (4, 2048)]  #: (sequences, prompt length)
QUICK_DECODE, QUICK_PREFILL = [64, 256, 512], [(2, 512), (4, 512)]


def exposed_share(trace: Any) -> float:
    s = summary(trace)
    return s.exposed_s / s.step_s if s.step_s > 0 else 0.0


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    smoke = args.smoke
    shape = GpuShape.tiny() if smoke else GpuShape()
    decode = [8, 16] if smoke else (QUICK_DECODE if args.quick else DECODE)
    prefill = [(2, 16), (4, 16)] if smoke else (QUICK_PREFILL if args.quick else PREFILL)
    repeats = 2 if smoke else (5 if args.quick else args.repeats)
    device = "cpu" if smoke else "cuda"
    t0 = time.perf_counter()
    work = GpuWorkload(shape, device, decode, prefill)
    print(shape.describe())
    print(f"built in {time.perf_counter() - t0:.0f} s; decode sizes {decode}, prefill shapes {prefill}, "
          f"{repeats} repeats per mode", flush=True)
    rows = []
    cases = [("decode", n, 1) for n in decode] + [("prefill", s, n) for s, n in prefill]
    for mode, n, length in cases:
        fns = {f"{how}_{kind}": work.step(mode, n, kind == "tbo", how == "graph", length)
               for how in ("eager", "graph") for kind in ("single", "tbo")}
        timings = work.time(fns, repeats)
        ref = fns["eager_single"]()
        diff = max(float((fns[k]() - ref).abs().max()) for k in fns if k != "eager_single")
        row = {"mode": mode, "n": n, "length": length, "tokens": n * length, "max_diff": diff,
               **{k: t.median for k, t in timings.items()}}
        row["traces"] = {(front, tbo): work.trace(mode, n, tbo, length, front_load=front and not smoke)
                         for front in (False, True) for tbo in (False, True)}
        plan = work.plan(mode, n, length)
        row["mb_tokens"] = [mb.tokens_len for mb in plan.microbatches] if plan else [n * length]
        half = max(1, n // 2)  # single-batch traces at the microbatch size: what the fit interpolates between
        row["half_traces"] = {front: work.trace(mode, half, False, length, front_load=front and not smoke)
                              for front in (False, True)}
        rows.append(row)
        print(f"  {mode} {n * length} tokens: eager {row['eager_single']:.2f}/{row['eager_tbo']:.2f} ms, graph "
              f"{row['graph_single']:.2f}/{row['graph_tbo']:.2f} ms (single/TBO), max diff {diff:.3g}", flush=True)
    predict(work, rows)
    return rows


def predict(work: GpuWorkload, rows: list[dict[str, Any]]) -> None:
    """Fit per-op costs from the traces (per mode; eager and front-loaded apart) and predict each row's ratio."""
    for mode in ("decode", "prefill"):
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        bound = work.model.bind(work.strategy[mode])
        for front, how in ((False, "eager"), (True, "graph")):
            traces = [t for r in mine for (f, _), t in r["traces"].items() if f == front]
            traces += [r["half_traces"][front] for r in mine]
            costs = fit_costs(traces, kind="table")
            for r in mine:
                single = simulate(bound, costs, [r["tokens"]], 0).step_s
                tbo = simulate(bound, costs, r["mb_tokens"]).step_s
                r[f"pred_{how}"] = tbo / single if single > 0 else float("nan")
                r[f"exposed_{how}"] = exposed_share(r["traces"][(front, True)])


def report(rows: list[dict[str, Any]], smoke: bool) -> None:
    print("\n| step | tokens | eager single ms | eager TBO ms | eager speedup | graph single ms | graph TBO ms | "
          "graph speedup | exposed comm (eager / GPU) | TBO/single eager: pred / meas | "
          "TBO/single graph: pred / meas | max diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for r in rows:
        label = "decode" if r["mode"] == "decode" else f"prefill {r['n']}x{r['length']}"
        cells = [label, str(r["tokens"])]
        for how in ("eager", "graph"):
            single, tbo = r[f"{how}_single"], r[f"{how}_tbo"]
            cells += [f"{single:.2f}", f"{tbo:.2f}", f"{single / tbo:.2f}x"]
        cells.append(f"{r['exposed_eager']:.0%} / {r['exposed_graph']:.0%}")
        for how in ("eager", "graph"):
            meas = r[f"{how}_tbo"] / r[f"{how}_single"]
            pred = r[f"pred_{how}"]
            worst = max(worst, abs(pred / meas - 1))
            cells.append(f"{pred:.2f} / {meas:.2f}")
        cells.append(f"{r['max_diff']:.3g}")
        print("| " + " | ".join(cells) + " |")
    if smoke:
        print("\nsmoke run on the CPU: the figures check the pipeline and measure nothing; no targets apply")
        print(f"torch {torch.__version__}")
        return
    at = {r["n"]: r for r in rows if r["mode"] == "decode"}
    if 512 in at:
        r = at[512]
        graph, eager = r["graph_single"] / r["graph_tbo"], r["eager_single"] / r["eager_tbo"]
        print(f"\ntarget: graph TBO >= 1.15x single at 512 decode tokens: {graph:.2f}x "
              f"({'met' if graph >= 1.15 else 'NOT met'})")
        print(f"target: eager TBO no slower than eager single at 512: {eager:.2f}x "
              f"({'met' if eager >= 1.0 else 'NOT met'})")
    print(f"target: simulator TBO/single within 10% on every row: worst {worst:.1%} "
          f"({'met' if worst <= 0.10 else 'NOT met'})")
    print(f"\nGPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, CUDA {torch.version.cuda}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats (scripts/gpu_check.sh)")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per mode and row")
    parser.add_argument("--smoke", action="store_true", help="run the pipeline on the CPU with a tiny model")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(f"benchmarks/gpu.py needs a CUDA GPU, and torch {torch.__version__} sees none: nothing to measure. "
              "(--smoke runs the pipeline on the CPU with a tiny model.)")
        return 0
    rows = run(args)
    report(rows, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
