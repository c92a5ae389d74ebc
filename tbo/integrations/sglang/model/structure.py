"""Where an SGLang model's pieces are, found from its modules rather than its name, and what tbo refuses.

tbo runs the layer loop of a model whose inner model (``model.model``) has SGLang's usual ends (``embed_tokens``,
``layers``, ``norm``, the residual stream started by ``residual_batch.start``) and whose decoder layers have SGLang's
layer-boundary stages (``attn_boundary``, ``ffn_boundary``: the residual adds and norms), a ``self_attn`` module and
an MLP: a MoE block with a router ``gate``, a ``topk`` and ``experts`` (Qwen3-MoE's ``mlp``, Mixtral's
``block_sparse_moe``), optionally a shared expert beside them (Qwen2-MoE's ``shared_expert`` with its sigmoid
``shared_expert_gate``, DeepSeek's ungated ``shared_experts``), or a dense MLP. The shared expert is found by
structure and run as its own op (``shared_experts``), so that a strategy can overlap it with the dispatch.
DeepSeek's multi-head latent attention runs as SGLang's own two-batch overlap runs it (``forward_prepare`` with a
per-microbatch ``zero_allocator``, then ``forward_core``), and its ``routed_scaling_factor`` is applied where
SGLang's block applies it. That covers the models that call SGLang's ``model_forward_stages`` (Qwen2/3-MoE,
DeepSeek, ...) and those that do not (Mixtral): admission reads the structure, never the class name. A model
tbo cannot reproduce is refused at load, naming the layer and the missing feature.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

from tbo.integrations.sglang.errors import TboSglangError

__all__ = ["LayerStructure", "ModelStructure", "model_structure"]

#: attribute names of a decoder layer's MLP, in the order they are looked for
_MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward", "moe")
#: attribute names of a MoE block's shared expert (one MLP every token runs beside its routed experts)
_SHARED_NAMES = ("shared_expert", "shared_experts")


@dataclass(frozen=True)
class LayerStructure:
    """One decoder layer's pieces."""

    attn: Any
    ffn: Any
    ffn_name: str
    kind: str  #: "moe" or "dense"
    split_attention: bool  #: attention as two ops (``forward_prepare`` / ``forward_core``, Qwen3-MoE's)
    ffn_takes_batch: bool  #: the MLP's forward takes the ForwardBatch as a second argument
    shared: Any = None  #: the MoE block's shared expert (an MLP called on the block's input), or None
    #: the shared expert's gate (Qwen2-MoE's ``shared_expert_gate``: one logit a token, its sigmoid scales the shared
    #: expert's output), or None: an ungated shared expert (DeepSeek's)
    shared_gate: Any = None
    #: the factor the routed output is scaled by after the experts, where SGLang's block scales it there (DeepSeek's
    #: ``routed_scaling_factor`` off CUDA); 1.0 where it has none or SGLang applies it inside its top-k or experts
    routed_scale: float = 1.0
    #: the attention's ``forward_prepare`` takes a ``zero_allocator`` (DeepSeek's MLA: SGLang's ``BumpAllocator``
    #: of per-layer scratch zeros, one per forward and, under two-batch overlap, per microbatch)
    attn_takes_allocator: bool = False


@dataclass(frozen=True)
class ModelStructure:
    """The inner model and its layers' pieces."""

    inner: Any
    layers: list[Any]
    structures: list[LayerStructure]
    architecture: str

    @property
    def top_k(self) -> int:
        return next(int(s.ffn.topk.topk_config.top_k) for s in self.structures if s.kind == "moe")

    @property
    def num_experts(self) -> int:
        return next(int(s.ffn.experts.num_experts) for s in self.structures if s.kind == "moe")


def _refuse(where: str, feature: str) -> TboSglangError:
    return TboSglangError(f"TBO_SGLANG_CONFIG: {where}: not supported ({feature}); tbo runs SGLang MoE models whose "
                          "decoder layers have SGLang's layer-boundary stages, an attention module and a MoE block "
                          "of gate, topk and experts, with or without a shared expert (Qwen3-MoE, Mixtral, "
                          "Qwen2-MoE, DeepSeek-V3, ...)")


def model_structure(model: Any, *, tensor_parallel: bool = False) -> ModelStructure:
    """The structure of SGLang's ``model`` (the ``*ForCausalLM``), or `TboSglangError` naming the part and the
    feature tbo cannot run. ``tensor_parallel`` (TP >= 2): a model without MoE layers is admitted (its all-reduces
    are what tbo overlaps)."""
    arch = type(model).__name__
    inner = getattr(model, "model", None)
    missing = [name for name in ("embed_tokens", "layers", "norm") if not hasattr(inner, name)]
    if inner is None or missing:
        raise _refuse(f"model {arch}", f"no inner model with {', '.join(missing or ['embed_tokens, layers, norm'])}")
    pp = getattr(inner, "pp_group", None)
    if pp is not None and not (pp.is_first_rank and pp.is_last_rank):
        raise _refuse(f"model {arch}", "pipeline parallelism")
    start, end = getattr(inner, "start_layer", 0), getattr(inner, "end_layer", len(inner.layers))
    layers = [inner.layers[i] for i in range(start, end)]
    structures = [layer_structure(layer, start + i) for i, layer in enumerate(layers)]
    if not tensor_parallel and not any(s.kind == "moe" for s in structures):
        raise _refuse(f"model {arch}, layer {start} ({type(layers[0]).__name__})",
                      "no MoE layer: tbo overlaps the expert dispatch, which this model does not have (at tensor "
                      "parallel >= 2 it overlaps the all-reduces)")
    return ModelStructure(inner, layers, structures, arch)


def layer_structure(layer: Any, index: int) -> LayerStructure:
    """One decoder layer's pieces, or `TboSglangError` naming the layer and the missing feature."""
    where = f"layer {index} ({type(layer).__name__})"
    for name in ("attn_boundary", "ffn_boundary", "self_attn"):
        if not hasattr(layer, name):
            raise _refuse(where, f"no {name!r}: a layer without SGLang's layer-boundary stages and attention module")
    ffn_name = next((n for n in _MLP_NAMES if hasattr(layer, n)), None)
    if ffn_name is None:
        raise _refuse(where, f"no MLP module (looked for {', '.join(_MLP_NAMES)})")
    ffn = getattr(layer, ffn_name)
    attn = layer.self_attn
    split = callable(getattr(attn, "forward_prepare", None)) and callable(getattr(attn, "forward_core", None))
    allocator = split and "zero_allocator" in inspect.signature(attn.forward_prepare).parameters
    moe = all(hasattr(ffn, n) for n in ("gate", "topk", "experts"))
    shared = shared_gate = None
    scale = 1.0
    if moe:
        block = f"{where}, {ffn_name} ({type(ffn).__name__})"
        shared, shared_gate = _moe_checks(block, ffn)
        scale = _routed_scale(block, ffn)
        takes_batch = False
    else:
        params = list(inspect.signature(ffn.forward).parameters)
        takes_batch = "forward_batch" in params
    return LayerStructure(attn, ffn, ffn_name, "moe" if moe else "dense", split, takes_batch, shared, shared_gate,
                          scale, allocator)


def _moe_checks(where: str, ffn: Any) -> tuple[Any, Any]:
    """The MoE block's shared expert and its gate (each None where it has none), or `TboSglangError` naming what of
    the block tbo's ops would not reproduce."""
    if getattr(ffn, "_use_mega_moe", False):
        raise _refuse(where, "SGLang's MegaMoE")
    if getattr(ffn, "num_fused_shared_experts", 0) or getattr(ffn, "enable_shared_expert_fusion", False):
        raise _refuse(where, "a shared expert fused into the routed experts' kernel (SGLang's shared-expert "
                             "fusion): tbo runs the shared expert as its own op")
    if getattr(getattr(ffn, "experts", None), "reduce_results", False):
        raise _refuse(where, "an experts module that all-reduces its own output (reduce_results=True): tbo's ops "
                             "sum the routed output as the block does, and a rank whose experts have no rows to run "
                             "does not call the module")
    if getattr(ffn, "_shared_expert_tp1", False):
        raise _refuse(where, "a shared expert replicated over the TP ranks (added after the block's all-reduce, on "
                             "one rank): tbo sums the shared expert's output as a partial sum")
    found = [(n, getattr(ffn, n)) for n in _SHARED_NAMES if getattr(ffn, n, None) is not None]
    if len(found) > 1:
        raise _refuse(where, f"two shared-expert modules ({', '.join(n for n, _ in found)})")
    if not found:
        return None, None
    name, shared = found[0]
    if not callable(shared):
        raise _refuse(where, f"its {name} is not a module tbo can call")
    gate = getattr(ffn, "shared_expert_gate", None)  # Qwen2-MoE's; built even where no shared expert is
    return shared, gate


#: the quant methods whose experts fold DeepSeek's routed scaling into the shared expert's add (SGLang's
#: ``maybe_fuse_routed_scale_and_shared_add``): not reproduced
_FUSED_SCALE_METHODS = ("Mxfp4FlashinferTrtllmMoEMethod", "Mxfp4FlashinferCutlassMoEMethod", "Mxfp4MarlinMoEMethod",
                        "ExpertPackMoEMethod")


def _routed_scale(where: str, ffn: Any) -> float:
    """The factor tbo scales the routed output by after the experts, as SGLang's DeepSeek block does
    (``DeepseekV2MoE.forward_normal``): its ``routed_scaling_factor`` off CUDA, MUSA and XPU (where the experts'
    kernel or the top-k apply it instead), unless AITER fused it into the top-k; or with KTransformers' experts. The
    platform is read from the block's own module, as the block reads it. 1.0: no scaling, or SGLang's top-k or
    experts apply it (and tbo runs those)."""
    factor = getattr(ffn, "routed_scaling_factor", None)
    if factor is None or float(factor) == 1.0:
        return 1.0
    method = type(getattr(ffn.experts, "quant_method", None)).__name__
    if method in _FUSED_SCALE_METHODS:
        raise _refuse(where, f"routed_scaling_factor={factor} with {method}, which folds it into the shared "
                             "expert's add")
    module = sys.modules.get(type(ffn).__module__)
    flags = [getattr(module, name, None) for name in ("_is_cuda", "_is_musa", "_is_xpu", "_use_aiter")]
    if None in flags or not hasattr(ffn, "routed_scaling_factor_fused_in_topk"):
        raise _refuse(where, f"routed_scaling_factor={factor} in a block whose module does not say where SGLang "
                             "applies it (its _is_cuda, _is_musa, _is_xpu, _use_aiter and the block's "
                             "routed_scaling_factor_fused_in_topk)")
    cuda, musa, xpu, aiter = flags
    after = (not cuda and not musa and not xpu and not (aiter and ffn.routed_scaling_factor_fused_in_topk)
             or method == "KTEPWrapperMethod")
    return float(factor) if after else 1.0
