"""tbo inside vLLM with data-parallel attention and expert parallelism: two DP ranks, tbo carrying the expert traffic.

Each DP rank is a process launched as vLLM's ``examples/offline_inference/data_parallel.py`` does (``VLLM_DP_*`` set,
``VLLM_CPU_OMP_THREADS_BIND="0|1"``; `tbo.harness.vllm_dp`), its engine over its own prompts, the experts spread
over both ranks (``enable_expert_parallel=True``). The reference is a DP = 1 engine without tbo, in this process,
over the same prompts (each rank's round in its own ``generate`` call). Qwen3-MoE float32: tokens exactly equal.
DeepSeek-V3 float32: tokens exactly equal too; bfloat16: judged by the float32 model at every generated position,
tbo's tokens as faithful as vLLM's own (bf16_oracle.py); its references have vLLM's CPU rotary kernel fixed
as the plugin fixes it. Every engine test also asserts that both ranks split steps and sent token rows to the other
(``remote_rows > 0``): none passes with local experts or without splitting. Every process a test starts is killed
when it ends, passing or failing (`run_dp`).

`make test-vllm` runs this file in .venv-vllm; without vLLM the engine tests skip and the agreement tests (gloo
processes, no vLLM) still run.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tbo.core.errors import CommTimeoutError
from tbo.split.agree import StepVote, agree_step, decide_step

from .helpers import (HAVE_VLLM, _CountingCpuKernel, _assert_both_split_and_sent, _dp, _dp_reference, _prompt,
                      _reference_llm, _save_mixtral, needs_vllm, DP_ENGINE as ENGINE,
                      DP_MAX_TOKENS as MAX_TOKENS, DP_TBO as TBO)


# ---- the agreement (gloo processes, no vLLM) ---------------------------------------------------------------------


def test_decide_step_rule():
    wants = StepVote(2, True, True, "decode", (3, 2))
    idle = StepVote(2, False, True, "idle", (1, 0))
    prefill = StepVote(2, False, True, "prefill", (9, 0))
    a = decide_step((wants, idle))
    assert (a.split, a.num_microbatches, a.slot, a.idle_ranks) == (True, 2, "decode", 1)
    assert a.rows == ((3, 1), (2, 0))  # per microbatch, per rank
    assert decide_step((idle, prefill)).rows == ((1, 9),)  # unsplit: each rank's total
    assert decide_step((wants, StepVote(2, False, True, "idle"))).rows is None  # a rank did not tell
    for bad in ((5,), (3, -1)):
        with pytest.raises(ValueError, match="StepVote.rows must give 2 row counts"):
            StepVote(2, True, True, "decode", bad)
    with pytest.raises(ValueError, match="num_microbatches must be 1..16"):
        StepVote(17, True, True, "decode")
    assert decide_step((wants, prefill)).slot == "prefill"  # its collectives' order rules
    assert not decide_step((wants, StepVote(2, True, False, "decode"))).split  # one veto: nobody splits
    assert not decide_step((idle, prefill)).split  # nobody planned a split
    with pytest.raises(ValueError, match="rank 0: 2, rank 1: 3"):
        decide_step((wants, StepVote(3, True, True, "decode")))
    with pytest.raises(ValueError, match="mode"):
        StepVote(2, True, True, "mixed")


def _agree_rank(rank: int, world: int) -> tuple:
    votes = [StepVote(2, True, True, "decode", (7, 6)), StepVote(2, False, True, "idle", (1, 0))]
    a = agree_step(votes[rank], timeout_s=20)
    if rank == 1:
        return (a.split, a.slot, a.rows)  # and then never takes part in the second agreement
    try:
        agree_step(votes[0], timeout_s=2)
    except CommTimeoutError as e:
        return (a.split, a.slot, a.rows, str(e))
    return (a.split, a.slot, a.rows, "no error")


@pytest.mark.dist
def test_agree_step_over_gloo_and_a_missing_peer_is_named():
    from tbo.harness.launch import launch

    results = launch(_agree_rank, 2, timeout_s=120)
    assert results[1] == (True, "decode", ((7, 1), (6, 0)))
    split, mode, rows, error = results[0]
    assert (split, mode, rows) == (True, "decode", ((7, 1), (6, 0)))
    assert "rank 0" in error and "agree_step" in error, error


def _stalled_peer_rank(rank: int, world: int) -> tuple:
    """Rank 1 stalls (sleeps, its connections open) while rank 0 runs a blocking all-reduce of "vLLM's" under
    `call_bounded`: the deadline, not gloo's 30 minutes, ends it, named; the group's own timeout comes back after."""
    import datetime

    import torch
    import torch.distributed as dist

    from tbo.integrations.vllm.comm.bounded import call_bounded

    group = dist.group.WORLD
    gloo = group._get_backend(torch.device("cpu"))
    gloo._set_default_timeout(datetime.timedelta(seconds=60))  # the group's own: far longer than the deadline
    if rank == 1:
        time.sleep(8)
        return ()
    t0 = time.monotonic()
    try:
        call_bounded(group, 2, "an engine's all_reduce", dist.all_reduce, torch.ones(1), group=group)
        error = "no error"
    except CommTimeoutError as e:
        error = str(e)
    return (error, time.monotonic() - t0, gloo.options._timeout == datetime.timedelta(seconds=60))


def _coordinate_rank(rank: int, world: int) -> tuple:
    """The hook's `coordinate` on two gloo ranks of 3 and 5 tokens: merged, ``determine`` runs under vLLM's
    ``skip_dp_coordination`` (its all-reduce skipped) and the per-rank counts come from the agreement; not merged,
    ``determine`` all-reduces as vLLM's coordination does, counted."""
    import torch
    import torch.distributed as dist
    from vllm.v1.worker.dp_utils import should_skip_dp_coordination

    from tbo.integrations.vllm.step.agree import StepAgreementHook
    from tbo.integrations.engine.stats import StepStats
    from tbo.integrations.engine.step import Step
    from tbo.split import ForwardMode

    def determine() -> tuple:  # vLLM's shape of result; without the skip it all-reduces each rank's count
        skipped = should_skip_dp_coordination()
        counts = torch.zeros(world, dtype=torch.int32)
        counts[rank] = 3 + 2 * rank
        if not skipped:
            dist.all_reduce(counts)
        return "mode", skipped, False, counts, None

    hook = StepAgreementHook(2, dist.group.WORLD, 30.0, stats=(StepStats(),))
    out = []
    for merged in (True, False):
        hook.merges_coordination = merged
        hook(Step("decode", ForwardMode.DECODE, 3 + 2 * rank, None), False)
        _, skipped, _, counts, _ = hook.coordinate(determine)
        out.append((skipped, counts.tolist()))
    return out, hook.stats[0].vllm_dp_all_reduces


@needs_vllm
@pytest.mark.dist
def test_the_agreement_answers_vllm_s_dp_batch_coordination_without_a_second_all_reduce():
    from tbo.harness.launch import launch

    for out, all_reduces in launch(_coordinate_rank, 2, timeout_s=120):
        assert out == [(True, [3, 5]), (False, [3, 5])], out
        assert all_reduces == 1  # the unmerged call only


@pytest.mark.dist
def test_call_bounded_ends_a_blocking_collective_on_a_stalled_peer_with_a_named_error():
    from tbo.harness.launch import launch

    error, waited, restored = launch(_stalled_peer_rank, 2, timeout_s=120)[0]
    assert error.startswith("rank 0: an engine's all_reduce") and "timed out after 2s" in error, error
    assert waited < 8 and restored, (waited, restored)


def _engine_sync_rank(rank: int, world: int) -> tuple:
    """vLLM's own engine-loop DP all-reduce (``DPEngineCoreProc._has_global_unfinished_reqs``, as the tbo plugin
    wraps it) on an engine core with tbo, over a real gloo group whose peer stalls: named, within tbo's deadline."""
    import datetime
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    group = dist.group.WORLD
    if rank == 1:
        dist.barrier(group)
        time.sleep(8)  # stalled: its connections stay open
        return ()
    from vllm.v1.engine.core import DPEngineCoreProc

    from tbo.integrations.vllm.plugin import register

    register()
    group._get_backend(torch.device("cpu"))._set_default_timeout(datetime.timedelta(seconds=60))
    dist.barrier(group)
    core = SimpleNamespace(dp_group=group, dp_rank=0, step_counter=0, dp_sync_interval=16, pending_pause=False,
                           vllm_config=SimpleNamespace(additional_config={"tbo": {"comm_timeout_s": 2}}))
    t0 = time.monotonic()
    try:
        DPEngineCoreProc._has_global_unfinished_reqs(core, True)  # step 1: vLLM syncs with its peers
        error = "no error"
    except CommTimeoutError as e:
        error = str(e)
    return (error, time.monotonic() - t0)


@needs_vllm
@pytest.mark.dist
def test_vllm_engine_loop_dp_all_reduce_is_bounded_and_named_on_a_stalled_peer():
    from tbo.harness.launch import launch

    error, waited = launch(_engine_sync_rank, 2, timeout_s=180)[0]
    assert error.startswith("rank 0: vLLM's engine-loop DP all-reduce (_has_global_unfinished_reqs)"), error
    assert "timed out after 2s" in error and waited < 8, (error, waited)


def _p2p_sync_rank(rank: int, world: int, engine_timeout_s: int | None) -> tuple:
    """vLLM 0.33's engine-loop DP sync as it waits: gloo sends and receives (``cpu_all_reduce_``), each wait taking
    ``parallel_config.cpu_distributed_timeout_seconds`` (None: the group's own, here 60 s), under
    `bounded_engine_sync` with tbo's 2 s deadline while rank 1 stalls: named within the deadline, the engine's
    setting back after."""
    import datetime
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from tbo.integrations.vllm.runner.dp import bounded_engine_sync

    group = dist.group.WORLD
    group._get_backend(torch.device("cpu"))._set_default_timeout(datetime.timedelta(seconds=60))
    dist.barrier(group)
    if rank == 1:
        time.sleep(8)  # stalled: its connections stay open
        return ()
    parallel_config = SimpleNamespace(cpu_distributed_timeout_seconds=engine_timeout_s)
    core = SimpleNamespace(dp_group=group, dp_rank=0, vllm_config=SimpleNamespace(parallel_config=parallel_config))
    seen = []

    def sync(core: Any, local_unfinished: bool) -> bool:  # vllm/distributed/utils.py's cpu_all_reduce_, one round
        seconds = core.vllm_config.parallel_config.cpu_distributed_timeout_seconds
        seen.append(seconds)
        tensor, scratch = torch.tensor([int(local_unfinished)]), torch.zeros(1, dtype=torch.int64)
        recv, send = group.recv([scratch], 1, 27100), group.send([tensor], 1, 27100)
        timeout = datetime.timedelta(seconds=seconds) if seconds is not None else datetime.timedelta(0)
        recv.wait(timeout)
        send.wait(timeout)
        return bool(tensor.add_(scratch).item())

    t0 = time.monotonic()
    try:
        bounded_engine_sync(core, 2.0, sync, True)
        error = "no error"
    except CommTimeoutError as e:
        error = str(e)
    return (error, time.monotonic() - t0, seen, parallel_config.cpu_distributed_timeout_seconds)


@pytest.mark.dist
@pytest.mark.parametrize("engine_timeout_s", [None, 600])
def test_engine_loop_dp_sync_point_to_point_waits_under_tbos_deadline(engine_timeout_s):
    """From vLLM 0.33 the engine-loop DP sync's waits ignore the group's timeout: tbo's deadline reaches them through
    ``cpu_distributed_timeout_seconds`` (unset, or longer than tbo's), and the engine's value comes back after."""
    from tbo.harness.launch import launch

    error, waited, seen, after = launch(_p2p_sync_rank, 2, engine_timeout_s, timeout_s=120)[0]
    assert seen == [2], seen  # the sync ran, and saw tbo's deadline
    assert error.startswith("rank 0: vLLM's engine-loop DP all-reduce (_has_global_unfinished_reqs)"), error
    assert "timed out after 2s" in error and waited < 6, (error, waited)
    assert after == engine_timeout_s


def _zero_rows_rank(rank: int, world: int, agreed: bool) -> tuple:
    """Rank 0 dispatches no rows at all (an empty microbatch), rank 1 five tokens, some to each rank's experts;
    ``agreed``: by the rows both ranks agreed (padded, no count exchange), as a DP step's dispatches go."""
    import torch

    from tbo.integrations.vllm.comm.ep import EpBackend

    backend = EpBackend(4, None, timeout_s=20)
    h = 8
    n = 0 if rank == 0 else 5
    x = torch.arange(n * h, dtype=torch.float32).view(n, h)
    ids = torch.tensor([[0, 3], [1, 2], [2, 3], [0, 1], [3, 1]])[:n]
    weights = torch.full((n, 2), 0.5)
    d = backend.dispatch_b(backend.dispatch_a(x, ids, weights, **({"rows_per_rank": (0, 5)} if agreed else {})))
    # the experts: local expert e multiplies by (global id + 1); -1 slots (other rank's experts) add nothing
    local = d.topk_idx
    scale = torch.where(local >= 0, (local + 1 + rank * 2).float(), torch.zeros_like(local, dtype=torch.float32))
    out = d.hidden * (scale * d.topk_weights.float()).sum(1, keepdim=True)
    y = backend.combine_b(backend.combine_a(out, d.handle))
    want = x * (weights * (ids + 1).float()).sum(1, keepdim=True)
    return (tuple(y.shape), bool(torch.equal(y, want)), backend.remote_rows, int(d.hidden.shape[0]),
            backend.count_exchanges)


@pytest.mark.dist
@pytest.mark.parametrize("agreed", [False, True], ids=["count-exchange", "agreed-rows"])
def test_ep_backend_dispatch_and_combine_handle_zero_rows_and_count_remote_rows(agreed):
    from tbo.harness.launch import launch

    (shape0, ok0, remote0, got0, ex0), (shape1, ok1, remote1, got1, ex1) = launch(_zero_rows_rank, 2, agreed,
                                                                                   timeout_s=120)
    assert shape0 == (0, 8) and ok0 and remote0 == 0  # nothing to send, still took part in every collective
    assert shape1 == (5, 8) and ok1
    assert remote1 == 4 and got0 == 4  # 4 of its 5 tokens name an expert of rank 0 (0 or 1): 4 rows sent there
    assert ex0 == ex1 == (0 if agreed else 1)  # agreed rows: the padding (5 rows to rank 0, 1 of them) dropped


class _Par:
    def __init__(self, **kw):
        self.__dict__.update(dict(data_parallel_size=2, enable_expert_parallel=True, tensor_parallel_size=1,
                                  expert_placement_strategy="linear"), **kw)


@pytest.mark.parametrize("kw, match", [
    ({"enable_expert_parallel": False}, r"data_parallel_size=2: not supported .*enable_expert_parallel=True"),
    ({"data_parallel_size": 1}, r"enable_expert_parallel=True: not supported .*data_parallel_size > 1"),
    ({"tensor_parallel_size": 2}, r"tensor_parallel_size=2: not supported .*1 per data-parallel rank"),
    ({"expert_placement_strategy": "round_robin"}, r"expert_placement_strategy='round_robin'.*'linear'"),
])
def test_dp_ep_combinations_refused_by_name(kw, match):
    from tbo.integrations.vllm.config import TboConfigError
    from tbo.integrations.vllm.admit.parallel import check_dp_ep

    check_dp_ep(_Par())  # DP 2 + EP, TP 1, linear: accepted
    with pytest.raises(TboConfigError, match=match):
        check_dp_ep(_Par(**kw))


def test_more_microbatches_than_the_agreement_carries_refused_at_engine_start():
    from tbo.integrations.vllm.config import TboConfigError
    from tbo.integrations.vllm.step.agree import StepAgreementHook

    StepAgreementHook(16, None, 1.0)
    with pytest.raises(TboConfigError, match=r"num_microbatches=17: not supported .*at most 16 with data parallel"):
        StepAgreementHook(17, None, 1.0)


def test_microbatch_rows_of_a_step():
    from tbo.integrations.vllm.step.agree import empty_tail_plan
    from tbo.integrations.engine.step import microbatch_rows
    from tbo.split import ForwardMode, SplitPolicy

    plan = SplitPolicy().plan(ForwardMode.DECODE, 7, None)
    assert microbatch_rows(plan, 7, 2) == tuple(mb.tokens_len for mb in plan.microbatches) and sum(
        microbatch_rows(plan, 7, 2)) == 7
    assert microbatch_rows(None, 3, 3) == (3, 0, 0) == microbatch_rows(empty_tail_plan(3, 3), 3, 3)


def test_empty_tail_plan():
    from tbo.integrations.vllm.step.agree import empty_tail_plan

    plan = empty_tail_plan(1, 3)  # an idle rank's one-token dummy step, three agreed microbatches
    assert [(m.tokens_start, m.tokens_unpadded_len) for m in plan.microbatches] == [(0, 1), (1, 0), (1, 0)]
    assert plan.num_tokens == 1 and plan.num_microbatches == 3


# ---- engines ------------------------------------------------------------------------------------------------------


#: rank 0: one short prompt, prefilled in one step, then decoding while rank 1 still prefills 126 tokens in 32-token
#: chunks; done first, it runs dummy steps while rank 1 decodes. (Every rank brings requests to each generate
#: call: offline, without vLLM's DP coordinator, an engine with none would not wake for its peers' wave.)
UNEVEN = [[[_prompt(5, 1)]],
          [[_prompt(40, 2), _prompt(40, 3), _prompt(40, 4), _prompt(6, 5)]]]


@needs_vllm
@pytest.mark.dist
def test_qwen3_moe_dp2_ep_uneven_load_tokens_equal_and_both_ranks_split(models, tmp_path):
    runs, per_rank = _dp(tmp_path, models["qwen3_moe"], UNEVEN, TBO, dtype="float32")
    for rank, rounds in enumerate(UNEVEN):
        want = [[list(o.token_ids) for o in r] for r in _dp_reference(models["qwen3_moe"], rounds, dtype="float32")]
        assert runs[rank].result["tokens"] == want, rank
    _assert_both_split_and_sent(per_rank, 2)
    idle, busy = per_rank
    # the idle rank's dummy steps ran through tbo, split as agreed; while it decoded its peer prefilled
    assert idle["split_steps_by_mode"]["idle"] > 0, idle
    assert idle["peer_strategy_steps"] > 0, idle
    assert busy["split_steps_by_mode"]["prefill"] + busy["split_steps_by_mode"]["mixed"] > 0, busy


@needs_vllm
@pytest.mark.dist
def test_compiled_qwen3_moe_dp2_ep_tokens_equal_compiled_vllm_and_both_ranks_split(models, tmp_path):
    """Compiled engines (no ``enforce_eager``; issue 37): every step of a DP rank runs tbo's loop (the expert traffic
    is tbo's) with its ops' tensor work compiled, vLLM's graph of the whole model never compiled. Without CUDA graphs
    vLLM pads no step, so the agreement answers vLLM's DP coordination as in an eager engine. Tokens equal plain
    compiled vLLM's at DP = 1; both ranks split, sent rows and ran compiled ops, within their compile bound."""
    compiled = dict(dtype="float32", enforce_eager=False)
    runs, per_rank = _dp(tmp_path, models["qwen3_moe"], UNEVEN, TBO, **compiled)
    for rank, rounds in enumerate(UNEVEN):
        want = [[list(o.token_ids) for o in r] for r in _dp_reference(models["qwen3_moe"], rounds, **compiled)]
        assert runs[rank].result["tokens"] == want, rank
    _assert_both_split_and_sent(per_rank, 2)
    for rank, s in enumerate(per_rank):
        # one graph per graph key, compiled at warm-up (its dummy runs run tbo's loop): the bound, exactly
        assert s["compiled_op_calls"] > 0 and 0 < s["op_compiles"] == s["op_compile_bound"], (rank, s)
    assert per_rank[0]["split_steps_by_mode"]["idle"] > 0, per_rank[0]  # the idle rank's dummy steps, split too


@needs_vllm
@pytest.mark.dist
@pytest.mark.parametrize("agreed_rows", [True, False], ids=["agreed-rows", "count-exchange"])
def test_qwen3_moe_dp2_ep_three_microbatches(models, tmp_path, agreed_rows):
    """Three microbatches, tokens equal; by the agreed rows, and (``agreed_rows: false``) with every dispatch
    exchanging row counts first."""
    rounds = [[[_prompt(9, 7), _prompt(8, 8), _prompt(3, 9)]], [[_prompt(4, 10), _prompt(17, 11)]]]
    tbo = {**TBO, "num_microbatches": 3, "decode_token_threshold": 3, "agreed_rows": agreed_rows}
    runs, per_rank = _dp(tmp_path, models["qwen3_moe"], rounds, tbo, dtype="float32")
    for rank, r in enumerate(rounds):
        want = [[list(o.token_ids) for o in x] for x in _dp_reference(models["qwen3_moe"], r, dtype="float32")]
        assert runs[rank].result["tokens"] == want, rank
    _assert_both_split_and_sent(per_rank, 3, agreed_rows)


def _deepseek_reference(model: Path, rounds_per_rank: list, dtype: str) -> list:
    """vLLM's own tokens for DeepSeek, per rank, round and request: DP = 1 without tbo, one ``generate`` per rank's
    round, with vLLM's CPU rotary kernel fixed as the plugin fixes it (test_engine.py: unfixed, vLLM's own
    DeepSeek tokens depend on the batch)."""

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True)
    with _reference_llm(model, **{**ENGINE, "dtype": dtype}) as llm:
        return [[[list(o.outputs[0].token_ids) for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in r],
                                                                     params, use_tqdm=False)] for r in rounds]
                for rounds in rounds_per_rank]


DEEPSEEK_ROUNDS = [[[_prompt(9, 12), _prompt(4, 13), _prompt(30, 14)]], [[_prompt(5, 15), _prompt(16, 16)]]]


@needs_vllm
@pytest.mark.dist
def test_deepseek_v3_fp32_dp2_ep_equals_vllm_and_both_ranks_split(models, tmp_path):
    """DeepSeek-V3 (MLA, a shared expert, grouped bias-corrected routing, a dense first layer) in float32 over
    DP = 2 + EP: exactly vLLM's own DP = 1 tokens (top-2 routing: each rank's partial sum and the combine's add are
    the sum vLLM's kernel makes)."""
    model = models["deepseek_v3"]
    runs, per_rank = _dp(tmp_path, model, DEEPSEEK_ROUNDS, TBO, dtype="float32")
    for rank, want in enumerate(_deepseek_reference(model, DEEPSEEK_ROUNDS, "float32")):
        assert runs[rank].result["tokens"] == want, rank
    _assert_both_split_and_sent(per_rank, 2)


@needs_vllm
@pytest.mark.dist
def test_deepseek_v3_bf16_dp2_ep_matches_vllm_and_both_ranks_split(models, tmp_path):
    """The same in bfloat16, where each rank's partial sum is rounded to bf16 before the combine adds them (as every
    expert-parallel combine does, and vLLM's DP = 1 kernel does not): judged by the float32 model at every
    generated position, tbo's tokens as faithful as vLLM's own (bf16_oracle.py)."""
    from .bf16_oracle import assert_as_faithful_as_vllm, reference_fp32

    model = models["deepseek_v3"]
    runs, per_rank = _dp(tmp_path, model, DEEPSEEK_ROUNDS, TBO, dtype="bfloat16")
    want = [t for rank in _deepseek_reference(model, DEEPSEEK_ROUNDS, "bfloat16") for t in rank[0]]
    prompts = [p for rounds in DEEPSEEK_ROUNDS for p in rounds[0]]
    got = [t for run in runs for t in run.result["tokens"][0]]
    with reference_fp32(model, ENGINE) as judge:
        judged = assert_as_faithful_as_vllm(judge, prompts, got, want, [MAX_TOKENS] * len(prompts))
    assert judged == len(prompts) * MAX_TOKENS
    _assert_both_split_and_sent(per_rank, 2)


def _live_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that are alive (zombies, already dead, excluded)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry))
    return alive


def _signal_rank_1_mid_generation(models: dict, tmp_path: Path, sig: int, timeout_s: float) -> tuple:
    """Two DP ranks generating three rounds of 240 tokens each, ``comm_timeout_s=timeout_s``; a second after both
    began the first round, ``sig`` goes to rank 1's whole process group. The work is sized so that no machine finishes
    it first: a fast CI machine generated one round of 200 tokens in 2.8 s, and a survivor that finished its rounds
    before the signal would exit cleanly (a wait between rounds times out after ``timeout_s`` too). Returns rank 0's `RankRun` (once it exited, or ``timeout_s + 90`` s passed) and
    the live processes of rank 1's group at that moment. Every process is gone when it returns (a stopped one takes
    SIGKILL too)."""
    from tbo.harness.launch import free_port
    from tbo.harness.vllm_dp import collect, start_rank, stop

    barrier = tmp_path / "barrier"
    barrier.mkdir()
    spec = dict(model=str(models["qwen3_moe"]), engine={**ENGINE, "dtype": "float32", "enable_expert_parallel": True},
                tbo={**TBO, "comm_timeout_s": timeout_s}, max_tokens=240, barrier_dir=str(barrier),
                barrier_s=timeout_s, rounds=[[_prompt(4, s) for s in range(6)]] * 3)
    port = free_port()
    runs = [start_rank(k, 2, port, spec) for k in range(2)]
    try:
        deadline = time.monotonic() + 400
        while not all((barrier / f"round0-{k}").exists() for k in range(2)):
            assert time.monotonic() < deadline and all(r.proc.poll() is None for r in runs), "ranks did not start"
            time.sleep(0.1)
        time.sleep(1)  # both are generating: past the prefill, seconds from the end of the first round
        assert all(r.proc.poll() is None for r in runs)
        stop(runs[1], sig)
        # its engine core may stay blocked in a collective with the stopped peer after the rank has failed and exited:
        # a short grace, not the default's two minutes for writing stats_file (none is read here), then the group goes
        survivor = collect(runs[0], timeout_s=timeout_s + 90, grace_s=10)
        peer_left = _live_members(runs[1].proc.pid)
    finally:
        for r in runs:
            stop(r, signal.SIGKILL)
            stop(r, signal.SIGCONT)
        collect(runs[1], 10, grace_s=10)  # reaped, its output files removed
    for r in runs:
        assert not _live_members(r.proc.pid), (r.rank, _live_members(r.proc.pid))
    return survivor, peer_left


@needs_vllm
@pytest.mark.dist
def test_a_killed_rank_makes_its_peer_fail_with_a_named_error_in_bounded_time(models, tmp_path):
    """Rank 1 is killed (SIGKILL, its whole process group) mid-generation: rank 0's engine fails with tbo's
    `CommTimeoutError` naming its rank and the op that lost its peer, well within ``comm_timeout_s`` plus the
    engine's own teardown; nothing hangs and no process is left."""
    survivor, _ = _signal_rank_1_mid_generation(models, tmp_path, signal.SIGKILL, timeout_s=20)
    out = survivor.stdout + survivor.stderr
    assert not survivor.extra.get("timed_out"), out[-4000:]
    assert survivor.returncode != 0 and survivor.result is None, out[-4000:]
    named = [line for line in out.splitlines() if "CommTimeoutError: rank 0:" in line]
    assert named and any(("could not complete" in line or "timed out" in line) for line in named), out[-6000:]


@needs_vllm
@pytest.mark.dist
def test_served_dp2_ep_concurrent_requests_tokens_equal_and_both_engines_split(models, tmp_path):
    """``python -m vllm.entrypoints.openai.api_server --data-parallel-size 2 --enable-expert-parallel`` on a CPU (two
    engines, vLLM's DP coordinator balancing the requests): concurrent completions, each equal to vLLM's own DP = 1
    tokens for its prompt; both engines split steps and sent rows to each other. The server's process group is
    killed at the end, passing or failing."""
    import subprocess
    import sys
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from tbo.harness.launch import free_port

    model, port = models["qwen3_moe"], free_port()
    tbo = {**TBO, "stats_file": str(tmp_path / "served-{rank}.json")}
    prompts = [_prompt(5 + 3 * i, 30 + i) for i in range(6)]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--skip-tokenizer-init",
           "--host", "127.0.0.1", "--port", str(port), "--data-parallel-size", "2", "--enable-expert-parallel",
           "--enforce-eager", "--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "32",
           "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0", "--additional-config", json.dumps({"tbo": tbo})]
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(cmd, env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)

    def complete(prompt: list[int]) -> list[int]:
        body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["token_ids"]

    try:
        deadline = time.monotonic() + 400
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-6000:]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)  # a graceful stop first: the workers write stats_file then
            server.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
    want = [[list(o.token_ids) for o in r] for r in _dp_reference(model, [prompts], dtype="float32")][0]
    assert got == want
    per_rank = [json.loads((tmp_path / f"served-{k}.json").read_text()) for k in range(2)]
    _assert_both_split_and_sent(per_rank, 2)


#: three generate calls in one launch, every rank submitting each round together: uneven in both directions (rank 0
#: done first in round 0, rank 1 in round 1), then rank 1 has nothing (the harness submits a placeholder request
#: for it, as vLLM's example does: offline, an engine without requests would not step for its peer)
ROUNDS = [[[_prompt(5, 1)], [_prompt(30, 21), _prompt(7, 22)], [_prompt(9, 24)]],
          [[_prompt(40, 2), _prompt(6, 5)], [_prompt(4, 23)], []]]


@needs_vllm
@pytest.mark.dist
def test_qwen3_moe_dp2_ep_several_generate_calls_in_one_launch_tokens_equal(models, tmp_path):
    """Each round's tokens exactly equal vLLM's DP = 1 engine's for that round, on both ranks; both ranks split and
    sent rows; both ran dummy steps (rank 0 while rank 1 finished round 0, rank 1 in round 2 beside its placeholder),
    rank 0's split as agreed."""
    runs, per_rank = _dp(tmp_path, models["qwen3_moe"], ROUNDS, TBO, dtype="float32")
    for rank, rounds in enumerate(ROUNDS):
        want = [[list(o.token_ids) for o in r] for r in _dp_reference(models["qwen3_moe"], rounds, dtype="float32")]
        assert runs[rank].result["tokens"] == want, rank
        assert len(want) == 3 and all(want[k] for k in range(2)), want  # two rounds compared per rank, at least
    _assert_both_split_and_sent(per_rank, 2)
    assert per_rank[0]["split_steps_by_mode"]["idle"] > 0 and per_rank[1]["steps_by_mode"]["idle"] > 0, per_rank
    # each round's wave ended with dummy steps on every rank at once (up to vLLM's dp_sync_interval - 1 of them):
    # counted, their layer stacks skipped, the same number on both ranks
    assert per_rank[0]["idle_skipped"] == per_rank[1]["idle_skipped"] > 0, per_rank


@needs_vllm
@pytest.mark.dist
def test_requests_arriving_while_the_engine_steps_do_not_end_the_wave_on_every_rank(models, tmp_path):
    """One-token requests (each finishes in the step that prefills it). Rank 0's first request goes alone, the other
    three arrive 1 s later, while its engine steps the first (an emulated link makes each step take seconds). At the
    step's all-reduce no rank's scheduler has an unfinished request; vLLM alone would end the wave on both ranks,
    rank 1 (done) would leave, and rank 0's engine would step its other requests alone until the deadline. tbo's
    wrapper counts the three waiting in rank 0's input queue: both ranks step on, tokens equal DP = 1."""
    rounds = [[[_prompt(6, 31), _prompt(5, 32), _prompt(7, 33), _prompt(4, 34)]], [[_prompt(5, 35)]]]
    tbo = {**TBO, "link": "1000000,1"}  # 1 s per transfer: a step of 2 MoE layers takes 4 s or more
    from tbo.harness.vllm_dp import describe_failure, run_dp

    (tmp_path / "barrier").mkdir()
    stats = tmp_path / "stats-{rank}.json"
    engine = {**ENGINE, "dtype": "float32", "enable_expert_parallel": True}
    specs = [dict(model=str(models["qwen3_moe"]), engine=engine,
                  tbo={**tbo, "stats_file": str(stats)}, rounds=r, max_tokens=1, stagger_s=1.0,
                  barrier_dir=str(tmp_path / "barrier")) for r in rounds]
    runs = run_dp(specs, timeout_s=600)
    assert all(r.returncode == 0 and r.result for r in runs), describe_failure(runs)
    per_rank = [json.loads(Path(str(stats).replace("{rank}", str(k))).read_text()) for k in range(2)]
    for rank, r in enumerate(rounds):
        want = [[list(o.token_ids)[:1] for o in x] for x in _dp_reference(models["qwen3_moe"], r, dtype="float32")]
        assert runs[rank].result["tokens"] == want, rank
    assert per_rank[0]["steps"] >= 2 and per_rank[1]["steps_by_mode"]["idle"] >= 1, per_rank


@needs_vllm
@pytest.mark.dist
def test_a_stalled_rank_makes_its_peer_fail_with_a_named_error_in_bounded_time(models, tmp_path):
    """Rank 1 is stopped (SIGSTOP, its whole process group: front end, engine core, worker) mid-generation, not
    killed: its sockets stay open, so no wait of rank 0's learns of it from a closed connection. Rank 0's engine
    fails with tbo's `CommTimeoutError` naming its rank and the wait that timed out, within ``comm_timeout_s`` plus
    the engine's teardown; nothing hangs, and every process (the stopped ones too) is gone at the end."""
    timeout_s = 20
    survivor, peer_left = _signal_rank_1_mid_generation(models, tmp_path, signal.SIGSTOP, timeout_s)
    assert peer_left, "the stopped rank must still be there (stopped, not dead)"
    out = survivor.stdout + survivor.stderr
    assert not survivor.extra.get("timed_out"), out[-4000:]
    assert survivor.returncode != 0 and survivor.result is None, out[-4000:]
    named = [line for line in out.splitlines() if "CommTimeoutError: rank 0:" in line]
    assert named and any(f"timed out after {timeout_s}s" in line for line in named), out[-6000:]


@needs_vllm
@pytest.mark.dist
def test_mixtral_dp2_ep_tokens_equal_and_both_ranks_split(tmp_path):
    """A family beyond Qwen3-MoE and DeepSeek under DP = 2 + EP, through the same layer adapter: Mixtral (its gate
    beside the runner, the MoE block named ``block_sparse_moe``), two of its four experts on each rank."""
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")

    model = _save_mixtral(tmp_path / "mixtral")
    rounds = [[[_prompt(9, 7), _prompt(30, 8)]], [[_prompt(4, 10), _prompt(17, 11), _prompt(3, 12)]]]
    runs, per_rank = _dp(tmp_path, model, rounds, TBO, dtype="float32")
    for rank, r in enumerate(rounds):
        want = [[list(o.token_ids) for o in x] for x in _dp_reference(model, r, dtype="float32")]
        assert runs[rank].result["tokens"] == want, rank
    _assert_both_split_and_sent(per_rank, 2)


@needs_vllm
@pytest.mark.dist
def test_ranks_started_with_different_configurations_refuse_each_other_by_name_at_warm_up(models, tmp_path):
    """Rank 1 starts with ``agreed_rows: false`` (its dispatches would exchange row counts, rank 0's not: the
    collectives would mis-pair). Both engines fail at start, in the first step agreement (the profiling run), with
    `AgreementMismatchError` naming the key and each rank's value; neither runs a dispatch."""
    from tbo.harness.vllm_dp import describe_failure, run_dp

    engine = {**ENGINE, "dtype": "float32", "enable_expert_parallel": True}
    specs = [dict(model=str(models["qwen3_moe"]), engine=engine, tbo={**TBO, "agreed_rows": rank == 0},
                  rounds=[[_prompt(4, 1)]], max_tokens=2) for rank in range(2)]
    runs = run_dp(specs, timeout_s=400)
    for run in runs:
        out = run.stdout + run.stderr
        assert run.returncode != 0 and run.result is None and not run.extra.get("timed_out"), run.tail()
        named = [line for line in out.splitlines() if "AgreementMismatchError" in line]
        assert named and any("'agreed_rows' differs: rank 0: 'True', rank 1: 'False'" in line for line in named), \
            run.tail(8000)


def _ep_layer_on_real_kernel(dtype, w13, w2):
    from types import SimpleNamespace

    import torch
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from tbo.integrations.vllm.model.ep_layer import EpDecoderLayer
    from tbo.integrations.vllm.model.quant import ExpertsCall
    from tbo.integrations.engine.stats import StepStats

    layer = object.__new__(EpDecoderLayer)  # the experts op alone: its kernel, its expert weights, its counters
    layer._ids_dtype, layer.counters = torch.int32, (StepStats(),)
    layer.runner = SimpleNamespace(routed_experts=SimpleNamespace(
        w13_weight=cpu_prepack_moe_weight(w13.to(dtype), "vec"), w2_weight=cpu_prepack_moe_weight(w2.to(dtype), "vec"),
        activation=MoEActivation.SILU, local_num_experts=w13.shape[0], apply_router_weight_on_input=False))
    layer.experts = ExpertsCall(layer.runner.routed_experts, kernel=_CountingCpuKernel())
    return layer


@needs_vllm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ep_experts_kernel_computes_only_this_ranks_slots(dtype):
    """The EP experts op on vLLM's real CPU fused-MoE kernel, top-3 rows naming 1 to 3 of this rank's 4 experts
    (-1: another rank's): the kernel is handed exactly the routed (token, local expert) pairs, expert by expert
    (no remote slot becomes expert 0), each row's output is its local slots' weighted sum, and the FFN call is
    counted. Expert 0 is built to overflow bf16 on the rows that do not route to it: turned into expert 0 with
    weight 0, their remote slots gave inf * 0 = NaN."""
    import torch
    from vllm._custom_ops import cpu_fused_moe

    from tbo.comm.types import DispatchFormat, DispatchOutput
    from tbo.core.state import State

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    experts, hidden, inter, rows = 4, 64, 64, 9
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.3
    x = torch.randn(rows, hidden, generator=g)
    ids = torch.tensor([[0, -1, 2], [-1, 1, -1], [3, 2, 1], [-1, -1, 3], [1, -1, 0], [2, 3, -1], [-1, 2, -1],
                        [3, -1, -1], [0, 1, 2]])
    weights = torch.rand(rows, 3, generator=g)
    if dt is torch.bfloat16:  # expert 0 overflows on the rows that never name it
        blow = ~(ids == 0).any(dim=1)
        x[blow] *= 64
        w13[0] *= 1e4
        w2[0] *= 1e4
    layer = _ep_layer_on_real_kernel(dt, w13, w2)
    state = State(dispatched=DispatchOutput(DispatchFormat.NORMAL, x.to(dt), torch.zeros(experts), "h", topk_idx=ids,
                                            topk_weights=weights))
    layer.op_experts(state)
    out, handle = state.pop("expert_out")
    assert handle == "h" and layer.counters[0].local_ffn_calls == 1
    seen = torch.cat([i.flatten() for i in layer.experts.kernel.ids]).long()
    assert (seen >= 0).all(), "a remote slot reached the experts kernel"
    assert torch.equal(torch.bincount(seen, minlength=experts), torch.bincount(ids[ids >= 0], minlength=experts))
    # each row: vLLM's kernel on that row's local slots alone
    ref = layer.runner.routed_experts
    for r in range(rows):
        keep = ids[r] >= 0
        want = torch.empty(1, hidden, dtype=dt)
        cpu_fused_moe(want, x[r:r + 1].to(dt), ref.w13_weight, ref.w2_weight, None, None,
                      weights[r:r + 1, keep].contiguous(), ids[r:r + 1, keep].to(torch.int32).contiguous(), "silu",
                      "vec")
        assert torch.isfinite(out[r]).all(), (r, out[r])
        torch.testing.assert_close(out[r:r + 1], want, rtol=0, atol=0) if dt is torch.float32 else \
            torch.testing.assert_close(out[r:r + 1].float(), want.float(), rtol=1e-2, atol=1e-2)


# ---- multi-node: two nodes on loopback ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def top3_model(tmp_path_factory):
    """A Qwen3-MoE of hidden 64, 12 experts, top-3 (fp32 records of 64 * 4 + 3 * 8 + 3 * 4 = 292 bytes: the width
    whose one-row receive crashed both engines), weights scaled so that no token is a near tie."""
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (make test-vllm runs this file in .venv-vllm with vllm-cpu 0.32.0)")
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_experts=12, num_experts_per_tok=3,
        max_position_embeddings=512, initializer_range=0.2)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("top3") / "qwen3_moe_top3"
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def _round_tokens(run) -> dict[int, list]:
    """The tokens of each round a rank finished, from its output (printed as each round ends)."""
    out = {}
    for line in run.stdout.splitlines():
        if line.startswith("TBO_DP_ROUND_TOKENS "):
            _, k, tokens = line.split(" ", 2)
            out[int(k)] = json.loads(tokens)
    return out


@needs_vllm
@pytest.mark.dist
def test_two_nodes_on_loopback_tokens_equal_and_a_killed_node_is_named(top3_model, tmp_path):
    """DP = 2 + EP as two nodes on loopback, as vLLM's multi-node example launches them: one process per node, each
    DP rank the only one of its node (``VLLM_DP_RANK_LOCAL=0``, its own core), both pointed at 127.0.0.1. A top-3
    model under uneven load (one-row receives of 292-byte records). Round 0: tokens of both nodes equal vLLM's
    DP = 1, both split and sent rows to the other node. Rounds 1 to 3 (240 tokens each): a second into round 1 node 1
    is killed; node 0 fails with tbo's `CommTimeoutError` naming its rank, within ``comm_timeout_s`` plus teardown.
    The work after the kill is sized as `_signal_rank_1_mid_generation`'s: a Sapphire Rapids CI machine generated one
    round of 200 tokens in 2.3 s, before a 3 s sleep ended, and node 0 then exited cleanly."""
    from tbo.harness.launch import free_port
    from tbo.harness.vllm_dp import collect, start_rank, stop

    timeout_s = 20
    rounds = [[[_prompt(5, 41)], [_prompt(4, 50 + s) for s in range(4)]],
              [[_prompt(40, 42), _prompt(33, 43), _prompt(6, 44)], [_prompt(4, 60 + s) for s in range(4)]]]
    barrier, stats = tmp_path / "barrier", tmp_path / "stats-{rank}.json"
    barrier.mkdir()
    engine = {**ENGINE, "dtype": "float32", "enable_expert_parallel": True}
    specs = [dict(model=str(top3_model), engine=engine, max_tokens=[MAX_TOKENS, 240, 240, 240],
                  barrier_dir=str(barrier), barrier_s=timeout_s,
                  tbo={**TBO, "comm_timeout_s": timeout_s, "stats_file": str(stats)}, rounds=r + [r[1]] * 2)
             for r in rounds]
    port = free_port()
    runs = [start_rank(k, 2, port, specs[k], binds=str(k), local_rank=0) for k in range(2)]
    try:
        deadline = time.monotonic() + 500
        while not all((barrier / f"round1-{k}").exists() for k in range(2)):
            if time.monotonic() > deadline or any(r.proc.poll() is not None for r in runs):
                for r in runs:
                    collect(r, 10, grace_s=10)
                pytest.fail("the nodes did not reach round 1:\n" + "\n".join(r.tail(6000) for r in runs))
            time.sleep(0.1)
        time.sleep(1)  # both generate round 1: past the prefill, seconds from the end of round 3
        assert all(r.proc.poll() is None for r in runs)
        per_rank = [json.loads(Path(str(stats).replace("{rank}", str(k))).read_text()) for k in range(2)]
        stop(runs[1], signal.SIGKILL)
        t0 = time.monotonic()
        survivor = collect(runs[0], timeout_s=timeout_s + 90)
        waited = time.monotonic() - t0
    finally:
        for r in runs:
            stop(r, signal.SIGKILL)
            if r.returncode is None and not r.extra["files"][0].closed:
                collect(r, 10, grace_s=10)  # reaped, its output read and its files removed
    got = [_round_tokens(survivor), _round_tokens(runs[1])]
    for rank in range(2):
        want = [[list(o.token_ids) for o in x] for x in _dp_reference(top3_model, [rounds[rank][0]], dtype="float32")]
        assert got[rank].get(0) == want[0], (rank, got[rank], want)
    _assert_both_split_and_sent(per_rank, 2)
    out = survivor.stdout + survivor.stderr
    assert survivor.returncode != 0 and not survivor.extra.get("timed_out"), out[-4000:]
    named = [line for line in out.splitlines() if "CommTimeoutError: rank 0:" in line]
    assert named and any(("could not complete" in line or "timed out" in line) for line in named), out[-6000:]
    assert waited < timeout_s + 90, waited
