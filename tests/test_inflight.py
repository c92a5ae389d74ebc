"""A backend's limit on transfers in flight, checked on the compiled schedule (tbo.core.inflight): no torch here."""

import pytest

from tbo import OperationsStrategy, StrategyError, Yield
from tbo.core.inflight import InFlightLimit, in_flight_violations, limit_of

ONE = InFlightLimit(1, frozenset({"dispatch", "combine"}), "a one-slot link", "it has one buffer")
DECODE = OperationsStrategy(name="decode", delta_stages=2, operations=[
    "route", Yield, "attn", Yield, "dispatch_a", "shared", Yield, "dispatch_b", "experts", "combine_a", Yield,
    "combine_b", Yield, "output"])


def where(v):
    return (v.launch.mb, v.launch.op, v.blocking.mb, v.blocking.op)


def test_decode_lead_two_keeps_one_transfer_in_flight_across_layers():
    for layers in (1, 2, 5):
        joined = OperationsStrategy.concat([DECODE] * layers)
        assert in_flight_violations(joined, ONE, 2) == ()
        assert joined.check_in_flight(ONE) is joined


def test_each_violation_names_both_ops_and_both_microbatches():
    joined = OperationsStrategy.concat([DECODE] * 2)
    # lead 1: B's dispatch launches while A's combine is un-received
    first = in_flight_violations(joined, ONE, 2, 1)[0]
    assert where(first) == (1, "dispatch_a", 0, "combine_a")
    assert str(first) == (
        "microbatch 1's 'dispatch_a' (stage 2, operations[4]) launches while microbatch 0's 'combine_a' (stage 3, "
        "operations[9]) is not yet received (its 'combine_b' has not run): that makes 2 transfers in flight, and a "
        "one-slot link tolerates at most 1 (it has one buffer)")
    # lead 3: fine inside a layer, but A's next layer dispatches while B's combine of the first is in flight
    boundary = in_flight_violations(joined, ONE, 2, 3)
    assert where(boundary[0]) == (0, "dispatch_a", 1, "combine_a") and boundary[0].launch.stage == 7
    assert in_flight_violations(DECODE, ONE, 2, 3) == ()  # one layer alone hides the boundary: check the stack
    # three microbatches do not fit a lead of two
    assert where(in_flight_violations(joined, ONE, 3)[0]) == (0, "dispatch_a", 2, "dispatch_a")


def test_check_raises_strategy_error_and_remembers():
    joined = OperationsStrategy.concat([DECODE] * 2)
    with pytest.raises(StrategyError, match=r"cannot run over a one-slot link with 2 microbatches and "
                                            r"delta_stages=1: microbatch 1's 'dispatch_a'.*\(1 more launch like it\)"):
        joined.check_in_flight(ONE, 2, 1)
    assert (ONE, 2, 1) in joined._in_flight_checked  # a later step's check is a lookup
    assert joined.check_in_flight(None, 3) is joined  # no limit, nothing to check


def test_limit_covers_its_kinds_and_validates():
    afd = OperationsStrategy(operations=["attn", "afd_send", Yield, "afd_recv", "output"])
    assert in_flight_violations(afd, ONE, 2) == ()  # afd transfers are not the link's
    assert in_flight_violations(afd, InFlightLimit(1), 2)  # a limit on every kind sees them
    with pytest.raises(ValueError, match="positive int"):
        InFlightLimit(0)

    class Backend:
        in_flight_limit = ONE

    class Wrong:
        in_flight_limit = 1

    assert limit_of(Backend()) is ONE and limit_of(object()) is None
    with pytest.raises(TypeError, match="must be a tbo.core.inflight.InFlightLimit"):
        limit_of(Wrong())


def test_fragment_waits_without_launches_are_skipped():
    fragment = OperationsStrategy(operations=["combine_b", Yield, "dispatch_a", Yield, "dispatch_b"], fragment=True)
    assert in_flight_violations(fragment, ONE, 1) == ()
