"""What a vLLM decoder layer is made of, found from its modules, not from the model's architecture name.

Every MoE model file of vLLM 0.32 builds its experts with ``FusedMoEFactory``, which returns a ``MoERunner``; its
attention modules hold an ``AttentionLayerBase``; its pre-norm layers fuse the residual add into
``input_layernorm`` / ``post_attention_layernorm`` and hand the residual on unadded. So one adapter
(`tbo.integrations.vllm.model.layers.VllmDecoderLayer`) runs them all, given where each piece sits. `layer_structure`
finds that out and refuses, at load and naming the layer and the feature, what the adapter would not reproduce;
a layer holding a module it does not know where to call is refused too, so that nothing runs silently wrong.

What truly differs between the families is the `QUIRKS` table, each entry a structural test and its reason. Add an
entry there, not a layer class, for a family that differs (docs/vllm.md, "Adding a family").
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from tbo.integrations.vllm.model.compute import EAGER, Compute
from tbo.integrations.vllm.errors import TboConfigError
from tbo.integrations.vllm.model.quant import kernel_problems

__all__ = ["LayerStructure", "ModelEnds", "QUIRKS", "attention_and_ffn", "layer_structure", "model_ends",
           "moe_dims", "moe_runner_of", "moe_runners", "shared_expert_of"]

#: the fused-residual pre-norms every admitted layer has (the norm adds the residual it is given)
NORMS = ("input_layernorm", "post_attention_layernorm")

#: What differs between families, by structure. name -> (how to recognise it, what tbo does about it)
QUIRKS: dict[str, tuple[str, str]] = {
    "gate beside the runner": (
        "the MoE runner has no gate; the MoE block has a gate module of num_experts outputs (Mixtral, Qwen2-MoE, "
        "OLMoE, GPT-OSS's `router`, Llama-4's `router`)",
        "op_gate calls the block's module; a gate that returns (logits, bias) or logits alike"),
    "shared expert": (
        "the runner holds a shared expert (DeepSeek, GLM-4.x, Llama-4; Qwen2/3-MoE's with its sigmoid "
        "shared_expert_gate inside the module)",
        "op_shared_experts runs the runner's module; strategy 'auto' picks the strategies that overlap it"),
    "routed scaling": ("runner.routed_scaling_factor != 1 (DeepSeek, GLM-4.x)",
                       "op_output scales the routed part before the shared part is added, as the runner does"),
    "attention split in two ops": (
        "the attention's forward is Qwen3-MoE's",
        "attn_prepare runs its projections, q/k norms and rotary; attn_core the attention and o_proj"),
    "attention as one call": (
        "any other attention module, `self_attn` or `attn` (GPT-OSS: sinks, sliding windows; Llama-4: NoPE and "
        "chunked layers; DeepSeek's MLA with llama_4_scaling)",
        "attn_core calls it by keyword (positions, hidden_states[, llama_4_scaling per microbatch])"),
    "dense layer": ("the feed-forward module holds no MoE runner (mlp_only_layers, first_k_dense_replace, "
                    "Llama-4's interleaved dense layers)", "op_mlp calls it whole"),
    "residual added in the layer": (
        "the layer's forward takes no residual and the layer has a numeric residual_multiplier (Granite-MoE: "
        "``h = residual + out * residual_multiplier`` after the attention and after the MoE, plain norms)",
        "op_comm_prepare_mlp and op_comm_postprocess_layer add the residual so; the layer hands on its hidden "
        "states alone, and the model's final norm takes no residual (`ModelEnds`)"),
    "embedding multiplier": (
        "the inner model has a numeric embedding_multiplier (Granite-MoE's forward scales the embeddings by it)",
        "the layer loop scales the embeddings by it, as the model's forward does, before the first layer"),
}


@dataclass(frozen=True)
class LayerStructure:
    """Where the pieces of one decoder layer are (see the module docstring)."""

    attn_name: str  #: ``self_attn`` or ``attn``
    ffn_name: str  #: ``mlp``, ``block_sparse_moe``, ``feed_forward``, ...
    runner: Any  #: the ``MoERunner``, or None for a dense layer
    gate: Any  #: the router gate (the runner's, or the block's own); None for a dense layer
    shared: Any  #: the shared expert module (gated or not), or None
    split_attention: bool  #: Qwen3-MoE's attention, as two ops
    attn_takes_scaling: bool  #: the attention takes DeepSeek's ``llama_4_scaling``
    #: None: the layer hands the residual on unadded (its fused pre-norms add it); a number: the layer adds it itself,
    #: scaled by it ("residual added in the layer")
    residual_multiplier: float | None = None


def _refuse(layer_idx: int, layer: Any, feature: str) -> TboConfigError:
    return TboConfigError(f"layer {layer_idx} ({type(layer).__name__}): tbo cannot run it: {feature}")


def moe_runner_of(module: Any) -> Any:
    """The ``MoERunner`` among ``module``'s direct children, or None."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface

    found = [m for m in module.children() if isinstance(m, MoERunnerInterface)]
    return found[0] if len(found) == 1 else None


def _holds_attention(module: Any) -> bool:
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    return any(isinstance(m, AttentionLayerBase) for m in module.modules())


def _is_qwen3_moe_attention(attn: Any) -> bool:
    """Whether ``attn`` runs exactly vLLM's ``Qwen3MoeAttention.forward``, which the two attention ops reproduce from
    its own modules (a subclass with another forward runs whole, in ``attn_core``)."""
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeAttention

    return type(attn).forward is Qwen3MoeAttention.forward


def shared_expert_of(runner: Any) -> Any:
    """The shared expert vLLM's MoE runner runs beside the routed experts, or None.

    Every vLLM 0.32 MoE block hands its shared expert to the runner (``FusedMoEFactory(shared_experts=...)``), whatever
    the block calls it: DeepSeek's ``mlp.shared_experts``, Qwen2/3-MoE's gated ``mlp.shared_expert`` (whose module
    applies its sigmoid ``shared_expert_gate`` itself), Llama-4's ``feed_forward.shared_expert``. The runner is where
    to look, not an attribute name: reading ``mlp.shared_experts`` drops Qwen3-MoE's gated expert without a word."""
    wrapper = runner.shared_experts  # vLLM's SharedExperts, around the block's module
    return None if wrapper is None else wrapper._layer


def _gate_of(ffn: Any, runner: Any) -> Any:
    """The router gate: the runner's, else the block's one module with ``num_experts`` outputs beside it."""
    if runner.gate is not None:
        return runner.gate
    n = runner.routed_experts.global_num_experts
    gates = [m for m in ffn.children() if m is not runner and getattr(m, "output_size", None) == n]
    return gates[0] if len(gates) == 1 else None


def _moe_problems(ffn: Any, runner: Any, gate: Any, shared: Any, expert_parallel: bool) -> list[str]:
    """The MoE features whose math tbo's ops would not reproduce."""
    problems = []
    if gate is None:
        problems.append("no router gate, in the MoE runner or beside it")
    if getattr(runner, "_fse_fuse_gate", False) or runner.shared_expert_gate is not None:
        problems.append("a shared-expert gate fused with the router")
    if runner.routed_input_transform is not None or runner.routed_output_transform is not None:
        problems.append("latent routed-input/output transforms")
    experts = runner.routed_experts
    problems += kernel_problems(experts, expert_parallel)  # the quant method: monolithic kernels, batched layouts
    moe = runner.moe_config
    if moe.is_sequence_parallel or (moe.dp_size > 1 and not expert_parallel):
        problems.append("sequence-parallel or data-parallel MoE")
    if type(runner.router).__name__ == "ZeroExpertRouter":
        problems.append("zero experts")
    if expert_parallel and moe.has_bias:
        problems.append("expert biases under expert parallelism (tbo's data-parallel experts kernel passes none)")
    w = getattr(experts, "w13_weight", None)
    if runner.routed_scaling_factor != 1.0 and shared is not None and getattr(w, "dtype", None) is not None \
            and str(w.dtype) == "torch.float16":
        problems.append("float16 with routed scaling beside a shared expert (vLLM's overflow rescaling)")
    known = {id(runner), id(gate), id(shared)} | ({id(m) for m in shared.modules()} if shared is not None else set())
    extra = [name for name, m in ffn.named_children() if id(m) not in known]
    if extra:
        problems.append(f"MoE block modules tbo does not know where to call: {', '.join(extra)}")
    return problems


def attention_and_ffn(layer: Any, layer_idx: int) -> tuple[str, str]:
    """The names of ``layer``'s attention module (the child holding an ``AttentionLayerBase``: ``self_attn``,
    GPT-OSS's ``attn``) and of its one feed-forward module (``mlp``, Mixtral's ``block_sparse_moe``, Llama-4's
    ``feed_forward``): besides the two `NORMS`, a layer may hold nothing else."""
    missing = [n for n in NORMS if getattr(layer, n, None) is None]
    children = dict(layer.named_children())
    attns = [name for name, m in children.items() if name not in NORMS and _holds_attention(m)]
    if missing or len(attns) != 1:
        raise _refuse(layer_idx, layer, f"not a pre-norm attention + feed-forward layer (norms missing: "
                                        f"{missing or 'none'}; attention modules: {attns or 'none'})")
    rest = [name for name in children if name not in NORMS and name != attns[0]]
    if len(rest) != 1:
        raise _refuse(layer_idx, layer, f"modules tbo does not know where to call: {', '.join(rest) or 'none'} (one "
                                        "feed-forward module expected)")
    return attns[0], rest[0]


def layer_structure(layer: Any, layer_idx: int, expert_parallel: bool = False) -> LayerStructure:
    """The `LayerStructure` of vLLM decoder layer ``layer``; a `TboConfigError` naming the layer and the feature
    for what tbo cannot reproduce."""
    params = inspect.signature(type(layer).forward).parameters
    residual_multiplier = None
    if "residual" not in params:
        residual_multiplier = getattr(layer, "residual_multiplier", None)
        if isinstance(residual_multiplier, bool) or not isinstance(residual_multiplier, (int, float)):
            raise _refuse(layer_idx, layer, "its forward takes no residual and it has no residual_multiplier (a "
                                            "layer that adds its residual itself in a way tbo does not know)")
        residual_multiplier = float(residual_multiplier)
    attn_name, ffn_name = attention_and_ffn(layer, layer_idx)
    attn, ffn = getattr(layer, attn_name), getattr(layer, ffn_name)
    attn_params = inspect.signature(attn.forward).parameters
    if not {"positions", "hidden_states"} <= set(attn_params):
        raise _refuse(layer_idx, layer, f"its attention {type(attn).__name__}.forward{tuple(attn_params)} takes no "
                                        "positions and hidden_states")
    runner = moe_runner_of(ffn)
    gate = shared = None
    if runner is not None:
        gate, shared = _gate_of(ffn, runner), shared_expert_of(runner)
        problems = _moe_problems(ffn, runner, gate, shared, expert_parallel)
        if problems:
            raise _refuse(layer_idx, layer, f"its MoE has {'; '.join(problems)}")
    return LayerStructure(attn_name, ffn_name, runner, gate, shared, _is_qwen3_moe_attention(attn),
                          "llama_4_scaling" in attn_params, residual_multiplier)


@dataclass(frozen=True)
class ModelEnds:
    """The model's own start and end around its layers, as tbo's layer loop runs them: the model's
    ``embed_input_ids`` (scaled by its ``embedding_multiplier``, where it has one) and its final ``norm`` (over the
    last layer's hidden states and residual, or its hidden states alone where the layers add their residual)."""

    model: Any  #: the inner model (``...Model``)
    embedding_multiplier: float | None  #: the "embedding multiplier" quirk
    hands_on_residual: bool  #: the layers return ``(hidden_states, residual)``; False: the residual was added

    @property
    def outputs(self) -> tuple[str, ...]:
        """The outputs of the last layer, merged over the microbatches."""
        return ("hidden_states", "residual") if self.hands_on_residual else ("hidden_states",)

    def start(self, input_ids: Any, inputs_embeds: Any = None) -> Any:
        hidden = inputs_embeds if inputs_embeds is not None else self.model.embed_input_ids(input_ids)
        return hidden if self.embedding_multiplier is None else hidden * self.embedding_multiplier

    def compute_keys(self) -> list[tuple[str, tuple[Any, ...]]]:
        """The compiled function the final norm runs through, with its module (`tbo.integrations.vllm.model.compute`)."""
        return [("add_norm" if self.hands_on_residual else "norm", (self.model.norm,))]

    def end(self, out: dict[str, Any], compute: Compute = EAGER) -> Any:
        """The final norm, through ``compute``'s functions (`tbo.integrations.vllm.model.compute`: the module called as it
        is, or, in a compiled engine, compiled as vLLM's graph computes it)."""
        if self.hands_on_residual:
            return compute.add_norm(self.model.norm, out["hidden_states"], out["residual"])[0]
        return compute.norm(self.model.norm, out["hidden_states"])


def model_ends(model: Any, layers: list[Any]) -> ModelEnds:
    """The `ModelEnds` of inner model ``model`` whose decoder layers are tbo's ``layers`` (each with its
    `LayerStructure`); refuses a model whose layers differ in how they hand the residual on."""
    multiplier = getattr(model, "embedding_multiplier", None)
    if multiplier is not None and (isinstance(multiplier, bool) or not isinstance(multiplier, (int, float))):
        raise TboConfigError(f"{type(model).__name__}: tbo cannot run it: its embedding_multiplier is "
                             f"{multiplier!r}, not a number")
    styles = {layer.structure.residual_multiplier is None for layer in layers}
    if len(styles) != 1:
        raise TboConfigError(f"{type(model).__name__}: tbo cannot run it: some of its layers hand the residual on "
                             "unadded and others add it themselves")
    return ModelEnds(model, None if multiplier is None else float(multiplier), styles.pop())


def moe_runners(layers: Any) -> list[tuple[int, Any]]:
    """``(index, MoERunner)`` of each of vLLM decoder ``layers`` that has one (in its feed-forward module)."""
    return [(i, r) for i, layer in enumerate(layers) for r in map(moe_runner_of, layer.children()) if r is not None]


def moe_dims(layers: Any) -> tuple[int, int]:
    """``(num_experts, top_k)`` of vLLM decoder ``layers``' MoE runners (whatever the config calls them:
    ``num_experts``, ``n_routed_experts``, ``num_local_experts``); refuses a model without MoE layers, or whose MoE
    layers disagree."""
    runners = [r for _, r in moe_runners(layers)]
    dims = {(r.routed_experts.global_num_experts, r.routed_experts.top_k) for r in runners}
    if not dims:
        raise TboConfigError("tbo cannot run this model: none of its decoder layers has a MoE (a vLLM MoERunner); "
                             "tbo overlaps expert traffic, and a dense model has none")
    if len(dims) > 1:
        raise TboConfigError(f"tbo cannot run this model: its MoE layers differ in (experts, top_k): {sorted(dims)}")
    return dims.pop()
