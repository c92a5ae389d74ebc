"""Tensor parallelism in an engine: a dense model's layers (no MoE: `tbo.integrations.vllm.admit.dense` says when),
``strategy: "auto"``'s choice under TP, and which of each layer's all-reduces its strategy runs as tbo's transfers
(`tbo.integrations.vllm.model.tp`), over the reducer `tbo.integrations.vllm.comm.tp.tp_reducer` makes.
"""

from __future__ import annotations

from typing import Any

from tbo import strategies
from tbo.integrations.vllm.errors import TboConfigError
from tbo.integrations.vllm.model.tp import deferred_by
from tbo.split.kinds import Slot

__all__ = ["build_dense_layers", "defer_reductions", "moe_tp_eligible"]


def build_dense_layers(engine: Any) -> None:
    """``engine``'s layers for a model with no MoE layer: checked (TP >= 2, DP 1, eager), each a
    `VllmDecoderLayer` with no backend, its strategies ``auto``'s dense TP ones or those named."""
    from tbo.integrations.vllm.admit.dense import check_dense_model
    from tbo.integrations.vllm.model.layers import VllmDecoderLayer
    from tbo.integrations.vllm.runner.forwards import is_compiled

    vllm_config, model = engine.runner.vllm_config, engine._model
    check_dense_model(engine.architecture, tensor_parallel_size=engine.tp,
                      data_parallel_size=vllm_config.parallel_config.data_parallel_size,
                      compiled=is_compiled(model))
    engine.backend, engine.dense = None, True
    engine.layers = [VllmDecoderLayer(layer, None, i, engine.tp, llama_4_scaling=engine.llama_4_scaling)
                     for i, layer in enumerate(model.layers)]
    engine.names = engine.config.strategy_names(False, dense=True, tensor_parallel=True)


def moe_tp_eligible(engine: Any) -> bool:
    """Whether ``strategy: "auto"`` runs a MoE model's reductions as transfers (``moe_tp_*``): TP >= 2 in an eager
    engine without expert parallelism or an MTP drafter, every MoE layer reduced once by vLLM's runner (its kernel's
    output not reduced already); otherwise it keeps the expert-traffic strategies, vLLM's modules reducing."""
    from tbo.integrations.vllm.admit.speculative import runs_draft_pass
    from tbo.integrations.vllm.runner.forwards import is_compiled

    return (engine.tp > 1 and engine.ep_size == 1 and not is_compiled(engine._model)
            and not runs_draft_pass(engine.runner.vllm_config.speculative_config)
            and all(layer.moe_reduces_once for layer in engine.layers if layer.kind == "moe"))


def _layer_strategy(engine: Any, name: str, layer: Any) -> Any:
    """The strategy ``name`` as it runs ``layer``: whole on a MoE layer and on a dense model's layers, and
    `tbo.strategies.dense_like` of it on a MoE model's dense layers (one stage, or the dense TP list)."""
    strategy = strategies.get(name)
    return strategy if engine.dense or layer.kind == "moe" else strategies.dense_like(strategy)


def defer_reductions(engine: Any, platform: str) -> None:
    """Before the strategies are bound: have each of ``engine``'s layers run, as transfers, the all-reduces its
    strategy names (``attn_reduce_a/_b``, ``mlp_reduce_a/_b``, ``moe_reduce_a/_b``). The decode and prefill
    strategies must agree on them (a layer's modules reduce one way for the engine's life); none deferred:
    nothing is changed."""
    per_layer = []
    for layer in engine.layers:
        modes = {slot: deferred_by(_layer_strategy(engine, engine.names.of(slot), layer)) for slot in Slot}
        if modes[Slot.DECODE] != modes[Slot.PREFILL]:
            raise TboConfigError(f"additional_config['tbo'] strategies {engine.names.decode!r} and "
                                 f"{engine.names.prefill!r} disagree on which tensor-parallel all-reduces of "
                                 f"{layer!r} they run as transfers ({sorted(modes[Slot.DECODE])} vs "
                                 f"{sorted(modes[Slot.PREFILL])}); name a decode and a prefill strategy that reduce "
                                 "alike")
        per_layer.append(modes[Slot.DECODE])
    if not any(per_layer):
        return
    from tbo.integrations.vllm.comm.tp import tp_reducer
    from tbo.integrations.vllm.runner.forwards import is_compiled

    if is_compiled(engine._model):
        raise TboConfigError(f"additional_config['tbo'] strategy {engine.names.decode!r} runs tensor-parallel "
                             "all-reduces as tbo's transfers, tested eager only: set enforce_eager=True or name "
                             "a strategy without *_reduce_a/_b ops")
    engine.reducer = tp_reducer(engine.config, platform)
    for layer, deferred in zip(engine.layers, per_layer):
        layer.defer_reductions(deferred, engine.reducer)
