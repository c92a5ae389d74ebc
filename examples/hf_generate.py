"""A real Hugging Face MoE model through tbo: greedy generation equal to HF's own `generate`.

Builds a tiny DeepseekV3 or Qwen3-MoE from a config (seeded random weights, no download), takes a batch of prompts of
different lengths (left-padded), and greedy-generates 16 tokens twice: with HF's `generate(do_sample=False)`, and
with tbo (prefill with the prefill strategy, decode with the decode strategy, two microbatches per step). With
`--ranks N` every rank builds the same model, keeps its slice of experts and dispatches over gloo.

    python examples/hf_generate.py --model deepseek_v3
    python examples/hf_generate.py --model qwen3_moe --ranks 2
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from tbo import Observer
from tbo.comm import TorchDistributedBackend
from tbo.integrations import transformers as tbo_hf
from tbo.integrations.hf_tiny import MODELS, tiny_model
from tbo.harness.launch import launch
from tbo.split import SplitPolicy


def prompts(rank: int, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    lens = torch.randint(3, 10, (batch,), generator=g).tolist()
    width = max(lens)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, n in enumerate(lens):  # left padding, as for generation
        ids[row, width - n:] = torch.randint(1, 128, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


class OpsPerMicrobatch(Observer):
    """Counts the ops each microbatch ran: every split step runs its ops once in microbatch 0 and once in 1."""

    def __init__(self) -> None:
        self.ops: Counter[int] = Counter()

    def on_op_start(self, mb: int, stage: int, name: str) -> None:
        self.ops[mb] += 1

    @property
    def every_step_split(self) -> bool:
        return sorted(self.ops) == [0, 1] and self.ops[0] == self.ops[1]


def run(rank: int, world: int, name: str, new_tokens: int) -> tuple[float, bool, bool]:
    model = tiny_model(name)
    backend = TorchDistributedBackend(8) if world > 1 else None
    policy = SplitPolicy(decode_token_threshold=2, prefill_token_threshold=2)
    ids, mask = prompts(rank)
    seen = OpsPerMicrobatch()
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask).logits
    logits, _ = tbo_hf.forward(model, ids, mask, policy=policy, backend=backend, observer=seen)
    hf_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    ours = tbo_hf.generate(model, ids, mask, max_new_tokens=new_tokens, policy=policy, backend=backend, observer=seen)
    return float((logits - reference).abs().max()), bool(torch.equal(hf_tokens, ours)), seen.every_step_split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="deepseek_v3")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    results = launch(run, args.ranks, args.model, args.new_tokens)
    print(f"{args.model}: {args.ranks} rank(s), batch of 4 left-padded prompts per rank, {args.new_tokens} new tokens")
    split = all(s for _, _, s in results)
    print(f"split: {'yes, every step in 2 microbatches' if split else 'no, some steps ran as one batch'}")
    print(f"max diff: {max(d for d, _, _ in results):.3g}  (prefill logits vs HF's forward; tolerance 1e-5)")
    print(f"tokens equal: {all(eq for _, eq, _ in results)}")


if __name__ == "__main__":
    main()
