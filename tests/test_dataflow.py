"""Data flow checked when a strategy is bound: ops declare what they read and write (`tbo.core.dataflow`), every
built-in strategy passes on every layer it is meant for, and broken orders are refused at bind time naming the op,
the key and the op that writes it, in the library (`bind`, `bind_layers`, `forward_tbo`) and in `tbo lint
--layer-kind`; unknown ops get the closest names; strategies come from configs and modules (`register_from_config`);
the CLI sees Python-registered strategies and warns about unpriced ops."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import tbo.strategies as S
from tbo import OperationsStrategy, State, StrategyError, Yield
from tbo.core.dataflow import OpFlow, declares, flow_of, same_flow
from tbo.models import ReferenceModel
from tbo.models.cache import AttentionMetadata, KVCache
from tbo.models.config import ModelConfig
from tbo.split import ForwardMode, SplitPolicy
from tbo.tools.cli import main
from tbo.tools.layer_kinds import LAYER_KINDS, kind_flows
from tbo.tools.lint import lint


def _names(strategy: OperationsStrategy) -> list:
    return list(strategy.operations)


def _swap(ops: list, a: str, b: str) -> list:
    ops = list(ops)
    i, j = ops.index(a), ops.index(b)
    ops[i], ops[j] = ops[j], ops[i]
    return ops


def _moved_before(ops: list, name: str, anchor: str) -> list:
    ops = [o for o in ops if o != name]
    ops.insert(ops.index(anchor), name)
    return ops


def _variant(base: OperationsStrategy, ops: list, name: str) -> OperationsStrategy:
    return OperationsStrategy(operations=ops, delta_stages=min(base.delta_stages, ops.count(Yield)), name=name)


DECODE = S.get("qwen3_moe_decode")
SHARED = S.get("deepseek_decode")

#: (strategy, layer kind, the op refused, the key it lacks, the op named as its writer)
BROKEN = [
    (_variant(DECODE, _swap(_names(DECODE), "experts", "dispatch_b"), "experts_before_its_wait"),
     "moe", "experts", "dispatched", "dispatch_b"),
    (DECODE.without(["select_experts"]), "moe", "dispatch_a", "topk", "select_experts"),
    (DECODE.without(["gate"]), "moe", "select_experts", "router_logits", "gate"),
    (_variant(DECODE, _swap(_names(DECODE), "attn_prepare", "attn_core"), "core_before_prepare"),
     "moe", "attn_core", "qkv", "attn_prepare"),
    (_variant(DECODE, _moved_before(_names(DECODE), "output", "combine_b"), "output_before_combine_wait"),
     "moe", "output", "routed_out", "combine_b"),
    (_variant(SHARED, _moved_before(_names(SHARED), "shared_experts", "gate"), "shared_expert_first"),
     "shared", "gate", "mlp_in", "shared_experts"),
    (DECODE.without(["comm_prepare_mlp"]), "moe", "gate", "mlp_in", "comm_prepare_mlp"),
]


@pytest.fixture(scope="module")
def models() -> dict[str, ReferenceModel]:
    """A model without shared experts (one dense layer first) and one with them."""
    base = dict(num_layers=3, first_k_dense=1, hidden_size=32, num_heads=2, head_dim=16, num_experts=4, top_k=2,
                moe_intermediate=16, dense_intermediate=32, vocab_size=64, dtype="float32")
    return {"moe": ReferenceModel(ModelConfig(**base, num_shared_experts=0)),
            "shared": ReferenceModel(ModelConfig(**base, num_shared_experts=1))}


# ---- declarations ----------------------------------------------------------------------------------------------
def test_declarations_follow_the_layer(models: dict[str, ReferenceModel]) -> None:
    dense, moe = models["moe"].layers[0], models["moe"].layers[1]
    shared = models["shared"].layers[1]
    assert flow_of(dense.op_output).takes == ("residual", "mlp_out")
    assert flow_of(moe.op_output).takes == ("residual", "routed_out")
    assert flow_of(shared.op_output).takes == ("residual", "routed_out", "shared_out")
    assert flow_of(moe.op_shared_experts) == OpFlow()
    assert flow_of(shared.op_dispatch_a).reads == ("mlp_in",) and "mlp_in" in flow_of(moe.op_dispatch_a).takes
    assert flow_of(moe.op_comm_postprocess_layer).clears


def test_declared_function_and_same_flow() -> None:
    @declares(takes="x", writes="y")
    def op_f(state: State) -> None: ...

    class Base:
        @declares(lambda layer: OpFlow(writes=layer.key))
        def op_g(self, state: State) -> None: ...

    class Child(Base):
        key = "z"

        @same_flow(Base.op_g)
        def op_g(self, state: State) -> None: ...

    class Undeclared(Base):
        key = "z"

        def op_g(self, state: State) -> None: ...

    assert flow_of(op_f) == OpFlow(takes=("x",), writes=("y",))
    assert flow_of(Child().op_g) == OpFlow(writes=("z",))
    assert flow_of(Undeclared().op_g) is None  # an override says nothing about its parent's flow
    with pytest.raises(TypeError, match="declares no flow"):
        same_flow(Undeclared.op_g)


# ---- built-in strategies pass, broken ones are refused ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["moe", "shared"])
def test_every_builtin_strategy_binds(models: dict[str, ReferenceModel], kind: str) -> None:
    names = [n for n in S.names() if not n.startswith(("afd", "dense_tp"))]  # dense_tp_*: dense layers only
    if kind == "shared":  # qwen3_moe_* are refused there by the layer's required_ops, not by the data flow
        names = [n for n in names if n.startswith("deepseek")]
    for name in names:
        assert models[kind].bind(name).is_bound, name
    for kind_name in LAYER_KINDS:  # and against every layer kind's declared ops
        ops = kind_flows(kind_name)
        for name in S.names():
            strategy = S.get(name)
            if (kind_name == "vllm-afd") != name.startswith("afd"):
                continue
            if kind_name.endswith("dense"):
                strategy = S.dense_like(strategy)
            elif name.startswith("dense_tp") or (kind_name.endswith("shared") and name.startswith("qwen3")):
                continue
            if "attn_reduce_a" in strategy.operations and "attn_reduce_a" not in ops:
                continue  # a layer kind without tensor-parallel reduce ops: TP strategies are not for it
            findings = [f for f in lint(strategy, layers=2, ops=ops) if f.level == "error"]
            assert not findings, (kind_name, name, findings)


@pytest.mark.parametrize("strategy,kind,op,key,writer", BROKEN, ids=[b[0].name for b in BROKEN])
def test_broken_strategy_refused_at_bind(models: dict[str, ReferenceModel], strategy: OperationsStrategy,
                                         kind: str, op: str, key: str, writer: str) -> None:
    layer = models[kind].layers[1]
    with pytest.raises(StrategyError) as info:
        strategy.bind(layer)
    msg = str(info.value)
    assert f"{op!r}" in msg and f"{key!r}" in msg and f"{writer!r}" in msg, msg
    assert strategy.name in msg
    # the same refusal through the model's own paths, before any op runs
    with pytest.raises(StrategyError, match=key):
        models[kind].bind(strategy)
    # and in lint, against the layer kind's declared ops
    findings = lint(strategy, layers=2, ops=kind_flows("reference-moe-shared" if kind == "shared" else "reference-moe"))
    errors = [f for f in findings if f.level == "error" and f.code.startswith("data-flow")]
    assert any(f.op == op and key in f.message and writer in f.message for f in errors), findings


def test_forward_tbo_refuses_before_running(models: dict[str, ReferenceModel]) -> None:
    model = models["moe"]
    ids = torch.arange(6) % model.config.vocab_size
    meta = AttentionMetadata.build([0, 1], [3, 3], [0, 0])
    cache = KVCache()
    plan = SplitPolicy(decode_token_threshold=2, prefill_token_threshold=2).plan(ForwardMode.EXTEND, 6, [3, 3])
    assert plan is not None
    with pytest.raises(StrategyError, match="'dispatch_a'.*'topk'.*'select_experts'"):
        model.forward_tbo(ids, meta, cache, BROKEN[1][0], plan)
    assert len(cache) == 0, "nothing ran: the KV cache is untouched"


def test_keyword_input_must_come_from_the_op_before(models: dict[str, ReferenceModel]) -> None:
    """``comm_prepare_attn`` takes ``hidden_states``, which only the op right before it (or the step) hands over."""
    ops = _names(DECODE)
    ops = [ops[1], ops[0], *ops[2:]]  # attn_prepare first, then comm_prepare_attn
    bad = _variant(DECODE, ops, "prepare_first")
    with pytest.raises(StrategyError) as info:
        bad.bind(models["moe"].layers[1])
    msg = str(info.value)
    assert "'comm_prepare_attn'" in msg and "'hidden_states'" in msg and "'attn_prepare', the op right before it" \
        in msg and "'comm_postprocess_layer' returns it" in msg
    # across layers: a layer that hands nothing on to the next layer's first op
    no_post = DECODE.without(["comm_postprocess_layer"])
    no_post.bind(models["moe"].layers[1])  # alone, its first op gets the step's inputs
    with pytest.raises(StrategyError, match="'hidden_states'.*'output', the op right before it, returns nothing"):
        S.bind_layers(models["moe"].layers[1:], no_post)


def test_misspelt_op_gets_the_closest_names(models: dict[str, ReferenceModel]) -> None:
    typo = DECODE._replace(operations=["atn_core" if o == "attn_core" else o for o in DECODE.operations])
    with pytest.raises(StrategyError, match=r"\[3\] op_atn_core \(did you mean 'attn_core'"):
        typo.bind(models["moe"].layers[1])
    findings = lint(typo, ops=kind_flows("vllm-moe"))
    assert [(f.code, f.index) for f in findings if f.level == "error"] == [("unknown-op", 3)]
    assert "did you mean 'attn_core'" in findings[0].message


def test_undeclared_ops_are_trusted() -> None:
    """A user's plain functions declare nothing: the check stops at them instead of refusing what it cannot see."""
    def op_make(state: State) -> None:
        state.x = 1

    @declares(takes="x", writes="y")
    def op_use(state: State) -> None:
        state.y = state.pop("x")

    @declares(takes="y")
    def op_end(state: State) -> None:
        state.pop("y")

    OperationsStrategy(operations=[op_make, Yield, op_use, op_end]).check_flow()
    with pytest.raises(StrategyError, match="'use'.*takes 'x'.*no op of this layer writes it"):
        OperationsStrategy(operations=[op_use, op_end]).check_flow()
    with pytest.raises(StrategyError, match="'end'.*'use' writes it, but runs after it"):
        OperationsStrategy(operations=[op_end, Yield, op_use, op_make]).check_flow()


def test_write_once_is_checked() -> None:
    @declares(writes="x")
    def op_w(state: State) -> None: ...

    with pytest.raises(StrategyError, match="'w'.*writes 'x', which 'w' \\(operations\\[0\\]\\) wrote"):
        OperationsStrategy(operations=[op_w, op_w]).check_flow()


# ---- strategies from configs and modules -----------------------------------------------------------------------
MINE = OperationsStrategy(name="x", delta_stages=1, operations=[
    "comm_prepare_attn", "attn_prepare", "attn_core", "comm_prepare_mlp", "gate", "select_experts", "dispatch_a",
    Yield, "dispatch_b", "experts", "combine_a", Yield, "combine_b", "output", "comm_postprocess_layer"])


def test_register_from_config_by_value(models: dict[str, ReferenceModel]) -> None:
    try:
        text = MINE.model_dump_json()
        assert S.register_from_config({"mine_lead1": text}) == ["mine_lead1"]
        assert S.get("mine_lead1").operations == MINE.operations and S.get("mine_lead1").name == "mine_lead1"
        assert S.register_from_config({"mine_lead1": json.loads(text)}) == ["mine_lead1"]  # a parsed object too
        models["moe"].bind("mine_lead1")
        other = MINE.without(["gate"])  # a config may give its own name a new value
        S.register_from_config({"mine_lead1": other.model_dump_json()})
        assert "gate" not in S.get("mine_lead1").operations
        with pytest.raises(StrategyError, match="'deepseek_decode' is already a registered strategy"):
            S.register_from_config({"deepseek_decode": text})
        with pytest.raises(StrategyError, match="strategy 'bad': .*a second Yield"):
            S.register_from_config({"bad": json.dumps({"operations": ["a", "Yield", "Yield", "b"]})})
        with pytest.raises(StrategyError, match="strategy 'bad': strategy JSON does not parse"):
            S.register_from_config({"bad": "{not json"})
        with pytest.raises(StrategyError, match="the name '1x' must be an identifier"):
            S.register_from_config({"1x": text})
    finally:
        S.unregister("mine_lead1")


def test_register_from_modules(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_strategies_47.py").write_text(textwrap.dedent("""
        import tbo.strategies as S
        from tbo import OperationsStrategy, Yield

        def lead1():
            return S.get("qwen3_moe_decode")._replace(name="lead1", delta_stages=1)

        S.register("from_module_47", lead1, overwrite=True)
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        S.register_from_config(None, ["my_strategies_47"])
        assert S.get("from_module_47").delta_stages == 1
        with pytest.raises(StrategyError, match="strategy_modules: cannot import 'no_such_module_47'.*"
                                                "importable in every process"):
            S.register_from_config(None, ["no_such_module_47"])
        # the CLI: module:NAME (registered, or defined), and --import
        assert main(["show", "my_strategies_47:from_module_47", "--json"]) == 0
        assert main(["show", "my_strategies_47:lead1"]) == 0
        assert main(["--import", "my_strategies_47", "lint", "from_module_47", "--layer-kind", "vllm-moe"]) == 0
        assert main(["show", "my_strategies_47:nothing"]) == 2
    finally:
        S.unregister("from_module_47")


# ---- the CLI ---------------------------------------------------------------------------------------------------
def test_cli_ops_lists_every_kind(capsys) -> None:
    assert main(["ops"]) == 0
    out = capsys.readouterr().out
    for kind in LAYER_KINDS:
        assert f"{kind}: " in out
    assert main(["ops", "--layer-kind", "vllm-moe"]) == 0
    out = capsys.readouterr().out
    assert "experts" in out and "takes dispatched; writes expert_out" in out
    assert "comm_prepare_attn       inputs hidden_states; writes residual, attn_in" in out


def test_cli_lint_layer_kind_refuses_each_broken_variant(tmp_path, capsys) -> None:
    for strategy, kind, op, key, writer in BROKEN:
        path = tmp_path / f"{strategy.name}.json"
        path.write_text(strategy.model_dump_json())
        assert main(["lint", str(path)]) == 0, strategy.name  # without a layer, nothing to see
        kind_name = "vllm-moe-shared" if kind == "shared" else "vllm-moe"
        assert main(["lint", str(path), "--layer-kind", kind_name]) == 1, strategy.name
        out = capsys.readouterr().out
        assert f"'{op}'" in out and f"'{key}'" in out and f"'{writer}'" in out, out


def test_cli_show_json_round_trips(tmp_path, capsys) -> None:
    assert main(["show", "qwen3_moe_decode", "--json"]) == 0
    text = capsys.readouterr().out
    assert OperationsStrategy.model_validate_json(text) == S.get("qwen3_moe_decode")


def test_cli_simulate_warns_naming_unpriced_ops(tmp_path, capsys) -> None:
    costs = {"ops": {"experts": {"kind": "constant", "seconds": 1e-4}, "attn_core": {"kind": "constant",
                                                                                     "seconds": 5e-5}},
             "default": {"kind": "constant", "seconds": 5e-6}}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs))
    assert main(["simulate", "qwen3_moe_decode", "--costs", str(path), "--tokens", "64"]) == 0
    err = capsys.readouterr().err
    assert "prices no op comm_prepare_attn, attn_prepare, comm_prepare_mlp, gate," in err
    assert "'experts'" not in err and " experts," not in err and "constant 5e-06 s" in err
    full = {**costs, "ops": {n: {"kind": "constant", "seconds": 1e-5} for n in
                             {o for o in S.get("qwen3_moe_decode").operations if o is not Yield}}}
    path.write_text(json.dumps(full))
    assert main(["simulate", "qwen3_moe_decode", "--costs", str(path), "--tokens", "64"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_wrapped_ops_keep_their_flow(models: dict[str, ReferenceModel]) -> None:
    """A timing or tracing wrapper (functools.wraps) around a layer's op still declares that op's flow; a
    layer-dependent declaration with no layer to ask is undeclared, never a crash."""
    import functools

    layer = models["shared"].layers[1]

    def timed(op):
        @functools.wraps(op)
        def run(state, **inputs):
            return op(state, **inputs)
        return run

    assert flow_of(timed(layer.op_output)) == flow_of(layer.op_output)
    assert flow_of(timed(layer.op_experts)) == OpFlow(takes=("dispatched",), writes=("expert_out",))
    assert flow_of(type(layer).op_output) is None  # the plain function: which layer's output?


def test_the_expert_parallel_layer_declares_what_the_vllm_layer_does() -> None:
    """`EpDecoderLayer` overrides ops for empty microbatches (`same_flow`): every op keeps the vLLM layer's flow, so
    a strategy binds on a DP + EP engine exactly when it binds on a one-rank one."""
    from tbo.core.dataflow import FLOW_ATTR
    from tbo.integrations.vllm.model.ep_layer import EpDecoderLayer
    from tbo.integrations.vllm.model.layers import VllmDecoderLayer

    ops = [a for a in dir(VllmDecoderLayer) if a.startswith("op_")]
    assert len(ops) == 24  # 15 of its own, 9 from TensorParallelOps (the reduce pairs and routed_experts)
    for op in ops:
        assert getattr(getattr(EpDecoderLayer, op), FLOW_ATTR) is getattr(getattr(VllmDecoderLayer, op), FLOW_ATTR), op
