"""The core of tbo in one screen: a layer as an operation list, two microbatches interleaved, outputs compared.

A tiny MoE-shaped layer in plain torch exposes ``op_*`` methods. Its strategy is a list of op names with Yield
markers. We split a batch into two microbatches, run them overlapped, and check the result equals running the whole
batch as one microbatch.
"""

from __future__ import annotations

import torch

from tbo import OperationsStrategy, State, Yield, execute_operations, execute_overlapped_operations

HIDDEN, EXPERTS, TOPK = 32, 8, 2


class TinyMoELayer:
    """Attention-ish mixing, a router, and top-k experts; `_a` ops stash work as a transfer would, `_b` ops pick it up."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w_attn = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
        self.w_gate = torch.randn(HIDDEN, EXPERTS, generator=g)
        self.w_experts = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5

    def op_attn(self, state: State, x: torch.Tensor) -> dict:
        state.residual = x
        return {"h": torch.tanh(x @ self.w_attn)}

    def op_gate(self, state: State, h: torch.Tensor) -> dict:
        weights, idx = torch.topk((h @ self.w_gate).softmax(-1), TOPK, dim=-1)
        state.topk_weights, state.topk_idx = weights, idx
        return {"h": h}

    def op_dispatch_a(self, state: State, h: torch.Tensor) -> None:
        state.dispatch = h  # a real backend launches an all-to-all here and keeps its handle in the state

    def op_dispatch_b(self, state: State) -> dict:
        return {"h": state.pop("dispatch")}

    def op_experts(self, state: State, h: torch.Tensor) -> dict:
        idx, weights = state.pop("topk_idx"), state.pop("topk_weights")
        out = torch.zeros_like(h)
        for k in range(TOPK):  # one row per token: no cross-token reduction, so splitting is bit-exact
            out += weights[:, k : k + 1] * torch.einsum("th,thd->td", h, self.w_experts[idx[:, k]])
        return {"h": out}

    def op_combine_a(self, state: State, h: torch.Tensor) -> None:
        state.combine = h

    def op_combine_b(self, state: State) -> dict:
        return {"h": state.pop("combine")}

    def op_output(self, state: State, h: torch.Tensor) -> dict:
        x = state.pop("residual") + h
        state.clear()
        return {"x": x}


STRATEGY = OperationsStrategy(
    name="tiny_moe_decode",
    delta_stages=1,
    operations=["attn", "gate", Yield, "dispatch_a", Yield, "dispatch_b", "experts", "combine_a", Yield, "combine_b",
                "output"],
)


def main() -> None:
    torch.manual_seed(0)
    layers = [TinyMoELayer(seed) for seed in range(4)]
    strategy = OperationsStrategy.concat([STRATEGY.bind(layer) for layer in layers])
    print(STRATEGY.describe())
    print(f"\n{len(layers)} layers joined: {strategy.num_stages} stages\n")
    print(strategy.render_schedule(2, width=40))

    x = torch.randn(12, HIDDEN)
    whole = execute_operations({"x": x}, strategy)["x"]
    halves = execute_overlapped_operations([{"x": x[:5]}, {"x": x[5:]}], strategy)
    merged = torch.cat([h["x"] for h in halves])
    alone = torch.cat([execute_operations({"x": part}, strategy)["x"] for part in (x[:5], x[5:])])
    print(f"\noverlapped == each microbatch alone: {torch.equal(merged, alone)}")
    print(f"max diff vs whole batch: {(merged - whole).abs().max().item():.3g}  (matmul blocking may differ by size)")


if __name__ == "__main__":
    main()
