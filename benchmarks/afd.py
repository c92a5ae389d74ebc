"""AFD with dual-batch overlap vs without: 1 attention rank and 1 FFN rank, each on its own core.

Here the overlap is real: the FFN process computes one microbatch while the attention process computes the other. The
shapes make attention compute about equal to FFN compute (both are printed per mode, from a traced step, with the
FFN rank's busy time); fast (batch-variant) kernels. Prints, per case, a line ``speedup: <x>``. Target: >= 1.4.

Why these shapes. A DBO step pays its pipeline fill (microbatch 0's first attention, with the FFN rank idle) and drain
(microbatch 1's last FFN, with the attention rank idle) once, so with L balanced layers the ideal speedup is 2L/(L+1):
1.6 at 4 layers, 1.78 at 8 (DeepSeek-V3 has 61). And a decode FFN call reads every expert's weights whatever its
batch, so two half-size calls cost more than one full-size call; at 512 sequences that costs the FFN rank about 15%
more per step, at 128 about 50%.
"""

from __future__ import annotations

import argparse
import statistics

from tbo.harness.afd import AFDCase, run_afd
from tbo.harness.launch import launch

CASES = {
    "prefill": AFDCase(mode="prefill", num_seqs=8, ctx=128, hidden_size=512, num_layers=8, batch_invariant=False),
    "decode": AFDCase(mode="decode", num_seqs=512, ctx=64, hidden_size=1024, num_layers=8, batch_invariant=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name, case in CASES.items():
        case = AFDCase(**{**case.__dict__, "repeats": args.repeats})
        attention, ffn = launch(run_afd, 2, case, timeout_s=600)
        print(f"{name}: {attention.tokens} tokens, hidden {case.hidden_size}, {case.num_layers} layers")
        for mode, microbatches in (("no_dbo", 1), ("dbo", 2)):
            print(f"  {mode}: attention compute {attention.attention_ms[mode]:.1f} ms, waiting for FFN "
                  f"{attention.wait_ms[mode]:.1f} ms; FFN rank busy {ffn.ffn_busy_ms.get(microbatches, 0.0):.1f} ms")
        print(f"  no DBO {statistics.median(attention.no_dbo_ms):.1f} ms, DBO {statistics.median(attention.dbo_ms):.1f}"
              f" ms, max diff {attention.max_diff:.2g}")
        print(f"speedup: {attention.speedup:.2f}")


if __name__ == "__main__":
    main()
