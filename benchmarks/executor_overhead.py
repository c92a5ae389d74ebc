"""Executor overhead per layer: `execute_overlapped_operations` vs a plain loop calling the same ops in the same order.

Shape: 61 layers of a DeepSeek-decode-shaped list (14 ops, 5 Yields per layer, delta 2, no trailing Yield), two
microbatches, ops doing trivial State work so that what is measured is the executor, not the ops.

For context it also times a re-implementation of the common approach this library replaces: stages re-split from
the flat list on every forward, a per-op context manager entered even with profiling off, and per-op dict lookups.

Target: executor minus plain loop <= 5 us per layer.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from tbo import OperationsStrategy, State, Yield, execute_overlapped_operations, strategies

DECODE_LAYER = strategies.get("deepseek_decode")  # 14 ops, 5 Yields, delta 2


class TrivialLayer:
    """Every op does a little State work and passes a dict along, like real ops, but costs almost nothing."""

    def op_comm_prepare_attn(self, state, hidden):
        state.residual = hidden
        return {"hidden": hidden}

    def op_attn_prepare(self, state, hidden):
        return {"hidden": hidden}

    def op_attn_core(self, state, hidden):
        return {"hidden": hidden}

    def op_comm_prepare_mlp(self, state, hidden):
        return {"hidden": hidden}

    def op_gate(self, state, hidden):
        state.logits = hidden
        return {"hidden": hidden}

    def op_select_experts(self, state, hidden):
        state.topk = state.pop("logits")
        return {"hidden": hidden}

    def op_dispatch_a(self, state, hidden):
        state.dispatch = hidden
        return {"hidden": hidden}

    def op_shared_experts(self, state, hidden):
        state.shared = hidden
        return None

    def op_dispatch_b(self, state):
        return {"tokens": state.pop("dispatch")}

    def op_experts(self, state, tokens):
        state.pop("topk")
        return {"tokens": tokens}

    def op_combine_a(self, state, tokens):
        state.combine = tokens
        return None

    def op_combine_b(self, state):
        return {"hidden": state.pop("combine")}

    def op_output(self, state, hidden):
        return {"hidden": hidden + state.pop("shared")}

    def op_comm_postprocess_layer(self, state, hidden):
        state.pop("residual")
        return {"hidden": hidden}


def build(num_layers: int) -> OperationsStrategy:
    layers = [TrivialLayer() for _ in range(num_layers)]
    return OperationsStrategy.concat([DECODE_LAYER.bind(layer) for layer in layers])


def run_executor(strategy: OperationsStrategy) -> list:
    return execute_overlapped_operations([{"hidden": 1}, {"hidden": 2}], strategy)


def make_plain_loop(strategy: OperationsStrategy):
    """The same calls, in the same order, precomputed: the least any executor could do."""
    schedule = strategy.schedule(2)
    calls = [(mb, op) for mb, stage in schedule.steps for op in strategy.stages[stage]]
    empty: dict = {}

    def plain() -> list:
        states = [State(), State()]
        outs = [{"hidden": 1}, {"hidden": 2}]
        for mb, op in calls:
            outs[mb] = op(states[mb], **(outs[mb] or empty))
        return outs

    return plain


def make_resplit_each_call(strategy: OperationsStrategy):
    """The approach we replace: split stages from the flat list per forward, a context manager around every op."""
    flat = list(strategy.operations)

    class _Exec:
        def __init__(self, stages, inputs):
            self.stages, self.out, self.state, self.i = stages, inputs, State(), 0

        def next(self):
            for op in self.stages[self.i]:
                with contextlib.nullcontext(f"op {getattr(op, '__name__', op)}"):
                    self.out = op(self.state, **(self.out or {}))
            self.i += 1

    def run() -> list:
        stages, cur = [], []
        for item in flat:
            if item is Yield:
                stages.append(cur)
                cur = []
            else:
                cur.append(item)
        stages.append(cur)
        a, b = _Exec(stages, {"hidden": 1}), _Exec(stages, {"hidden": 2})
        delta = strategy.delta_stages
        for _ in range(delta):
            a.next()
        for _ in range(len(stages) - delta):
            a.next()
            b.next()
        for _ in range(delta):
            b.next()
        return [a.out, b.out]

    return run


def best_time_us(fn, repeats: int, inner: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner * 1e6)
    return min(samples), statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--inner", type=int, default=20)
    args = parser.parse_args()

    strategy = build(args.layers)
    plain = make_plain_loop(strategy)
    resplit = make_resplit_each_call(strategy)
    exec_fn = lambda: run_executor(strategy)  # noqa: E731
    assert exec_fn() == plain() == resplit(), "all three must compute the same thing"

    for fn in (plain, exec_fn, resplit):  # warm up
        best_time_us(fn, 3, args.inner)
    # interleave measurements so that machine noise hits all three alike
    results = {"plain loop": [], "tbo executor": [], "re-split + ctx per op": []}
    for _ in range(args.repeats):
        for name, fn in (("plain loop", plain), ("tbo executor", exec_fn), ("re-split + ctx per op", resplit)):
            results[name].append(best_time_us(fn, 1, args.inner)[0])

    n = args.layers
    print(f"{n} layers x 2 microbatches, {strategy.num_stages} stages, 14 ops/layer, delta {strategy.delta_stages}")
    print(f"{'loop':<24}{'min us/layer':>14}{'median us/layer':>17}")
    for name, samples in results.items():
        print(f"{name:<24}{min(samples) / n:>14.2f}{statistics.median(samples) / n:>17.2f}")
    overhead_min = (min(results["tbo executor"]) - min(results["plain loop"])) / n
    overhead_med = (statistics.median(results["tbo executor"]) - statistics.median(results["plain loop"])) / n
    baseline = (statistics.median(results["re-split + ctx per op"]) - statistics.median(results["plain loop"])) / n
    print(f"re-split + ctx per op overhead: {baseline:.2f} us/layer")
    print(f"executor overhead: {overhead_min:.2f} us/layer (min), {overhead_med:.2f} us/layer (median); target <= 5")


if __name__ == "__main__":
    main()
