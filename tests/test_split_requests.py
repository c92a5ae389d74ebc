"""Per-request inputs on a plan that cuts a sequence, the policy that never cuts one, and typed entry points.

The equivalence test is the one that matters: an attention over packed sequences with a KV cache, reading only the
per-microbatch values `split_inputs` hands it (this step's lengths, cached prefixes, total lengths, request ids),
must give the unsplit layer's output for any batch, cut or not.
"""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tbo
from tbo.split import REQUEST_KINDS, ForwardMode, SplitPolicy, boundary_cuts, merge_outputs, split_inputs

E, D = ForwardMode.EXTEND, ForwardMode.DECODE
ALL_KINDS = {"lengths": "lengths", "prefix_lens": "prefix_lens", "total_lens": "total_lens", "req_ids": "request"}


# ---- the splitting page's example (docs/splitting.md) ------------------------------------------------------
def test_docs_example_cut_sequence_gets_its_share():
    plan = SplitPolicy().plan(E, 100, [10, 90])
    assert plan.two_chunk  # the cut falls inside the second sequence: 50 tokens each side
    h = torch.randn(100, 4)
    seq_lens = torch.tensor([10, 90])
    a, b = split_inputs({"hidden": h, "seq_lens": seq_lens}, plan, request_keys={"seq_lens": "lengths"})
    assert a["seq_lens"].tolist() == [10, 40] and b["seq_lens"].tolist() == [50]
    assert a["hidden"].shape[0] == 50 == b["hidden"].shape[0]
    assert seq_lens.tolist() == [10, 90]  # the caller's tensor is not written to


def test_opaque_request_key_refused_on_a_cut_never_wrong():
    plan = SplitPolicy().plan(E, 100, [10, 90])
    inputs = {"hidden": torch.randn(100, 4), "seq_lens": torch.tensor([10, 90])}
    with pytest.raises(ValueError, match=r"request key 'seq_lens' has no rule for a cut sequence, and this plan "
                                         r"cuts request 1 \(40 tokens in microbatch 0, 50 in microbatch 1\)"):
        split_inputs(inputs, plan, request_keys=["seq_lens"])
    with pytest.raises(ValueError, match="'lengths'.*allow_cut_sequences=False"):
        split_inputs(inputs, plan, request_keys={"seq_lens": "opaque"})
    # an uncut plan: the old list form slices by request, as before
    uncut = SplitPolicy().plan(E, 100, [50, 50])
    a, b = split_inputs(inputs, uncut, request_keys=["seq_lens"])
    assert a["seq_lens"].tolist() == [10] and b["seq_lens"].tolist() == [90]


def test_every_kind_on_a_three_way_cut():
    """One 100-token request cut in three, after a 5-token one: each kind gives each part what it means."""
    plan = SplitPolicy(num_microbatches=3, decode_token_threshold=3, prefill_token_threshold=3).plan(
        E, 105, [5, 100])
    assert [m.extend_lens for m in plan.microbatches] == [(5, 30), (35,), (35,)]
    inputs = {"x": torch.zeros(105), "lengths": [5, 100], "prefix_lens": (7, 3), "total_lens": torch.tensor([12, 103]),
              "req_ids": ["r0", "r1"]}
    parts = split_inputs(inputs, plan, request_keys=ALL_KINDS)
    assert [p["lengths"] for p in parts] == [[5, 30], [35], [35]]
    assert [p["prefix_lens"] for p in parts] == [(7, 3), (33,), (68,)]          # tuples stay tuples
    assert [p["total_lens"].tolist() for p in parts] == [[12, 33], [68], [103]]
    assert [p["req_ids"] for p in parts] == [["r0", "r1"], ["r1"], ["r1"]]
    for p in parts:  # prefix + this part's tokens == the total up to the part's end, request by request
        assert [a + b for a, b in zip(p["prefix_lens"], p["lengths"])] == p["total_lens"].tolist()


def test_callable_rule_gets_every_slice():
    plan = SplitPolicy().plan(E, 100, [10, 90])
    seen = []

    def cu_seqlens(value, mb):  # a cumulative layout that no kind describes
        seen.append(mb.microbatch_idx)
        return torch.tensor([0, *torch.tensor(mb.extend_lens).cumsum(0).tolist()])

    parts = split_inputs({"x": torch.zeros(100), "cu": torch.tensor([0, 10])}, plan, request_keys={"cu": cu_seqlens})
    assert seen == [0, 1] and parts[0]["cu"].tolist() == [0, 10, 50] and parts[1]["cu"].tolist() == [0, 50]


def test_request_rule_errors_name_the_key():
    plan = SplitPolicy().plan(E, 100, [10, 90])
    x = torch.zeros(100)
    with pytest.raises(ValueError, match="'seq' has kind 'length'; the kinds are opaque, request, lengths"):
        split_inputs({"x": x, "seq": [10, 90]}, plan, request_keys={"seq": "length"})
    with pytest.raises(TypeError, match="'seq' has rule 3"):
        split_inputs({"x": x, "seq": [10, 90]}, plan, request_keys={"seq": 3})
    with pytest.raises(TypeError, match="got the string 'seq'"):
        split_inputs({"x": x, "seq": [10, 90]}, plan, request_keys="seq")
    with pytest.raises(ValueError, match=r"'seq' is declared 'lengths' but holds \[12, 93\].*'total_lens'"):
        split_inputs({"x": x, "seq": [12, 93]}, plan, request_keys={"seq": "lengths"})
    with pytest.raises(ValueError, match="'seq' is declared 'total_lens' but request 1 has 80"):
        split_inputs({"x": x, "seq": [12, 80]}, plan, request_keys={"seq": "total_lens"})
    with pytest.raises(ValueError, match="'seq' is declared 'prefix_lens' but request 0 has -1"):
        split_inputs({"x": x, "seq": [-1, 0]}, plan, request_keys={"seq": "prefix_lens"})
    assert set(REQUEST_KINDS) == {"opaque", "request", "lengths", "prefix_lens", "total_lens"}


# ---- typed entry points ---------------------------------------------------------------------------------------
def test_plan_none_passes_through_as_one_microbatch():
    inputs = {"x": torch.arange(3), "seq": [3]}
    parts = split_inputs(inputs, None, request_keys={"seq": "lengths"})
    assert len(parts) == 1 and parts[0] == inputs and parts[0] is not inputs
    assert merge_outputs([inputs["x"]], None) is inputs["x"]
    with pytest.raises(ValueError, match="2 outputs for a plan of 1 microbatch$"):
        merge_outputs([inputs["x"]] * 2, None)
    with pytest.raises(ValueError, match=r"\['nope'\] are listed but not in the inputs"):  # checked unsplit too
        split_inputs(inputs, None, shared_keys=["nope"])


def test_wrong_types_say_what_was_expected():
    with pytest.raises(TypeError, match="plan must be a tbo.SplitPlan or None .* got SplitPolicy"):
        split_inputs({"x": torch.zeros(2)}, SplitPolicy())
    with pytest.raises(TypeError, match="plan must be a tbo.SplitPlan or None .* got list"):
        merge_outputs([torch.zeros(2)], [])
    with pytest.raises(TypeError, match="inputs must be a dict of named values, got Tensor"):
        split_inputs(torch.zeros(2), None)


@pytest.mark.parametrize("mode", ["extend", "EXTEND", " Extend", E])
def test_mode_strings_any_case(mode):
    assert ForwardMode.of(mode) is E
    assert SplitPolicy().plan(mode, 100, [10, 90]) == SplitPolicy().plan(E, 100, [10, 90])
    assert tbo.split.compute_split_seq_index(mode, 100, [10, 90]) == 1


def test_bad_modes_name_the_type():
    with pytest.raises(ValueError, match=r"mode 'prefill' is not a tbo.ForwardMode; expected one of DECODE, EXTEND, "
                                         r"TARGET_VERIFY, IDLE \(any case\)"):
        SplitPolicy().plan("prefill", 4, [4])
    with pytest.raises(TypeError, match="mode must be a tbo.ForwardMode or its name as a string, got int 1"):
        SplitPolicy().plan(1, 4, [4])


# ---- never cutting a sequence ---------------------------------------------------------------------------------
def test_allow_cut_sequences_false_runs_a_long_prefill_unsplit():
    never = SplitPolicy(allow_cut_sequences=False, token_distribution_threshold=1e-9)
    assert SplitPolicy(token_distribution_threshold=1e-9).plan(E, 1000, [1000]).two_chunk  # the reported case
    assert never.plan(E, 1000, [1000]) is None
    assert never.plan(E, 100, [10, 90]).cuts[0] == (10, 1, False)  # a lopsided boundary is fine at t ~ 0
    strict = SplitPolicy(allow_cut_sequences=False)
    assert strict.plan(E, 100, [10, 90]) is None  # 10% < 48%: unsplit, never two-chunk
    assert strict.plan(E, 100, [48, 52]).cuts[0] == (48, 1, False)
    assert strict.plan(D, 8) is not None  # decode never cuts inside a sequence anyway
    three = SplitPolicy(num_microbatches=3, decode_token_threshold=3, prefill_token_threshold=3,
                        allow_cut_sequences=False)
    assert [c.token_index for c in three.plan(E, 30, [10, 10, 10]).cuts] == [10, 20]
    assert three.plan(E, 30, [10, 20]) is None  # fewer sequences than microbatches


@settings(max_examples=150, deadline=None)
@given(lens=st.lists(st.integers(0, 30), min_size=1, max_size=8), parts=st.integers(2, 4),
       t=st.floats(min_value=0.01, max_value=0.5))
def test_property_boundary_cuts(lens, parts, t):
    cuts = boundary_cuts(lens, parts, t)
    plan = SplitPolicy(num_microbatches=parts, decode_token_threshold=parts, prefill_token_threshold=parts,
                       token_distribution_threshold=t, allow_cut_sequences=False).plan(E, sum(lens), lens)
    if plan is not None:
        assert list(plan.cuts) == cuts and not plan.two_chunk
        assert all(m.tokens_unpadded_len * parts >= 2 * t * sum(lens) for m in plan.microbatches)
    if cuts is not None and parts == 2:  # the two-microbatch rule is the default policy's boundary rule
        assert SplitPolicy(token_distribution_threshold=t, prefill_token_threshold=2).plan(E, sum(lens), lens).cuts[
            0] == cuts[0]


# ---- equivalence: a layer that reads only what split_inputs gives it ------------------------------------------
H = 8


class PackedAttention:
    """Causal attention over packed sequences with a per-request KV cache, in plain torch (float64).

    It trusts its inputs: for each request it appends this step's keys at ``prefix_lens``, attends over the first
    ``total_lens`` cached keys, and checks only that the cache holds what ``prefix_lens`` claims. Wrong per-request
    values give wrong outputs (or that error), which is what the test looks for.
    """

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.wq, self.wk, self.wv, self.wo = (torch.randn(H, H, generator=g, dtype=torch.float64) / H**0.5
                                              for _ in range(4))

    def __call__(self, x, lengths, prefix_lens, total_lens, req_ids, cache):
        out, offset = [], 0
        for rid, n, prefix, total in zip(req_ids, lengths, prefix_lens, total_lens):
            n, prefix, total = int(n), int(prefix), int(total)
            rows = x[offset : offset + n]
            offset += n
            k_cache, v_cache = cache[rid]
            if k_cache.shape[0] != prefix:
                raise ValueError(f"request {rid}: cache holds {k_cache.shape[0]} tokens, prefix_lens says {prefix}")
            k_cache, v_cache = torch.cat([k_cache, rows @ self.wk]), torch.cat([v_cache, rows @ self.wv])
            cache[rid] = (k_cache, v_cache)
            q = rows @ self.wq
            scores = (q @ k_cache[:total].T) / math.sqrt(H)
            visible = torch.arange(total)[None, :] <= (prefix + torch.arange(n))[:, None]
            out.append(scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v_cache[:total])
        y = torch.cat(out) @ self.wo if out else x.new_zeros(0, H)
        return torch.cat([y, x.new_zeros(x.shape[0] - y.shape[0], H)])  # padding rows stay zero


def _batch(lens, prefixes, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), H, generator=g, dtype=torch.float64)
    ids = [f"req{r}" for r in range(len(lens))]
    cache = {rid: (torch.randn(p, H, generator=g, dtype=torch.float64), torch.randn(p, H, generator=g,
                                                                                  dtype=torch.float64))
             for rid, p in zip(ids, prefixes)}
    inputs = {"x": x, "lengths": torch.tensor(lens), "prefix_lens": list(prefixes),
              "total_lens": torch.tensor([p + n for p, n in zip(prefixes, lens)]), "req_ids": ids}
    return inputs, cache


def _run(layer, inputs, cache, plan, rules=ALL_KINDS):
    cache = dict(cache)  # the microbatches share one cache, as they share a KV pool
    parts = split_inputs(inputs, plan, request_keys=rules)
    outs = [layer(p["x"], p["lengths"], p["prefix_lens"], p["total_lens"], p["req_ids"], cache) for p in parts]
    return merge_outputs(outs, plan)


@settings(max_examples=120, deadline=None)
@given(data=st.lists(st.tuples(st.integers(0, 24), st.integers(0, 6)), min_size=1, max_size=6),
       parts=st.integers(2, 3), pad=st.integers(1, 3), t=st.floats(min_value=0.05, max_value=0.5),
       allow_cut=st.booleans(), seed=st.integers(0, 999))
@example(data=[(10, 0), (90, 0)], parts=2, pad=1, t=0.48, allow_cut=True, seed=0)  # the reported case
@example(data=[(100, 3)], parts=3, pad=4, t=0.48, allow_cut=True, seed=1)          # one request in three parts
def test_property_split_layer_equals_unsplit(data, parts, pad, t, allow_cut, seed):
    lens, prefixes = [n for n, _ in data], [p for _, p in data]
    policy = SplitPolicy(num_microbatches=parts, decode_token_threshold=parts, prefill_token_threshold=parts,
                         token_distribution_threshold=t, pad_to_multiple=pad, allow_cut_sequences=allow_cut)
    plan = policy.plan("extend", sum(lens), lens)
    if not allow_cut and plan is not None:
        assert not plan.two_chunk
    layer = PackedAttention(seed)
    inputs, cache = _batch(lens, prefixes, seed)
    whole = _run(layer, inputs, cache, None)
    split = _run(layer, inputs, cache, plan)
    # tolerance: the split run multiplies smaller matrices, whose float rounding may differ in the last bits
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize("wrong", ["lengths", "prefix_lens", "total_lens"])
def test_the_layer_notices_a_wrong_rule(wrong):
    """Slicing one length key as if it described the whole request (the old behaviour) is caught on the docs'
    plan, by an error or by a different output: the equivalence test above can fail."""
    plan = SplitPolicy().plan(E, 100, [10, 90])
    layer = PackedAttention(0)
    inputs, cache = _batch([10, 90], [0, 0], 0)
    whole = _run(layer, inputs, cache, None)
    try:
        got = _run(layer, inputs, cache, plan, {**ALL_KINDS, wrong: "request"})
    except (ValueError, RuntimeError, IndexError):
        return
    assert (got - whole).abs().max() > 1e-3
