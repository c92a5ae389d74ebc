"""`make demo`: DeepSeek decode and prefill on the reference model; TBO vs single batch. On the GPU when there is one.

``--device cpu`` (the default without CUDA): 2 gloo ranks, emulated link. Each rank holds its own batch
(data-parallel attention) and half the experts; dispatch and combine cross ranks over gloo, each transfer taking the
emulated link's latency + bytes / bandwidth. The table shows, per strategy: tokens over both ranks, the largest
|TBO - forward()| on any rank (0: bit-exact), and median step times.

``--device cuda`` (the default with CUDA): one GPU, a DeepSeek-shaped model (hidden 4096, 8 layers, KV context 2048)
whose experts sit behind a `CopyEngineLink` (FP8-dispatch / BF16-combine bytes through the copy engines), decode
and prefill, eager and captured as CUDA graphs (`tbo.harness.gpu`). The table shows median step times of single and
TBO and the largest |TBO - single| logit difference (bf16 rounding: the two split the GEMMs differently).
"""

from __future__ import annotations

import argparse
import sys
import time

from tbo import strategies
from tbo.harness.launch import launch
from tbo.harness.workload import Case, render_schedule, run_case, summarize

CASES = [
    Case(model="deepseek", mode="decode", num_seqs=32, prompt_len=512, link="50,0.002", repeats=3),
    Case(model="deepseek", mode="prefill", num_seqs=6, prompt_len=16, link="50,0.005", repeats=3),
]


def main_cpu() -> None:
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
    if not all(r["split"] for _, r in rows):
        raise SystemExit("a case was not split: its TBO figures are one batch's")


def main_cuda(repeats: int = 10) -> None:
    """One GPU: decode at 256 and 512 requests, prefill of 4 x 512 tokens; eager and CUDA graph."""
    import torch

    from tbo.harness.gpu import GpuShape, GpuWorkload

    t0 = time.perf_counter()
    shape = GpuShape()
    work = GpuWorkload(shape, "cuda", decode_sizes=[256, 512], prefill=[(4, 512)])
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n{shape.describe()}\n")
    print("| step | tokens | how | single ms | TBO ms | speedup | max diff TBO vs single |")
    print("|---|---|---|---|---|---|---|")
    for mode, n, length in (("decode", 256, 1), ("decode", 512, 1), ("prefill", 4, 512)):
        for graph in (False, True):
            single, tbo = work.step(mode, n, False, graph, length), work.step(mode, n, True, graph, length)
            t = work.time({"single": single, "tbo": tbo}, repeats)
            diff = float((tbo().float() - single().float()).abs().max())
            print(f"| {mode} | {n * length} | {'graph' if graph else 'eager'} | {t['single'].median:.2f} | "
                  f"{t['tbo'].median:.2f} | {t['single'].median / t['tbo'].median:.2f}x | {diff:.3g} |")
    print(f"\none GPU, copy-engine link; {time.perf_counter() - t0:.0f} s (benchmarks/gpu.py has the full table)")


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description="TBO vs single batch on the reference model")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda: one GPU, copy-engine link, eager and CUDA graphs; cpu: 2 gloo ranks, emulated "
                             "link (default: cuda when available)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit(f"--device cuda: torch {torch.__version__} sees no CUDA device; use --device cpu")
        main_cuda()
    else:
        main_cpu()


if __name__ == "__main__":
    main()
