"""`SglangDecoderLayer`: an SGLang decoder layer (Qwen3-MoE's, Mixtral's, ...) as the ops tbo's strategies name.

Every op calls the layer's own modules, so the math is SGLang's: the layer-boundary stages (``attn_boundary``,
``ffn_boundary``: the residual adds and norms, on the microbatch's own residual stream), the attention module
(Qwen3-MoE's as two ops: ``forward_prepare`` with its projections, q/k norms and rotary in ``attn_prepare``,
``forward_core`` with SGLang's attention backend and KV cache in ``attn_core``; any other whole in ``attn_core``),
the router gate, SGLang's ``TopK``, the ``experts`` module (its own MoE runner, unquantized or not) and, where the
block has one, its shared expert as its own op (``shared_experts``: the block's module, gated by the sigmoid of its
``shared_expert_gate`` where it has one, as Qwen2-MoE's block computes it; its output added to the routed one in
``output``), so that a strategy (``deepseek_decode``/``deepseek_prefill``) runs it while a dispatch or combine is in
flight. What tbo changes is where the tokens go between routing and the experts: through an `EPBackend` (dispatch, combine), in the
NORMAL layout SGLang's experts take (each token once with its top-k ids and weights).

Under SGLang's expert parallelism at TP (``--ep-size`` = ``--tp-size``: each rank holds whole experts, a share of
them, and the same tokens after attention's sum), the backend is tbo's all-to-all over SGLang's expert-parallel
group, and each rank dispatches only its slice of the microbatch's rows (`ep_rows`; every rank knows every slice,
so no row counts are exchanged: the agreed rows of a NORMAL dispatch). SGLang's experts module gets
the rows it receives as (row, expert) pairs naming this rank's experts by SGLang's global ids (see
`_run_local_experts`). Combined back, the routed output is the rank's slice and zeros elsewhere: a
partial sum over the TP group, as when each rank holds every expert's slice, completed by the same reduction.

Each microbatch carries its own ForwardBatch (pinned in its State as ``forward_batch``, with its ``positions``): the
attention reads that microbatch's requests and KV slots, and the residual stream lives on it. The last layer ends
the stack as SGLang's model does (``residual_batch.final_norm``), per microbatch: the final RMSNorm is per token, so
merging normed microbatches equals norming the merged step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tbo.core.dataflow import OpFlow, declares
from tbo.core.state import State
from tbo.integrations.sglang.model.structure import LayerStructure
from tbo.integrations.sglang.model.tp import TensorParallelOps
from tbo.ops import ExpertParallelOps

__all__ = ["SglangDecoderLayer"]


class SglangDecoderLayer(TensorParallelOps, ExpertParallelOps):
    """An SGLang decoder layer as ops; its experts' tokens dispatched through ``backend`` (None: a dense model, at
    tensor parallel >= 2); under TP its reductions as tbo's transfers where its strategy says (`model.tp`)."""

    #: the engine's `StepStats` (counts local_ffn_calls); None: not counted
    stats: Any = None

    #: rows this rank dispatched (its slices), and rows its experts received from other ranks (expert parallelism)
    ep_rows_dispatched = 0
    ep_rows_from_peers = 0

    def __init__(self, layer: Any, structure: LayerStructure, backend: Any, layer_idx: int,
                 final_norm: Any = None, ep: tuple[int, int] | None = None) -> None:
        self.layer, self.backend, self.layer_idx, self.structure = layer, backend, layer_idx, structure
        #: ``(rank, size)`` of SGLang's expert-parallel group where its experts are spread whole over the TP ranks
        #: (each rank dispatches its slice of the rows); None: every rank's backend holds every expert it computes
        self.ep = ep if structure.kind == "moe" else None
        self.attn, self.ffn, self.kind = structure.attn, structure.ffn, structure.kind
        self.split_attention = structure.split_attention
        #: the model's final norm, on the last layer only: it ends each microbatch's stack as SGLang's model does
        self.final_norm = final_norm
        self.shared, self.shared_gate = structure.shared, structure.shared_gate
        self.has_shared_experts = self.shared is not None
        #: a strategy without the shared expert's op would run and leave its part out: refused when bound
        self.required_ops = ("shared_experts",) if self.has_shared_experts else ()
        self._ids_dtype = torch.int32
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        self._residual, self._topk_output = residual_batch, StandardTopKOutput

    def __repr__(self) -> str:
        return f"SglangDecoderLayer({self.layer_idx}, {type(self.layer).__name__}, {self.kind})"

    # ---- attention ---------------------------------------------------------------------------------------------
    @declares(inputs="hidden_states", writes="attn_in", pinned="forward_batch")
    def op_comm_prepare_attn(self, state: State, hidden_states: torch.Tensor) -> None:
        state.attn_in = self.layer.attn_boundary.prepare(hidden_states, state.forward_batch)

    @declares(lambda layer: OpFlow(takes="attn_in", writes="qkv", pinned=(
        ("positions", "forward_batch", "zero_allocator") if layer.structure.attn_takes_allocator else
        ("positions", "forward_batch"))) if layer.split_attention else OpFlow())
    def op_attn_prepare(self, state: State) -> None:
        """Qwen3-MoE, DeepSeek's MLA: projections, norms and rotary (``forward_prepare``), so that the other
        microbatch's dispatch has that compute to hide behind; other attention modules are one call in
        ``attn_core``. MLA takes the microbatch's own ``zero_allocator`` too, as under SGLang's two-batch overlap."""
        if self.split_attention:
            extra = {"zero_allocator": state.zero_allocator} if self.structure.attn_takes_allocator else {}
            state.qkv = self.attn.forward_prepare(positions=state.positions, hidden_states=state.pop("attn_in"),
                                                  forward_batch=state.forward_batch, **extra)

    @declares(lambda layer: OpFlow(takes="qkv" if layer.split_attention else "attn_in", writes="attn_out",
                                   pinned=() if layer.split_attention else ("positions", "forward_batch")))
    def op_attn_core(self, state: State) -> None:
        if self.split_attention:
            out = self.attn.forward_core(state.pop("qkv"))
            # DeepSeek's sparse attention may also return its top-k indices, which only its next layer reads;
            # SGLang's two-batch overlap drops them too
            state.attn_out = out[0] if isinstance(out, tuple) else out
            return
        x = state.pop("attn_in")
        state.attn_out = x if x.shape[0] == 0 else self.attn(positions=state.positions, hidden_states=x,
                                                             forward_batch=state.forward_batch)

    @declares(takes="attn_out", writes="mlp_in", pinned="forward_batch")
    def op_comm_prepare_mlp(self, state: State) -> None:
        state.mlp_in = self.prepare_ffn_input(state.pop("attn_out"), state.forward_batch)

    # ---- dense layers ------------------------------------------------------------------------------------------
    @declares(takes="mlp_in", writes="mlp_out", pinned="forward_batch")
    def op_mlp(self, state: State) -> None:
        self._count_ffn()
        x = state.pop("mlp_in")
        state.mlp_out = self.ffn(x, state.forward_batch) if self.structure.ffn_takes_batch else self.ffn(x)

    def _count_ffn(self) -> None:
        if self.stats is not None:
            self.stats.local_ffn_calls += 1

    # ---- MoE: router, dispatch, experts, combine ---------------------------------------------------------------
    @declares(reads="mlp_in", writes="router_logits")
    def op_gate(self, state: State) -> None:
        logits = self.ffn.gate(state.mlp_in.view(-1, state.mlp_in.shape[-1]))
        state.router_logits = logits[0] if isinstance(logits, tuple) else logits

    @declares(reads="mlp_in", takes="router_logits", writes="topk")
    def op_select_experts(self, state: State) -> None:
        x = state.mlp_in.view(-1, state.mlp_in.shape[-1])
        logits = state.pop("router_logits")
        if x.shape[0] == 0:
            out = self.ffn.topk.empty_topk_output(x.device)
        else:
            out = self.ffn.topk(x, logits)
        self._ids_dtype = out.topk_ids.dtype  # the experts take them back in their own dtype
        state.topk = (out.topk_ids, out.topk_weights)

    def ep_rows(self, rows: int) -> tuple[int, int]:
        """``(start, stop)``: the rows of a microbatch of ``rows`` this rank dispatches: all of them, or under expert
        parallelism at TP (`ep`) the rank's slice of near-equal slices in rank order (one row: the last rank's)."""
        if self.ep is None:
            return 0, rows
        return self._slice(rows, self.ep[0])

    def _slice(self, rows: int, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of rank ``rank``'s slice of ``rows`` in the expert-parallel group."""
        size = self.ep[1]  # type: ignore[index]
        return rows * rank // size, rows * (rank + 1) // size

    def ep_slices(self, rows: int) -> list[int]:
        """Every rank's slice of a microbatch of ``rows`` (`ep_rows`), by rank: known to each rank, since each holds
        the same rows, so the dispatch needs no exchange of row counts (its agreed ``rows_per_rank``)."""
        return [stop - start for start, stop in (self._slice(rows, r) for r in range(self.ep[1]))]  # type: ignore

    def _dispatch_a(self, x: torch.Tensor, topk: tuple[torch.Tensor, torch.Tensor]) -> Any:
        """Launch the dispatch of this rank's rows of ``x`` (``[..., H]``) with their top-k ids and weights."""
        flat = x.view(-1, x.shape[-1])
        ids, weights = topk
        if self.ep is None:
            return self.backend.dispatch_a(flat, ids, weights)
        start, stop = self.ep_rows(flat.shape[0])
        self.ep_rows_dispatched += stop - start
        return self.backend.dispatch_a(flat[start:stop], ids[start:stop], weights[start:stop],
                                       rows_per_rank=self.ep_slices(flat.shape[0]))

    def _routed(self, out: torch.Tensor, shape: Any) -> torch.Tensor:
        """The combined rows as the microbatch's routed output: under expert parallelism at TP this rank's slice in
        zeros, a partial sum its TP group completes (its other rows are other ranks' slices)."""
        if self.ep is None:
            return out
        rows = math.prod(shape[:-1])
        start, stop = self.ep_rows(rows)
        full = out.new_zeros((rows, out.shape[-1]))
        full[start:stop] = out
        return full

    @declares(lambda layer: OpFlow(reads="mlp_in", takes="topk", writes=("dispatch", "mlp_shape"))
              if layer.has_shared_experts else OpFlow(takes=("mlp_in", "topk"), writes=("dispatch", "mlp_shape")))
    def op_dispatch_a(self, state: State) -> None:
        x = state.mlp_in if self.has_shared_experts else state.pop("mlp_in")  # the shared expert reads it later
        state.mlp_shape = x.shape
        state.dispatch = self._dispatch_a(x, state.pop("topk"))

    @declares(lambda layer: OpFlow(takes="combine", reads="mlp_shape", writes="routed_out") if layer.ep is not None
              else OpFlow(takes="combine", writes="routed_out"))
    def op_combine_b(self, state: State) -> None:
        out = self.backend.combine_b(state.pop("combine"))
        state.routed_out = out if self.ep is None else self._routed(out, state.mlp_shape)

    @declares(lambda layer: OpFlow(takes="mlp_in", writes="shared_out") if layer.has_shared_experts else OpFlow())
    def op_shared_experts(self, state: State) -> None:
        """The block's shared expert on this microbatch's tokens, scaled per token by the sigmoid of its gate where it
        has one (Qwen2-MoE's ``shared_expert_gate``); nothing on a layer without a shared expert."""
        if not self.has_shared_experts:
            return
        x = state.pop("mlp_in")
        x = x.view(-1, x.shape[-1])
        if x.shape[0] == 0:  # an empty microbatch: SGLang's block skips its shared expert too
            state.shared_out = torch.zeros_like(x)
            return
        self._count_ffn()
        out = self.shared(x)
        if self.shared_gate is not None:
            gate = self.shared_gate(x)
            out = torch.sigmoid(gate[0] if isinstance(gate, tuple) else gate) * out
        state.shared_out = out

    @declares(takes="dispatched", writes="expert_out")
    def op_experts(self, state: State) -> None:
        """SGLang's experts module on the tokens dispatched here: per token, the weighted sum over its experts."""
        state.expert_out = self.run_experts(state.pop("dispatched"), state.get("mlp_in"))

    def run_experts(self, d: Any, mlp_in: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """``(output, combine handle)`` of SGLang's experts module on the dispatched rows ``d``. ``mlp_in``: the
        microbatch's MLP input while its shared expert has yet to read it."""
        x = d.hidden
        if self.ep is not None:
            return self._run_local_experts(d), d.handle
        self._count_ffn()
        ids = d.topk_idx.to(self._ids_dtype)
        if mlp_in is not None and x.numel() and x.data_ptr() == mlp_in.data_ptr():
            # the shared expert has not run yet and reads the same storage (the local backend dispatches the MLP
            # input itself): the experts get a copy, so that a runner writing its input in place cannot change it
            x = x.clone()
        logits = x.new_empty((x.shape[0], 0))  # the runner reads ids and weights, not the logits
        out = self.ffn.experts(x, self._topk_output(d.topk_weights.to(torch.float32), ids, logits))
        return out, d.handle

    def _run_local_experts(self, d: Any) -> torch.Tensor:
        """Expert parallelism: SGLang's experts module on the rows this rank received, one (row, expert) pair per row
        of its input. The backend names this rank's experts by local id, -1 for a slot whose expert another rank
        holds; SGLang's module takes global ids and maps them itself, and its CPU path takes neither a -1 nor an
        expert twice in a row (it counts a row's experts with a scatter), so a stand-in expert in that slot cannot
        work either when a rank holds fewer experts than the top-k. So each pair is its own row with top-1 (its id,
        its weight), and a row's output is the sum of its pairs' outputs in slot order. No rows: nothing to run
        (SGLang's CPU path fails on none)."""
        x = d.hidden
        counts = getattr(d.handle, "recv_counts", None)  # rows from each rank, on the host already
        if counts is not None:
            self.ep_rows_from_peers += int(counts.sum()) - int(counts[self.ep[0]])
        out = x.new_zeros((x.shape[0], x.shape[-1]))
        row, slot = (d.topk_idx >= 0).nonzero(as_tuple=True)
        if row.numel() == 0:
            return out
        self._count_ffn()
        base = self.ep[0] * self.backend.num_local_experts
        ids = (d.topk_idx[row, slot].to(torch.int64) + base).to(self._ids_dtype).view(-1, 1)
        weights = d.topk_weights[row, slot].to(torch.float32).view(-1, 1)
        pairs = x[row]
        logits = pairs.new_empty((pairs.shape[0], 0))
        return out.index_add_(0, row, self.ffn.experts(pairs, self._topk_output(weights, ids, logits)))

    # ---- output ------------------------------------------------------------------------------------------------
    @declares(lambda layer: OpFlow(takes="mlp_out" if layer.kind == "dense" else
                                   ("routed_out", "shared_out", "mlp_shape") if layer.has_shared_experts else
                                   ("routed_out", "mlp_shape"), writes="layer_out"))
    def op_output(self, state: State) -> None:
        if self.kind == "dense":
            state.layer_out = state.pop("mlp_out")
            return
        out = state.pop("routed_out")
        if self.structure.routed_scale != 1.0:  # DeepSeek's routed scaling, where SGLang's block applies it here
            out = out * self.structure.routed_scale
        if self.has_shared_experts:  # the shared part added to the routed one, as SGLang's block adds it
            out = out + state.pop("shared_out").view(out.shape)
        state.layer_out = out.view(state.pop("mlp_shape"))

    @declares(takes="layer_out", clears=True, returns="hidden_states", pinned="forward_batch")
    def op_comm_postprocess_layer(self, state: State) -> dict[str, Any]:
        fb = state.forward_batch
        hidden = self.finish_ffn_output(state.pop("layer_out"), fb)
        if self.final_norm is not None:  # the stack's end, per microbatch (as the model's forward ends it)
            hidden = self._residual.final_norm(hidden, fb, self.final_norm, skip_empty=True)
        state.clear()
        return {"hidden_states": hidden}
