"""A split decode step that never reads the host (issue 37, item 2), and the guard that proves it on a CPU.

`tbo.testing.host_reads.forbid_host_reads` raises on any host read of a tensor's value; a step run inside
`tbo.comm.devices.no_host_reads` takes tbo's fixed-shape paths. Over the local backend (one rank) and
torch.distributed (gloo, agreed rows), the guarded split decode step passes and equals, bit for bit, the unguarded
counted step (batch-invariant model); the same step without ``no_host_reads`` fails the guard (the counted paths do
read), and so does a planted ``.item()`` (the test of the test).
"""

import pytest
import torch

from tbo.comm import DispatchFormat, LocalBackend, TorchDistributedBackend
from tbo.comm.devices import host_reads_forbidden, no_host_reads
from tbo.harness.launch import launch
from tbo.models import ModelConfig, ReferenceModel, StaticAttentionMetadata
from tbo.split import ForwardMode, SplitPolicy
from tbo.testing.host_reads import HostReadError, forbid_host_reads

POLICY = SplitPolicy(decode_token_threshold=2, prefill_token_threshold=2)
FAMILIES = {"deepseek": ModelConfig.deepseek_v3_tiny, "qwen3_moe": ModelConfig.qwen3_moe_tiny}


# ---- the guard itself -------------------------------------------------------------------------------------------

READS = {
    "item": lambda x: x[0].item(),
    "tolist": lambda x: x.tolist(),
    "__bool__": lambda x: bool(x[0] > 0),
    "__int__": lambda x: int(x[0]),
    "__float__": lambda x: float(x[0]),
    "__index__": lambda x: [1, 2, 3][x[0]],
    "nonzero": lambda x: torch.nonzero(x),
    "unique": lambda x: x.unique(),
    "bincount": lambda x: torch.bincount(x),
    "indexing by a boolean mask": lambda x: x[x > 1],
    "repeat_interleave by a tensor": lambda x: torch.repeat_interleave(x, x),
    "equal": lambda x: torch.equal(x, x),
}


@pytest.mark.parametrize("name", list(READS))
def test_the_guard_refuses_each_host_read_by_name(name):
    x = torch.arange(1, 5)
    READS[name](x)  # fine outside the guard
    with forbid_host_reads() as guard, pytest.raises(HostReadError, match="host read inside a step"):
        READS[name](x)
    assert len(guard.reads) == 1 and guard.reads[0].startswith(name), guard.reads


def test_the_guard_lets_fixed_shape_work_and_metadata_through():
    x = torch.arange(1, 5)
    with forbid_host_reads() as guard:
        y = torch.where(x > 2, x, torch.zeros_like(x)).cumsum(0)
        assert y.shape[0] == 4 and y.dtype == torch.long  # shapes and dtypes are metadata
        torch.repeat_interleave(x, x, output_size=10)  # sized by the caller: no read
    assert guard.reads == []


def test_no_host_reads_is_a_scope():
    assert not host_reads_forbidden()
    with no_host_reads():
        assert host_reads_forbidden()
        with no_host_reads(False):
            assert host_reads_forbidden()  # a no-op scope inside keeps the outer one
    assert not host_reads_forbidden()


# ---- a split decode step on one rank ----------------------------------------------------------------------------


def _decode_inputs(model, lens, seed):
    cache = model.static_cache(len(lens) + 1, 32)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 256, (sum(lens),), generator=g)
    model.forward(prompt, StaticAttentionMetadata.build(list(range(len(lens))), lens, [0] * len(lens),
                                                        cache.scratch_slot), cache)
    meta = StaticAttentionMetadata.decode(torch.tensor(lens), torch.arange(len(lens)), cache.scratch_slot)
    return torch.randint(0, 256, (len(lens),), generator=g), meta, cache


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("lens", [[3, 5], [2, 7, 4, 1, 6]])
def test_split_decode_step_on_the_local_backend_reads_nothing(family, lens):
    model = ReferenceModel(FAMILIES[family](), LocalBackend(8, DispatchFormat.NORMAL))
    ids, meta, cache = _decode_inputs(model, lens, seed=len(lens))
    plan = POLICY.plan(ForwardMode.DECODE, len(lens))
    assert plan is not None and plan.num_microbatches == 2
    counted = model.forward_tbo(ids, meta, cache.clone(), f"{family}_decode", plan)
    with no_host_reads(), forbid_host_reads() as guard:
        fixed = model.forward_tbo(ids, meta, cache.clone(), f"{family}_decode", plan)
    assert guard.reads == []
    assert torch.equal(fixed, counted)
    assert torch.equal(counted, model.forward(ids, meta, cache.clone()))


def test_the_guard_fails_the_counted_step_and_a_planted_item():
    """The test of the test: the same split decode step fails the guard without ``no_host_reads`` (the counted
    routing check and the experts runner read), and inside it once an op reads ``.item()``. (The executor reports
    an op's failure as an `OperationError` naming the op and the cause.)"""
    model = ReferenceModel(ModelConfig.qwen3_moe_tiny(), LocalBackend(8, DispatchFormat.NORMAL))
    ids, meta, cache = _decode_inputs(model, [3, 5, 2], seed=1)
    plan = POLICY.plan(ForwardMode.DECODE, 3)
    with forbid_host_reads(), pytest.raises(Exception, match="op 'dispatch_a' failed: HostReadError"):
        model.forward_tbo(ids, meta, cache.clone(), "qwen3_moe_decode", plan)
    layer = next(layer for layer in model.layers if layer.kind == "moe")
    op_gate = type(layer).op_gate

    def planted(state):
        op_gate(layer, state)
        state.router_logits[0, 0].item()  # the planted read

    layer.op_gate = planted
    model._bound.clear()
    try:
        with no_host_reads(), forbid_host_reads(), pytest.raises(Exception,
                                                                match="failed: HostReadError.*: item, at .*planted"):
            model.forward_tbo(ids, meta, cache.clone(), "qwen3_moe_decode", plan)
    finally:
        del layer.op_gate
        model._bound.clear()


# ---- torch.distributed (gloo), agreed rows ----------------------------------------------------------------------

DIST_LENS = {0: [3, 5, 2], 1: [4, 1, 6, 2, 3]}  # decode requests per rank (tokens: 3 and 5)


def _dist_decode(rank, world, family):
    backend = TorchDistributedBackend(8, DispatchFormat.NORMAL, timeout_s=60)
    model = ReferenceModel(FAMILIES[family](), backend)
    lens = DIST_LENS[rank]
    ids, meta, cache = _decode_inputs(model, lens, seed=10 + rank)
    plans = {r: POLICY.plan(ForwardMode.DECODE, len(DIST_LENS[r])) for r in range(world)}
    rows = [tuple(mb.tokens_end - mb.tokens_start for mb in (plans[r].microbatches[m] for r in range(world)))
            for m in range(2)]
    unsplit = [tuple(len(DIST_LENS[r]) for r in range(world))]
    counted = model.forward_tbo(ids, meta, cache.clone(), f"{family}_decode", None)  # count exchanges
    exchanges = backend.count_exchanges
    agreed = model.forward_tbo(ids, meta, cache.clone(), f"{family}_decode", plans[rank], rows_per_rank=rows)
    with no_host_reads(), forbid_host_reads() as guard:
        fixed = model.forward_tbo(ids, meta, cache.clone(), f"{family}_decode", plans[rank], rows_per_rank=rows)
        fixed_unsplit = model.forward_tbo(ids, meta, cache.clone(), f"{family}_decode", None,
                                          rows_per_rank=unsplit)
    return (guard.reads, torch.equal(fixed, counted), torch.equal(agreed, counted),
            torch.equal(fixed_unsplit, counted), exchanges, backend.count_exchanges - exchanges)


@pytest.mark.dist
@pytest.mark.parametrize("family", list(FAMILIES))
def test_split_decode_step_over_gloo_by_agreed_rows_reads_nothing(family):
    """Two gloo ranks, a split decode step by agreed rows inside the guard: no host read on either rank, results bit
    for bit the count exchange's (unsplit) and the counted agreed-rows path's, and no count exchange made."""
    for rank, (reads, fixed, agreed, fixed_unsplit, before, after) in enumerate(launch(_dist_decode, 2, family,
                                                                                       timeout_s=180)):
        assert reads == [], f"rank {rank}: {reads}"
        assert fixed and agreed and fixed_unsplit, f"rank {rank}: the fixed-shape step differs from the counted one"
        assert before > 0 and after == 0, f"rank {rank}: count exchanges {before} then {after}"


def _fixed_dispatch(rank, world):
    """Rank 1 dispatches no rows in the first case; every case: fixed shapes inside the guard, counted outside."""
    from tbo.experts import run_experts
    from tbo.testing.moe import SwiGLUExperts, make_routing

    backend = TorchDistributedBackend(8, DispatchFormat.NORMAL, timeout_s=60)
    each = SwiGLUExperts.build(8, 16, 24, seed=3).local(rank, backend.num_local_experts)

    def fn(e, x):  # row by row: batch invariant, so that the fixed runner's all-rows GEMM gives the same rows
        return torch.cat([each(e, row.unsqueeze(0)) for row in x]) if x.shape[0] else each(e, x)
    same, reads = [], []
    for case, rows in enumerate([(4, 0), (1, 1), (5, 3)]):
        n = rows[rank]
        x = torch.randn(n, 16, generator=torch.Generator().manual_seed(case * 10 + rank))
        idx, w = make_routing(n, 8, 2, seed=case * 10 + rank, drop=0.2)
        d = backend.dispatch_b(backend.dispatch_a(x, idx, w, rows_per_rank=rows))
        counted = backend.combine_b(backend.combine_a(run_experts(d, fn), d.handle))
        with no_host_reads(), forbid_host_reads() as guard:
            d = backend.dispatch_b(backend.dispatch_a(x, idx, w, rows_per_rank=rows))
            fixed = backend.combine_b(backend.combine_a(run_experts(d, fn), d.handle))
        same.append(torch.equal(fixed, counted) and d.hidden.shape[0] == sum(rows))
        reads += guard.reads
    return same, reads, backend.count_exchanges


@pytest.mark.dist
def test_fixed_shape_dispatch_by_agreed_rows_equals_the_counted_one_with_an_empty_rank():
    """The fixed-shape agreed-rows dispatch receives exactly the agreed rows (padding kept), combines bit for bit
    what the counted one does, one rank dispatching none; no read, no count exchange."""
    for rank, (same, reads, exchanges) in enumerate(launch(_fixed_dispatch, 2, timeout_s=120)):
        assert all(same) and reads == [] and exchanges == 0, (rank, same, reads, exchanges)
