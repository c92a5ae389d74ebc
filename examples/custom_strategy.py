"""Write your own strategy: a user-defined MoE layer, its ops, and a strategy authored as a plain Python list.

The layer below is not the reference model: it is what a framework engineer writes for their own model. Its ops
follow the naming rules (``op_<verb>``, ``*_a`` launches, ``*_b`` waits); the strategy places Yields so that the
other microbatch's attention runs while a dispatch is in flight. We check TBO against the plain forward, register
the strategy, and print it the way ``tbo show`` does.

    python examples/custom_strategy.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

import tbo
import tbo.strategies
from tbo import OperationsStrategy, SplitPolicy, State, Yield
from tbo.tools.cli import main as tbo_cli
from tbo.comm import LocalBackend
from tbo.experts import run_experts
from tbo.comm.emulated import EmulatedLink

HIDDEN, EXPERTS, TOP_K = 64, 8, 2


class ParallelBlockMoE:
    """A 'parallel block' layer (attention and MoE read the same normed input), with a gated residual."""

    def __init__(self, backend, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.backend = backend
        self.w_attn = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
        self.w_router = torch.randn(HIDDEN, EXPERTS, generator=g)
        self.w_experts = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
        self.gate = torch.rand(HIDDEN, generator=g)

    # the plain forward: what the ops must equal
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.layer_norm(x, (HIDDEN,))
        attn = torch.tanh(h @ self.w_attn)
        weights, idx = torch.topk((h @ self.w_router).softmax(-1), TOP_K)
        d = self.backend.dispatch_b(self.backend.dispatch_a(h, idx, weights))
        moe = self.backend.combine_b(self.backend.combine_a(run_experts(d, self.expert), d.handle))
        return x + self.gate * attn + (1 - self.gate) * moe

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return torch.relu(rows @ self.w_experts[e])

    # the same layer as ops
    def op_norm(self, state: State, x: torch.Tensor) -> None:
        state.x, state.h = x, torch.nn.functional.layer_norm(x, (HIDDEN,))

    def op_route(self, state: State) -> None:
        weights, idx = torch.topk((state.h @ self.w_router).softmax(-1), TOP_K)
        state.dispatch = self.backend.dispatch_a(state.h, idx, weights)  # launch

    def op_attn(self, state: State) -> None:  # runs while this microbatch's dispatch is in flight
        state.attn = torch.tanh(state.pop("h") @ self.w_attn)

    def op_experts(self, state: State) -> None:
        d = self.backend.dispatch_b(state.pop("dispatch"))  # wait
        state.combine = self.backend.combine_a(run_experts(d, self.expert), d.handle)  # launch

    def op_mix(self, state: State) -> dict:
        moe = self.backend.combine_b(state.pop("combine"))  # wait
        out = state.pop("x") + self.gate * state.pop("attn") + (1 - self.gate) * moe
        state.clear()
        return {"x": out}


# the strategy: a Python list, Yields between stages; B starts one stage behind A
PARALLEL_BLOCK = OperationsStrategy(
    name="parallel_block",
    delta_stages=1,
    operations=["norm", "route", Yield, "attn", Yield, "experts", Yield, "mix"],
)


def main() -> None:
    backend = EmulatedLink(LocalBackend(EXPERTS), latency_s=200e-6, bandwidth_bytes_per_s=20e6)
    layers = [ParallelBlockMoE(backend, seed) for seed in range(6)]
    x = torch.randn(48, HIDDEN, generator=torch.Generator().manual_seed(0))

    reference = x
    for layer in layers:
        reference = layer.forward(reference)

    plan = SplitPolicy(decode_token_threshold=2).plan(tbo.ForwardMode.DECODE, x.shape[0])
    out = tbo.model_forward_maybe_tbo(layers, {"x": x}, PARALLEL_BLOCK, plan, output_key="x")["x"]
    print(f"max diff: {(out - reference).abs().max().item():.3g}  (tolerance 1e-5: GEMMs of different sizes)")
    assert torch.allclose(out, reference, atol=1e-5), "TBO must equal the plain forward"

    tbo.strategies.register("parallel_block", PARALLEL_BLOCK, overwrite=True)
    print("\n$ tbo show parallel_block")
    tbo_cli(["show", "parallel_block"])
    with tempfile.TemporaryDirectory() as tmp:  # the same from a JSON file, as a separate `tbo` process would read it
        path = Path(tmp) / "parallel_block.json"
        path.write_text(PARALLEL_BLOCK.model_dump_json())
        print(f"\n$ tbo show {path.name} --microbatches 3 --delta 1")
        tbo_cli(["show", str(path), "--microbatches", "3", "--delta", "1"])
        assert json.loads(path.read_text())["operations"][2] == "Yield"


if __name__ == "__main__":
    main()
