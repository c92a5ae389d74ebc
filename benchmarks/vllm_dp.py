"""tbo in vLLM with data-parallel attention and expert parallelism (DP = 2, the experts spread over both ranks): step
time and tokens/s, tbo split vs tbo unsplit, over real gloo traffic and over an emulated link.

Each configuration is two DP rank processes launched as vLLM's offline data-parallel example does
(`tbo.harness.vllm_dp`), each rank generating the same workload once: ``--batch`` requests of 4-token prompts,
``--decode-tokens`` greedy tokens each (one prefill step, then decode steps). The step time is the slower rank's
round over its steps; tokens/s add both ranks'. (One round per launch. Several rounds run since the plugin counts
requests still in an engine's input queue when vLLM decides whether a wave ends, see docs/vllm-dp.md, but a front end
slower than a step can still start a wave alone.)

* gloo: tbo's all-to-all over vLLM's expert-parallel group, real traffic between the two processes.
* link: the same, plus `tbo.comm.EmulatedLink` around it, bandwidth-bound, sized from the unsplit gloo run's
  compute ops (``op_times``) so that a decode step's communication about equals its compute (``--link`` sets it).
  Over the link the split also runs with ``agreed_rows: false``: every dispatch then exchanges row counts with its
  peer first, blocking, as it did before the step agreement carried every rank's rows.

The default model (8 MoE layers, hidden 1024) makes the layer stacks most of a step: vLLM's own per-step work
(scheduling, input preparation, sampling, its DP all-reduce) is the same for any model and no overlap touches it,
and at 4 layers of hidden 512 it was about 40% of the step.

Each configuration also prints rank 0's per-step breakdown from ``op_times``: compute ops, the waits overlap left
exposed, and what no op covers.

Target (reported, not asserted): split >= 1.3x unsplit over the link. Over real gloo on two shared cores the ranks'
traffic is a memory copy through loopback TCP that competes with the other rank's compute for the same two cores:
there is little latency to hide, and a split step runs the experts kernel twice on half the rows.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_dp.py     # after make test-vllm
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def save_model(path: Path, hidden: int, layers: int, experts: int) -> Path:
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
        num_hidden_layers=layers, num_attention_heads=max(2, hidden // 64), num_key_value_heads=max(1, hidden // 128),
        head_dim=64, num_experts=experts, num_experts_per_tok=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def moe_bytes_per_step(tokens: int, hidden: int, top_k: int, moe_layers: int) -> int:
    """Bytes one rank's unsplit step sends (NORMAL layout: fp32 rows, int64 top-k ids, fp32 weights out; fp32 rows
    back), every MoE layer."""
    return moe_layers * tokens * (2 * hidden * 4 + top_k * (8 + 4))


def run(model: Path, args: argparse.Namespace, tbo: dict, tmp: Path, name: str,
        warmup_rounds: int = 0) -> tuple[float, float, dict]:
    """One DP=2 launch: (seconds per step, tokens/s over both ranks, rank 0's stats with op times). The launch
    generates the workload ``warmup_rounds`` + 1 times, one wave each, and is timed on the last wave only: the rounds
    before it warm the engine up (an adaptive policy learns its table there, as a long-lived engine's first minutes
    do), as `benchmarks/vllm_adaptive.py`'s unmeasured round 0 does for the single-rank engines."""
    from tbo.harness.vllm_dp import describe_failure, run_dp

    barrier = tmp / f"barrier-{name}"
    barrier.mkdir()
    prompts = [[(s * 7 + i) % 500 + 1 for i in range(4)] for s in range(args.batch)]
    engine = dict(skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=256 << 20, max_model_len=1024,
                  max_num_batched_tokens=1024, enable_prefix_caching=False, dtype=args.dtype, seed=0,
                  enable_expert_parallel=True)
    stats = tmp / f"stats-{name}-{{rank}}.json"
    spec = dict(model=str(model), engine=engine, tbo={**tbo, "stats_file": str(stats), "op_times": True},
                rounds=[prompts] * (warmup_rounds + 1), max_tokens=args.decode_tokens, barrier_dir=str(barrier))
    runs = run_dp([spec, spec], timeout_s=1200 * (warmup_rounds + 1))
    for r in runs:
        if r.returncode != 0 or not r.result:
            raise RuntimeError(f"{name}: DP rank {r.rank} failed\n{describe_failure(runs)}")
    seconds = max(r.result["seconds"][-1] for r in runs)
    rank0 = json.loads(Path(str(stats).replace("{rank}", "0")).read_text())
    return seconds / args.decode_tokens, 2 * args.batch * args.decode_tokens / seconds, rank0


def _parts(stats: dict) -> tuple[float, dict[str, float], dict[str, float]]:
    """Rank 0's op seconds (``op_times``) as compute (neither launch nor wait), launches and waits."""
    from tbo.runtime.op_times import ops_of_role

    ops = stats["op_seconds"]
    launches, waits = ops_of_role(ops, "launch"), ops_of_role(ops, "wait")
    return sum(ops.values()) - sum(launches.values()) - sum(waits.values()), launches, waits


def compute_per_forward(stats: dict) -> float:
    """Seconds of compute ops (neither launches nor waits) per counted forward (``op_times``): what the link is sized
    against, so that a decode step's transfers take about as long as its compute (the step's time also holds
    vLLM's own work, which no overlap touches, and sizing against it made the link slower than the compute it could
    hide)."""
    return _parts(stats)[0] / stats["steps"]


def breakdown(stats: dict) -> str:
    """Rank 0's layer-stack time per counted forward: compute ops, launches (``*_a``: routing, padding or the
    blocking count exchange with the peer, starting the transfers), each wait (``*_b``: exposed transfer time), and what no op
    covers (the executor, microbatch contexts, splitting and merging)."""
    compute, launches, waits = _parts(stats)
    rest = stats["layers_seconds"] - sum(stats["op_seconds"].values())
    cells = [stats["layers_seconds"], compute, sum(launches.values()),
             *(waits.get(n, 0.0) for n in ("dispatch_b", "combine_b")), rest]
    return " | ".join(f"{1e3 * c / stats['steps']:.1f} ms" for c in cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--batch", type=int, default=32, help="requests per rank")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--link", default=None, help="'LATENCY_US,GBPS'; default: decode comm ~= compute")
    p.add_argument("--strategy", default="qwen3_moe_prefill",
                   help="the split engines' strategy key (lead 0: the other microbatch's attention hides the "
                        "dispatch, which a bandwidth-bound link needs; 'auto' for the family's decode/prefill pair)")
    p.add_argument("--repeat", type=int, default=1,
                   help="launches per configuration, unsplit and split alternating; the median launch is reported "
                        "(load drift between launches moves single ones)")
    args = p.parse_args()

    never = {"decode_token_threshold": 1 << 30, "prefill_token_threshold": 1 << 30}
    split = {"decode_token_threshold": 2, "prefill_token_threshold": 12, "strategy": args.strategy}
    rows, every = {}, {}  # the median launch per configuration; every launch's step time
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = save_model(tmp / "qwen3_moe", args.hidden, args.layers, args.experts)

        def pair(over: str, extra: dict, exchanged: bool = False) -> None:
            ways = {"unsplit": never, "split": split}
            if exchanged:  # the split without agreed rows: every dispatch exchanges row counts first, blocking
                ways["split, count exchange"] = {**split, "agreed_rows": False}
            launches: dict[str, list] = {how: [] for how in ways}
            for k in range(args.repeat):
                for i, (how, tbo) in enumerate(ways.items()):
                    launches[how].append(run(model, args, {**tbo, **extra}, tmp, f"{over.split()[0]}-{i}-{k}"))
            for how, got in launches.items():
                rows[f"{over}: tbo {how}"] = sorted(got, key=lambda r: r[0])[len(got) // 2]
                every[f"{over}: tbo {how}"] = [r[0] for r in got]

        pair("gloo", {})
        compute = compute_per_forward(rows["gloo: tbo unsplit"][2])
        link = args.link or f"0,{moe_bytes_per_step(args.batch, args.hidden, 2, args.layers) / compute / 1e9:.6f}"
        pair(f"link {link}", {"link": link}, exchanged=True)

    print(f"DP=2 + EP, Qwen3-MoE hidden {args.hidden}, {args.layers} MoE layers, {args.experts} experts top-2, "
          f"{args.dtype}; per rank {args.batch} requests x {args.decode_tokens} tokens (one prefill step of 4-token "
          f"prompts, then decode); split strategy {args.strategy}; median of {args.repeat} launch(es) each")
    print("| configuration | step | tokens/s (both ranks) | every launch's step | rank 0's forwards: all, split, "
          "dummy |\n|---|---|---|---|---|")
    for name, (sec, tps, stats) in rows.items():
        launches = ", ".join(f"{1e3 * t:.0f}" for t in every[name])
        print(f"| {name} | {sec * 1e3:.1f} ms | {tps:.0f} | {launches} ms | {stats['steps']}, {stats['split_steps']}, "
              f"{stats['steps_by_mode']['idle']} |")
    print("\nrank 0, per forward (op_times): the layer stacks, their compute ops, launches, waits, and what no op "
          "covers")
    print("| configuration | layers | compute ops | launches (`*_a`) | dispatch_b | combine_b | not in ops |\n"
          "|---|---|---|---|---|---|---|")
    for name, (_, _, stats) in rows.items():
        print(f"| {name} | {breakdown(stats)} |")
    for over in ("gloo", f"link {link}"):
        ratio = rows[f"{over}: tbo unsplit"][0] / rows[f"{over}: tbo split"][0]
        print(f"{over}: split is {ratio:.2f}x unsplit" + (" (target >= 1.3x)" if over != "gloo" else ""))
    exchanged = rows[f"link {link}: tbo unsplit"][0] / rows[f"link {link}: tbo split, count exchange"][0]
    print(f"link {link}: split with a count exchange in every dispatch is {exchanged:.2f}x unsplit")

if __name__ == "__main__":
    main()
