"""CUDA graphs of split decode steps in vLLM (issue 37, item 3; `tbo.integrations.vllm.step.graphs`), the parts a CPU
runs: which of vLLM's batch descriptors tbo captures split and with which plan (the graph key), the rule that
replays a step or runs it eager ("a step whose split differs from its graph's runs eager"), what each counts, and
which ``cudagraph_mode`` is refused by name. The capture and replay themselves need a GPU and a CUDA vLLM:
tests/vllm/test_gpu.py (marked ``gpu``; skipped here)."""

from __future__ import annotations

import importlib.util

import pytest

from tbo.integrations.vllm.config import TboConfigError, parse_config
from tbo.integrations.engine.stats import StepStats
from tbo.integrations.engine.step import decide
from tbo.split import ForwardMode, SplitPolicy

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (make test-vllm runs this in .venv-vllm)")
POLICY = SplitPolicy(decode_token_threshold=4, prefill_token_threshold=12)


def _desc(num_tokens, num_reqs=None, uniform=True, has_lora=False):
    from vllm.forward_context import BatchDescriptor

    return BatchDescriptor(num_tokens=num_tokens, num_reqs=num_tokens if num_reqs is None else num_reqs,
                           uniform=uniform, has_lora=has_lora)


def _decode(n, allowed=True):
    """tbo's own decision for a decode step of ``n`` requests (its real tokens, unpadded)."""
    return decide(POLICY, [1] * n, [True] * n, allowed=allowed, padded_tokens=n)


@needs_vllm
def test_graph_key_is_the_descriptor_and_the_plan_fixed_for_it():
    from tbo.integrations.vllm.step.graphs import GraphKey, graph_key, graph_plan

    plan = graph_plan(POLICY, _desc(8))
    assert plan is not None and plan.mode is ForwardMode.DECODE
    assert [(mb.tokens_start, mb.tokens_end) for mb in plan.microbatches] == [(0, 4), (4, 8)]
    assert graph_key(POLICY, _desc(8)) == GraphKey(8, 8, True, ((0, 4), (4, 8)))
    # FULL mode's descriptors are not uniform, but vLLM's dummy batch is a decode batch when num_reqs == num_tokens
    assert graph_key(POLICY, _desc(6, uniform=False)) == GraphKey(6, 6, False, ((0, 3), (3, 6)))
    assert graph_key(POLICY, _desc(9)).microbatches == ((0, 4), (4, 9))  # the policy's own cut, per size
    for desc in (_desc(2), _desc(3),  # below the decode threshold: vLLM's own unsplit graph
                 _desc(16, num_reqs=8),  # not decode-shaped (more tokens than requests): never split in a graph
                 _desc(8, has_lora=True), None):
        assert graph_plan(POLICY, desc) is None and graph_key(POLICY, desc) is None, desc
    three = SplitPolicy(num_microbatches=3, decode_token_threshold=3)
    assert graph_key(three, _desc(9)).microbatches == ((0, 3), (3, 6), (6, 9))


@needs_vllm
@pytest.mark.parametrize("own, replays", [
    (_decode(7), True),  # 7 real tokens in the 8-token graph: the size's plan, one padding row in microbatch 1
    (_decode(5), True),  # its own plan cuts at 3, the graph's at 4: the graph's plan runs, both microbatches real
    (_decode(8), True),
    (_decode(4), False),  # split by the policy, but microbatch 1 of the graph (tokens 4..8) would be padding only
    (_decode(3), False),  # below the decode threshold: unsplit, and this size's graph is split
    (_decode(7, allowed=False), False),  # vLLM's prefix-cache veto
    (decide(POLICY, [1, 1, 5], [True, True, False], allowed=True, padded_tokens=7), False),  # a mixed step
    (decide(POLICY, [2, 2, 2], [True] * 3, allowed=True, padded_tokens=6, drafts=[1, 1, 1]), False),  # verify
])
def test_a_step_replays_its_sizes_graph_only_when_its_split_is_the_graphs(own, replays):
    from tbo.integrations.vllm.step.graphs import graph_plan, settle

    plan = graph_plan(POLICY, _desc(8))
    step = settle(own, plan)
    if not replays:
        assert step is None, own
        return
    assert step.plan is plan and step.num_tokens == own.num_tokens and step.kind == own.kind == "decode"
    assert step.runner_split  # vLLM's runner builds it in the plan's microbatches, padding in the last one


@needs_vllm
def test_split_graphs_count_replays_as_split_steps_and_eager_steps_apart():
    from tbo.integrations.vllm.step.graphs import SplitGraphs, graph_key, graph_plan

    stats = StepStats()
    graphs = SplitGraphs(POLICY, (stats,))
    desc, small = _desc(8), _desc(2)
    assert graph_key(POLICY, desc) is not None and graph_key(POLICY, small) is None  # vLLM captures 2 unsplit
    graphs.record(desc, graph_plan(POLICY, desc))  # what wrap() records once vLLM captured it
    assert graph_key(POLICY, desc).microbatches == tuple((mb.tokens_start, mb.tokens_end)
                                                         for mb in graphs.captured[desc].microbatches)
    assert graphs.holds(True, desc) and not graphs.holds(False, desc) and not graphs.holds(True, small)
    assert graphs.settle(_decode(7), desc).plan.num_tokens == 8
    assert graphs.settle(_decode(3), desc) is None
    assert (graphs.replays, graphs.eager_steps) == (1, 1)
    assert (stats.steps, stats.split_steps, stats.tokens, stats.microbatches) == (1, 1, 7, 2)
    assert (stats.graph_replays, stats.graph_eager_steps, stats.split_steps_by_mode["decode"]) == (1, 1, 1)


def _compiled_config(mode, dp=1):
    from types import SimpleNamespace

    return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=mode)),
                           parallel_config=SimpleNamespace(data_parallel_size=dp))


def test_cudagraph_modes_accepted_and_refused_by_name():
    from tbo.integrations.vllm.admit.graphs import GRAPH_MODES, check_cudagraph_mode

    tbo = parse_config({"tbo": {}})
    for mode in ("NONE", *GRAPH_MODES):
        check_cudagraph_mode(_compiled_config(mode), tbo)
    check_cudagraph_mode(_compiled_config("NONE", dp=2), tbo)  # no graphs: data parallelism is another check's
    with pytest.raises(TboConfigError, match=r"cudagraph_mode='PIECEWISE': not supported \(PIECEWISE alone pads "
                                             r"every step to a capture size.*accepted: NONE, FULL, FULL_DECODE_ONLY, "
                                             r"FULL_AND_PIECEWISE, or enforce_eager=True"):
        check_cudagraph_mode(_compiled_config("PIECEWISE"), tbo)
    with pytest.raises(TboConfigError, match=r"cudagraph_mode='FULL' and data_parallel_size=2: not supported "
                                             r"\(CUDA graphs of split steps are built for one data-parallel rank"):
        check_cudagraph_mode(_compiled_config("FULL", dp=2), tbo)
    with pytest.raises(TboConfigError, match=r"split='adaptive' and compilation_config.cudagraph_mode="
                                             r"'FULL_DECODE_ONLY': not supported"):
        check_cudagraph_mode(_compiled_config("FULL_DECODE_ONLY"), parse_config({"tbo": {"split": "adaptive"}}))


def test_a_decode_backend_that_reads_the_host_is_refused_with_graphs():
    from tbo.comm import DispatchFormat, LocalBackend
    from tbo.comm.emulated import EmulatedLink
    from tbo.integrations.vllm.admit.graphs import check_graph_backend

    check_graph_backend(LocalBackend(8, DispatchFormat.NORMAL))  # one rank: the identity route under no_host_reads
    check_graph_backend(LocalBackend(8, DispatchFormat.MASKED, masked_capacity=16))
    with pytest.raises(TboConfigError, match=r"the decode steps' backend EmulatedLink\(.*cannot be captured in a "
                                             r"CUDA graph.*accepted: backend 'local' without a link"):
        check_graph_backend(EmulatedLink.from_spec(LocalBackend(8, DispatchFormat.NORMAL), "5,10"))
