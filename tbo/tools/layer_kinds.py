"""Layer kinds: the ops a kind of layer provides and their declared data flow, without building a layer.

`tbo ops` lists them and `tbo lint --layer-kind` checks a strategy against them, as binding it to such a layer would
(`OperationsStrategy.bind`): an op the layer does not provide, with the closest names, and every op whose inputs
are not there when it runs. A kind is a layer class and the few attributes its declarations read (a shared expert,
a dense MLP, Qwen3-MoE's split attention), so no weights, vLLM or GPU are needed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from tbo.core.dataflow import FLOW_ATTR, OpFlow

__all__ = ["LayerKind", "LAYER_KINDS", "layer_kind", "kind_flows"]


@dataclass(frozen=True)
class LayerKind:
    """A layer class (``module:Class``), the attributes its flow declarations read, and what it is."""

    cls: str
    attrs: dict[str, Any] = field(default_factory=dict)
    about: str = ""


_REF, _VLLM = "tbo.models.decoder:DecoderLayer", "tbo.integrations.vllm.model.layers:VllmDecoderLayer"
_VLLM_ATTRS = {"split_attention": True, "residual_multiplier": None}

#: every layer kind tbo ships, by the name `tbo ops` and `tbo lint --layer-kind` take
LAYER_KINDS: dict[str, LayerKind] = {
    "reference-moe": LayerKind(_REF, {"kind": "moe", "has_shared_experts": False},
                               "the reference model's MoE layer without a shared expert (Qwen3-MoE-style)"),
    "reference-moe-shared": LayerKind(_REF, {"kind": "moe", "has_shared_experts": True},
                                      "the reference model's MoE layer with shared experts (DeepSeek-style)"),
    "reference-dense": LayerKind(_REF, {"kind": "dense", "has_shared_experts": False},
                                 "the reference model's dense layer (DeepSeek's first layers)"),
    "vllm-moe": LayerKind(_VLLM, {**_VLLM_ATTRS, "kind": "moe", "has_shared_experts": False},
                          "a vLLM MoE layer without a shared expert (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, ...)"),
    "vllm-moe-shared": LayerKind(_VLLM, {**_VLLM_ATTRS, "kind": "moe", "has_shared_experts": True},
                                 "a vLLM MoE layer with a shared expert (DeepSeek-V2/V3, Qwen2-MoE, GLM-4.x, ...)"),
    "vllm-afd": LayerKind("tbo.integrations.vllm.afd.attention:VllmAFDLayer",
                          {**_VLLM_ATTRS, "kind": "afd", "has_shared_experts": False},
                          "a vLLM layer whose FFN runs remotely (attention-FFN disaggregation: afd_attention_dbo)"),
    "vllm-dense": LayerKind(_VLLM, {**_VLLM_ATTRS, "kind": "dense", "has_shared_experts": False},
                            "a dense layer of a vLLM MoE model (DeepSeek's first layers)"),
}


def layer_kind(name: str) -> LayerKind:
    """The kind named ``name``; an unknown one is a ValueError listing the kinds."""
    try:
        return LAYER_KINDS[name]
    except KeyError:
        raise ValueError(f"no layer kind {name!r}; kinds: {', '.join(LAYER_KINDS)}") from None


def kind_flows(name: str) -> dict[str, OpFlow | None]:
    """The ops the kind's layer class provides, by name, each with its declared flow (None: undeclared)."""
    kind = layer_kind(name)
    module, _, cls_name = kind.cls.partition(":")
    cls = getattr(importlib.import_module(module), cls_name)
    stand_in = SimpleNamespace(**kind.attrs)
    flows: dict[str, OpFlow | None] = {}
    for attr in sorted(dir(cls)):
        fn = getattr(cls, attr)
        if attr.startswith("op_") and len(attr) > 3 and callable(fn):
            decl = getattr(fn, FLOW_ATTR, None)
            flows[attr[3:]] = decl if decl is None or isinstance(decl, OpFlow) else decl(stand_in)
    return flows
