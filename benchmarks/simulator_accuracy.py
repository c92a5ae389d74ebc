"""Does the simulator predict real runs? Fit costs from traced single-batch runs, predict a grid, compare.

1. Trace single-batch and TBO steps of the reference model over an `EmulatedLink` (one process) at several batch
   sizes per mode, and fit per-op cost tables (`fit_costs(kind="table")`: per-trace mean call, median over traces,
   interpolated): from the single-batch traces the plain costs, from the TBO traces each op's costs in the first
   and in the second microbatch when they interleave (the second finds the weights the first just used warm).
2. Predict, for a grid of batch sizes, the single-batch and TBO step times (`simulate`, with the split plan's real
   microbatch sizes), and whether to split (`recommend`).
3. Measure the same steps (medians; each size until it has enough samples and enough measured time) and compare.

Every sequence has the same length (prompt or cached context), so the token count is the only variable: the cost
model is a function of tokens, and attention cost also depends on context lengths, which this grid holds fixed.
Measurements go round-robin over all sizes, the calibration runs included, alternating single and TBO steps, so that
a slow spell of this shared machine spreads over every size, and over calibration and measurement alike.

Prints a row per grid point and, last, ``max ratio error: <fraction>`` (the worst |predicted TBO/single ÷ measured
TBO/single − 1|) and ``decision accuracy: <fraction>``. Targets: <= 0.10 and >= 0.95.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch

from tbo.models import ModelConfig
from tbo.simulate import fit_costs, recommend, simulate
from tbo.trace import summary
from tbo.workload import TracedModel

#: (sequences, length) of the single-batch runs the costs are fitted from: they cover the microbatch sizes TBO makes
#: of the grid (half of each), down to the 16-token chunks a one-sequence prefill is cut into.
FIT = {"decode": [(n, 64) for n in (1, 2, 4, 8, 16, 32, 64, 128)],
       "prefill": [(1, 8), (1, 16), (1, 24)] + [(n, 32) for n in (1, 2, 3, 4, 6, 8, 12)]}
GRID = {"decode": [2, 4, 8, 16, 24, 32, 48, 64, 96, 128], "prefill": [1, 2, 3, 4, 6, 8, 10, 12]}
CTX = {"decode": 64, "prefill": 32}


def rounds(bench: TracedModel, batches: dict, strategy: str, repeats: int, min_seconds: float) -> dict:
    """Round-robin over the batches, a single and a TBO step each per round; the traces, per batch and mode.

    A batch keeps being measured, round after round, until it has ``repeats`` samples and ``min_seconds`` of steps:
    a 5 ms step needs many more samples than a 60 ms one for a median as steady.
    """
    out: dict = defaultdict(lambda: {False: [], True: []})
    spent: dict = defaultdict(float)
    for n, batch in batches.items():  # warm up: the first steps of a new size pay for allocations
        for split in (False, True, False, True):
            bench.step(batch, strategy, split)
    todo = dict(batches)
    while todo:
        for n, batch in list(todo.items()):
            for split in (False, True):
                trace = bench.step(batch, strategy, split)
                out[n][split].append(trace)
                spent[n] += summary(trace).step_s
            if len(out[n][False]) >= repeats and spent[n] >= min_seconds or len(out[n][False]) >= 8 * repeats:
                del todo[n]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="at least this many samples per size and mode")
    parser.add_argument("--min-seconds", type=float, default=0.6, help="and at least this much measured time")
    parser.add_argument("--latency-us", type=float, default=20.0)
    parser.add_argument("--gbps", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = ModelConfig.scaled("deepseek", 128, 4, head_dim=32, batch_invariant=False)
    bench = TracedModel(config, args.latency_us * 1e-6, args.gbps * 1e9)
    errors, right, rows = [], 0, []
    for mode in ("decode", "prefill"):
        strategy = f"deepseek_{mode}"
        bound = bench.model.bind(strategy)
        fit_batches = {("fit", n, ctx): bench.batch(mode, n, ctx, seed=100 + n, spread=0.0) for n, ctx in FIT[mode]}
        grid_batches = {n: bench.batch(mode, n, CTX[mode], seed=n, spread=0.0) for n in GRID[mode]}
        # calibration and measurement share the rounds, so a slow spell of the machine hits both alike
        measured = rounds(bench, {**fit_batches, **grid_batches}, strategy, args.repeats, args.min_seconds)
        costs = fit_costs([t for key in fit_batches for split in (False, True) for t in measured[key][split]],
                          bench.link.latency_s, bench.link.bandwidth, kind="table")
        for n, batch in grid_batches.items():
            single, tbo = (statistics.median(summary(t).step_s for t in measured[n][split]) for split in (False, True))
            p_single = simulate(bound, costs, [batch.num_tokens], 0).step_s
            p_tbo = simulate(bound, costs, [mb.tokens_len for mb in batch.plan.microbatches]).step_s
            error = abs((p_tbo / p_single) / (tbo / single) - 1)
            decision = recommend(bound, costs, batch.num_tokens, mode).split
            correct = decision == (tbo < single)
            errors.append(error)
            right += correct
            rows.append(f"{mode:<8}{n:>5}{batch.num_tokens:>7}{single * 1e3:>10.2f}{tbo * 1e3:>9.2f}"
                        f"{p_single * 1e3:>11.2f}{p_tbo * 1e3:>10.2f}{error:>9.3f}   {'split' if decision else 'no':<6}"
                        f"{'ok' if correct else 'WRONG'}")
    print(f"{'mode':<8}{'seqs':>5}{'tokens':>7}{'single ms':>10}{'TBO ms':>9}{'pred single':>11}{'pred TBO':>10}"
          f"{'error':>9}   decision")
    print("\n".join(rows))
    print(f"link {args.latency_us:g} us + {args.gbps:g} GB/s; costs fitted from traces of "
          f"(sequences, length) {FIT['decode']} (decode) and {FIT['prefill']} (prefill)")
    print(f"max ratio error: {max(errors):.3f}")
    print(f"decision accuracy: {right / len(errors):.3f}")


if __name__ == "__main__":
    main()
