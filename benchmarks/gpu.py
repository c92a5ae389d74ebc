"""TBO on one GPU: single batch vs TBO, eager vs CUDA graph, decode and prefill, and what the simulator predicts.

A DeepSeek-shaped reference model (hidden 4096, 8 layers, KV context 2048; see `tbo.harness.gpu.GpuShape`) with its
experts behind a `CopyEngineLink` carrying FP8-dispatch / BF16-combine bytes of top-8 at hidden 7168. Per row:

* milliseconds per step (CUDA events, median) of eager single, eager TBO, graph single, graph TBO, and the speedups;
* the exposed communication share of a TBO step (time the compute stream stalled in ``_b`` / step time, from a
  ``Tracer(cuda=True)`` trace): eager, and front-loaded (the GPU's own timeline, what a graph replays);
* the simulator's prediction of TBO/single: `fit_costs` on this benchmark's CUDA-event traces (eager traces for the
  eager columns, front-loaded ones for the graph columns; decode and prefill fitted apart), `simulate` with each
  row's split plan, against the measured ratio.

Correctness is checked: every mode's logits (eager TBO, graph single, graph TBO) against eager single, within the
stated tolerance (`tbo.harness.gpu.tolerance`: 2% of the largest logit in bf16, 1e-4 in fp32), all finite. A row
that fails makes the script exit 1, after the table. Each front-loaded trace is checked too (`FrontLoad`): a row
whose "GPU" traces were CPU-paced after all is flagged (``*``), as are the graph-column predictions fitted on them.

Targets, reported (exit 0 when missed, unless ``--require-targets``: then exit 2): graph TBO >= 1.15x single at
512 decode tokens; eager TBO no slower than eager single at 512; every predicted TBO/single within 10% of the
measured one. Then the GPU's name and torch's version.

On a machine without CUDA it says so and exits 0. ``--quick`` (scripts/gpu_check.sh) measures fewer sizes and
repeats; ``--smoke`` runs the whole pipeline on the CPU with a tiny model (graphs re-run by `EagerCapturer`), to
check the script itself, not to measure anything: there are no timings to trust and no GPU to front-load, but the
correctness check applies.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from tbo.experts import masked_path
from tbo.harness.gpu import FrontLoad, GpuShape, GpuWorkload, max_diff, tolerance
from tbo.tools.simulate import fit_costs, simulate
from tbo.tools.trace import summary

DECODE = [64, 128, 256, 512, 1024]
PREFILL = [(4, 512), (4, 2048)]  #: (sequences, prompt length)
QUICK_DECODE, QUICK_PREFILL = [64, 256, 512], [(2, 512), (4, 512)]
SMOKE_DECODE, SMOKE_PREFILL = [8, 16], [(2, 16), (4, 16)]


def exposed_share(trace: Any) -> float:
    s = summary(trace)
    return s.exposed_s / s.step_s if s.step_s > 0 else 0.0


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    smoke = args.smoke
    shape = GpuShape.tiny() if smoke else GpuShape()
    decode = SMOKE_DECODE if smoke else (QUICK_DECODE if args.quick else DECODE)
    prefill = SMOKE_PREFILL if smoke else (QUICK_PREFILL if args.quick else PREFILL)
    repeats = 2 if smoke else (5 if args.quick else args.repeats)
    device = "cpu" if smoke else "cuda"
    t0 = time.perf_counter()
    work = GpuWorkload(shape, device, decode, prefill)
    print(shape.describe())
    print(f"experts: {expert_path(work)}")
    print(f"built in {time.perf_counter() - t0:.0f} s; decode sizes {decode}, prefill shapes {prefill}, "
          f"{repeats} repeats per mode", flush=True)
    rows = []
    cases = [("decode", n, 1) for n in decode] + [("prefill", s, n) for s, n in prefill]
    for mode, n, length in cases:
        fns = {f"{how}_{kind}": work.step(mode, n, kind == "tbo", how == "graph", length)
               for how in ("eager", "graph") for kind in ("single", "tbo")}
        timings = work.time(fns, repeats)
        row = {"mode": mode, "n": n, "length": length, "tokens": n * length,
               **{k: t.median for k, t in timings.items()}, **check(fns, shape.dtype)}
        row["traces"] = {(front, tbo): work.trace(mode, n, tbo, length, front_load=front)
                         for front in (False, True) for tbo in (False, True)}
        plan = work.plan(mode, n, length)
        row["mb_tokens"] = [mb.tokens_len for mb in plan.microbatches] if plan else [n * length]
        half = max(1, n // 2)  # single-batch traces at the microbatch size: what the fit interpolates between
        row["half_traces"] = {front: work.trace(mode, half, False, length, front_load=front)
                              for front in (False, True)}
        front = [FrontLoad.of(t) for (f, _), t in row["traces"].items() if f] + [FrontLoad.of(row["half_traces"][True])]
        row["front_loaded"] = all(v is not None and v.ok for v in front)
        row["front_load"] = "; ".join(sorted({str(v) if v else "NOT front-loaded: no GPU to park" for v in front
                                              if v is None or not v.ok}))
        rows.append(row)
        print(f"  {mode} {n * length} tokens: eager {row['eager_single']:.2f}/{row['eager_tbo']:.2f} ms, graph "
              f"{row['graph_single']:.2f}/{row['graph_tbo']:.2f} ms (single/TBO), max diff {row['max_diff']:.3g}"
              f"{'' if row['ok'] else '  FAILED: ' + row['failure']}", flush=True)
    predict(work, rows)
    return rows


def expert_path(work: GpuWorkload) -> str:
    """How the MASKED experts run here (`tbo.experts.masked_path`), and what that costs."""
    layer = next(layer for layer in work.model.layers if layer.kind == "moe")
    c = work.model.config
    probe = torch.empty(c.num_experts, 8, c.hidden_size, dtype=c.torch_dtype, device=work.device)
    path = masked_path(probe, layer.stacked_experts)
    return {"grouped": "one grouped GEMM per projection over the routed rows only",
            "batched": f"one GEMM chain over every slab row: {c.num_experts / c.top_k:.1f}x the routed rows",
            "per-expert": f"one GEMM chain per expert over its whole slab: {c.num_experts / c.top_k:.1f}x the routed "
                          "rows",
            "counted": "each expert on exactly its rows (counts read on the host: the CPU)"}[path] + f" ({path})"


def check(fns: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Each mode's logits against eager single's, within the stated tolerance; all finite."""
    ref = fns["eager_single"]()
    tol = tolerance(dtype)
    worst, failures = 0.0, []
    for name, fn in fns.items():
        if name == "eager_single":
            continue
        diff, scale = max_diff(fn(), ref)
        if diff != diff:  # NaN: something was not finite
            failures.append(f"{name} or eager_single is not finite")
            worst = float("nan")
            continue
        worst = max(worst, diff)
        if diff > tol * max(scale, 1e-6):
            failures.append(f"{name} differs from eager_single by {diff:.3g} > {tol:g} x {scale:.3g}")
    return {"max_diff": worst, "ok": not failures, "failure": "; ".join(failures), "tolerance": tol}


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


def report(rows: list[dict[str, Any]], smoke: bool) -> bool:
    """Print the table, the checks and the targets; return whether every target was met (True on a smoke run)."""
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
        star = "" if r["front_loaded"] else "*"
        cells.append(f"{r['exposed_eager']:.0%} / {r['exposed_graph']:.0%}{star}")
        for how in ("eager", "graph"):
            meas = r[f"{how}_tbo"] / r[f"{how}_single"]
            pred = r[f"pred_{how}"]
            worst = max(worst, abs(pred / meas - 1))
            cells.append(f"{pred:.2f} / {meas:.2f}{star if how == 'graph' else ''}")
        cells.append(f"{r['max_diff']:.3g}{'' if r['ok'] else ' FAILED'}")
        print("| " + " | ".join(cells) + " |")
    flagged = [r for r in rows if not r["front_loaded"]]
    if flagged:
        print("\n* front-loading did not hold, so these GPU-timeline figures are CPU-paced:")
        for r in flagged:
            print(f"  {r['mode']} {r['tokens']} tokens: {r['front_load']}")
    failed = [r for r in rows if not r["ok"]]
    print(f"\ncorrectness: {len(rows) - len(failed)} of {len(rows)} rows within tolerance "
          f"({rows[0]['tolerance']:g} of the largest logit, all finite)" if rows else "\ncorrectness: no rows")
    for r in failed:
        print(f"  FAILED {r['mode']} {r['tokens']} tokens: {r['failure']}")
    if smoke:
        print("\nsmoke run on the CPU: the figures check the pipeline and measure nothing; no targets apply")
        print(f"torch {torch.__version__}")
        return True
    met = [worst <= 0.10]
    at = {r["n"]: r for r in rows if r["mode"] == "decode"}
    if 512 in at:
        r = at[512]
        graph, eager = r["graph_single"] / r["graph_tbo"], r["eager_single"] / r["eager_tbo"]
        met += [graph >= 1.15, eager >= 1.0]
        print(f"\ntarget: graph TBO >= 1.15x single at 512 decode tokens: {graph:.2f}x "
              f"({'met' if graph >= 1.15 else 'NOT met'})")
        print(f"target: eager TBO no slower than eager single at 512: {eager:.2f}x "
              f"({'met' if eager >= 1.0 else 'NOT met'})")
    print(f"target: simulator TBO/single within 10% on every row: worst {worst:.1%} "
          f"({'met' if worst <= 0.10 else 'NOT met'})")
    print(f"\nGPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, CUDA {torch.version.cuda}")
    return all(met)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats (scripts/gpu_check.sh)")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per mode and row")
    parser.add_argument("--smoke", action="store_true", help="run the pipeline on the CPU with a tiny model")
    parser.add_argument("--require-targets", action="store_true", help="exit 2 when a target is missed")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(f"benchmarks/gpu.py needs a CUDA GPU, and torch {torch.__version__} sees none: nothing to measure. "
              "(--smoke runs the pipeline on the CPU with a tiny model.)")
        return 0
    rows = run(args)
    targets_met = report(rows, args.smoke)
    if not all(r["ok"] for r in rows):
        print("benchmarks/gpu.py: FAILED: a result exceeds the stated tolerance (see above)")
        return 1
    if args.require_targets and not targets_met:
        print("benchmarks/gpu.py: a target was missed (--require-targets)")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
