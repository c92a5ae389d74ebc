"""`model_forward_maybe_tbo`: one step of a stack of layers, overlapped when a split plan exists, else as one batch.

This is the seam between a framework and tbo: the framework owns the layers, the inputs and the split decision
(`SplitPolicy`, `agree_to_split`); this function splits, runs the bound strategy, and merges. What a microbatch's
ops need besides tensors (attention metadata, a KV cache) arrives through ``pinned``, as pinned State keys.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

from tbo.core.executors import execute_operations, execute_overlapped_operations
from tbo.core.executors.guard import Drainable
from tbo.core.inflight import limit_of
from tbo.core.observer import Observer
from tbo.core.stage_hooks import StageHooks
from tbo.runtime.profile import RecordFunctionObserver
from tbo.comm.sm_budget import deep_gemm_num_sms
from tbo.split.plan import MicrobatchSlice, SplitPlan
from tbo.split.tensors import RequestRule, merge_outputs, split_inputs
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
    request_keys: Iterable[str] | Mapping[str, RequestRule] = (),
    shared_keys: Iterable[str] = (),
    output_key: str | Sequence[str] = "hidden_states",
    backend: Drainable | None = None,
    observer: Observer | None = None,
    stage_hooks: StageHooks | None = None,
    profile: bool = False,
    **guard: Any,
) -> dict[str, Any]:
    """Run ``layers`` on ``inputs``; overlapped over ``plan``'s microbatches, or unsplit when ``plan`` is None.

    ``strategy`` is a bound strategy for the whole stack (build it once with `bind_layers`: the fast path), or what
    `bind_layers` takes: one strategy for every layer (or its registered name, ``"deepseek_decode"``), one per
    layer kind, or a function of the layer.
    ``pinned(slice)`` returns step-scoped values to pin in each microbatch's State (``slice`` is None unsplit).
    ``request_keys`` and ``shared_keys`` say how `split_inputs` splits the non-token inputs: per-request keys with
    their `RequestRule` (``{"extend_lens": "lengths"}``), so that a plan cutting a sequence splits them correctly.
    ``backend``: the layers' communication backend (an `EPBackend`, an AFD connector). Unless ``guard`` names
    ``drain`` itself, a step that fails drains it before raising, so no transfer still writes into buffers the
    caller is about to free or reuse. A backend with an ``in_flight_limit`` (DeepEP low-latency) has the plan's
    schedule checked against it first (`OperationsStrategy.check_in_flight`, once per microbatch count).
    ``stage_hooks``: the engine's `StageHooks` around each microbatch's stages (its forward context: correctness, not
    diagnostics), kept apart from ``observer`` so that a split step without one runs the executor's fast path.
    ``profile`` adds torch.profiler ranges per stage and op.
    ``guard`` passes ``drain``, ``watchdog_s``, ``watchdog_label`` and ``dump_stacks`` to the executor.
    Returns ``{output_key: tensor}``, merged back to the whole batch; ``output_key`` may name several outputs
    (``("hidden_states", "residual")`` for a layer stack that hands the residual on, as vLLM's do), each merged.
    """
    keys = (output_key,) if isinstance(output_key, str) else tuple(output_key)
    if backend is not None:
        guard.setdefault("drain", (backend,))
    observers = [RecordFunctionObserver(), observer] if profile else observer
    bound = strategy if isinstance(strategy, OperationsStrategy) and strategy.is_bound else bind_layers(
        layers, strategy, backend=backend)
    if plan is not None:  # the schedule of this plan's microbatch count, against the backend's limit (cached)
        bound.check_in_flight(limit_of(backend), len(plan.microbatches))
    with deep_gemm_num_sms(bound.deep_gemm_num_sms):
        if plan is None:
            state = State()
            if pinned is not None:
                state.pin(**pinned(None))
            out = execute_operations(inputs, bound, state=state, observer=observers, stage_hooks=stage_hooks, **guard)
            return {key: _result(out, key, bound, 0) for key in keys}
        parts = split_inputs(inputs, plan, request_keys=request_keys, shared_keys=shared_keys)
        states = plan.make_states()
        if pinned is not None:
            for state, mb in zip(states, plan.microbatches):
                state.pin(**pinned(mb))
        outs = execute_overlapped_operations(parts, bound, states=states, observer=observers, stage_hooks=stage_hooks,
                                             **guard)
        return {key: merge_outputs([_result(o, key, bound, k) for k, o in enumerate(outs)], plan) for key in keys}


def _result(out: Any, output_key: str, strategy: OperationsStrategy, mb: int) -> Any:
    """The step's output tensor from the last op's return value, or an error naming that op.

    The executor hands back whatever the last op returned, None included (a run may leave its results in States
    the caller passed); this seam needs ``{output_key: tensor}``, so it is where a missing result is an error.
    """
    if isinstance(out, Mapping) and output_key in out:
        return out[output_key]
    last = f"the last op, {strategy.stage_names[-1][-1]!r} (stage {strategy.num_stages - 1})"
    if not isinstance(out, Mapping):
        raise TypeError(f"microbatch {mb}: {last}, returned {'nothing (None)' if out is None else type(out).__name__}"
                        f"; model_forward_maybe_tbo needs it to return {{{output_key!r}: tensor}}")
    raise ValueError(f"microbatch {mb}: {last}, returned keys {sorted(out)} without {output_key!r}; pass "
                     f"output_key= to name the output")
