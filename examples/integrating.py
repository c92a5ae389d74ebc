"""Integrate your own MoE layer with tbo: the worked example of docs/integrating.md, run by tests/test_examples.py.

The layer is what a framework engineer writes for their own model, not tbo's reference model: attention over packed
sequences with a per-request KV cache, a softmax top-k router, routed SwiGLU experts behind an expert-parallel
backend, and a shared SwiGLU expert. It is written once as a plain ``forward`` and once as ``op_*`` methods; a
strategy places the Yields; `tbo.model_forward_maybe_tbo` runs two microbatches overlapped, and we check the result
against the plain forward over a prefill step whose cut falls inside a sequence, then a decode step.

    python examples/integrating.py                       # one process
    python examples/integrating.py --ranks 2             # expert parallel over 2 gloo ranks (tbo.harness.launch)
    python examples/integrating.py --png timeline.png    # the overlapped prefill step's timeline
    python examples/integrating.py --save-strategy moe.json  # for `tbo lint moe.json`, `tbo simulate moe.json`
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

import tbo
import tbo.strategies
from tbo import OperationsStrategy, SplitPolicy, State, Yield
from tbo.comm import EPBackend, LocalBackend, TorchDistributedBackend
from tbo.experts import run_experts
from tbo.split import split_inputs
from tbo.tools.lint import tally

HIDDEN, HEADS, EXPERTS, TOP_K, INTER, LAYERS = 64, 4, 8, 2, 96, 3
HEAD_DIM = HIDDEN // HEADS
TOLERANCE = 1e-5  # float32; see "Checking yourself" in docs/integrating.md for why this is not 0

#: How each per-request metadata key splits when a plan cuts a sequence in two (`tbo.split.REQUEST_KINDS`).
META_RULES = {"extend_lens": "lengths", "prefix_lens": "prefix_lens", "req_ids": "request"}

#: The strategy: attention and routing, Yield while the dispatch flies (the shared expert hides it), the experts,
#: Yield while the combine flies. Microbatch B runs one stage behind A.
MOE = OperationsStrategy(
    name="my_moe",
    delta_stages=1,
    operations=["attn", "gate", "dispatch_a", Yield,
                "shared", "dispatch_b", "experts", "combine_a", Yield,
                "combine_b", "output"],
)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def _swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(x @ w_gate) * (x @ w_up)) @ w_down


class MyMoELayer(torch.nn.Module):
    """One decoder layer: attention, then a routed + shared MoE, each with a residual."""

    def __init__(self, layer_idx: int, backend: EPBackend, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed * 100 + layer_idx)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[-2])

        self.layer_idx, self.backend = layer_idx, backend
        self.norm1, self.norm2 = torch.ones(HIDDEN), torch.ones(HIDDEN)
        self.wq, self.wk, self.wv, self.wo = (w(HIDDEN, HIDDEN) for _ in range(4))
        self.router = torch.randn(HIDDEN, EXPERTS, generator=g)
        # every rank builds all experts from the same seed and uses its own slice (a real model loads only its own)
        self.experts = [(w(HIDDEN, INTER), w(HIDDEN, INTER), w(INTER, HIDDEN)) for _ in range(EXPERTS)]
        self.shared_weights = (w(HIDDEN, INTER), w(HIDDEN, INTER), w(INTER, HIDDEN))

    # ---- the pieces, shared by forward() and the ops ---------------------------------------------------------------
    def attention(self, x: torch.Tensor, meta: dict[str, Any], kv: dict) -> torch.Tensor:
        """Causal attention over packed sequences. Request ``r``'s ``extend_lens[r]`` tokens follow its
        ``prefix_lens[r]`` cached ones; their keys and values are appended to ``kv[(layer, req_id)]``."""
        h = _rms_norm(x, self.norm1)
        out = torch.zeros_like(h)  # padding rows, if any, stay zero
        start = 0
        for rid, n, prefix in zip(meta["req_ids"], meta["extend_lens"], meta["prefix_lens"]):
            n, prefix = int(n), int(prefix)
            rows = h[start : start + n]
            q, k, v = ((rows @ w_).view(n, HEADS, HEAD_DIM).transpose(0, 1) for w_ in (self.wq, self.wk, self.wv))
            k_old, v_old = kv.get((self.layer_idx, rid), (k[:, :0], v[:, :0]))
            if k_old.shape[1] != prefix:
                raise ValueError(f"layer {self.layer_idx}, request {rid}: the cache holds {k_old.shape[1]} tokens "
                                 f"but prefix_lens says {prefix}")
            k, v = torch.cat([k_old, k], 1), torch.cat([v_old, v], 1)
            kv[(self.layer_idx, rid)] = (k, v)
            visible = torch.arange(prefix + n)[None, :] <= (prefix + torch.arange(n))[:, None]
            scores = (q @ k.transpose(1, 2)) / math.sqrt(HEAD_DIM)
            attn = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
            out[start : start + n] = attn.transpose(0, 1).reshape(n, HIDDEN) @ self.wo
            start += n
        return out

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_idx, topk_weights) in the order `EPBackend.dispatch_a` takes them; torch.topk gives the reverse."""
        weights, idx = torch.topk((h @ self.router).softmax(-1), TOP_K, dim=-1)
        return idx, weights

    def local_expert(self, local: int, rows: torch.Tensor) -> torch.Tensor:
        """Local expert ``local`` of this rank is global expert ``rank * num_local_experts + local``."""
        b = self.backend
        return _swiglu(rows, *self.experts[b.rank * b.num_local_experts + local])

    # ---- the plain forward: what the ops must equal ---------------------------------------------------------------
    def forward(self, x: torch.Tensor, meta: dict[str, Any], kv: dict) -> torch.Tensor:
        x = x + self.attention(x, meta, kv)
        h = _rms_norm(x, self.norm2)
        d = self.backend.dispatch_b(self.backend.dispatch_a(h, *self.route(h)))
        routed = self.backend.combine_b(self.backend.combine_a(run_experts(d, self.local_expert), d.handle))
        return x + routed + _swiglu(h, *self.shared_weights)

    # ---- the same layer as ops: op(state, **previous op's dict) -> dict | None ------------------------------------
    def op_attn(self, state: State, hidden_states: torch.Tensor) -> dict:
        # state.meta and state.kv are pinned for the whole step (model_forward_maybe_tbo's pinned=)
        return {"x": hidden_states + self.attention(hidden_states, state.meta, state.kv)}

    def op_gate(self, state: State, x: torch.Tensor) -> dict:
        state.residual = x
        h = _rms_norm(x, self.norm2)
        idx, weights = self.route(h)
        return {"h": h, "topk_idx": idx, "topk_weights": weights}

    def op_dispatch_a(self, state: State, h: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
                      ) -> None:
        state.h = h  # the shared expert's input, for the next stage
        state.dispatch = self.backend.dispatch_a(h, topk_idx, topk_weights)  # launch; the handle lives in the State

    def op_shared(self, state: State) -> None:  # compute that hides this microbatch's dispatch
        state.shared = _swiglu(state.pop("h"), *self.shared_weights)

    def op_dispatch_b(self, state: State) -> dict:
        return {"dispatched": self.backend.dispatch_b(state.pop("dispatch"))}  # wait

    def op_experts(self, state: State, dispatched: Any) -> dict:
        return {"expert_out": run_experts(dispatched, self.local_expert), "handle": dispatched.handle}

    def op_combine_a(self, state: State, expert_out: torch.Tensor, handle: Any) -> None:
        state.combine = self.backend.combine_a(expert_out, handle)  # launch

    def op_combine_b(self, state: State) -> dict:
        return {"routed": self.backend.combine_b(state.pop("combine"))}  # wait

    def op_output(self, state: State, routed: torch.Tensor) -> dict:
        out = state.pop("residual") + routed + state.pop("shared")
        state.clear()  # raises if an op left a tensor behind; the pinned meta and kv survive
        return {"hidden_states": out}


# ---- one step, both ways ----------------------------------------------------------------------------------------
def step(layers: list[MyMoELayer], bound: OperationsStrategy, x: torch.Tensor, meta: dict[str, Any],
         policy: SplitPolicy, mode: str, kv_ref: dict, kv_tbo: dict, observer: Any = None,
         ref_layers: list[MyMoELayer] | None = None) -> tuple[float, str]:
    """Run one step with the plain forward and with TBO; return the max difference and how the step split."""
    ref = x
    for layer in ref_layers or layers:
        ref = layer.forward(ref, meta, kv_ref)

    plan = policy.plan(mode, x.shape[0], meta["extend_lens"])
    if not tbo.agree_to_split(plan, strategy=bound):  # every rank must make the same decision
        plan = None
    parts = split_inputs(meta, plan, request_keys=META_RULES)  # per-microbatch metadata (plan None: one part)

    def pinned(mb: Any) -> dict:  # mb is the MicrobatchSlice, or None when the step runs unsplit
        return {"meta": parts[0 if mb is None else mb.microbatch_idx], "kv": kv_tbo}

    out = tbo.model_forward_maybe_tbo(layers, {"hidden_states": x}, bound, plan, pinned=pinned,
                                      backend=layers[0].backend, observer=observer)["hidden_states"]
    if plan is None:
        how = "unsplit"
    elif plan.two_chunk:
        left, right = plan.cut_extend_lens
        how = f"2 microbatches, request {plan.split_seq_index} cut {left}|{right}"
    else:
        how = f"{plan.num_microbatches} microbatches at request {plan.split_seq_index}"
    return (out - ref).abs().max().item(), how


def run_rank(rank: int, world: int, png: str | None = None) -> list[str]:
    raw: EPBackend = LocalBackend(EXPERTS) if world == 1 else TorchDistributedBackend(EXPERTS, timeout_s=60)
    backend, tracer = raw, None
    if png and rank == 0:
        from tbo.tools.trace import Tracer, traced

        tracer = Tracer(label="examples/integrating.py prefill")
        backend = traced(raw, tracer)  # transfers on the trace's communication lane
    layers = [MyMoELayer(i, backend) for i in range(LAYERS)]
    ref_layers = layers if tracer is None else [MyMoELayer(i, raw) for i in range(LAYERS)]  # same weights, untraced
    bound = tbo.strategies.bind_layers(layers, MOE)  # bind once per model, reuse every step
    policy = SplitPolicy(prefill_token_threshold=8)

    g = torch.Generator().manual_seed(10 + rank)
    lens = [7, 120 + 3 * rank, 5]  # one long prefill: no balanced boundary, so the cut falls inside it
    ids = [f"rank{rank}-req{i}" for i in range(len(lens))]
    kv_ref: dict = {}
    kv_tbo: dict = {}
    lines = []
    prefill = {"extend_lens": lens, "prefix_lens": [0] * len(lens), "req_ids": ids}
    x = torch.randn(sum(lens), HIDDEN, generator=g)
    diff, how = step(layers, bound, x, prefill, policy, "extend", kv_ref, kv_tbo, tracer, ref_layers)
    lines.append(f"rank {rank}: prefill {sum(lens)} tokens, {how}: max diff {diff:.3g}")
    if tracer is not None:
        from tbo.tools.trace import save_png, summary

        trace = tracer.finish()
        lines.append(f"rank {rank}: prefill trace: {summary(trace)}; wrote {save_png(trace, png)}")
    decode = {"extend_lens": [1] * len(lens), "prefix_lens": lens, "req_ids": ids}
    x = torch.randn(len(lens), HIDDEN, generator=g)
    diff2, how = step(layers, bound, x, decode, policy, "decode", kv_ref, kv_tbo, None, ref_layers)
    lines.append(f"rank {rank}: decode {len(lens)} tokens, {how}: max diff {diff2:.3g}")
    lines.append(f"max diff: {max(diff, diff2):.3g}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--png", help="write the overlapped prefill step's timeline (rank 0)")
    parser.add_argument("--save-strategy", help="write the strategy as JSON, for `tbo lint` / `tbo simulate`")
    args = parser.parse_args()

    findings = tbo.lint(MOE, 2, layers=2)  # two layers joined, to see the layer boundary
    print(f"lint {MOE.name}: {tally(findings)}")
    for f in findings:
        print(f"  {f}")
    if args.save_strategy:
        Path(args.save_strategy).write_text(MOE.model_dump_json(indent=2) + "\n")
        print(f"wrote {args.save_strategy}")

    if args.ranks == 1:
        results = [run_rank(0, 1, args.png)]
    else:
        from tbo.harness.launch import launch

        results = launch(run_rank, args.ranks, args.png)
    print(f"ranks: {args.ranks}, tolerance {TOLERANCE:g}")
    lines = [line for rank_lines in results for line in rank_lines if not line.startswith("max diff")]
    print("\n".join(lines))
    worst = max(float(r[-1].split()[-1]) for r in results)
    assert worst <= TOLERANCE, f"TBO differs from the plain forward by {worst:.3g} > {TOLERANCE:g}"
    # the bits of the difference depend on the CPU and its kernels; what holds everywhere is the bound just asserted
    print(f"max diff: {worst:.3g} (within the tolerance {TOLERANCE:g})")


if __name__ == "__main__":
    main()
