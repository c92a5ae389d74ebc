"""Tensor parallelism in an engine: a dense model's layers (no MoE: `tbo.integrations.vllm.admit.dense` says when),
and, in dense and MoE models alike, which of each layer's all-reduces its strategies run as tbo's transfers
(`tbo.integrations.vllm.model.tp`), over the reducer `tbo.integrations.vllm.comm.tp.tp_reducer` makes.
"""

from __future__ import annotations

from typing import Any

from tbo import strategies
from tbo.integrations.vllm.errors import TboConfigError
from tbo.integrations.vllm.model.tp import deferred_by

__all__ = ["build_dense_layers", "defer_reductions"]


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
    engine.names = engine.config.strategy_names(False, dense=True)
    engine.strategies = {mode: engine._bind(getattr(engine.names, mode), mode) for mode in ("decode", "prefill")}


def defer_reductions(engine: Any, platform: str) -> None:
    """Have each of ``engine``'s layers run, as transfers, the all-reduces its strategy names
    (``attn_reduce_a/_b``, ``mlp_reduce_a/_b``): every layer of a dense model, the MoE layers of a MoE model (its
    dense layers run one stage, their reductions inside vLLM's modules). The decode and prefill strategies must
    agree on them (a layer's modules reduce one way for the engine's life); none deferred: nothing is changed."""
    per_mode = {mode: deferred_by(strategies.get(getattr(engine.names, mode))) for mode in ("decode", "prefill")}
    if per_mode["decode"] != per_mode["prefill"]:
        raise TboConfigError(f"additional_config['tbo'] strategies {engine.names.decode!r} and "
                             f"{engine.names.prefill!r} disagree on which tensor-parallel all-reduces they run as "
                             f"transfers ({sorted(per_mode['decode'])} vs {sorted(per_mode['prefill'])}); name a "
                             "decode and a prefill strategy that reduce alike")
    deferred = per_mode["decode"]
    if not deferred:
        return
    from tbo.integrations.vllm.comm.tp import tp_reducer
    from tbo.integrations.vllm.runner.forwards import is_compiled

    if is_compiled(engine._model):
        raise TboConfigError(f"additional_config['tbo'] strategy {engine.names.decode!r} runs tensor-parallel "
                             "all-reduces as tbo's transfers, tested eager only: set enforce_eager=True or name "
                             "a strategy without *_reduce_a/_b ops")
    engine.reducer = tp_reducer(engine.config, platform)
    for layer in engine.layers:
        if getattr(engine, "dense", False) or layer.kind == "moe":
            layer.defer_reductions(deferred, engine.reducer)
