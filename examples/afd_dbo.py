"""Attention-FFN disaggregation with dual-batch overlap: 1 attention rank, 1 FFN rank, over gloo.

The attention rank keeps the KV cache and runs attention; every layer's FFN (dense MLP or MoE) runs on the FFN rank.
With DBO the attention rank sends microbatch 0, computes microbatch 1 while the FFN rank computes microbatch 0, then receives.
Each step runs without and with DBO; both are compared with the colocated model's plain forward().

    python examples/afd_dbo.py
    python examples/afd_dbo.py --attention-ranks 2 --ffn-ranks 1
"""

from __future__ import annotations

import argparse
import statistics

from tbo.harness.afd import AFDCase, run_afd
from tbo.harness.launch import launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention-ranks", type=int, default=1)
    parser.add_argument("--ffn-ranks", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    world = args.attention_ranks + args.ffn_ranks
    for mode, seqs, ctx in (("decode", 16, 32), ("prefill", 4, 32)):
        case = AFDCase(mode=mode, num_seqs=seqs, ctx=ctx, num_attention_ranks=args.attention_ranks,
                       num_ffn_ranks=args.ffn_ranks, repeats=args.repeats)
        results = launch(run_afd, world, case, timeout_s=300)
        attention = [r for r in results if r.role == "attention"]
        served = sum(len(r.received) for r in results if r.role == "ffn")
        no_dbo = max(statistics.median(r.no_dbo_ms) for r in attention)
        dbo = max(statistics.median(r.dbo_ms) for r in attention)
        print(f"{mode}: {args.attention_ranks} attention : {args.ffn_ranks} FFN ranks, "
              f"{sum(r.tokens for r in attention)} tokens, split into 2 microbatches: "
              f"{'yes' if all(r.split for r in attention) else 'no'}, FFN requests served: {served}")
        print(f"max diff: {max(r.max_diff for r in attention):.3g}  (vs the colocated forward(); bit-exact expected)")
        print(f"no DBO: {no_dbo:.1f} ms   DBO: {dbo:.1f} ms")
        print(f"speedup: {no_dbo / dbo:.2f}x\n")


if __name__ == "__main__":
    main()
