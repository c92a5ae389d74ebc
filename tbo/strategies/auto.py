"""``strategy: "auto"``: the registered strategies a model's layers call for, chosen by their structure, not its name.

One rule for every caller (the reference model's ``forward_tbo(strategy="auto")``, the vLLM plugin's ``strategy``
key): what there is to overlap decides. Under tensor parallelism the all-reduces are (``dense_tp_*`` for a model
without MoE layers, ``moe_tp_*`` with them, ``moe_tp_ep_*`` where the experts are spread whole over the TP ranks
and the rows travel to them too); otherwise the expert traffic is, with the shared expert beside the
dispatch where the MoE layers have one (``deepseek_*``) and the same shapes less that op where they do not
(``qwen3_moe_*``). A dense model on one rank has nothing to overlap, and is refused by name.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from tbo.core.errors import StrategyError

__all__ = ["AutoNames", "auto_names", "auto_names_for_layers"]


class AutoNames(NamedTuple):
    """The registry names for decode steps and for steps with prefill."""

    decode: str
    prefill: str


def auto_names(*, moe: bool, shared_experts: bool = False, tensor_parallel: bool = False,
               expert_parallel: bool = False) -> AutoNames:
    """The strategies for a model with (``moe``) or without MoE layers, a shared expert in any of them, its layers'
    outputs reduced over a TP group of more than one rank (``tensor_parallel``), and, under TP, its experts whole
    and spread over the TP ranks (``expert_parallel``: each rank dispatches its share of the rows, ``moe_tp_ep_*``)
    rather than each rank holding every expert's slice."""
    if tensor_parallel:
        shape = ("moe_tp_ep" if expert_parallel else "moe_tp") if moe else "dense_tp"
    elif not moe:
        raise StrategyError("strategy 'auto': a dense model without tensor parallelism has nothing to overlap (no "
                            "expert traffic, no all-reduce); run it without tbo, or at tensor parallel >= 2")
    else:
        shape = "deepseek" if shared_experts else "qwen3_moe"  # the strategies' shape, not the model's name
    return AutoNames(f"{shape}_decode", f"{shape}_prefill")


def auto_names_for_layers(layers: Sequence[Any]) -> AutoNames:
    """`auto_names` read off the layers: ``kind`` (``"moe"``/``"dense"``), ``has_shared_experts``, and a ``reducer``
    over more than one rank (tensor parallel)."""
    moe = any(getattr(layer, "kind", "moe") == "moe" for layer in layers)
    shared = any(getattr(layer, "has_shared_experts", False) for layer in layers)
    tp = any(getattr(getattr(layer, "reducer", None), "num_ranks", 1) > 1 for layer in layers)
    return auto_names(moe=moe, shared_experts=shared, tensor_parallel=tp)
