import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tbo.harness.launch import launch
from tbo.split import (ForwardMode, SplitPolicy, agree_to_split, compute_split_seq_index, compute_split_token_index,
                       merge_outputs, split_inputs)

D, E, V, I = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE


# ---- split index rules ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode,num_tokens,lens,tpp,seq,tok",
    [
        (D, 1, None, 1, None, None),        # a 1-sequence decode does not split
        (D, 2, None, 1, 1, 1),
        (D, 7, None, 1, 3, 3),              # (7 // 1) // 2
        (V, 12, None, 3, 2, 6),             # 4 sequences of 3 draft tokens
        (V, 3, None, 3, None, None),
        (E, 100, [100], 1, 0, 50),          # one long prefill: two chunks, cut in the middle
        (E, 101, [101], 1, 0, 50),
        (E, 1, [1], 1, None, None),
        (E, 0, [], 1, None, None),
        (E, 1, [0, 1], 1, None, None),      # lengths 0 and 1: one side would be empty
        (E, 2, [1, 1], 1, 1, 1),
        (E, 2, [0, 2], 1, 1, 1),            # two-chunk inside the second sequence
        (E, 40, [10, 10, 10, 10], 1, 2, 20),
        (E, 30, [5, 10, 15], 1, 2, 15),     # |15-15| at i=2
        (E, 102, [50, 2, 50], 1, 2, 52),    # ties |50-52|=|52-50|: the larger index
        (E, 20, [9, 2, 9], 1, 1, 10),       # the tie's share 11/20 > 0.52: two-chunk inside sequence 1
        (E, 100, [10, 90], 1, 1, 50),       # lopsided: two-chunk in sequence 1
        (E, 100, [48, 52], 1, 1, 48),       # share 0.48 is not below the threshold
        (E, 100, [47, 53], 1, 1, 50),       # share 0.47 is: two-chunk
        (E, 100, [50, 0, 50], 1, 2, 50),    # zero-length sequence goes left (larger index on a tie)
        (I, 0, None, 1, None, None),
        (V, 12, [3, 3, 3, 3], 1, 2, 6),     # uniform 1 + k given per request: the decode rule
        (V, 10, [4, 1, 1, 4], 1, 2, 5),     # k varies: the request boundary nearest half the tokens
        (V, 10, [4, 2, 4], 1, 2, 6),        # |4-5| = |6-5|: the larger index
        (V, 9, [1, 4, 4], 1, 2, 5),         # never inside a request's 1 + k tokens, however lopsided
        (V, 5, [1, 4], 1, 1, 1),
        (V, 4, [4], 1, None, None),         # one request: nothing to split (decode-like: no two-chunk)
    ],
)
def test_split_index_table(mode, num_tokens, lens, tpp, seq, tok):
    got = compute_split_seq_index(mode, num_tokens, lens, tpp)
    assert got == seq
    if seq is not None:
        assert compute_split_token_index(seq, mode, lens, tpp) == tok


def test_threshold_changes_two_chunk():
    assert compute_split_token_index(1, E, [40, 60], token_distribution_threshold=0.4) == 40
    assert compute_split_token_index(1, E, [40, 60], token_distribution_threshold=0.45) == 50


@pytest.mark.parametrize("t", [0, -0.1, 0.51, 1.0])
def test_bad_distribution_threshold(t):
    with pytest.raises(ValueError, match="token_distribution_threshold"):
        compute_split_seq_index(E, 4, [2, 2], token_distribution_threshold=t)


@pytest.mark.parametrize(
    "args,match",
    [((E, 5, [2, 2]), "sum to 4 but num_tokens is 5"), ((E, 4, None), "extend_lens is required"),
     ((V, 7, None, 3), "not a multiple"), ((E, 0, [1, -1]), r"extend_lens\[1\] = -1"),
     ((D, -1), "num_tokens must be >= 0"), ((V, 4, [4, 0]), r"extend_lens\[1\] = 0 in TARGET_VERIFY"),
     ((V, 6, [3, 3, 1]), "sum to 7 but num_tokens is 6"), ((D, 3, [1, 2]), "must be 1 per sequence")],
)
def test_bad_batch_descriptions(args, match):
    with pytest.raises(ValueError, match=match):
        compute_split_seq_index(*args)


# ---- policy -----------------------------------------------------------------------------------------------------
def test_policy_thresholds_edges():
    p = SplitPolicy(decode_token_threshold=4, prefill_token_threshold=12)
    assert p.plan(D, 3) is None and p.plan(D, 4) is not None
    assert p.plan(E, 11, [5, 6]) is None and p.plan(E, 12, [6, 6]) is not None
    assert p.plan(E, 4, [1, 1, 1, 1]) is not None  # extend of decode-like requests uses the decode threshold
    assert p.plan(I, 0) is None


@pytest.mark.parametrize(
    "kwargs,field",
    [(dict(num_microbatches=1), "num_microbatches"), (dict(decode_token_threshold=1), "decode_token_threshold"),
     (dict(prefill_token_threshold=1), "prefill_token_threshold"),
     (dict(num_microbatches=3, decode_token_threshold=2), "decode_token_threshold"),
     (dict(token_distribution_threshold=0.0), "token_distribution_threshold"),
     (dict(token_distribution_threshold=0.6), "token_distribution_threshold"), (dict(pad_to_multiple=0), "pad_to")],
)
def test_policy_validation_names_field(kwargs, field):
    with pytest.raises(ValidationError, match=field):  # pydantic's error (a ValueError), naming the field
        SplitPolicy(**kwargs)


def test_policy_defaults_follow_num_microbatches():
    """SplitPolicy(num_microbatches=3) is valid: unset thresholds follow the count (one decode token, six prefill
    tokens per microbatch); set ones are kept and checked."""
    three = SplitPolicy(num_microbatches=3)
    assert (three.decode_token_threshold, three.prefill_token_threshold) == (3, 18)
    assert len(three.plan(D, 3).microbatches) == 3 and three.plan(D, 2) is None
    assert (SplitPolicy().decode_token_threshold, SplitPolicy().prefill_token_threshold) == (2, 12)
    assert SplitPolicy(num_microbatches=2) == SplitPolicy()
    assert SplitPolicy(num_microbatches=4, prefill_token_threshold=4).decode_token_threshold == 4
    assert SplitPolicy.model_validate({"num_microbatches": 3}).prefill_token_threshold == 18


def test_plan_fields_two_chunk():
    plan = SplitPolicy().plan(E, 100, [10, 90])
    assert plan.two_chunk and plan.cut_extend_lens == (40, 50)
    a, b = plan.microbatches
    assert (a.microbatch_idx, a.num_microbatches, b.microbatch_idx, b.num_microbatches) == (0, 2, 1, 2)
    assert (a.tokens_start, a.tokens_unpadded_len, a.requests_start, a.requests_len) == (0, 50, 0, 2)
    assert (b.tokens_start, b.tokens_unpadded_len, b.requests_start, b.requests_len) == (50, 50, 1, 1)
    assert a.extend_lens == (10, 40) and b.extend_lens == (50,) and b.prefix_offset == 40


def test_plan_padding():
    plan = SplitPolicy(pad_to_multiple=8).plan(D, 13)
    assert [(m.tokens_len, m.tokens_unpadded_len) for m in plan.microbatches] == [(8, 6), (8, 7)]


def test_plan_states_carry_stage_metadata():
    plan = SplitPolicy().plan(D, 4)
    states = plan.make_states()
    assert [(s.microbatch_idx, s.num_microbatches) for s in states] == [(0, 2), (1, 2)]
    states[0].clear()
    assert states[0].split is plan.microbatches[0]


def test_more_than_two_microbatches():
    p = SplitPolicy(num_microbatches=3, decode_token_threshold=3, prefill_token_threshold=3)
    plan = p.plan(E, 100, [100])
    assert [m.tokens_unpadded_len for m in plan.microbatches] == [33, 33, 34]
    assert [m.prefix_offset for m in plan.microbatches] == [0, 33, 66]
    assert all(m.requests_len == 1 for m in plan.microbatches)
    assert p.plan(D, 7).microbatches[2].requests_len == 3
    assert p.plan(D, 2) is None


# ---- properties -------------------------------------------------------------------------------------------------
batches = st.one_of(
    st.tuples(st.just(E), st.lists(st.integers(0, 40), min_size=1, max_size=8)),
    st.tuples(st.just(D), st.integers(1, 30).map(lambda n: [1] * n)),
)


@settings(max_examples=200, deadline=None)
@given(batch=batches, parts=st.integers(2, 4), pad=st.integers(1, 4),
       t=st.floats(min_value=0.05, max_value=0.5))
def test_property_plans(batch, parts, pad, t):
    mode, lens = batch
    total = sum(lens)
    policy = SplitPolicy(num_microbatches=parts, decode_token_threshold=parts, prefill_token_threshold=parts,
                         token_distribution_threshold=t, pad_to_multiple=pad)
    plan = policy.plan(mode, total, lens if mode is E else None)
    if plan is None:
        return
    mbs = plan.microbatches
    assert all(m.tokens_unpadded_len > 0 for m in mbs)                     # no empty microbatch
    assert sum(m.tokens_unpadded_len for m in mbs) == total
    assert all(m.tokens_len % pad == 0 and 0 <= m.padding < pad for m in mbs)
    for m in mbs:                                                          # shares agree with token ranges
        assert sum(m.extend_lens) == m.tokens_unpadded_len and len(m.extend_lens) == m.requests_len
    covered = [0] * len(lens)                                              # every request's tokens land once
    for m in mbs:
        for j, share in enumerate(m.extend_lens):
            covered[m.requests_start + j] += share
    assert covered == lens
    if parts == 2 and not plan.two_chunk:                                  # balance within the longest sequence
        a, b = (m.tokens_unpadded_len for m in mbs)
        assert abs(a - b) <= max(lens)
    if parts == 2 and plan.two_chunk:                                      # two-chunk metadata is consistent
        a, b = mbs
        assert a.tokens_unpadded_len == total // 2
        left, right = plan.cut_extend_lens
        assert left > 0 and right > 0 and left + right == lens[plan.split_seq_index]
        assert b.prefix_offset == left and b.requests_start == plan.split_seq_index


@settings(max_examples=100, deadline=None)
@given(lens=st.lists(st.integers(0, 20), min_size=1, max_size=6), pad=st.integers(1, 5), seed=st.integers(0, 99))
def test_property_split_merge_round_trip(lens, pad, seed):
    total = sum(lens)
    plan = SplitPolicy(prefill_token_threshold=2, pad_to_multiple=pad).plan(E, total, lens)
    if plan is None:
        return
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(total, 3, generator=g)
    ids = torch.randint(0, 100, (total,), generator=g)
    inputs = {"hidden": hidden, "ids": ids, "seq_lens": torch.tensor(lens), "cfg": "shared"}
    parts = split_inputs(inputs, plan, request_keys={"seq_lens": "lengths"}, shared_keys=["cfg"])
    for part, m in zip(parts, plan.microbatches):
        assert part["hidden"].shape[0] == m.tokens_len
        assert torch.all(part["hidden"][m.tokens_unpadded_len:] == 0)
        assert part["cfg"] == "shared" and part["seq_lens"].tolist() == list(m.extend_lens)
    assert torch.equal(merge_outputs([p["hidden"] for p in parts], plan), hidden)
    assert torch.equal(merge_outputs([p["ids"] for p in parts], plan), ids)


def test_split_inputs_errors():
    plan = SplitPolicy().plan(D, 4)
    x = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="'seq' has leading size 3 but the plan has 4 tokens.*request_keys"):
        split_inputs({"x": x, "seq": torch.zeros(3)}, plan)
    with pytest.raises(ValueError, match="'seq' has leading size 3 but the plan has 4 requests"):
        split_inputs({"x": x, "seq": torch.zeros(3)}, plan, request_keys=["seq"])
    with pytest.raises(ValueError, match=r"\['nope'\] are listed but not in the inputs"):
        split_inputs({"x": x}, plan, shared_keys=["nope"])
    with pytest.raises(ValueError, match="microbatch 1 output has 5 rows"):
        merge_outputs([x[:2], torch.zeros(5, 2)], plan)
    with pytest.raises(ValueError, match="3 outputs for a plan of 2"):
        merge_outputs([x, x, x], plan)


# ---- agreement across ranks -------------------------------------------------------------------------------------
def _agree(rank, world, tokens_per_rank):
    policy = SplitPolicy(decode_token_threshold=4)
    plan = policy.plan(D, tokens_per_rank[rank])
    return plan is not None, agree_to_split(plan)


@pytest.mark.dist
def test_agree_to_split_over_gloo():
    # rank 1 is below the threshold: neither rank splits, although rank 0 could
    assert launch(_agree, 2, [8, 3]) == [(True, False), (False, False)]
    assert launch(_agree, 2, [8, 5]) == [(True, True), (True, True)]


def test_agree_without_process_group():
    assert agree_to_split(None) is False
    assert agree_to_split(SplitPolicy().plan(D, 4)) is True


# ---- the configuration rides the agreement ----------------------------------------------------------------------
def _mismatches(rank, world):
    """Each case one agreement on both ranks, in this order; each a named error on both (or a result); the group
    stays usable after every refusal (the last case agrees)."""
    from tbo import Yield
    from tbo.core.strategy import OperationsStrategy
    from tbo.split.agree import AgreementMismatchError, StepVote, agree_step

    long_ops = ["attn", "gate", Yield, "dispatch_a", Yield, "dispatch_b", "experts"] * 40
    strategies = [OperationsStrategy(operations=long_ops, name="mine"),
                  OperationsStrategy(operations=long_ops[:-1] + ["shared_experts"], name="mine")]
    vote = StepVote(2, True, True, "decode", (3, 2))
    base = {"backend": "local", "agreed_rows": True, "link": None}
    cases = [
        lambda: agree_step(vote, timeout_s=20, config={**base, "agreed_rows": rank == 0}),
        lambda: agree_step(vote, timeout_s=20, config={**base, **({"link": "5,10"} if rank else {}), "x": 1}
                           if rank else base),
        lambda: agree_step(vote, timeout_s=20, config={**base, "strategy": {"decode": strategies[rank]}}),
        lambda: agree_to_split(SplitPolicy(num_microbatches=2 + rank).plan(D, 8), timeout_s=20),
        lambda: agree_to_split(SplitPolicy().plan(D, 8), timeout_s=20,
                               strategy=("deepseek_decode", "deepseek_prefill")[rank]),
        lambda: (agree_step(vote, timeout_s=20) if rank == 0 else agree_to_split(SplitPolicy().plan(D, 8),
                                                                                 timeout_s=20)),
        lambda: (agree_to_split(SplitPolicy().plan(D, 8), timeout_s=20, config=base, strategy="deepseek_decode"),
                 agree_to_split(None if rank else SplitPolicy().plan(D, 8), timeout_s=20),
                 agree_step(vote, timeout_s=20, config=base).rows),
    ]
    out = []
    for case in cases:
        try:
            out.append(case())
        except AgreementMismatchError as e:
            out.append(str(e))
    return out


@pytest.mark.dist
def test_a_configuration_mismatch_is_named_on_every_rank_by_key():
    """Ranks configured apart (agreed_rows, a link and a key set on one rank only, an op list, a microbatch count, a
    strategy) or calling different agreements: every rank raises `AgreementMismatchError` naming the key and each
    rank's value, in the agreement itself; no collective of another shape is ever issued (that aborts in gloo)."""
    r0, r1 = launch(_mismatches, 2, timeout_s=120)
    for errors in (r0, r1):
        agreed_rows, one_sided, ops, counts, strategy, calls, fine = errors
        assert "'agreed_rows' differs: rank 0: 'True', rank 1: 'False'" in agreed_rows, agreed_rows
        assert "'link' differs: rank 0: 'None', rank 1: '5,10'" in one_sided, one_sided
        assert "'x' differs: rank 0: (not set), rank 1: '1'" in one_sided and "backend" not in one_sided, one_sided
        assert "'strategy' differs" in ops and "first difference at character" in ops and "shared_experts" in ops, ops
        assert "different microbatch counts (rank 0: 2, rank 1: 3)" in counts, counts
        assert "'strategy' differs: rank 0: 'deepseek_decode', rank 1: 'deepseek_prefill'" in strategy, strategy
        assert "rank 0: agree_step, rank 1: agree_to_split" in calls, calls
        assert fine[0] is True and fine[2] == ((3, 3), (2, 2)), fine
    assert r0[6][1] is False and r1[6][1] is False  # a rank without a plan: nobody splits, nothing to compare


@pytest.mark.parametrize("parts", [2, 3, 5])
@pytest.mark.parametrize("pad", [1, 4])
def test_uniform_decode_plan_equals_the_general_one(parts, pad):
    """A decode-like step with no ``extend_lens`` takes the loop-free path (`SplitPolicy._uniform_plan`, so that a
    10,000-request decode step plans as fast as a 10-request one); it must make exactly the general path's plan."""
    policy = SplitPolicy(num_microbatches=parts, pad_to_multiple=pad)
    for mode, per_seq in ((ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 1), (ForwardMode.TARGET_VERIFY, 3)):
        for n in range(0, 41):
            fast = policy.plan(mode, n * per_seq, None, per_seq)
            general = policy.plan(mode, n * per_seq, [per_seq] * n, per_seq)
            assert fast == general, (mode, per_seq, n)
            assert (fast is not None) == (n >= parts and n * per_seq >= policy.decode_token_threshold)
    with pytest.raises(ValueError, match=r"num_tokens=7 is not a multiple of token_num_per_seq=2 in TARGET_VERIFY"):
        policy.plan(ForwardMode.TARGET_VERIFY, 7, None, 2)


@pytest.mark.parametrize("parts", [2, 3, 4])
@given(lens=st.lists(st.integers(1, 5), min_size=0, max_size=24))
@settings(max_examples=150, deadline=None)
def test_verify_plans_never_cut_inside_a_request(parts, lens):
    """A verify step whose requests bring different draft counts is cut between requests only, every microbatch
    with a request, from the decode threshold; each request's 1 + k tokens lie in one microbatch."""
    policy = SplitPolicy(num_microbatches=parts)
    plan = policy.plan(V, sum(lens), lens)
    if len(lens) < parts or sum(lens) < policy.decode_token_threshold:
        assert plan is None
        return
    assert plan is not None and not plan.two_chunk and plan.extend_lens == tuple(lens)
    assert all(mb.requests_len >= 1 and mb.prefix_offset == 0 for mb in plan.microbatches)
    assert [share for mb in plan.microbatches for share in mb.extend_lens] == lens
    if len(set(lens)) == 1:  # uniform: what the loop-free decode rule makes
        assert plan == policy.plan(V, sum(lens), None, lens[0])


# ---- steps and time-outs (issue 45) -----------------------------------------------------------------------------
def _late_rank(rank, world):
    """A step number mismatch is named; then rank 1 arrives 5 s late at a 2 s deadline: both ranks fail the step
    (the late one used to return True while its peer had failed), and the group is poisoned on both, named, with no
    collective more."""
    import time

    from tbo.core.errors import CommTimeoutError
    from tbo.split.agree import AgreementMismatchError, poisoned

    out = []
    plan = SplitPolicy().plan(D, 8)
    try:
        agree_to_split(plan, timeout_s=20, step=3 + rank)
    except AgreementMismatchError as e:
        out.append(str(e))
    out.append(agree_to_split(plan, timeout_s=20, step=5))  # the group still agrees after a mismatch
    if rank == 1:
        time.sleep(5)
    for step in (6, 7):
        try:
            out.append(agree_to_split(plan, timeout_s=2, step=step))
        except CommTimeoutError as e:
            out.append(str(e))
    out.append(poisoned() is not None)
    return out


@pytest.mark.dist
def test_a_late_rank_fails_its_step_too_and_a_timed_out_agreement_poisons_the_group():
    results = launch(_late_rank, 2, timeout_s=120)
    for rank, out in enumerate(results):
        assert "the ranks agree on different steps (rank 0: step 3, rank 1: step 4)" in out[0], out
        assert out[1] is True
        assert out[-1] is True, out
        assert "step 7: refused, this group's agreement is poisoned since step 6" in out[3], out
    assert "timed out after 2s" in results[0][2], results[0]
    assert "rank(s) [0] gave the agreement up at their deadline before this rank (rank 1)" in results[1][2], results
