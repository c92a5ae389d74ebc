"""`VllmDecoderLayer`: any vLLM decoder layer whose MoE is a ``MoERunner`` (and its dense layers), as the ops tbo's
strategies name: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GLM-4.x, GPT-OSS, Llama-4, DeepSeek-V2/V3, ...

Where the pieces are is found from the layer's modules (`tbo.integrations.vllm.model.structure`), not from the model's
name. Every op calls the layer's own modules, so the math is vLLM's: the fused residual-add RMSNorms, the attention
module (Qwen3-MoE's as two ops: its projections, q/k norms and rotary in ``attn_prepare``, vLLM's attention backend
with its KV cache and the output projection in ``attn_core``; any other, GPT-OSS's with sinks and sliding windows,
Llama-4's NoPE and chunked layers, DeepSeek's MLA, whole in ``attn_core``), the router gate (the runner's, or the
block's own beside it) and the runner's ``select_experts`` for top-k, the runner's shared expert (gated or not), and
the fused-MoE experts kernel through the layer's own quant method, quantized or not (`tbo.integrations.vllm.model.quant`).
What tbo changes is where the tokens go between routing and the experts: through an `EPBackend` (dispatch,
combine), in the NORMAL layout that kernel takes (each token once, with its top-k ids and weights; with FP8
dispatch, as FP8 rows with their scales, quantised by the quant method's own quantiser). The routed output is then
scaled, added to the shared expert's and all-reduced over tensor parallelism as vLLM's MoE runner does, in that
order.

vLLM's pre-norm layers hand the residual on unadded (the next layer's input norm adds it), so a layer's output is
``{"hidden_states", "residual"}``: `model_forward_maybe_tbo` merges both, and the model's final norm adds them. A
layer that adds its residual itself, scaled (Granite-MoE's ``residual_multiplier``), adds it here as its forward does
and hands on ``{"hidden_states"}`` alone (`tbo.integrations.vllm.model.structure.ModelEnds`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tbo.comm.types import DispatchFormat, payload_refusal
from tbo.core.dataflow import OpFlow, declares
from tbo.core.state import State
from tbo.integrations.vllm.comm.backend import ModeBackends
from tbo.integrations.vllm.model.compute import EAGER, Compute
from tbo.integrations.vllm.errors import TboConfigError
from tbo.integrations.vllm.model.quant import ExpertsCall, batch_dependent_scales
from tbo.integrations.vllm.model.structure import layer_structure
from tbo.integrations.vllm.model.tp import TensorParallelOps, reduction_sites
from tbo.ops import ExpertParallelOps

__all__ = ["VllmDecoderLayer", "reduce_plan"]

logger = logging.getLogger("vllm.tbo")  # under vLLM's logger, as the engine's


def reduce_plan(runner: Any, tp_size: int, has_shared: bool) -> tuple[bool, bool]:
    """``(reduce_shared, reduce_final)``: the all-reduces vLLM's MoE runner makes after its experts kernel, by its
    rule (``_maybe_reduce_shared_expert_output``, ``_maybe_reduce_final_output``). A kernel whose output is already
    reduced (``_fused_output_is_reduced``) leaves only the shared expert's output to reduce; a model that reduces
    later itself (``moe_config.skip_final_all_reduce``) gets none; otherwise the sum of both is reduced once, and only
    with tensor or expert parallelism. Reducing twice would multiply the output by the group's size."""
    moe = runner.moe_config
    parallel = tp_size > 1 or moe.tp_size > 1 or moe.ep_size > 1
    fused_reduced = bool(runner._fused_output_is_reduced)
    if moe.skip_final_all_reduce and fused_reduced:
        raise TboConfigError("the MoE runner skips its final all-reduce but its kernel's output is reduced: vLLM "
                             "forbids this combination too")
    reduce_shared = parallel and fused_reduced and has_shared
    reduce_final = parallel and not fused_reduced and not moe.skip_final_all_reduce
    return reduce_shared, reduce_final


class VllmDecoderLayer(TensorParallelOps, ExpertParallelOps):
    """A vLLM decoder layer as ops; its experts' tokens dispatched through ``backend``."""

    #: the engine's `StepStats`, which count local_ffn_calls (the engine sets them; None: not counted)
    stats: Any = None
    #: the ops' tensor work (`tbo.integrations.vllm.model.compute`): as it is, or compiled in a compiled engine (the engine
    #: sets it)
    compute: Compute = EAGER
    #: True for `tbo.integrations.vllm.model.ep_layer.EpDecoderLayer`: the experts are spread over data-parallel ranks
    expert_parallel = False

    def __init__(self, layer: Any, backend: Any, layer_idx: int, tp_size: int,
                 llama_4_scaling: dict[str, Any] | None = None, fp8_dispatch: bool = False) -> None:
        self.layer, self.backend, self.layer_idx = layer, backend, layer_idx
        #: where this layer's pieces are (`tbo.integrations.vllm.model.structure`); refuses what tbo cannot reproduce
        self.structure = s = layer_structure(layer, layer_idx, self.expert_parallel)
        self.attn, self.ffn = getattr(layer, s.attn_name), getattr(layer, s.ffn_name)
        #: whether the attention module takes DeepSeek's ``llama_4_scaling`` (vLLM's MLA does; its plain MHA does
        #: not, and vLLM then does not apply it either)
        self._attn_takes_scaling = s.attn_takes_scaling
        #: the config's ``llama_4_scaling`` (original_max_position_embeddings, beta): a per-token factor on q that
        #: vLLM's model computes from the step's positions; each microbatch computes it from its own
        self.llama_4_scaling = llama_4_scaling if self._attn_takes_scaling else None
        #: attention as two ops (Qwen3-MoE), or one call in attn_core (every other attention module)
        self.split_attention = s.split_attention
        self.runner, self.gate, self.shared = s.runner, s.gate, s.shared
        #: None: the residual goes on unadded; a number: this layer adds it, scaled ("residual added in the layer")
        self.residual_multiplier = s.residual_multiplier
        self.kind = "dense" if self.runner is None else "moe"
        if self.runner is not None:
            if backend is not None and self.runner.routed_experts.global_num_experts != backend.num_experts:
                raise TboConfigError(f"layer {layer_idx} ({type(layer).__name__}) has "
                                     f"{self.runner.routed_experts.global_num_experts} experts but the backend "
                                     f"routes {backend.num_experts}")
            self.scale = float(self.runner.routed_scaling_factor)
            self._topk_dtype = self.runner.routed_experts.quant_method.topk_indices_dtype
            self._ids_dtype = torch.int32
            #: the experts through the quant method, with what each call needs (padding, FP8 rows and scales)
            self.experts = ExpertsCall.of(self.runner, fp8=fp8_dispatch, expert_parallel=self.expert_parallel)
            self._check_payload(fp8_dispatch)
        self.has_shared_experts = self.shared is not None
        #: ops a strategy must run on this layer (`tbo.strategies.bind_layers` refuses one without them)
        self.required_ops = ("shared_experts",) if self.has_shared_experts else ()
        #: which tensor-parallel all-reduces op_output makes: vLLM's MoE runner's rule (`reduce_plan`)
        self.reduce_shared, self.reduce_final = (False, False) if self.runner is None else reduce_plan(
            self.runner, tp_size, self.has_shared_experts)
        self._all_reduce = None
        self._masked: Any = None  #: `tbo.integrations.vllm.model.masked.MaskedExperts`, at the first MASKED dispatch
        if self.reduce_shared or self.reduce_final:
            from vllm.distributed import tensor_model_parallel_all_reduce

            self._all_reduce = tensor_model_parallel_all_reduce

    @property
    def moe_reduces_once(self) -> bool:
        """Whether vLLM's MoE runner reduces this layer's output once, whole, after the sum of its parts (what the
        TP strategies' ``moe_reduce``/``shared_reduce`` then do in its place)."""
        return self.runner is not None and self.reduce_final and not self.reduce_shared

    def defer_reductions(self, deferred: frozenset[str], reducer: Any) -> None:
        """Run the reductions ``deferred`` (``"attn"``, ``"mlp"``) as ``reducer``'s transfers, in the strategy's
        ``*_reduce_a/_b`` ops (`tbo.integrations.vllm.model.tp`), instead of inside vLLM's modules."""
        if "moe" in deferred and not self.moe_reduces_once:
            raise TboConfigError(f"{self!r}: its strategy reduces the MoE output (moe_reduce_a/_b) but vLLM's MoE "
                                 "runner does not reduce it once here (its kernel's output comes reduced, or the "
                                 "model reduces later itself): a strategy without moe_reduce_a/_b runs it")
        self.sites = reduction_sites(self.layer, self.attn, self.ffn, self.runner is None, self.layer_idx)
        self.deferred, self.reducer = frozenset(deferred), reducer

    def __repr__(self) -> str:
        return f"VllmDecoderLayer({self.layer_idx}, {type(self.layer).__name__}, {self.kind})"

    def compute_keys(self) -> list[tuple[str, tuple[Any, ...]]]:
        """The functions of `tbo.integrations.vllm.model.compute` this layer's ops call, each with the modules it is given:
        what `CompiledCompute.bound` counts the graph keys of."""
        layer, first = self.layer, self.layer_idx == 0 or self.residual_multiplier is not None
        keys: list[tuple[str, tuple[Any, ...]]] = [("norm" if first else "add_norm", (layer.input_layernorm,))]
        keys.append(("qkv", (self.attn,)) if self.split_attention else ("attention", (self.attn,)))
        if self.split_attention:
            keys.append(("attention_core", (self.attn,)))
        keys.append(("norm" if self.residual_multiplier is not None else "add_norm", (layer.post_attention_layernorm,)))
        if self.runner is None:
            return keys + [("mlp", (self.ffn,))]
        keys += [("route", (self.runner.router,)), ("experts", (self.experts, self.runner.routed_experts)),
                 ("moe_output", (self.runner, self.scale, self.has_shared_experts))]
        return keys + ([("mlp", (self.shared,))] if self.has_shared_experts else [])

    def _check_payload(self, fp8: bool) -> None:
        """The backend must move what this layer dispatches (FP8 rows with scales, or the model's dtype), and, where
        its decode steps run DeepEP low-latency (`tbo.integrations.vllm.comm.backend.ModeBackends`), vLLM's batched
        kernel must read this layer's expert weights (`tbo.integrations.vllm.model.masked.check_masked_kernel`); a quant
        method whose activation scale spans the whole call is named in a warning (`quant.batch_dependent_scales`)."""
        name = f"layer {self.layer_idx} ({type(self.layer).__name__})"
        dtype = self.runner.moe_config.in_dtype
        why = None if self.backend is None else payload_refusal(self.backend, dtype, fp8)
        if why is not None:
            raise TboConfigError(f"{name}: the backend cannot dispatch its {'FP8 rows' if fp8 else dtype} ({why})")
        if isinstance(self.backend, ModeBackends):
            from tbo.integrations.vllm.model.masked import check_masked_kernel

            check_masked_kernel(self.runner.routed_experts, repr(self))
        if batch_dependent_scales(self.runner.routed_experts):
            logger.warning(
                "tbo: %s quantises its experts' input with one dynamic scale per call (per-tensor): each microbatch "
                "of a split step gets its own scale, as under vLLM's DBO, so split and unsplit steps agree to that "
                "rounding, not bit for bit", name)

    # ---- attention ---------------------------------------------------------------------------------------------
    @declares(inputs="hidden_states", writes=("residual", "attn_in"))
    def op_comm_prepare_attn(self, state: State, hidden_states: torch.Tensor,
                             residual: torch.Tensor | None = None) -> None:
        if residual is None:  # the first layer (the embeddings are the residual), or Granite's: its input is
            state.residual = hidden_states
            state.attn_in = self.compute.norm(self.layer.input_layernorm, hidden_states)
        else:
            attn_in, state.residual = self.compute.add_norm(self.layer.input_layernorm, hidden_states, residual)
            state.attn_in = attn_in

    @declares(lambda layer: OpFlow(takes="attn_in", writes="qkv", pinned="positions") if layer.split_attention
              else OpFlow())
    def op_attn_prepare(self, state: State) -> None:
        """Qwen3-MoE: the QKV projection, the q/k norms and rotary, with vLLM's modules, in its forward's order (so
        the other microbatch's dispatch has that compute to hide behind). Other attention modules (DeepSeek's MLA)
        are one call: ``attn_core`` makes it."""
        if self.split_attention:
            state.qkv = self.compute.qkv(self.attn, state.pop("attn_in"), state.positions)

    @declares(lambda layer: OpFlow(takes="qkv" if layer.split_attention else "attn_in", writes="attn_out",
                                   pinned=() if layer.split_attention else "positions"))
    def op_attn_core(self, state: State) -> None:
        with self.deferring("attn"):  # o_proj's partial sum, where the strategy reduces it (attn_reduce_a/_b)
            if self.split_attention:
                state.attn_out = self.compute.attention_core(self.attn, *state.pop("qkv"))
            else:
                extra = {"llama_4_scaling": self._scaling(state.positions)} if self._attn_takes_scaling else {}
                state.attn_out = self.compute.attention(self.attn, state.positions, state.pop("attn_in"), extra)

    def _scaling(self, positions: torch.Tensor) -> torch.Tensor | None:
        """vLLM's ``_get_llama_4_scaling`` for these positions (elementwise per token: a microbatch's slice of the
        step's factor), or None when the config has no ``llama_4_scaling``."""
        if self.llama_4_scaling is None:
            return None
        from vllm.model_executor.models.deepseek_v2 import _get_llama_4_scaling

        cfg = self.llama_4_scaling
        return _get_llama_4_scaling(original_max_position_embeddings=cfg["original_max_position_embeddings"],
                                    scaling_beta=cfg["beta"], positions=positions)

    @declares(takes=("residual", "attn_out"), writes=("residual", "mlp_in"))
    def op_comm_prepare_mlp(self, state: State) -> None:
        if self.residual_multiplier is not None:  # Granite: the residual added here, the norm a plain one
            residual = state.pop("residual") + state.pop("attn_out") * self.residual_multiplier
            state.update(mlp_in=self.compute.norm(self.layer.post_attention_layernorm, residual), residual=residual)
            return
        mlp_in, residual = self.compute.add_norm(self.layer.post_attention_layernorm, state.pop("attn_out"),
                                                 state.pop("residual"))
        state.update(mlp_in=mlp_in, residual=residual)

    # ---- dense layers ------------------------------------------------------------------------------------------
    @declares(takes="mlp_in", writes="mlp_out")
    def op_mlp(self, state: State) -> None:
        self._count_ffn()
        with self.deferring("mlp"):  # its down projection all-reduces over TP, or leaves that to mlp_reduce_a/_b
            state.mlp_out = self.compute.mlp(self.ffn, state.pop("mlp_in"))

    def _count_ffn(self) -> None:
        if self.stats is not None:
            self.stats.local_ffn_calls += 1

    @property
    def counters(self) -> tuple[Any, ...]:
        """`stats` as a tuple of the one `StepStats` it is (none: not counted)."""
        return () if self.stats is None else (self.stats,)

    @counters.setter
    def counters(self, counters: tuple[Any, ...]) -> None:
        if len(counters) > 1:
            raise ValueError("a layer counts into one engine's StepStats")
        self.stats = counters[0] if counters else None

    # ---- MoE: router, dispatch, experts, combine ---------------------------------------------------------------
    @declares(reads="mlp_in", writes="router_logits")
    def op_gate(self, state: State) -> None:
        logits = self.gate(state.mlp_in)  # the runner's gate or the block's (GPT-OSS's returns no bias)
        state.router_logits = logits[0] if isinstance(logits, tuple) else logits

    @declares(reads="mlp_in", takes="router_logits", writes="topk")
    def op_select_experts(self, state: State) -> None:
        weights, ids = self.compute.route(self.runner.router, state.mlp_in, state.pop("router_logits"),
                                          self._topk_dtype)
        self._ids_dtype = ids.dtype  # the experts kernel wants it back (the NORMAL layout carries int64)
        state.topk = (ids, weights)

    @declares(lambda layer: OpFlow(reads=("mlp_in",) if layer.has_shared_experts else (),
                                   takes=("topk",) if layer.has_shared_experts else ("mlp_in", "topk"),
                                   writes="dispatch", pinned="rows_per_rank"))
    def op_dispatch_a(self, state: State) -> None:
        x = state.mlp_in if self.has_shared_experts else state.pop("mlp_in")
        if self.experts.fp8:  # FP8 rows and their scales, by the quant method's own quantiser
            x = self.experts.quantize(x)
        state.dispatch = self.backend.dispatch_a(x, *state.pop("topk"), **self._dispatch_options(state))

    def _dispatch_options(self, state: State) -> dict[str, Any]:
        """Keyword arguments of this microbatch's ``dispatch_a`` beyond the tensors (none here; data parallel:
        `tbo.integrations.vllm.model.ep_layer.EpDecoderLayer`)."""
        return {}

    @declares(lambda layer: OpFlow(takes="mlp_in", writes="shared_out") if layer.has_shared_experts else OpFlow())
    def op_shared_experts(self, state: State) -> None:
        if self.has_shared_experts:
            state.shared_out = self.compute.mlp(self.shared, state.pop("mlp_in"))

    @declares(lambda layer: OpFlow(reads=("mlp_in",) if layer.has_shared_experts else (),
                                   takes=("topk",) if layer.has_shared_experts else ("mlp_in", "topk"),
                                   writes="routed_out", pinned="rows_per_rank"))
    def op_routed_experts(self, state: State) -> None:
        """Dispatch, the experts and combine in one op, nothing yielded between (the TP strategies': every rank
        holds every expert's slice, so no row crosses ranks and there is no transfer to overlap; the routed output
        is a partial sum, which ``moe_reduce``/``shared_reduce`` reduce)."""
        for op in (self.op_dispatch_a, self.op_dispatch_b, self.op_experts, self.op_combine_a, self.op_combine_b):
            op(state)

    @declares(takes="dispatched", writes="expert_out")
    def op_experts(self, state: State) -> None:
        """vLLM's fused-MoE kernel, through the layer's quant method, on the tokens dispatched here: per token, the
        weighted sum over its local experts (the NORMAL layout's contract: combine only adds)."""
        d = state.pop("dispatched")
        if d.format is DispatchFormat.MASKED:  # DeepEP low-latency decode
            return self._masked_experts(state, d)
        self._count_ffn()
        ids = d.topk_idx.to(self._ids_dtype)
        x = d.hidden
        if "mlp_in" in state and x.data_ptr() == state.mlp_in.data_ptr():
            # the shared expert has not run yet and reads the same storage (the identity route dispatches the MLP
            # input itself): the experts get a copy, so that no kernel writing its input in place can change the
            # shared expert's input (vLLM 0.32's modular kernels allocate their output, but nothing promises it)
            x = x.clone()
        if d.scales is None:
            out = self.compute.experts(self.experts, x, ids, d.topk_weights)
        else:  # FP8 rows with their scales (DeepEP, GPUs): the quant method's kernel from its experts step on
            out = self.experts.local(x, ids, d.topk_weights, d.scales)
        state.expert_out = (out, d.handle)

    def _masked_experts(self, state: State, d: Any) -> None:
        """vLLM's experts kernel on the MASKED slabs of a DeepEP low-latency dispatch: each valid row's expert
        output, unweighted (the combine weighs and sums), `tbo.integrations.vllm.model.masked`."""
        self._count_ffn()
        if self._masked is None:
            from tbo.integrations.vllm.model.masked import MaskedExperts

            self._masked = MaskedExperts(self.runner.routed_experts)
        state.expert_out = (self._masked(d.hidden, d.tokens_per_expert, self.runner.routed_experts.top_k), d.handle)

    # ---- output ------------------------------------------------------------------------------------------------
    @declares(lambda layer: OpFlow() if layer.kind == "moe" and "moe" in getattr(layer, "deferred", ()) else
              OpFlow(takes="mlp_out" if layer.kind == "dense" else
                     ("shared_out", "routed_out") if layer.has_shared_experts else "routed_out", writes="layer_out"))
    def op_output(self, state: State) -> None:
        """The layer's output: a dense layer's MLP output, or a MoE layer's as vLLM's runner makes it (reduced over
        TP by its rule); nothing where the strategy reduces the MoE output (``moe_reduce``/``shared_reduce`` made
        it: `tbo.integrations.vllm.model.tp`)."""
        if self.kind == "dense":
            state.layer_out = state.pop("mlp_out")
            return
        if "moe" in self.deferred:
            return
        shared = state.pop("shared_out") if self.has_shared_experts else None
        if self.reduce_shared:  # the routed part came reduced from the kernel: reduce the shared part alone
            shared = self._all_reduce(shared)
        # DeepSeek's routed_scaling_factor on the routed part, then the shared part added, as vLLM's runner does
        out = self.compute.moe_output(self.runner, state.pop("routed_out"), shared)
        if self.reduce_final:
            out = self._all_reduce(out)
        state.layer_out = out

    def _moe_output(self, state: State) -> torch.Tensor:
        """This rank's part of the MoE output, for the strategy's reduction (vLLM's runner's sum, unreduced)."""
        shared = state.pop("shared_out") if self.has_shared_experts else None
        return self.compute.moe_output(self.runner, state.pop("routed_out"), shared)

    @declares(lambda layer: OpFlow(takes=("residual", "layer_out"), clears=True,
                                   returns="hidden_states" if layer.residual_multiplier is not None else
                                   ("hidden_states", "residual")))
    def op_comm_postprocess_layer(self, state: State) -> dict[str, Any]:
        if self.residual_multiplier is not None:  # Granite: the layer's output is the residual stream itself
            out = {"hidden_states": state.pop("residual") + state.pop("layer_out") * self.residual_multiplier}
        else:
            out = {"hidden_states": state.pop("layer_out"), "residual": state.pop("residual")}
        state.clear()  # every key a layer wrote was consumed: anything left is a leak
        return out
