"""The SGLang plugin's deployment check without SGLang: tensor parallelism, and expert parallelism over the TP ranks,
are admitted (tests/sglang/test_tp.py runs both in real engines); what tbo does not drive inside SGLang is refused
by name, the TP-only refusals (the adaptive split, quantised all-reduces) included, and so are attention backends
tbo does not plan per microbatch and SGLang's graphs; a strategy's deferred reductions are read off its op list."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def _args(**kw):
    return SimpleNamespace(**{"enable_two_batch_overlap": False, "speculative_algorithm": None,
                              "attention_backend": "torch_native", **kw})


def _parallel(**kw):
    return SimpleNamespace(**{"tp_size": 1, "pp_size": 1, "moe_ep_size": 1, "attn_dp_size": 1, **kw})


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_tensor_parallelism_is_admitted(tp):
    from tbo.integrations.sglang.config import parse_config
    from tbo.integrations.sglang.runner.engine import check_deployment

    check_deployment(_args(), _parallel(tp_size=tp), parse_config({}))  # no refusal


@pytest.mark.parametrize("args, parallel, config, named", [
    ({}, {"tp_size": 4, "moe_ep_size": 2}, {}, "moe_ep_size=2 with tp_size=4"),
    ({"moe_a2a_backend": "deepep"}, {"tp_size": 2, "moe_ep_size": 2}, {}, "moe_a2a_backend='deepep'"),
    ({"ep_num_redundant_experts": 2}, {"tp_size": 2, "moe_ep_size": 2}, {}, "ep_num_redundant_experts=2"),
    ({"enable_eplb": True}, {"tp_size": 2, "moe_ep_size": 2}, {}, "enable_eplb"),
    ({}, {"attn_dp_size": 2, "tp_size": 2}, {}, "attn_dp_size=2"),
    ({}, {"pp_size": 2}, {}, "pp_size=2"),
    ({}, {"tp_size": 2}, {"split": "adaptive"}, "split='adaptive' at SGLang's tp_size=2"),
    ({"enable_quant_communications": True}, {"tp_size": 2}, {}, "--enable-quant-communications"),
    ({"attention_backend": "flashmla"}, {"tp_size": 2}, {}, "attention_backend='flashmla'"),
    ({"enable_two_batch_overlap": True}, {}, {}, "--enable-two-batch-overlap"),
])
def test_what_tbo_does_not_drive_is_refused_by_name(args, parallel, config, named):
    from tbo.integrations.sglang.config import parse_config
    from tbo.integrations.sglang.errors import TboSglangError
    from tbo.integrations.sglang.runner.engine import check_deployment

    with pytest.raises(TboSglangError, match="TBO_SGLANG_CONFIG") as info:
        check_deployment(_args(**args), _parallel(**parallel), parse_config(config))
    assert named in str(info.value) and "accepted" in str(info.value)


@pytest.mark.parametrize("backend", ["torch_native", "triton", "intel_amx", "fa3", "flashinfer"])
def test_attention_backends_planned_per_microbatch_are_admitted(backend):
    from tbo.integrations.sglang.config import parse_config
    from tbo.integrations.sglang.runner.engine import check_deployment

    check_deployment(_args(attention_backend=backend), _parallel(), parse_config({}))


@pytest.mark.parametrize("prefill, decode, named", [
    ("triton", "flashmla", "decode attention backend='flashmla'"),
    ("torch_flex", "triton", "prefill attention backend='torch_flex'"),
])
def test_the_runners_resolved_prefill_and_decode_backends_are_checked(prefill, decode, named):
    """``--prefill-attention-backend`` / ``--decode-attention-backend`` may name others than
    ``--attention-backend``: what the runner resolved is checked, once it has."""
    from tbo.integrations.sglang.errors import TboSglangError
    from tbo.integrations.sglang.runner.attention import check_attention

    runner = SimpleNamespace(prefill_attention_backend_str=prefill, decode_attention_backend_str=decode)
    with pytest.raises(TboSglangError, match="accepted") as info:
        check_attention(_args(attention_backend="triton"), runner)
    assert named in str(info.value)
    check_attention(_args(), SimpleNamespace(prefill_attention_backend_str="triton",
                                             decode_attention_backend_str="torch_native"))  # no refusal
    # unnamed at launch (SGLang chooses per device and model): checked once the runner resolved it
    check_attention(_args(attention_backend=None))
    with pytest.raises(TboSglangError, match="prefill attention backend='flashmla'"):
        check_attention(_args(attention_backend=None), SimpleNamespace(prefill_attention_backend_str="flashmla",
                                                                       decode_attention_backend_str="flashmla"))


def test_graphs_sglang_would_capture_are_refused_by_name():
    from tbo.integrations.sglang.errors import TboSglangError
    from tbo.integrations.sglang.runner.engine import check_graphs

    with pytest.raises(TboSglangError, match="CUDA graphs") as info:
        check_graphs(graphs_disabled=False)
    assert "--disable-cuda-graph" in str(info.value)
    check_graphs(graphs_disabled=True)  # no refusal


@pytest.mark.parametrize("tp", [2, 8])
def test_expert_parallelism_over_the_tp_ranks_is_admitted(tp):
    """``--ep-size`` equal to ``--tp-size`` (tests/sglang/test_tp.py runs it at 2), without SGLang's all-to-all
    backends: tbo's all-to-all carries the rows."""
    from tbo.integrations.sglang.config import parse_config
    from tbo.integrations.sglang.runner.engine import check_deployment

    check_deployment(_args(moe_a2a_backend="none", ep_num_redundant_experts=0, enable_eplb=False),
                     _parallel(tp_size=tp, moe_ep_size=tp), parse_config({}))


def test_the_adaptive_split_and_quantised_sums_run_at_one_rank():
    from tbo.integrations.sglang.config import parse_config
    from tbo.integrations.sglang.runner.engine import check_deployment

    check_deployment(_args(enable_quant_communications=True), _parallel(),
                     parse_config({"split": "adaptive", "adaptive": {"microbatches": [2]}}))


@pytest.mark.parametrize("name, deferred", [
    ("moe_tp_decode", {"attn", "moe"}), ("moe_tp_prefill", {"attn", "moe"}),
    ("dense_tp_decode", {"attn", "mlp"}), ("qwen3_moe_decode", set()), ("deepseek_prefill", set()),
    ("moe_tp_ep_decode", {"attn", "moe"}), ("moe_tp_ep_prefill", {"attn", "moe"}),
])
def test_the_reductions_a_strategy_defers_are_read_off_its_ops(name, deferred):
    from tbo import strategies
    from tbo.integrations.sglang.model.tp import deferred_by

    assert deferred_by(strategies.get(name)) == deferred


def test_an_experts_module_that_sums_its_own_output_is_refused_by_name():
    """An experts module built with ``reduce_results=True`` would all-reduce inside tbo's experts op (and under
    expert parallelism a rank with no rows to run skips the call, so the ranks' collectives would not match)."""
    from tbo.integrations.sglang.errors import TboSglangError
    from tbo.integrations.sglang.model.structure import _moe_checks

    block = SimpleNamespace(experts=SimpleNamespace(reduce_results=True))
    with pytest.raises(TboSglangError, match=r"layer 3.*reduce_results=True"):
        _moe_checks("layer 3", block)
    assert _moe_checks("layer 3", SimpleNamespace(experts=SimpleNamespace(reduce_results=False))) == (None, None)


def test_a_strategy_must_sum_the_shared_expert_where_it_sums_the_routed_output():
    """At TP >= 2 a shared expert's output is a partial sum like the routed one: a strategy sums both as tbo's
    all-reduces or leaves both to SGLang; one of each is refused at start (`SglangEngine._defer_reductions`)."""
    from tbo import strategies
    from tbo.integrations.sglang.runner.engine import sums_shared_as_routed

    for name in ("moe_tp_decode", "moe_tp_prefill", "moe_tp_ep_decode", "moe_tp_ep_prefill", "deepseek_decode",
                 "deepseek_prefill"):
        assert sums_shared_as_routed(strategies.get(name)), name
    routed_only = strategies.get("moe_tp_decode").without(["shared_reduce_a", "shared_reduce_b"], name="routed_only")
    assert not sums_shared_as_routed(routed_only)


#: the platform flags SGLang's DeepSeek block reads from its own module, here as this module's (`_routed_scale` reads
#: them from the module of the block's class)
_is_cuda = _is_musa = _is_xpu = _use_aiter = False


class _Block:
    """A DeepSeek-style MoE block as `_routed_scale` reads it: its factor, where its top-k applies it, its experts'
    quant method."""

    def __init__(self, factor: float, fused_in_topk: bool = False, method: object = None) -> None:
        self.routed_scaling_factor, self.routed_scaling_factor_fused_in_topk = factor, fused_in_topk
        self.experts = SimpleNamespace(quant_method=method)


def test_the_routed_scaling_is_applied_where_sglangs_block_applies_it(monkeypatch):
    """DeepSeek's ``routed_scaling_factor``: off CUDA/MUSA/XPU SGLang's block scales the routed output after the
    experts, and so does tbo (tests/sglang/test_deepseek.py runs it); on CUDA the experts' kernel or the top-k apply
    it, inside the modules tbo calls (1.0: tbo adds nothing); a quant method that folds it into the shared add is
    refused by name."""
    import sys

    from tbo.integrations.sglang.errors import TboSglangError
    from tbo.integrations.sglang.model.structure import _routed_scale

    assert _routed_scale("layer 1", _Block(2.5)) == 2.5
    assert _routed_scale("layer 1", _Block(1.0)) == 1.0
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "_is_cuda", True)
    assert _routed_scale("layer 1", _Block(2.5)) == 1.0
    monkeypatch.setattr(module, "_is_cuda", False)
    monkeypatch.setattr(module, "_use_aiter", True)
    assert _routed_scale("layer 1", _Block(2.5, fused_in_topk=True)) == 1.0  # AITER fused it into the top-k
    assert _routed_scale("layer 1", _Block(2.5, fused_in_topk=False)) == 2.5

    class Mxfp4MarlinMoEMethod:
        pass

    with pytest.raises(TboSglangError, match=r"layer 1.*routed_scaling_factor=2.5 with Mxfp4MarlinMoEMethod"):
        _routed_scale("layer 1", _Block(2.5, method=Mxfp4MarlinMoEMethod()))
    with pytest.raises(TboSglangError, match="does not say where SGLang applies it"):
        _routed_scale("layer 1", SimpleNamespace(routed_scaling_factor=2.5, experts=SimpleNamespace()))
