"""``tbo predict afd``: the AFD pipeline of a cluster not yet measured, from the predictor's per-op costs.

The predictor prices every op of a MoE layer on a GPU (`tbo.tools.predict.costs`); AFD puts the attention ops on
one pool and the FFN ops (router, experts, shared experts) on another, with the hidden states crossing a link each
way. This groups the predicted ops by side into `tbo.tools.afd_pipeline.AFDCosts`, so that `choose_count` says which
microbatch count pays there (MegaScale-Infer's ping-pong condition with the predicted stage times).
"""

from __future__ import annotations

from tbo.tools.afd_pipeline import AFDCosts
from tbo.tools.predict.costs import Prediction
from tbo.tools.simulate import Cost

__all__ = ["ATTENTION_OPS", "FFN_OPS", "afd_costs"]

#: the ops each side of an AFD pair runs (the predictor's names); dispatch and combine are AFD's link instead
ATTENTION_OPS = ("comm_prepare_attn", "attn_prepare", "attn_core", "comm_prepare_mlp", "output")
FFN_OPS = ("gate", "select_experts", "experts", "shared_experts")


def _summed(costs: list[Cost]) -> Cost:
    """One piecewise-linear table: the sum of ``costs`` (the predictor's tables) at the union of their points."""
    marks = sorted({x for c in costs for x, _ in (c.points or [(0.0, 0.0), (1.0, 0.0)])})
    return Cost(kind="table", points=[(x, sum(c(x) for c in costs)) for x in marks])


def afd_costs(p: Prediction, latency_s: float | None = None, bandwidth: float | None = None,
              activation_bytes: float = 2.0) -> AFDCosts:
    """``p``'s MoE layer as an AFD pair: attention-side and FFN-side costs per layer (the FFN side's experts priced
    as the deployment's busiest expert GPU), ``activation_bytes`` per hidden element each way (BF16), and the link:
    ``latency_s``/``bandwidth`` where given, else the hardware's message latency and effective NIC bandwidth."""
    ops = p.costs.ops
    attention = _summed([ops[name] for name in ATTENTION_OPS if name in ops])
    ffn = _summed([ops[name] for name in FFN_OPS if name in ops])
    hw, eff = p.hardware, p.efficiency
    return AFDCosts(attention=attention, ffn=ffn, num_layers=p.model.num_moe_layers,
                    bytes_per_token=activation_bytes * p.model.hidden,
                    latency_s=hw.message_latency_s if latency_s is None else latency_s,
                    bandwidth=eff.nic_efficiency * hw.nic_bandwidth if bandwidth is None else bandwidth)
