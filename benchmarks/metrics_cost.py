"""What tbo's ``/metrics`` path costs a worker's steps: the publisher thread (`tbo.integrations.engine.metrics`)
beside an unsplit decode step of the reference model, against the same step without it.

The step path itself calls nothing for the metrics (the thread reads the counters the step already keeps), so the
cost is the thread's: one JSON encoding of a worker's stats into its shared-memory slot every ``interval_s``, which
holds the GIL meanwhile. Measured here:

* ``publish``: one publish of a realistic document (op_times over a DeepSeek layer's ops, 12 adaptive buckets);
* ``share``: publish / interval, the share of a worker's time the thread takes (the average cost per step);
* ``step ratio``: the median unsplit decode step with the thread publishing (at the default 1 s, and stressed at
  ``--stress-ms``) over the median without it, steps interleaved so that drift falls on both alike.

Target: share < 1% and step ratio - 1 < 1% at the default interval.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from tbo.harness.workload import TracedModel
from tbo.integrations.engine.metrics import MetricsPublisher
from tbo.integrations.engine.stats import StepStats
from tbo.models import ModelConfig

OPS = ("comm_prepare_attn", "attn_prepare", "attn_core", "comm_prepare_mlp", "gate", "select_experts", "dispatch_a",
       "dispatch_b", "experts", "shared_experts", "combine_a", "combine_b", "comm_finish")


def document() -> dict:
    """A busy worker's stats_file document: op_times over a DeepSeek layer's ops and 12 adaptive buckets."""
    s = StepStats()
    for i in range(1000):
        s.record(("decode", "prefill", "mixed")[i % 3], 64, 2 if i % 2 else 1, i % 7 == 0)
    s.add_op_times({op: 1.5 for op in OPS}, {op: 1000 for op in OPS}, 30.0)
    buckets = [{"kind": kind, "tokens": f"{2 ** b}-{2 ** (b + 1) - 1} tokens", "choice": "split, deepseek_decode",
                "steps": 500, "explored": 20,
                "estimates": {"unsplit": 1e-4, "split, deepseek_decode": 8e-5, "split, deepseek_prefill": 9e-5},
                "predicted": {}, "samples": {"unsplit": 10, "split, deepseek_decode": 12, "split, deepseek_prefill": 3}}
               for kind in ("decode", "prefill", "mixed") for b in range(4)]
    return {**s.as_dict(), "adaptive": [{"buckets": buckets, "summary": ["x" * 80] * len(buckets)}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60, help="steps per arm")
    parser.add_argument("--stress-ms", type=float, default=10.0, help="the stressed arm's interval")
    args = parser.parse_args()
    torch.set_num_threads(1)

    doc = document()
    with tempfile.TemporaryDirectory() as folder:
        probe = MetricsPublisher(folder, {"engine": 0, "rank": 0}, {"version": "bench"}, lambda: doc, interval_s=60)
        for _ in range(20):
            probe.publish()
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            probe.publish()
            times.append(time.perf_counter() - t0)
        probe.close()
    publish_s = statistics.median(times)
    print(f"publish: {publish_s * 1e6:.0f} us (median of 200; document {len(str(doc))} chars)")
    print(f"share at the default 1 s interval: {publish_s / 1.0:.4%}")

    config = ModelConfig.scaled("deepseek", args.hidden, args.layers, head_dim=32, batch_invariant=False)
    bench = TracedModel(config, 20e-6, 1e9)
    batch = bench.batch("decode", args.seqs, 48)
    for _ in range(3):
        bench.step(batch, "deepseek_decode", False)

    def step_s() -> float:
        t0 = time.perf_counter()
        bench.step(batch, "deepseek_decode", False)
        return time.perf_counter() - t0

    arms: dict[str, list[float]] = {"off": [], "1 s": [], f"{args.stress_ms:g} ms": []}
    with tempfile.TemporaryDirectory() as folder:
        publishers = {"1 s": 1.0, f"{args.stress_ms:g} ms": args.stress_ms / 1e3}
        order = list(arms)
        for r in range(args.steps // 5):
            for arm in order[r % 3:] + order[:r % 3]:  # each arm first in turn: no order bias
                pub = None if arm == "off" else MetricsPublisher(folder, {"arm": arm.replace(" ", "")}, {},
                                                                 lambda: doc, interval_s=publishers[arm]).start()
                arms[arm].extend(step_s() for _ in range(5))
                if pub is not None:
                    pub.close()
    base = statistics.median(arms["off"])
    print(f"unsplit decode step ({args.layers} layers, hidden {args.hidden}, {batch.num_tokens} tokens): "
          f"{base * 1e3:.2f} ms; publish / step: {publish_s / base:.2%}")
    for arm, values in arms.items():
        if arm != "off":
            print(f"step ratio, publishing every {arm}: {statistics.median(values) / base:.4f}")


if __name__ == "__main__":
    main()
