"""`split_price`: a candidate strategy's split step priced against unsplit, from what an engine measured of a step.

The adaptive split (`tbo.split.adaptive`) chooses among strategies as well as microbatch counts, and a choice it
has not measured yet needs a prior, or every candidate costs its warm-up steps wherever it loses. Over a link, an
engine knows two things of a bucket measured unsplit: its compute and its wire time per token (the link books
every transfer). What a strategy makes of them is its schedule's: which compute runs while a transfer is in flight.
That is what `tbo simulate` (`tbo.tools.simulate.simulate`) computes on a cost model; this is the same replay on
the cost model an engine has at run time (an engine sits below the tools and cannot import them), reduced to:

* a layer's compute spread evenly over the strategy's compute ops (bookkeeping ``comm_*`` ops cost nothing), and
  its wire time evenly over its transfers, each microbatch paying its share of the tokens;
* ``X_a`` books transfer ``X`` on one link after earlier transfers (FIFO) and never blocks compute; ``X_b`` blocks
  compute until it has arrived (the simulator's rules, latency left out: a bandwidth-bound link).

Unsplit waits for each transfer in turn: compute plus wire. A split strategy that launches a transfer and then runs
the other microbatch's compute before waiting hides it; one whose lead puts nothing between the launch and the
wait (``qwen3_moe_decode``'s lead of two stages runs the other microbatch's small ``attn_prepare`` stage there)
hides little. The price ignores what splitting costs the compute (weights read once per microbatch): it is a prior
that the measurements correct, used to spare the warm-up of a candidate predicted far slower than the best.
"""

from __future__ import annotations

from collections import defaultdict, deque

from tbo.core.errors import StrategyError
from tbo.core.strategy import OperationsStrategy

__all__ = ["split_price"]

#: layers replayed: enough that the pipeline's fill and drain weigh as in a model of a few layers
_LAYERS = 4


def split_price(strategy: OperationsStrategy, num_microbatches: int, compute: float, wire: float) -> float | None:
    """The step time of ``strategy`` over ``num_microbatches`` equal microbatches relative to the unsplit step's,
    where the unsplit step computes for ``compute`` and waits ``wire`` (any unit: per token, per step). None where
    the strategy has no compute op or no transfer to price, or the times are not positive and finite."""
    total = compute + wire
    if not (compute >= 0 and wire >= 0 and 0 < total < float("inf")) or num_microbatches < 1:
        return None
    try:
        visits = list(OperationsStrategy.concat([strategy] * _LAYERS).walk(num_microbatches))
    except StrategyError:  # a strategy whose stack cannot be replayed (a lead its stages do not allow): no price
        return None
    computing = sum(v.role is None and not v.op.startswith("comm_") for v in visits)
    launches = sum(v.role is not None and v.role[0] == "launch" for v in visits)
    if not computing or not launches:
        return None
    # per microbatch op: the layer's compute over its ops, the microbatch's share of the tokens
    op_s, transfer_s = compute / total * _LAYERS / computing, wire / total * _LAYERS / launches
    t, link_free = 0.0, 0.0
    in_flight: dict[tuple[int, str], deque[float]] = defaultdict(deque)
    for v in visits:
        if v.role is not None and v.role[0] == "wait":
            queue = in_flight[(v.mb, v.role[1])]
            if queue:
                t = max(t, queue.popleft())
        elif v.role is None and not v.op.startswith("comm_"):
            t += op_s
        if v.role is not None and v.role[0] == "launch":
            link_free = max(t, link_free) + transfer_s
            in_flight[(v.mb, v.role[1])].append(link_free)
    return t / _LAYERS
