"""AFD with dual-batch overlap vs without: 1 attention rank and 1 FFN rank, each on its own core.

Here the overlap is real: the FFN process computes one stage while the attention process computes the other. The
shapes make attention compute about equal to FFN compute (both are printed, measured from a traced step without
DBO); fast (batch-variant) kernels. Prints, per case, a line ``speedup: <x>``. Target: >= 1.4.
"""

from __future__ import annotations

import argparse
import statistics

from tbo.afd.run import AFDCase, run_afd
from tbo.launch import launch

CASES = {
    "prefill": AFDCase(mode="prefill", num_seqs=8, ctx=128, hidden_size=512, num_layers=4, batch_invariant=False),
    "decode": AFDCase(mode="decode", num_seqs=256, ctx=96, hidden_size=1536, num_layers=4, batch_invariant=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name, case in CASES.items():
        case = AFDCase(**{**case.__dict__, "repeats": args.repeats})
        attention = launch(run_afd, 2, case, timeout_s=600)[0]
        print(f"{name}: {attention.tokens} tokens, hidden {case.hidden_size}, {case.num_layers} layers; per step "
              f"without DBO: attention {attention.attention_ms:.1f} ms, FFN (waited) {attention.ffn_ms:.1f} ms")
        print(f"  no DBO {statistics.median(attention.no_dbo_ms):.1f} ms, DBO {statistics.median(attention.dbo_ms):.1f}"
              f" ms, max diff {attention.max_diff:.2g}")
        print(f"speedup: {attention.speedup:.2f}")


if __name__ == "__main__":
    main()
