"""`model_forward_maybe_tbo`: one step of a stack of layers, overlapped when a split plan exists, else as one batch.

This is the seam between a framework and tbo: the framework owns the layers, the inputs and the split decision
(`SplitPolicy`, `agree_to_split`); this function splits, runs the bound strategy, and merges. What a microbatch's
ops need besides tensors (attention metadata, a KV cache) arrives through ``pinned``, as pinned State keys.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

from tbo.core.executors import execute_operations, execute_overlapped_operations
from tbo.core.executors.guard import Drainable
from tbo.core.observer import Observer
from tbo.runtime.profile import RecordFunctionObserver
from tbo.runtime.sm_budget import deep_gemm_num_sms
from tbo.split.plan import MicrobatchSlice, SplitPlan
from tbo.split.tensors import merge_outputs, split_inputs
from tbo.core.state import State
from tbo.strategies.dense import LayerStrategies, bind_layers
from tbo.core.strategy import OperationsStrategy

__all__ = ["model_forward_maybe_tbo"]

Pinned = Callable[[MicrobatchSlice | None], Mapping[str, Any]]


def model_forward_maybe_tbo(
    layers: Sequence[Any],
    inputs: Mapping[str, Any],
    strategy: LayerStrategies,
    plan: SplitPlan | None,
    *,
    pinned: Pinned | None = None,
    request_keys: Iterable[str] = (),
    shared_keys: Iterable[str] = (),
    output_key: str = "hidden_states",
    backend: Drainable | None = None,
    observer: Observer | None = None,
    profile: bool = False,
    **guard: Any,
) -> dict[str, Any]:
    """Run ``layers`` on ``inputs``; overlapped over ``plan``'s microbatches, or unsplit when ``plan`` is None.

    ``strategy`` is a bound strategy for the whole stack (build it once with `bind_layers`: the fast path), or what
    `bind_layers` takes: one strategy for every layer, one per layer kind, or a function of the layer.
    ``pinned(slice)`` returns step-scoped values to pin in each microbatch's State (``slice`` is None unsplit).
    ``backend``: the layers' communication backend (an `EPBackend`, an AFD connector). Unless ``guard`` names
    ``drain`` itself, a step that fails drains it before raising, so no transfer still writes into buffers the
    caller is about to free or reuse. ``profile`` adds torch.profiler ranges per stage and op.
    ``guard`` passes ``drain``, ``watchdog_s``, ``watchdog_label`` and ``dump_stacks`` to the executor.
    Returns ``{output_key: tensor}``, merged back to the whole batch.
    """
    if backend is not None:
        guard.setdefault("drain", (backend,))
    observers = [RecordFunctionObserver(), observer] if profile else observer
    bound = strategy if isinstance(strategy, OperationsStrategy) and strategy.is_bound else bind_layers(
        layers, strategy)
    with deep_gemm_num_sms(bound.deep_gemm_num_sms):
        if plan is None:
            state = State()
            if pinned is not None:
                state.pin(**pinned(None))
            out = execute_operations(inputs, bound, state=state, observer=observers, **guard)
            return {output_key: out[output_key]}
        parts = split_inputs(inputs, plan, request_keys=request_keys, shared_keys=shared_keys)
        states = plan.make_states()
        if pinned is not None:
            for state, mb in zip(states, plan.microbatches):
                state.pin(**pinned(mb))
        outs = execute_overlapped_operations(parts, bound, states=states, observer=observers, **guard)
        return {output_key: merge_outputs([o[output_key] for o in outs], plan)}
