"""`StageHooks`: an engine's per-stage enter/leave (its forward context), apart from `Observer`.

The hooks are called in schedule order around every stage, every op runs between its own microbatch's enter and
leave, a failing op's stage is still left, and with hooks and no observer the executor keeps its fast path (the
observed path's functions are never entered)."""

from __future__ import annotations

import pytest
import torch

from tbo import OperationError, OperationsStrategy, Yield, execute_operations, execute_overlapped_operations
from tbo.core import StageHooks
from tbo.core.executors import overlapped
from tbo.core.observer import Observer
from tbo.core.schedule import interleave


class Contexts(StageHooks):
    """Stands for an engine's forward context: one microbatch's is current between its enter and leave."""

    def __init__(self) -> None:
        self.current: int | None = None
        self.events: list[tuple[str, int, int]] = []

    def enter_stage(self, mb: int, stage: int) -> None:
        assert self.current is None, f"microbatch {mb} stage {stage} entered inside microbatch {self.current}'s"
        self.current = mb
        self.events.append(("enter", mb, stage))

    def leave_stage(self, mb: int, stage: int) -> None:
        assert self.current == mb, (self.current, mb)
        self.current = None
        self.events.append(("leave", mb, stage))


def _strategy(contexts: Contexts, num_stages: int, delta: int, seen: list) -> OperationsStrategy:
    """``num_stages`` stages of two fp32 ops each; every op records which microbatch's context it ran in."""
    w = torch.linspace(-1.0, 1.0, 64, dtype=torch.float32).reshape(8, 8)

    def make(stage: int, k: int):
        def op(state, x):
            seen.append((state.mb, stage, contexts.current))
            return {"x": torch.tanh(x @ w) + k}
        op.__name__ = f"op_s{stage}_{k}"
        return op

    ops: list = []
    for stage in range(num_stages):
        if stage:
            ops.append(Yield)
        ops += [make(stage, 0), make(stage, 1)]
    return OperationsStrategy(operations=ops, delta_stages=delta)


def _inputs(sizes):
    g = torch.Generator().manual_seed(sum(sizes))
    return [{"x": torch.randn(n, 8, generator=g)} for n in sizes]


def _states(count):
    from tbo import State
    return [State(mb=i) for i in range(count)]


@pytest.mark.parametrize("sizes,num_stages,delta", [((3, 5), 4, 1), ((2, 7), 3, 0), ((4, 1, 6), 5, 2),
                                                    ((5, 5, 2, 3), 2, 1)])
def test_hooks_enclose_every_stage_in_schedule_order(sizes, num_stages, delta):
    contexts, seen = Contexts(), []
    strategy = _strategy(contexts, num_stages, delta, seen)
    ins = _inputs(sizes)
    out = execute_overlapped_operations(ins, strategy, states=_states(len(sizes)), stage_hooks=contexts)
    steps = list(interleave([num_stages] * len(sizes), delta).steps)
    assert contexts.events == [(kind, mb, s) for mb, s in steps for kind in ("enter", "leave")]
    assert len(seen) == 2 * num_stages * len(sizes)
    assert all(ctx == mb for mb, _, ctx in seen), "an op ran outside its own microbatch's context"
    assert contexts.current is None  # the step's own context is current after the run
    # the hooks change nothing the ops compute: fp32 exact against each microbatch run alone, without hooks
    alone = [execute_operations(i, _strategy(Contexts(), num_stages, delta, []), state=st)
             for i, st in zip(ins, _states(len(sizes)))]
    for got, want in zip(out, alone):
        assert torch.equal(got["x"], want["x"])


def test_hooks_alone_keep_the_fast_path(monkeypatch):
    """With only hooks, the observed executor is never entered and the hooked fast path is; with an observer too,
    the same patch trips (so it would have caught the slow path)."""
    def slow(*args, **kwargs):
        raise AssertionError("the observed path was entered")

    monkeypatch.setattr(overlapped._ObservedStageExecutor, "next", slow)
    monkeypatch.setattr(overlapped._ObservedStageExecutor, "_observed", slow)
    fast_calls = []
    fast_next = overlapped._HookedStageExecutor.next

    def counting(self):
        fast_calls.append((self.mb, self.stage))
        return fast_next(self)

    monkeypatch.setattr(overlapped._HookedStageExecutor, "next", counting)
    contexts, seen = Contexts(), []
    strategy = _strategy(contexts, 3, 1, seen)
    execute_overlapped_operations(_inputs((3, 4)), strategy, states=_states(2), stage_hooks=contexts)
    assert fast_calls == list(interleave([3, 3], 1).steps)
    assert len(contexts.events) == 2 * 6
    with pytest.raises(AssertionError, match="observed path was entered"):
        execute_overlapped_operations(_inputs((3, 4)), strategy, states=_states(2), stage_hooks=Contexts(),
                                      observer=Observer())


def test_a_failing_op_leaves_its_stage_and_is_named():
    contexts = Contexts()

    def ok(state, x):
        return {"x": x + 1}

    def boom(state, x):
        if state.mb == 1:
            raise ValueError("bad rows")
        return {"x": x}

    strategy = OperationsStrategy(operations=[ok, Yield, boom, Yield, ok], delta_stages=1)
    with pytest.raises(OperationError, match=r"microbatch 1.*stage 1.*boom") as err:
        execute_overlapped_operations(_inputs((2, 3)), strategy, states=_states(2), stage_hooks=contexts)
    assert isinstance(err.value.__cause__, ValueError)
    assert contexts.current is None, "the failing stage's context was not left"
    assert contexts.events[-2:] == [("enter", 1, 1), ("leave", 1, 1)]


def test_an_observer_runs_inside_the_hooks():
    contexts = Contexts()
    events = []

    class Watch(Observer):
        def on_stage_start(self, mb, stage):
            events.append(("start", mb, stage, contexts.current))

        def on_stage_end(self, mb, stage):
            events.append(("end", mb, stage, contexts.current))

    strategy = _strategy(contexts, 2, 1, [])
    execute_overlapped_operations(_inputs((2, 2)), strategy, states=_states(2), stage_hooks=contexts,
                                  observer=Watch())
    steps = list(interleave([2, 2], 1).steps)
    assert events == [(kind, mb, s, mb) for mb, s in steps for kind in ("start", "end")]
    assert contexts.events == [(kind, mb, s) for mb, s in steps for kind in ("enter", "leave")]
