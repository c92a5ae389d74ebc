"""tbo in a real SGLang engine (sglang 0.5.23 on CPU): SGLang alone, SGLang + tbo unsplit, and, over an emulated
link, tbo unsplit against tbo split. Prints each engine's decode and prefill wall time.

Targets (reported, not asserted): tbo's unsplit overhead is at most 3% of SGLang's time; over a link whose transfers
take about as long as the layers' compute, tbo split is at least 1.3x tbo unsplit over that link.

``--tp 2`` runs every engine at tensor parallel 2 (one scheduler process per rank, each bound to its core) and
measures only the split over a link, which then carries each layer's two all-reduces (attention's and the MoE's,
``moe_tp_*``; target >= 1.15x, as in vLLM); ``--ep`` adds SGLang's expert parallelism over those ranks, whose rows
tbo's all-to-all carries over a link of its own (``moe_tp_ep_*``), each link sized from all the bytes.

How the link is set, as in benchmarks/vllm.py (its helpers, loaded by path): tbo unsplit without a link measures the
compute of the decode and of the prefill run; from the bytes those runs' MoE layers send, a bandwidth-bound link per
mode makes that run's communication equal its compute (``--link`` sets one for both).

A tiny random Qwen3-MoE (``--hidden``, ``--layers``, ``--experts``) is saved in a temporary directory; nothing is
downloaded. Each engine is started alone (one at a time), warmed up, timed over ``--repeats`` runs (the minimum is
reported), and shut down. SGLang and SGLang + tbo unsplit are measured in ``--rounds`` rounds in alternating order
(SGLang first in even rounds, tbo first in odd ones), so that neither always runs on a machine the other just warmed
or slowed; the overhead is the median over the rounds. ``--control`` times a second plain SGLang engine in each round
too: SGLang against itself, the spread an overhead inside it cannot be told from. The decode figure is a batch of ``--batch`` requests generating ``--new`` tokens (its
prefill included, a small share); the prefill figure is the same batch with long prompts generating one token. On 2
shared cores timing is noisy: run it several times and report the range.

    SGLANG_USE_CPU_ENGINE=1 .venv-sglang/bin/python benchmarks/sglang.py     # after make test-sglang
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# this file is benchmarks/sglang.py: its folder on sys.path would shadow the sglang package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from tbo.harness.scripts import load_script

ENGINE_ARGS = dict(device="cpu", skip_tokenizer_init=True, attention_backend="torch_native", disable_cuda_graph=True,
                   max_total_tokens=8192, mem_fraction_static=0.05, dtype="float32", log_level="error",
                   disable_radix_cache=True)  # every timed run computes its prompts (no prefix-cache hits)


def save_model(path: Path, args: argparse.Namespace) -> Path:
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, num_experts=args.experts, num_experts_per_tok=2,
        max_position_embeddings=1024, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def _bench_vllm():
    """benchmarks/vllm.py's link helpers (loaded by path: its name shadows vllm; it imports no vllm at load)."""
    return load_script(Path(__file__).with_name("vllm.py"))


def measure(model: Path, tbo: dict | None, args: argparse.Namespace,
            modes: tuple[str, ...] = ("decode", "prefill")) -> dict[str, float]:
    import sglang as sgl

    os.environ.pop("TBO_SGLANG_CONFIG", None)
    if tbo is not None:
        os.environ["TBO_SGLANG_CONFIG"] = json.dumps(tbo)
    parallel = {}
    if args.tp > 1:  # one core per rank's scheduler process (SGLang's CPU engine needs it at TP >= 2)
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(args.tp)))
        parallel = {"tp_size": args.tp, "ep_size": args.tp if args.ep else 1}
    e = sgl.Engine(model_path=str(model), **ENGINE_ARGS, **parallel)
    os.environ.pop("TBO_SGLANG_CONFIG", None)
    try:
        short = [[(7 * i + j) % 250 + 1 for j in range(4)] for i in range(args.batch)]
        long = [[(11 * i + j) % 250 + 1 for j in range(args.prompt)] for i in range(args.batch)]
        out = {}
        for name, prompts, new in (("decode", short, args.new), ("prefill", long, 1)):
            if name not in modes:
                continue
            e.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": new})  # warm-up
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                e.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": new})
                times.append(time.perf_counter() - t0)
            out[name] = min(times)
        return out
    finally:
        e.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="rounds of SGLang and tbo unsplit, in alternating order")
    p.add_argument("--control", action="store_true",
                   help="each round also times a second plain SGLang engine: the spread of SGLang against itself, "
                        "which an overhead inside it cannot be told from")
    p.add_argument("--link", default=None, help="'LATENCY_US,GBPS'; default: per mode, comm ~= compute")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel ranks: only the split over a link is measured")
    p.add_argument("--ep", action="store_true", help="with --tp: SGLang's expert parallelism over the TP ranks")
    args = p.parse_args()
    if args.ep and args.tp < 2:
        p.error("--ep needs --tp 2 or more (expert parallelism over the TP ranks)")
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    bench = _bench_vllm()
    #: tokens each mode's run sends through the MoE layers: the decode steps' (its prefill a small share), the prompts
    tokens = {"decode": args.batch * args.new, "prefill": args.batch * args.prompt}
    if args.tp > 1:
        return main_tp(args, bench, tokens)
    with tempfile.TemporaryDirectory() as tmp:
        model = save_model(Path(tmp) / "qwen3_moe", args)
        never = {"decode_token_threshold": 10**6, "prefill_token_threshold": 10**6}
        always = {"decode_token_threshold": 2, "prefill_token_threshold": 2, "strategy": "qwen3_moe_prefill"}
        rounds: dict[str, list[dict[str, float]]] = {"sglang": [], "tbo unsplit": []}
        order = ["sglang", "tbo unsplit"] + (["sglang again"] if args.control else [])
        if args.control:
            rounds["sglang again"] = []
        for k in range(args.rounds):  # alternating order: no engine always runs first
            for name in (order if k % 2 == 0 else order[::-1]):
                rounds[name].append(measure(model, never if name == "tbo unsplit" else None, args))
        runs = {name: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for name, rs in rounds.items()}
        overheads = {m: sorted(t[m] / s[m] - 1 for s, t in zip(rounds["sglang"], rounds["tbo unsplit"]))
                     for m in tokens}
        control = {m: sorted(a[m] / s[m] - 1 for s, a in zip(rounds["sglang"], rounds["sglang again"]))
                   for m in tokens} if args.control else None
        links = {m: args.link or bench.link_for(runs["tbo unsplit"][m],
                                                bench.moe_bytes_per_step(tokens[m], args.hidden, 2, args.layers))
                 for m in tokens}
        for m, link in links.items():  # one link per mode, each sized to that run's compute
            runs[f"{m}: tbo unsplit, link"] = measure(model, {**never, "link": link}, args, (m,))
            runs[f"{m}: tbo split, link"] = measure(model, {**always, "link": link}, args, (m,))
    for name, r in runs.items():
        print(f"{name:28s}" + "   ".join(f"{m} {r[m] * 1e3:8.1f} ms" for m in r))
    for mode in ("decode", "prefill"):
        overhead = statistics.median(overheads[mode])
        print(f"{mode}: tbo unsplit overhead per round " + ", ".join(f"{x * 100:+.1f}%" for x in overheads[mode]))
        if control:
            print(f"{mode}: SGLang against itself per round (the noise) " +
                  ", ".join(f"{x * 100:+.1f}%" for x in control[mode]))
        speedup = runs[f"{mode}: tbo unsplit, link"][mode] / runs[f"{mode}: tbo split, link"][mode]
        print(f"{mode}: tbo unsplit overhead {overhead * 100:+.1f}% (target <= 3%); split over the link "
              f"{links[mode]} {speedup:.2f}x unsplit (target >= 1.3x)")


def main_tp(args: argparse.Namespace, bench: object, tokens: dict[str, int]) -> None:
    """``--tp``: tbo unsplit without a link (each mode's compute), then tbo unsplit and tbo split over a link per
    mode whose bytes take about that long: per layer and microbatch row, the two all-reduces of fp32 rows, and with
    ``--ep`` the rows each rank dispatches and gets back (a 1/tp slice of the rows, the whole NORMAL record)."""
    never = {"decode_token_threshold": 10**6, "prefill_token_threshold": 10**6}
    always = {"decode_token_threshold": 2, "prefill_token_threshold": 2}  # strategy "auto": moe_tp_* / moe_tp_ep_*
    runs: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = save_model(Path(tmp) / "qwen3_moe", args)
        runs["tbo unsplit"] = compute = measure(model, never, args)
        for m in tokens:
            nbytes = 2 * tokens[m] * args.hidden * 4 * args.layers
            if args.ep:
                nbytes += bench.moe_bytes_per_step(tokens[m] // args.tp, args.hidden, 2, args.layers)
            link = args.link or bench.link_for(compute[m], nbytes)
            runs[f"{m}: tbo unsplit, link"] = measure(model, {**never, "link": link}, args, (m,))
            runs[f"{m}: tbo split, link"] = split = measure(model, {**always, "link": link}, args, (m,))
            speedup = runs[f"{m}: tbo unsplit, link"][m] / split[m]
            runs[f"{m}: speedup"] = {m: speedup}
            print(f"{m}: TP {args.tp}{', EP' if args.ep else ''}: split over the link {link} {speedup:.2f}x unsplit "
                  "(target >= 1.15x)", flush=True)
    for name, r in runs.items():
        if not name.endswith("speedup"):
            print(f"{name:28s}" + "   ".join(f"{m} {r[m] * 1e3:8.1f} ms" for m in r))


if __name__ == "__main__":
    main()
