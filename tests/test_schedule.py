import itertools

import pytest

from tbo.core.schedule import interleave


def expected_steps(num_stages, offsets):
    """The rule, stated independently: walk rounds; in each, microbatches in index order."""
    steps = []
    for r in range(max(n + o for n, o in zip(num_stages, offsets))):
        for mb, (n, o) in enumerate(zip(num_stages, offsets)):
            if 0 <= r - o < n:
                steps.append((mb, r - o))
    return steps


@pytest.mark.parametrize("num_mb", [1, 2, 3, 4])
@pytest.mark.parametrize("stages", [1, 2, 3, 6, 9])
@pytest.mark.parametrize("delta", [0, 1, 2, 5])
def test_interleave_follows_rule(num_mb, stages, delta):
    sched = interleave([stages] * num_mb, delta)
    assert list(sched.steps) == expected_steps([stages] * num_mb, [i * delta for i in range(num_mb)])


@pytest.mark.parametrize("counts", [(3, 5), (5, 3), (1, 4, 2), (7, 7, 7)])
@pytest.mark.parametrize("delta", [0, 1, 3])
def test_unequal_stage_counts(counts, delta):
    sched = interleave(counts, delta)
    assert list(sched.steps) == expected_steps(counts, [i * delta for i in range(len(counts))])
    for mb, n in enumerate(counts):  # every microbatch runs each stage once, in order
        assert [s for m, s in sched.steps if m == mb] == list(range(n))


@pytest.mark.parametrize("n,delta", list(itertools.product([3, 6, 10], [0, 1, 2])))
def test_two_microbatches_classic_shape(n, delta):
    """A runs delta stages alone, then A and B alternate, then B runs its last delta stages."""
    steps = list(interleave([n, n], delta).steps)
    classic = [(0, s) for s in range(delta)]
    for k in range(n - delta):
        classic += [(0, delta + k), (1, k)]
    classic += [(1, s) for s in range(n - delta, n)]
    assert steps == classic


def test_per_microbatch_delta_list_equals_int():
    assert interleave([6, 6], [0, 2]) is interleave([6, 6], 2)
    assert interleave([4, 4, 4], [0, 1, 2]).steps == interleave([4, 4, 4], 1).steps


def test_cached_same_object():
    a = interleave([5, 5], 1)
    assert interleave((5, 5), 1) is a
    assert interleave([5, 5], 2) is not a


def test_immutable():
    sched = interleave([2, 2], 1)
    with pytest.raises(AttributeError):
        sched.steps = ()  # type: ignore[misc]
    assert isinstance(sched.steps, tuple)


@pytest.mark.parametrize(
    "counts,delta,msg",
    [([], 0, "at least one"), ([0, 2], 0, "microbatch 0 has 0 stages"), ([2, 2], -1, ">= 0"),
     ([2, 2], [0], "1 entries for 2"), ([2, 2], [0, -1], r"delta_stages\[1\]"), ([2], "x", "int")],
)
def test_interleave_rejects(counts, delta, msg):
    with pytest.raises(ValueError, match=msg):
        interleave(counts, delta)


def test_render_table():
    sched = interleave([3, 3], 1)
    text = sched.render(["attn", "dispatch_a", "combine_b"])
    lines = text.splitlines()
    assert lines[0].split("|")[1].strip() == "microbatch A"
    assert len(lines) == 2 + sched.num_rounds
    # round 1: A runs stage 1, B runs stage 0
    row = [c.strip() for c in lines[3].split("|")]
    assert row == ["1", "s1 dispatch_a", "s0 attn"]
    with pytest.raises(ValueError, match="2 labels"):
        sched.render(["a", "b"])


def test_rounds_grouping():
    sched = interleave([2, 2], 1)
    assert sched.rounds() == (((0, 0),), ((0, 1), (1, 0)), ((1, 1),))
