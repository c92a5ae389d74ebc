import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tbo import (OperationError, OperationsStrategy, State, StrategyError, Yield, execute_operations,
                 execute_overlapped_operations)
from tbo.core.observer import Observer
from tbo.core.schedule import interleave
from tbo.runtime.profile import RecordFunctionObserver


class ToyMoELayer:
    """Real torch work with state carried across stages, the way an MoE layer carries handles."""

    def __init__(self, hidden=16, experts=4, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.w_attn = torch.randn(hidden, hidden, generator=g) / hidden**0.5
        self.w_gate = torch.randn(hidden, experts, generator=g)
        self.w_exp = torch.randn(experts, hidden, hidden, generator=g) / hidden**0.5

    def op_attn(self, state, x):
        state.residual = x
        return {"h": torch.tanh(x @ self.w_attn)}

    def op_gate(self, state, h):
        state.topk = torch.topk(h @ self.w_gate, 2, dim=-1)
        return {"h": h}

    def op_dispatch_a(self, state, h):
        state.handle = ("in flight", h.clone())  # stands for an async transfer's handle
        return None

    def op_dispatch_b(self, state):
        _, h = state.pop("handle")
        return {"h": h}

    def op_experts(self, state, h):
        weights, idx = state.topk.values.softmax(-1), state.pop("topk").indices
        out = torch.zeros_like(h)
        for k in range(idx.shape[1]):
            per_expert = torch.einsum("th,thd->td", h, self.w_exp[idx[:, k]])
            out = out + weights[:, k : k + 1] * per_expert
        return {"h": out}

    def op_combine_a(self, state, h):
        state.combine = h * 1.0
        return None

    def op_combine_b(self, state):
        return {"h": state.pop("combine")}

    def op_output(self, state, h):
        x = state.pop("residual") + h
        state.clear()
        return {"x": x}


OP_ORDER = ["attn", "gate", "dispatch_a", "dispatch_b", "experts", "combine_a", "combine_b", "output"]


def make_strategy(cuts, delta, layers=1):
    ops = []
    for i, name in enumerate(OP_ORDER):
        if i in cuts:
            ops.append(Yield)
        ops.append(name)
    return OperationsStrategy(operations=ops, delta_stages=delta), layers


def build(cuts=(2, 4, 6), delta=1, num_layers=3):
    layers = [ToyMoELayer(seed=i) for i in range(num_layers)]
    per_layer, _ = make_strategy(cuts, 0)
    strategy = OperationsStrategy.concat([per_layer.bind(l) for l in layers])
    strategy = OperationsStrategy(operations=strategy.operations, delta_stages=delta)
    return strategy


def inputs(sizes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(n, 16, generator=g)} for n in sizes]


@pytest.mark.parametrize("delta", [0, 1, 2])
@pytest.mark.parametrize("sizes", [(5, 7), (1, 9, 3), (4, 4, 4, 4)])
def test_overlapped_equals_sequential_bit_exact(delta, sizes):
    strategy = build(delta=delta)
    ins = inputs(sizes)
    overlapped = execute_overlapped_operations(ins, strategy)
    sequential = [execute_operations(i, strategy) for i in ins]
    assert len(overlapped) == len(sizes)
    for got, want in zip(overlapped, sequential):
        assert torch.equal(got["x"], want["x"])


def test_results_in_microbatch_order():
    strategy = build(delta=2)
    ins = inputs((2, 3, 4))
    out = execute_overlapped_operations(ins, strategy)
    assert [o["x"].shape[0] for o in out] == [2, 3, 4]


def test_delta_list_same_as_int():
    strategy = build(delta=0)
    ins = inputs((3, 5))
    calls_a, calls_b = [], []

    class Rec(Observer):
        def __init__(self, calls):
            self.calls = calls

        def on_stage_start(self, mb, stage):
            self.calls.append((mb, stage))

    execute_overlapped_operations(ins, strategy, 2, observer=Rec(calls_a))
    execute_overlapped_operations(ins, strategy, [0, 2], observer=Rec(calls_b))
    assert calls_a == calls_b == list(interleave([strategy.num_stages] * 2, 2).steps)


def test_op_input_output_chaining_and_first_inputs():
    seen = []

    def first(state, a, b):
        seen.append((a, b))
        return {"c": a + b}

    def second(state, c):
        state.c = c
        return None

    def third(state):
        return state.c * 10

    s = OperationsStrategy(operations=[first, Yield, second, third], delta_stages=1)
    assert execute_overlapped_operations([{"a": 1, "b": 2}, {"a": 3, "b": 4}], s) == [30, 70]
    assert seen == [(1, 2), (3, 4)]


def test_states_are_per_microbatch_and_can_be_prefilled():
    def read(state):
        return {"v": state.microbatch_idx}

    def out(state, v):
        return (v, state.num_microbatches)

    s = OperationsStrategy(operations=[read, Yield, out], delta_stages=1)
    states = [State(microbatch_idx=i, num_microbatches=2) for i in range(2)]
    assert execute_overlapped_operations([{}, {}], s, states=states) == [(0, 2), (1, 2)]


class Recorder(Observer):
    def __init__(self):
        self.events = []

    def on_stage_start(self, mb, stage):
        self.events.append(("stage", mb, stage))

    def on_op_start(self, mb, stage, name):
        self.events.append(("op", mb, stage, name))

    def on_stage_end(self, mb, stage):
        self.events.append(("end", mb, stage))


def test_observer_sees_schedule_and_ops():
    strategy = build(num_layers=1, delta=1)
    rec = Recorder()
    execute_overlapped_operations(inputs((2, 2)), strategy, observer=rec)
    stages = [(e[1], e[2]) for e in rec.events if e[0] == "stage"]
    assert stages == list(interleave([4, 4], 1).steps)
    ops_mb0 = [e[3] for e in rec.events if e[0] == "op" and e[1] == 0]
    assert ops_mb0 == OP_ORDER


def test_profile_adds_record_function_ranges():
    strategy = build(num_layers=1, delta=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        execute_overlapped_operations(inputs((2, 2)), strategy, observer=RecordFunctionObserver())
    names = {e.name for e in prof.events()}
    assert "tbo/mb1/stage3" in names and "tbo/mb0/dispatch_a" in names


def test_op_times_sum_each_op_over_microbatches_and_layers():
    """`OpTimes` with a clock that advances one tick per read: each op's start and end are one tick apart, so every
    op adds exactly one tick per call; the waits are the ``*_b`` ops."""
    from tbo.runtime.op_times import OpTimes

    ticks = iter(range(1_000_000))
    timer = OpTimes(clock=lambda: float(next(ticks)))
    strategy = build(num_layers=2, delta=1)
    execute_overlapped_operations(inputs((2, 2)), strategy, observer=[Recorder(), timer])
    assert timer.calls == {name: 2 * 2 for name in OP_ORDER}  # 2 microbatches x 2 layers
    assert timer.seconds == {name: 4.0 for name in OP_ORDER}
    assert timer.exposed_wait_s() == 4.0 * sum(name.endswith("_b") for name in OP_ORDER) > 0


def test_operation_error_names_microbatch_stage_op_and_stops():
    ran = []

    def ok(state, **kw):
        ran.append(("ok", state.mb))
        return None

    def boom(state, **kw):
        if state.mb == 1:
            raise ZeroDivisionError("division by zero in test")
        ran.append(("boom", state.mb))
        return None

    def after(state, **kw):
        ran.append(("after", state.mb))

    s = OperationsStrategy(operations=[ok, Yield, ok, boom, Yield, after], delta_stages=1)
    with pytest.raises(OperationError) as info:
        execute_overlapped_operations([{}, {}], s, states=[State(mb=0), State(mb=1)])
    err = info.value
    assert (err.microbatch, err.stage, err.op_name) == (1, 1, "boom")
    assert "microbatch 1, stage 1, op 'boom'" in str(err)
    assert isinstance(err.__cause__, ZeroDivisionError)
    # schedule: A0, A1, B0, A2, B1(boom) -> A's stage 2 ran, nothing after B's failure
    assert ran == [("ok", 0), ("ok", 0), ("boom", 0), ("ok", 1), ("after", 0), ("ok", 1)]


def test_operation_error_with_observer_path():
    def boom(state):
        raise ValueError("bad")

    s = OperationsStrategy(operations=[lambda st: None, Yield, boom])
    with pytest.raises(OperationError, match="microbatch 0, stage 1, op 'boom'"):
        execute_overlapped_operations([{}, {}], s, observer=[RecordFunctionObserver(), Recorder()])


def test_non_dict_output_blames_the_op_that_returned_it():
    def first(state):
        return {}

    def returns_tensor(state):
        return torch.ones(3)

    def consumer(state, **kw):
        return None

    for strategy, stage in ((OperationsStrategy(operations=[first, returns_tensor, consumer]), 0),
                            (OperationsStrategy(operations=[first, returns_tensor, Yield, consumer]), 0)):
        for observer in (None, Recorder()):  # the fast path and the observed path say the same
            with pytest.raises(OperationError, match=rf"microbatch 0, stage {stage}, op 'returns_tensor' failed: "
                                                     r"TypeError: it returned a Tensor, which the next op, 'consumer' "
                                                     r"\(stage \d\), cannot take: an op returns a dict") as info:
                execute_overlapped_operations([{}], strategy, observer=observer)
            assert (info.value.stage, info.value.op_name) == (stage, "returns_tensor")
    # across a Yield in an overlapped run: the producer's stage, not the consumer's
    s = OperationsStrategy(operations=[first, Yield, returns_tensor, Yield, consumer], delta_stages=1)
    with pytest.raises(OperationError, match="microbatch 0, stage 1, op 'returns_tensor'"):
        execute_overlapped_operations([{}, {}], s)


def test_none_output_then_an_op_with_arguments_says_so():
    def attn(state, x):
        state.x = x
        return None  # forgot to return {"h": ...}

    def route(state, h):
        return {"h": h}

    s = OperationsStrategy(operations=[attn, Yield, route])
    with pytest.raises(OperationError, match=r"microbatch 0, stage 1, op 'route' failed: TypeError: .*missing 1 "
                                             r"required positional argument: 'h'; the previous op, 'attn' \(stage 0\), "
                                             r"returned nothing \(None\), so it got no arguments"):
        execute_overlapped_operations([{"x": 1}, {"x": 2}], s)


def test_wrong_keys_name_what_the_previous_op_returned():
    def gate(state, h):
        return {"h": h, "topk": 2}

    def experts(state, h):
        return {"h": h}

    with pytest.raises(OperationError, match=r"op 'experts' failed: TypeError: .*unexpected keyword argument 'topk'; "
                                             r"it got the keyword arguments \['h', 'topk'\] from the previous op, "
                                             r"'gate' \(stage 0\)"):
        execute_operations({"h": 1}, [gate, experts])
    with pytest.raises(OperationError, match=r"op 'gate' failed: .*'x'; it got the keyword arguments \['x'\] from "
                                             r"the microbatch's inputs"):
        execute_operations({"x": 1}, [gate, experts])


def test_a_type_error_inside_an_op_is_left_alone():
    def op(state, h):
        return {"h": h + "text"}  # a TypeError raised by the op's own code

    with pytest.raises(OperationError, match=r"op 'op' failed: TypeError: unsupported operand type\(s\)[^;]*$"):
        execute_operations({"h": 1}, [op])


def test_last_op_returning_none_is_the_result_and_states_hold_the_output():
    """Documented, not an error: the executor returns what the last op returned; a run may write its results into
    States the caller passed. The seam, which needs a dict, raises naming the last op."""
    def compute(state, x):
        state.result = x * 2

    states = [State(), State()]
    assert execute_overlapped_operations([{"x": 1}, {"x": 2}], [compute], states=states) == [None, None]
    assert [st.result for st in states] == [2, 4]


def test_unbound_strategy_rejected():
    s = OperationsStrategy(operations=["attn", Yield, "gate"])
    with pytest.raises(StrategyError, match=r"unbound op names \[0\] 'attn'.*bind"):
        execute_overlapped_operations([{}, {}], s)


def test_mismatched_counts_rejected():
    s = build(num_layers=1)
    with pytest.raises(ValueError, match="3 operation lists for 2 microbatches"):
        execute_overlapped_operations(inputs((2, 2)), [s, s, s])
    with pytest.raises(ValueError, match="1 states for 2 microbatches"):
        execute_overlapped_operations(inputs((2, 2)), s, states=[State()])
    with pytest.raises(TypeError, match=r"inputs_arr\[1\] is a list"):
        execute_overlapped_operations([{}, []], s)


def test_raw_lists_accepted_and_per_microbatch_strategies():
    def inc(state, v):
        return {"v": v + 1}

    def dbl(state, v):
        return {"v": v * 2}

    assert execute_overlapped_operations([{"v": 1}, {"v": 2}], [inc, Yield, dbl], 1) == [{"v": 4}, {"v": 6}]
    per_mb = [[inc, Yield, dbl], [dbl, Yield, inc, Yield, inc]]
    assert execute_overlapped_operations([{"v": 1}, {"v": 2}], per_mb, 1) == [{"v": 4}, {"v": 6}]


def test_disagreeing_deltas_need_explicit_delta():
    a = OperationsStrategy(operations=[lambda st: None, Yield, lambda st: None], delta_stages=1)
    b = OperationsStrategy(operations=[lambda st: None, Yield, lambda st: None], delta_stages=0)
    with pytest.raises(StrategyError, match="disagree on delta_stages"):
        execute_overlapped_operations([{}, {}], [a, b])
    execute_overlapped_operations([{}, {}], [a, b], 1)


@settings(max_examples=60, deadline=None)
@given(
    cuts=st.sets(st.integers(min_value=1, max_value=len(OP_ORDER) - 1), max_size=len(OP_ORDER) - 1),
    delta_frac=st.floats(min_value=0, max_value=0.999),
    sizes=st.lists(st.integers(min_value=1, max_value=6), min_size=2, max_size=4),
    num_layers=st.integers(min_value=1, max_value=3),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_property_overlapped_equals_sequential(cuts, delta_frac, sizes, num_layers, seed):
    per_layer_stages = len(cuts) + 1
    total_stages = num_layers * per_layer_stages - (num_layers - 1)
    delta = int(delta_frac * total_stages)
    strategy = build(cuts=tuple(sorted(cuts)), delta=delta, num_layers=num_layers)
    assert strategy.num_stages == total_stages
    ins = inputs(sizes, seed=seed)
    overlapped = execute_overlapped_operations(ins, strategy)
    for got, i in zip(overlapped, ins):
        assert torch.equal(got["x"], execute_operations(i, strategy)["x"])


def test_seam_names_the_last_op_when_the_result_is_missing():
    from tbo import SplitPolicy, model_forward_maybe_tbo

    class Layer:
        def op_mlp(self, state, hidden_states):
            return {"hidden_states": hidden_states + 1}

        def op_finish(self, state, hidden_states):
            state.out = hidden_states  # forgot to return it

    layers = [Layer()]
    strategy = OperationsStrategy(operations=["mlp", Yield, "finish"], delta_stages=1)
    x = torch.zeros(4, 2)
    plan = SplitPolicy().plan("decode", 4)
    for p in (plan, None):
        with pytest.raises(TypeError, match=r"microbatch 0: the last op, 'finish' \(stage 1\), returned nothing "
                                            r"\(None\); model_forward_maybe_tbo needs it to return "
                                            r"\{'hidden_states': tensor\}"):
            model_forward_maybe_tbo(layers, {"hidden_states": x}, strategy, p)
    with pytest.raises(ValueError, match=r"returned keys \['hidden_states'\] without 'h'; pass output_key="):
        model_forward_maybe_tbo(layers[:1], {"hidden_states": x}, OperationsStrategy(operations=["mlp"]), plan,
                                output_key="h")


def test_seam_merges_every_named_output():
    """A stack that hands two tensors from layer to layer (vLLM's hidden states and residual) gets both back,
    each merged over the microbatches, split or not."""
    from tbo import SplitPolicy, model_forward_maybe_tbo

    class Layer:
        def op_mlp(self, state, hidden_states, residual=None):
            state.residual = hidden_states if residual is None else residual + hidden_states
            return {"hidden_states": hidden_states * 2}

        def op_output(self, state, hidden_states):
            return {"hidden_states": hidden_states, "residual": state.pop("residual")}

    strategy = OperationsStrategy(operations=["mlp", Yield, "output"], delta_stages=1)
    x = torch.arange(12.0).view(6, 2)
    want = model_forward_maybe_tbo([Layer(), Layer()], {"hidden_states": x}, strategy, None,
                                   output_key=("hidden_states", "residual"))
    assert torch.equal(want["hidden_states"], x * 4) and torch.equal(want["residual"], x * 3)
    got = model_forward_maybe_tbo([Layer(), Layer()], {"hidden_states": x}, strategy, SplitPolicy().plan("decode", 6),
                                  output_key=("hidden_states", "residual"))
    assert set(got) == {"hidden_states", "residual"}
    assert all(torch.equal(got[k], want[k]) for k in want)
