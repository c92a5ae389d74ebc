"""`make demo`: DeepSeek decode and prefill on the reference model, 2 gloo ranks, emulated link; TBO vs single batch.

Each rank holds its own batch (data-parallel attention) and half the experts; dispatch and combine cross ranks over
gloo, each transfer taking the emulated link's latency + bytes / bandwidth. The table shows, per strategy: tokens
over both ranks, the largest |TBO - forward()| on any rank (0: bit-exact), and median step times.
"""

from __future__ import annotations

import time

from tbo import strategies
from tbo.harness.launch import launch
from tbo.harness.workload import Case, render_schedule, run_case, summarize

CASES = [
    Case(model="deepseek", mode="decode", num_seqs=32, prompt_len=512, link="50,0.002", repeats=3),
    Case(model="deepseek", mode="prefill", num_seqs=6, prompt_len=16, link="50,0.005", repeats=3),
]


def main() -> None:
    t0 = time.perf_counter()
    print(render_schedule(strategies.get("deepseek_decode")), end="\n\n")
    rows = []
    for case in CASES:
        row = summarize(launch(run_case, 2, case, timeout_s=300))
        rows.append((case.strategy_name, row))
    print("| strategy | tokens | max diff | single ms | TBO ms | speedup |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['tokens']} | {r['max_diff']:.3g} | {r['single_ms']:.1f} | {r['tbo_ms']:.1f} | "
              f"{r['speedup']:.2f}x |")
    print(f"\n2 ranks over gloo, emulated links {', '.join(c.link for c in CASES)} (latency us, GB/s); "
          f"{time.perf_counter() - t0:.0f} s")
    if any(r["max_diff"] != 0 for _, r in rows):
        raise SystemExit("TBO differs from forward()")


if __name__ == "__main__":
    main()
