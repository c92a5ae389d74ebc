"""The generic overlapped executor: walk a compiled `Schedule`, running each microbatch's next stage in turn.

It knows ops, stages, a schedule and states, and nothing else: no tensors, no models, no distributed. Overlap comes
from the ops themselves (``*_a`` launches a transfer and returns; ``*_b`` waits), and from the schedule, which puts
another microbatch's compute between them.

Speed matters because this loop runs ~60 layers x 2 microbatches every decode step. So stages are split once (by the
strategy), the schedule is compiled once (cached), and with no observer the inner loop is exactly the plain
``out = op(state, **out)`` a hand-written loop would do. An engine's `StageHooks` (its per-microbatch forward
context) keep that loop: they add two calls around each stage, none per op; only an `Observer` takes the observed
path.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from tbo.core.errors import HangError, OperationError, StrategyError
from tbo.core.observer import Observer, as_observer
from tbo.core.operations import YieldType, op_name
from tbo.core.schedule import Schedule, interleave
from tbo.core.stage_hooks import StageHooks
from tbo.core.state import State
from tbo.core.strategy import OperationsStrategy
from tbo.core.executors.guard import Drainable, PositionObserver, drain_all, watchdog

__all__ = ["execute_operations", "execute_overlapped_operations", "run_schedule"]

_EMPTY: Mapping[str, Any] = {}


class _StageExecutor:
    """One microbatch: its stages, its State, its cursor, and the last op's output (next op's input)."""

    __slots__ = ("mb", "stages", "state", "output", "stage")

    def __init__(self, mb: int, strategy: OperationsStrategy, inputs: Mapping[str, Any], state: State) -> None:
        self.mb = mb
        self.stages = strategy.stages
        self.state = state
        self.output: Any = inputs
        self.stage = 0

    @property
    def done(self) -> bool:
        return self.stage >= len(self.stages)

    def next(self) -> None:
        """Run the next stage. The fast path: one call per op, nothing else (the failing op is the loop variable)."""
        state, out, op = self.state, self.output, None
        try:
            for op in self.stages[self.stage]:
                out = op(state, **(out or _EMPTY))
        except HangError:
            raise  # the watchdog speaks for the whole step, not for this op
        except Exception as exc:
            raise self._error(op, out, exc) from exc
        self.output = out
        self.stage += 1

    def _error(self, op: Any, received: Any, exc: Exception) -> OperationError:
        """The failure path only: blame the op that broke the contract, which is not always the one that raised.

        An error raised by the call itself (no frame of the op on the traceback: the output could not be unpacked,
        or Python could not bind the arguments) is about what the op received, i.e. what the previous op returned.
        A non-dict is that op's fault; None or the wrong keys are reported at the op called, saying what the
        previous op handed over.
        """
        stage, ops = self.stage, self.stages[self.stage]
        if exc.__traceback__ is None or exc.__traceback__.tb_next is not None:  # raised inside the op
            return OperationError(self.mb, stage, op_name(op), exc)
        pos = next((j for j, o in enumerate(ops) if o is op), 0)  # the first, if one callable sits twice in a stage
        prev_stage = stage if pos else stage - 1
        prev = ops[pos - 1] if pos else self.stages[prev_stage][-1] if stage else None
        if prev is not None and received is not None and not isinstance(received, Mapping):
            return OperationError(self.mb, prev_stage, op_name(prev), TypeError(
                f"it returned a {type(received).__name__}, which the next op, {op_name(op)!r} (stage {stage}), "
                "cannot take: an op returns a dict (passed on as keyword arguments) or None; only the last op may "
                f"return anything else ({exc})"
            ))
        if not isinstance(exc, TypeError):
            return OperationError(self.mb, stage, op_name(op), exc)
        if prev is None:
            source = "the microbatch's inputs"
        else:
            source = f"the previous op, {op_name(prev)!r} (stage {prev_stage})"
        if received is None and prev is not None:
            note = f"{source}, returned nothing (None), so it got no arguments"
        elif not received:
            note = f"{source} gave it no arguments"
        else:
            note = f"it got the keyword arguments {sorted(received)} from {source}"
        return OperationError(self.mb, stage, op_name(op), TypeError(f"{exc}; {note}"))


class _HookedStageExecutor(_StageExecutor):
    """The fast path with an engine's `StageHooks` around each stage: two calls a stage, none per op."""

    __slots__ = ("hooks",)

    def __init__(self, mb: int, strategy: OperationsStrategy, inputs: Mapping[str, Any], state: State,
                 hooks: StageHooks) -> None:
        super().__init__(mb, strategy, inputs, state)
        self.hooks = hooks

    def next(self) -> None:
        hooks, mb, stage = self.hooks, self.mb, self.stage
        state, out, op = self.state, self.output, None
        hooks.enter_stage(mb, stage)
        try:
            for op in self.stages[stage]:
                out = op(state, **(out or _EMPTY))
        except HangError:
            raise
        except Exception as exc:
            raise self._error(op, out, exc) from exc
        finally:
            hooks.leave_stage(mb, stage)  # also when an op raised: the step's context is current again
        self.output = out
        self.stage += 1


class _ObservedStageExecutor(_StageExecutor):
    """The same, reporting every stage and op to an observer (inside the stage hooks, if any). Chosen once per run,
    never per op."""

    __slots__ = ("observer", "names", "hooks")

    def __init__(self, mb: int, strategy: OperationsStrategy, inputs: Mapping[str, Any], state: State,
                 observer: Observer, hooks: StageHooks | None = None) -> None:
        super().__init__(mb, strategy, inputs, state)
        self.observer = observer
        self.names = strategy.stage_names
        self.hooks = hooks

    def next(self) -> None:
        hooks, mb, stage = self.hooks, self.mb, self.stage
        if hooks is None:
            return self._observed()
        hooks.enter_stage(mb, stage)
        try:
            self._observed()
        finally:
            hooks.leave_stage(mb, stage)  # also when an op raised

    def _observed(self) -> None:
        obs, mb, stage = self.observer, self.mb, self.stage
        state, out, op = self.state, self.output, None
        obs.on_stage_start(mb, stage)
        try:
            for op, name in zip(self.stages[stage], self.names[stage]):
                obs.on_op_start(mb, stage, name)
                out = op(state, **(out or _EMPTY))
                obs.on_op_end(mb, stage, name)
        except HangError:
            raise
        except Exception as exc:
            raise self._error(op, out, exc) from exc
        obs.on_stage_end(mb, stage)
        self.output = out
        self.stage += 1


def run_schedule(schedule: Schedule, executors: Sequence[_StageExecutor]) -> list[Any]:
    """Run every step of ``schedule``; return each microbatch's last output, in microbatch order."""
    steps = [e.next for e in executors]
    for mb in schedule.microbatch_order:
        steps[mb]()
    return [e.output for e in executors]


def _as_strategies(operations_arr: Any, count: int) -> list[OperationsStrategy]:
    """One bound strategy per microbatch, from a shared strategy, a shared flat list, or one of either per microbatch."""
    if isinstance(operations_arr, OperationsStrategy):
        items: list[Any] = [operations_arr] * count
    elif isinstance(operations_arr, Sequence) and operations_arr and all(
        isinstance(o, (OperationsStrategy, list, tuple)) for o in operations_arr
    ):
        items = list(operations_arr)
        if len(items) != count:
            raise ValueError(f"got {len(items)} operation lists for {count} microbatches; they must match")
    elif isinstance(operations_arr, Sequence) and all(
        callable(o) or isinstance(o, (str, YieldType)) for o in operations_arr
    ):
        items = [operations_arr] * count  # one flat list shared by every microbatch
    else:
        raise StrategyError(
            "operations must be an OperationsStrategy, a list of ops and Yield, or one of those per microbatch"
        )
    strategies = [s if isinstance(s, OperationsStrategy) else OperationsStrategy(operations=s) for s in items]
    for mb, s in enumerate(strategies):
        if not s.is_bound:
            unbound = [f"[{i}] {o!r}" for i, o in enumerate(s.operations) if isinstance(o, str)]
            raise StrategyError(
                f"microbatch {mb}: strategy {s.name or '(unnamed)'} has unbound op names {', '.join(unbound[:5])}"
                f"{' ...' if len(unbound) > 5 else ''}; call strategy.bind(layer) first"
            )
    return strategies


def execute_overlapped_operations(
    inputs_arr: Sequence[Mapping[str, Any]],
    operations_arr: Any,
    delta_stages: int | Sequence[int] | None = None,
    *,
    states: Sequence[State] | None = None,
    observer: Observer | Sequence[Observer] | None = None,
    stage_hooks: StageHooks | None = None,
    drain: Sequence[Drainable] = (),
    watchdog_s: float | None = None,
    watchdog_label: str = "",
    dump_stacks: bool = False,
) -> list[Any]:
    """Run two or more microbatches interleaved; return each one's last op output, in microbatch order.

    The output is whatever the last op returned, None included: a run may leave its results in the ``states`` the
    caller passed, so the executor does not second-guess it (`model_forward_maybe_tbo`, which needs a dict, raises
    naming the last op).

    ``operations_arr`` is an `OperationsStrategy` (or a flat op list) shared by all microbatches, or one per
    microbatch. Pass bound strategies built once: raw lists are validated and split on every call.
    ``delta_stages`` is the lead of each microbatch over the next, or a per-microbatch offset list (``[0, 2]`` is the
    same as ``2``); None takes the strategy's own. ``states`` pre-filled per microbatch (split metadata, say) are
    used as given; otherwise each microbatch gets a fresh `State`.

    ``stage_hooks``: an engine's `StageHooks`, entered and left around every stage of every microbatch, in schedule
    order (its forward context); without an observer the run keeps the fast path.
    ``drain``: backends whose transfers in flight are waited out when an op fails, before `OperationError` is raised.
    ``watchdog_s``: a step running longer raises `HangError` with each microbatch's position, the pending transfers
    of ``drain`` and ``watchdog_label``; ``dump_stacks`` adds every thread's stack.
    """
    count = len(inputs_arr)
    if count < 1:
        raise ValueError("execute_overlapped_operations needs at least one microbatch")
    for mb, inputs in enumerate(inputs_arr):
        if not isinstance(inputs, Mapping):
            raise TypeError(f"inputs_arr[{mb}] is a {type(inputs).__name__}; each microbatch's inputs must be a dict")
    strategies = _as_strategies(operations_arr, count)
    if delta_stages is None:
        deltas = {s.delta_stages for s in strategies}
        if len(deltas) > 1:
            raise StrategyError(f"microbatch strategies disagree on delta_stages {sorted(deltas)}; pass delta_stages")
        delta_stages = deltas.pop()
    if states is None:
        states = [State() for _ in range(count)]
    elif len(states) != count:
        raise ValueError(f"got {len(states)} states for {count} microbatches; they must match")
    schedule = interleave([s.num_stages for s in strategies], delta_stages)
    obs = as_observer(observer)
    positions = None
    if watchdog_s is not None:
        obs = positions = PositionObserver(count, obs)
    runs = list(enumerate(zip(strategies, inputs_arr, states)))
    if obs is not None:
        executors: list[_StageExecutor] = [_ObservedStageExecutor(mb, s, i, st, obs, stage_hooks)
                                           for mb, (s, i, st) in runs]
    elif stage_hooks is not None:
        executors = [_HookedStageExecutor(mb, s, i, st, stage_hooks) for mb, (s, i, st) in runs]
    else:
        executors = [_StageExecutor(mb, s, i, st) for mb, (s, i, st) in runs]
    if obs is None and not drain:
        return run_schedule(schedule, executors)
    try:
        if positions is not None:
            with watchdog(watchdog_s, watchdog_label, positions, drain, dump_stacks):  # type: ignore[arg-type]
                return run_schedule(schedule, executors)
        return run_schedule(schedule, executors)
    except OperationError as exc:
        problems = drain_all(drain)  # nothing may still write into buffers the caller is about to free or reuse
        for problem in problems:
            exc.add_note(f"while draining after the failure: {problem}")
        raise
    finally:
        if obs is not None:
            obs.close()


def execute_operations(
    inputs: Mapping[str, Any],
    operations: Any,
    *,
    state: State | None = None,
    observer: Observer | Sequence[Observer] | None = None,
    stage_hooks: StageHooks | None = None,
    **guard: Any,
) -> Any:
    """Run one microbatch through every stage in order: the single-batch reference the overlapped run must equal.

    ``guard`` takes the `execute_overlapped_operations` keywords ``drain``, ``watchdog_s``, ``watchdog_label`` and
    ``dump_stacks``."""
    return execute_overlapped_operations(
        [inputs], operations, 0, states=None if state is None else [state], observer=observer,
        stage_hooks=stage_hooks, **guard,
    )[0]
