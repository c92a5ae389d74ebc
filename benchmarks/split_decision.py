"""Host cost of one step's split decision: `AdaptiveSplit.choose` + `observe` and the `SplitPolicy.plan` it wraps.

An engine decides every step on the host, before the device can start it, so this is paid once per step at every
batch size. Shapes: a uniform decode step of 10, 1,000 and 10,000 requests (the plan needs no loop over requests),
and for comparison a mixed step of the same request count (one prefill chunk among decodes: the general path,
which is linear in requests).

Target: the adaptive decision plus the plan of a 1,000-request decode step <= 50 us.

    .venv/bin/python benchmarks/split_decision.py [--repeat 2000]
"""

from __future__ import annotations

import argparse
import time

from tbo.split import ForwardMode, SplitPolicy
from tbo.split.adaptive import AdaptiveSplit, Choice

TARGET_US = 50.0


def per_call_us(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):  # the best of five rounds: the host's noise only ever adds
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    policy = SplitPolicy(decode_token_threshold=2, prefill_token_threshold=12)
    adaptive = AdaptiveSplit({"decode": [Choice("qwen3_moe_decode", 2), Choice("qwen3_moe_prefill", 2)],
                              "mixed": [Choice("qwen3_moe_prefill", 2)]})

    def decision(kind: str, tokens: int, mode: ForwardMode, lens: list[int] | None):
        def step():
            choice = adaptive.choose(kind, tokens)
            policy.plan(mode, tokens, lens)
            adaptive.observe(kind, tokens, choice, 1e-3)
        return step

    print("| requests | decode step, us | mixed step, us |")
    print("|---|---|---|")
    results = {}
    for n in (10, 1000, 10000):
        decode = per_call_us(decision("decode", n, ForwardMode.DECODE, None), args.repeat)
        lens = [1] * (n - 1) + [64]
        mixed = per_call_us(decision("mixed", sum(lens), ForwardMode.EXTEND, lens), max(args.repeat // 20, 10))
        results[n] = decode
        print(f"| {n} | {decode:.1f} | {mixed:.1f} |")
    verdict = "met" if results[1000] <= TARGET_US else "MISSED"
    print(f"target: a 1,000-request decode decision <= {TARGET_US:.0f} us: {results[1000]:.1f} us, {verdict}")


if __name__ == "__main__":
    main()
