"""How much communication TBO hides: a stack of MoE layers over an emulated link, single batch vs TBO.

The reference model (DeepSeek-shaped, fast kernels) runs in one process with all experts local; every dispatch and
combine goes through an `EmulatedLink`, whose transfers take latency + bytes / bandwidth of real time while the CPU
is free. The default link makes communication about equal to compute. Each step is traced, and:

* hidden = communication time not spent waiting (link busy time minus the time `_b` ops blocked);
* ideally hideable = min(communication, compute): what a perfect two-stream schedule could overlap.

Prints step times, the speedup, the same schedule's ideal (simulated with the run's own op costs, zero overhead),
and last ``hidden: <fraction>`` (hidden / ideally hideable). Target: >= 0.80.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tbo.models import ModelConfig
from tbo.tools.simulate import fit_costs, simulate
from tbo.tools.trace import summary
from tbo.harness.workload import TracedModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["prefill", "decode"], default="prefill")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--ctx", type=int, default=48, help="prompt length (prefill) or cached context (decode)")
    parser.add_argument("--latency-us", type=float, default=20.0)
    parser.add_argument("--gbps", type=float, default=0.11, help="link bandwidth in GB/s")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)

    config = ModelConfig.scaled("deepseek", args.hidden, args.layers, head_dim=32, batch_invariant=False)
    bench = TracedModel(config, args.latency_us * 1e-6, args.gbps * 1e9)
    batch = bench.batch(args.mode, args.seqs, args.ctx)
    strategy = f"deepseek_{args.mode}"
    bench.step(batch, strategy, False), bench.step(batch, strategy, True)  # warm up

    singles, tbos, fractions, same_schedule = [], [], [], []
    for _ in range(args.repeats):
        singles.append(summary(bench.step(batch, strategy, False)).step_s)
        trace = bench.step(batch, strategy, True)
        t = summary(trace)
        tbos.append(t.step_s)
        fractions.append((t.comm_s - t.exposed_s) / min(t.comm_s, t.compute_s))
        costs = fit_costs([trace], bench.link.latency_s, bench.link.bandwidth)
        ideal = summary(simulate(bench.model.bind(strategy), costs, trace.tokens).trace)
        same_schedule.append((ideal.comm_s - ideal.exposed_s) / min(ideal.comm_s, ideal.compute_s))
    single, tbo = statistics.median(singles), statistics.median(tbos)
    print(f"{strategy}: {args.layers} layers, hidden {args.hidden}, {batch.num_tokens} tokens, link "
          f"{args.latency_us:g} us + {args.gbps:g} GB/s, one process")
    print(f"TBO step: compute {t.compute_s * 1e3:.1f} ms, communication {t.comm_s * 1e3:.1f} ms, "
          f"exposed {t.exposed_s * 1e3:.1f} ms (last repeat)")
    print(f"single: {single * 1e3:.1f} ms   TBO: {tbo * 1e3:.1f} ms   speedup: {single / tbo:.2f}x")
    print(f"same schedule, zero overhead (simulated): hidden {statistics.median(same_schedule):.2f}")
    print(f"hidden: {statistics.median(fractions):.2f}")


if __name__ == "__main__":
    main()
