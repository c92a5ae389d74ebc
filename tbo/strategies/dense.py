"""Strategies for dense layers and for whole models whose layers differ.

A dense layer has no communication to hide, but it can still run inside the overlapped region: its ops form one
stage, so the two microbatches simply take turns. (SGLang refuses dense layers in TBO; we do not need to.)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, Union

from tbo.core.errors import StrategyError
from tbo.core.inflight import limit_of
from tbo.core.operations import Yield, op_name
from tbo.core.strategy import OperationsStrategy
from tbo.strategies import registry

__all__ = ["DENSE_OPS", "dense_like", "bind_layers", "LayerStrategies"]

DENSE_OPS = ("comm_prepare_attn", "attn_prepare", "attn_core", "comm_prepare_mlp", "mlp", "output",
             "comm_postprocess_layer")

#: One strategy for every layer, one per layer ``kind`` (e.g. ``{"dense": ..., "moe": ...}``), or a function. A
#: strategy may be given by its registered name (``"deepseek_decode"``), as `ReferenceModel.forward_tbo` takes it.
LayerStrategies = Union[OperationsStrategy, str, Mapping[str, Union[OperationsStrategy, str]],
                        Callable[[Any], OperationsStrategy]]


def dense_like(strategy: OperationsStrategy) -> OperationsStrategy:
    """The dense-layer strategy that can be joined with ``strategy``: same delta and SM budget, one stage; for a
    tensor-parallel strategy (its layers' outputs are partial sums), the dense TP list, its reductions overlapped,
    with ``strategy``'s lead (`tbo.strategies.tensor_parallel`)."""
    from tbo.strategies.tensor_parallel import DENSE_TP_OPS, is_tp

    if is_tp(strategy):
        return OperationsStrategy(operations=list(DENSE_TP_OPS), delta_stages=strategy.delta_stages,
                                  deep_gemm_num_sms=strategy.deep_gemm_num_sms,
                                  name=f"dense_for_{strategy.name or 'strategy'}")
    return OperationsStrategy(operations=DENSE_OPS, delta_stages=0, deep_gemm_num_sms=strategy.deep_gemm_num_sms,
                              name=f"dense_for_{strategy.name or 'strategy'}")


def _named(strategy: Any) -> Any:
    """A registered name resolved to its strategy (an unknown name: the registry's error, listing the names)."""
    return registry.get(strategy) if isinstance(strategy, str) else strategy


def _for_layer(strategies: LayerStrategies, layer: Any) -> OperationsStrategy:
    kind = getattr(layer, "kind", "moe")
    strategies = _named(strategies)
    if isinstance(strategies, OperationsStrategy):
        return dense_like(strategies) if kind == "dense" else strategies
    if isinstance(strategies, Mapping):
        if kind in strategies:
            return _named(strategies[kind])
        if kind == "dense" and "moe" in strategies:
            return dense_like(_named(strategies["moe"]))
        raise StrategyError(f"no strategy for layer kind {kind!r} ({layer!r}); have {sorted(strategies)}")
    if not callable(strategies):
        raise TypeError(f"a layer strategy is an OperationsStrategy, a registered name, a mapping of layer kind to "
                        f"either, or a function of the layer; got {type(strategies).__name__}")
    found = strategies(layer)
    if not isinstance(found, OperationsStrategy):
        raise TypeError(f"the strategy function {getattr(strategies, '__name__', strategies)!r} returned "
                        f"{type(found).__name__} for {layer!r}, not an OperationsStrategy")
    return found


def _check_required_ops(strategy: OperationsStrategy, layer: Any) -> None:
    """A layer may name ops (``required_ops``) without which its math is incomplete, such as the shared expert of a
    layer that has one: a strategy without them would run, and run wrong, so it is refused here."""
    have = {op_name(item) for item in strategy.operations if item is not Yield}
    missing = [name for name in getattr(layer, "required_ops", ()) if name not in have]
    if missing:
        raise StrategyError(f"strategy {strategy.name or '(unnamed)'} has no op {', '.join(missing)}, which "
                            f"{layer!r} needs (it would be skipped, and the layer's output wrong)")


def bind_layers(layers: Sequence[Any], strategies: LayerStrategies, name: str | None = None, *,
                backend: Any = None, num_microbatches: int | None = 2) -> OperationsStrategy:
    """Bind each layer's strategy to it and join them into the one list the executor runs, by
    `OperationsStrategy.concat`'s rule (multi-stage layers agree on the lead; a dense layer's one stage takes any).

    The joined strategy's schedule (``num_microbatches`` of them) is then checked against the `InFlightLimit` of
    ``backend``, or of the layers' own ``backend`` attributes when none is given (DeepEP low-latency: one
    un-received call): a launch over the limit is a `StrategyError` naming both ops and both microbatches, here
    rather than a hang on the GPUs. `model_forward_maybe_tbo` checks other microbatch counts when a plan has them;
    ``num_microbatches=None`` leaves the check to it (an adapter that binds every mode up front, some of which may
    only ever run unsplit).
    """
    if not layers:
        raise StrategyError("bind_layers needs at least one layer")
    strategies = _named(strategies)  # once, not per layer
    per_layer = [_for_layer(strategies, layer) for layer in layers]
    for strategy, layer in zip(per_layer, layers):
        _check_required_ops(strategy, layer)
    bound = OperationsStrategy.concat([s.bind(layer) for s, layer in zip(per_layer, layers)],
                                      name=name or per_layer[-1].name)
    bound.check_flow()  # each layer was checked alone; this sees what one layer hands the next
    owners = [backend] if backend is not None else list({id(b): b for b in (getattr(layer, "backend", None)
                                                                           for layer in layers)}.values())
    for owner in owners if num_microbatches is not None else ():
        bound.check_in_flight(limit_of(owner), num_microbatches)
    return bound
