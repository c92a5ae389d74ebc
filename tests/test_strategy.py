import pickle

import pytest

from tbo import OperationsStrategy, StrategyError, Yield
from tbo.core.operations import op_name


def op_attn(state):
    return None


class Layer:
    def op_attn(self, state):
        return None

    def op_mlp(self, state):
        return None


def test_yield_singleton_repr_pickle():
    assert repr(Yield) == "Yield"
    assert type(Yield)() is Yield
    assert pickle.loads(pickle.dumps(Yield)) is Yield


def test_op_name():
    import functools

    assert op_name(op_attn) == "attn"
    assert op_name(Layer().op_mlp) == "mlp"
    assert op_name(functools.partial(op_attn)) == "attn"
    assert op_name("dispatch_a") == "dispatch_a"
    assert op_name(lambda s: None) == "<lambda>"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(operations=[]), r"empty"),
        (dict(operations=[Yield, "a"]), r"operations\[0\] is Yield"),
        (dict(operations=["a", "b", Yield]), r"operations\[2\] is Yield at the end"),
        (dict(operations=["a", Yield, Yield, "b"]), r"operations\[2\] is a second Yield"),
        (dict(operations=["a", Yield, 3.5]), r"operations\[2\] = 3.5 \(float\)"),
        (dict(operations=["a", "not an id"]), r"operations\[1\] = 'not an id'"),
        (dict(operations=["a"], delta_stages=-1), r"delta_stages must be >= 0"),
        (dict(operations=["a", Yield, "b"], delta_stages=2), r"delta_stages=2 must be less than the number of stages \(2\)"),
        (dict(operations=["a"], deep_gemm_num_sms=0), r"deep_gemm_num_sms must be positive"),
        (dict(operations=["a"], deep_gemm_num_sms=-4), r"deep_gemm_num_sms must be positive"),
        (dict(operations=["a"], bogus=1), r"bogus"),
        (dict(operations="abc"), r"must be a list"),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises(StrategyError, match=match):
        OperationsStrategy(**kwargs)


def test_strategy_error_is_value_error():
    assert issubclass(StrategyError, ValueError)


def test_stages_cached_and_shape():
    s = OperationsStrategy(operations=["a", "b", Yield, "c", Yield, op_attn], delta_stages=1)
    assert s.stages == (("a", "b"), ("c",), (op_attn,))
    assert s.stages is s.stages
    assert s.stage_names == (("a", "b"), ("c",), ("attn",))
    assert s.num_stages == 3


def test_strategy_is_frozen():
    s = OperationsStrategy(operations=["a"])
    with pytest.raises(Exception):
        s.delta_stages = 3  # type: ignore[misc]


def test_bind_resolves_and_reports_all_missing():
    layer = Layer()
    s = OperationsStrategy(operations=["attn", Yield, "mlp"], delta_stages=1, name="x")
    b = s.bind(layer)
    assert b.is_bound and not s.is_bound
    assert b.stages == ((layer.op_attn,), (layer.op_mlp,))
    assert b.delta_stages == 1 and b.name == "x"
    bad = OperationsStrategy(operations=["attn", "gate", Yield, "mlp", "experts"])
    with pytest.raises(StrategyError, match=r"\[1\] op_gate, \[4\] op_experts"):
        bad.bind(layer)


def test_concat_joins_without_yield_and_checks_agreement():
    a = OperationsStrategy(operations=["attn", Yield, "mlp"], delta_stages=1)
    joined = OperationsStrategy.concat([a, a, a])
    assert joined.num_stages == 4  # the last stage of each layer flows into the next layer's first
    assert joined.stages[1] == ("mlp", "attn")
    with pytest.raises(StrategyError, match=r"strategy \[1\] has delta_stages=0"):
        OperationsStrategy.concat([a, OperationsStrategy(operations=["attn", Yield, "mlp"])])
    with pytest.raises(StrategyError, match=r"strategy \[2\] has deep_gemm_num_sms=8"):
        OperationsStrategy.concat([a, a, OperationsStrategy(operations=["x", Yield, "y"], delta_stages=1,
                                                            deep_gemm_num_sms=8)])
    with pytest.raises(StrategyError, match="at least one"):
        OperationsStrategy.concat([])


def test_json_round_trip():
    s = OperationsStrategy(operations=["attn", Yield, "dispatch_a", Yield, "dispatch_b"], delta_stages=2,
                           deep_gemm_num_sms=100, name="demo")
    text = s.model_dump_json()
    assert '"Yield"' in text
    back = OperationsStrategy.model_validate_json(text)
    assert back == s
    assert back.stages == s.stages
    assert back.operations[1] is Yield


def test_json_rejects_callables_with_index():
    s = OperationsStrategy(operations=["attn", Yield, op_attn])
    with pytest.raises(StrategyError, match=r"operations\[2\] \(attn\) is a callable"):
        s.model_dump_json()


def test_json_validation_errors_are_strategy_errors():
    with pytest.raises(StrategyError, match=r"operations\[0\] is Yield"):
        OperationsStrategy.model_validate_json('{"operations": ["Yield", "a"]}')
    with pytest.raises(StrategyError, match=r"delta_stages"):
        OperationsStrategy.model_validate_json('{"operations": ["a"], "delta_stages": "two"}')


def test_describe_lists_stages():
    s = OperationsStrategy(operations=["attn", "gate", Yield, "dispatch_a", "dispatch_b"], name="n",
                           deep_gemm_num_sms=3)
    text = s.describe()
    assert "strategy n: 2 stages, delta_stages=0, deep_gemm_num_sms=3" in text
    assert "stage 0: attn, gate" in text and "stage 1: dispatch_a, dispatch_b" in text


def test_without_drops_ops_and_empty_stages():
    s = OperationsStrategy(operations=["a", Yield, "b", Yield, "c", "d"], delta_stages=2, name="x")
    t = s.without(["b"])
    assert t.stage_names == (("a",), ("c", "d")) and t.delta_stages == 1 and t.name == "x_without_b"
    assert s.without(["d"], name="y").stage_names == (("a",), ("b",), ("c",))
    with pytest.raises(StrategyError, match="empty"):
        s.without(["a", "b", "c", "d"])


def test_without_refuses_a_name_it_does_not_have():
    """A name not in the strategy is a typo: silently returning the same strategy would hide it."""
    s = OperationsStrategy(operations=["a", Yield, "b"], name="x")
    with pytest.raises(StrategyError, match=r"x has no op named 'nonexistent'; its ops: a, b"):
        s.without(["nonexistent"])
    with pytest.raises(StrategyError, match="'zz'"):
        s.without(["a", "zz"])
    with pytest.raises(TypeError, match=r"without\(\['b'\]\)"):
        s.without("b")  # a string is a list of one-letter names: refused, not dropped letter by letter
    assert s.without(["b"]).name == "x_without_b" and s.without(["b"], name="y").name == "y"



def test_one_joining_rule_for_concat_and_bind_layers():
    """Multi-stage layers must agree on the lead; a one-stage (dense) layer has none of its own and takes any."""
    moe = OperationsStrategy(operations=["attn", Yield, "dispatch_a", Yield, "dispatch_b"], delta_stages=2)
    dense = OperationsStrategy(operations=["attn", "mlp"])
    joined = OperationsStrategy.concat([dense, moe, dense, moe])
    assert joined.delta_stages == 2 and joined.num_stages == 5
    with pytest.raises(StrategyError, match=r"strategy \[3\] has delta_stages=1 but strategy \[1\] has 2"):
        OperationsStrategy.concat([dense, moe, dense, moe._replace(delta_stages=1)])

    class Layer:
        def __init__(self, kind):
            self.kind = kind
            for name in ("attn", "mlp", "dispatch_a", "dispatch_b", "comm_prepare_attn", "attn_prepare", "attn_core",
                         "comm_prepare_mlp", "output", "comm_postprocess_layer"):
                setattr(self, f"op_{name}", lambda state, **kw: None)

    from tbo import strategies as S
    layers = [Layer("dense"), Layer("moe"), Layer("moe")]
    assert S.bind_layers(layers, moe).delta_stages == 2  # the dense layer joins under the same rule
    with pytest.raises(StrategyError, match=r"strategy \[2\] has delta_stages=1 but strategy \[1\] has 2"):
        S.bind_layers(layers, lambda layer: dense if layer.kind == "dense" else
                      moe if layer is layers[1] else moe._replace(delta_stages=1))


def test_walk_is_the_schedule_with_names_and_roles():
    s = OperationsStrategy(operations=["attn", Yield, "dispatch_a", Yield, "dispatch_b", "mlp"], delta_stages=1)
    visits = list(s.walk(2))
    assert [(v.mb, v.stage, v.op) for v in visits] == [
        (0, 0, "attn"), (0, 1, "dispatch_a"), (1, 0, "attn"), (0, 2, "dispatch_b"), (0, 2, "mlp"),
        (1, 1, "dispatch_a"), (1, 2, "dispatch_b"), (1, 2, "mlp")]
    assert [v.role for v in visits if v.role] == [("launch", "dispatch"), ("wait", "dispatch")] * 2
    assert [v.mb for v in s.walk(2, delta_stages=0)][:3] == [0, 1, 0]  # an explicit lead overrides the strategy's
    custom = list(s.walk(1, role=lambda name: ("launch", "x") if name == "mlp" else None))
    assert [v.op for v in custom if v.role] == ["mlp"]
    table = s.render_schedule(2, width=30)
    assert "microbatch A" in table and "s1 dispatch_a" in table and len(table.splitlines()) == 2 + 4


# ---- transfer ordering, checked when a strategy is built --------------------------------------------------------
def test_wait_before_launch_is_refused_at_construction_naming_both():
    with pytest.raises(StrategyError, match=r"strategy swapped: operations\[2\] 'dispatch_b' \(stage 1\) waits for a "
                                            r"'dispatch' transfer before operations\[3\] 'dispatch_a' \(stage 1\) "
                                            r"launches it: move the launch before the wait\. Every microbatch"):
        OperationsStrategy(operations=["attn", Yield, "dispatch_b", "dispatch_a", Yield, "experts"], name="swapped")
    with pytest.raises(StrategyError, match=r"operations\[0\] 'combine_b' \(stage 0\) waits for a 'combine' "
                                            r"transfer that no earlier op launches"):
        OperationsStrategy(operations=["combine_b", Yield, "attn"])
    with pytest.raises(StrategyError, match=r"operations\[1\] 'dispatch_a' \(stage 0\) launches a 'dispatch' "
                                            r"transfer that no later op waits for"):
        OperationsStrategy(operations=["attn", "dispatch_a", Yield, "mlp"])
    with pytest.raises(StrategyError, match=r"operations\[2\] 'afd_recv' \(stage 1\) waits for a 'afd' transfer "
                                            r"before operations\[3\] 'afd_send'"):
        OperationsStrategy(operations=["attn", Yield, "afd_recv", "afd_send"])  # the AFD names pair up too
    # both problems of one list, in list order, in one message
    with pytest.raises(StrategyError, match=r"operations\[0\] 'x_b'.*; operations\[2\] 'y_a'"):
        OperationsStrategy(operations=["x_b", Yield, "y_a"])


def test_ordering_checked_on_bind_concat_json_and_raw_lists():
    class Layer:
        def op_dispatch_b(self, state):
            return None

        def op_dispatch_a(self, state):
            return None

    with pytest.raises(StrategyError, match="waits for a 'dispatch' transfer before"):
        OperationsStrategy(operations=[Layer().op_dispatch_b, Yield, Layer().op_dispatch_a])  # callables too
    with pytest.raises(StrategyError, match="waits for a 'dispatch' transfer before"):
        OperationsStrategy.model_validate_json('{"operations": ["dispatch_b", "Yield", "dispatch_a"]}')
    from tbo import execute_operations
    with pytest.raises(StrategyError, match="waits for a 'dispatch' transfer before"):
        execute_operations({}, [Layer().op_dispatch_b, Layer().op_dispatch_a])
    launch = OperationsStrategy(operations=["attn", Yield, "combine_a"], fragment=True)
    wait = OperationsStrategy(operations=["combine_b", Yield, "mlp"], fragment=True)
    with pytest.raises(StrategyError, match="no later op waits for"):
        OperationsStrategy.concat([launch, wait, launch])  # the joined run is checked whatever its pieces say
    joined = OperationsStrategy.concat([launch, wait, launch, wait])
    assert not joined.fragment and joined.transfer_order.pairs == {3: 2, 9: 8}


def test_fragment_survives_bind_json_and_repr():
    class Layer:
        def op_attn(self, state):
            return None

        def op_combine_a(self, state):
            return None

    piece = OperationsStrategy(operations=["attn", Yield, "combine_a"], fragment=True, name="piece")
    assert piece.bind(Layer()).fragment and piece.without(["attn"]).fragment
    assert "fragment=True" in repr(piece)
    assert OperationsStrategy.model_validate_json(piece.model_dump_json()) == piece
    assert "fragment" not in OperationsStrategy(operations=["attn"]).model_dump_json()  # old files stay the same


def test_transfer_order_is_computed_once_per_strategy():
    s = OperationsStrategy(operations=["attn", "dispatch_a", Yield, "mlp", "dispatch_b"])
    assert s.transfer_order is s.transfer_order and s.transfer_order.pairs == {4: 1}


def test_builtins_pass_the_construction_check():
    from tbo import strategies as S
    for name in S.names():
        joined = OperationsStrategy.concat([S.get(name)] * 2)  # each layer's pairs stay inside the layer
        assert not joined.transfer_order.problems, name


# ---- Yield, the marker ------------------------------------------------------------------------------------------
def test_yield_called_is_yield_and_the_string_is_refused_in_python():
    assert Yield() is Yield
    assert OperationsStrategy(operations=["a", Yield(), "b"]).num_stages == 2
    with pytest.raises(StrategyError, match=r"operations\[1\] is the string 'Yield': write the marker tbo.Yield"):
        OperationsStrategy(operations=["a", "Yield", "b"])
    assert OperationsStrategy.model_validate({"operations": ["a", "Yield", "b"]}).operations[1] is Yield  # data
    with pytest.raises(StrategyError, match="does not parse"):
        OperationsStrategy.model_validate_json("{not json")
