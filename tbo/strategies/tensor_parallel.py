"""Strategies for layers under tensor parallelism: their all-reduces are transfers, hidden by the other microbatch.

Under TP every layer ends attention (``o_proj``) and its FFN (``down_proj``, or the MoE's routed and shared outputs)
with an all-reduce of partial sums, and without overlap the GPU waits for each. These lists launch each reduction
(``attn_reduce_a``, ...; `tbo.ops.TensorParallelOps`), Yield, and wait for it only after the other
microbatch has run a stage of compute:

* **Dense** (``dense_tp_decode``, ``dense_tp_prefill``), delta 0: three stages per layer, attention then its
  reduction's launch | the wait, the MLP and its launch | the wait and the output (joined to the next layer's
  attention). Microbatches alternate, so A's attention reduction flies during B's attention, A's MLP reduction
  during B's MLP. Only the last microbatch's last reduction has nothing left to hide behind.
* **MoE** (``moe_tp_decode``, ``moe_tp_prefill``), experts sharded over the TP ranks (each rank computes every
  expert's slice of the intermediate width), the same three stages with the MoE in the middle one: the router, the
  routed experts (``routed_experts``: dispatch and combine move nothing between ranks here, so they run in one op
  rather than as transfers, which would leave stages with no compute for the other microbatch to hide a reduction
  behind), the routed output's launch, the shared expert (which hides part of it) and its launch. The shared
  expert's pair is a no-op on a layer without one, so one list serves both.
* **MoE with expert-parallel experts under TP attention** (``moe_tp_ep_decode``, ``moe_tp_ep_prefill``): each rank
  holds whole experts, a share of them, and every rank holds the same tokens after attention's sum. Each rank
  dispatches its own share of the microbatch's rows (rank ``r`` of ``n`` the ``r``-th of ``n`` near-equal slices) to
  the ranks whose experts they picked, runs its experts on the rows it received, and combines them back; its routed
  output is then its slice, zeros elsewhere: a partial sum, completed by ``moe_reduce_a``/``_b`` as under TP. Four
  transfers per layer (attention's sum, dispatch, combine, the routed output's sum), each in its own stage, and the
  shared expert's sum where there is one; decode has ``deepseek_decode``'s lead of two (one dispatch in flight at a
  time, what DeepEP's low-latency mode tolerates), prefill no lead. This is what SGLang's own expert parallelism
  over an all-to-all backend does without DP attention (its MLP input scattered over the attention TP ranks,
  gathered after).

The dense and MoE TP lists are the same for decode and prefill; prefill budgets SMs. A decode all-reduce is small
and latency-bound (a one-shot kernel on a few SMs), while a prefill one is bandwidth-bound and its ring kernels hold
their SMs for the whole transfer, so the ``*_prefill`` lists leave ``comm_num_sms`` SMs to it (DeepGEMM, where the
GEMMs run through it, is limited to the rest; no budget without ``comm_num_sms`` or off the GPU).

`tbo.strategies.dense.dense_like` of a TP strategy is the dense TP list (a DeepSeek-like model's first dense
layers), with the same lead.
"""

from __future__ import annotations

from tbo.comm.sm_budget import gemm_num_sms_beside
from tbo.core.operations import Yield
from tbo.core.strategy import OperationsStrategy

__all__ = ["dense_tp_decode", "dense_tp_prefill", "moe_tp_decode", "moe_tp_prefill", "moe_tp_ep_decode",
           "moe_tp_ep_prefill", "DENSE_TP_OPS", "is_tp"]

#: One dense layer under TP, as three stages (see the module docstring).
DENSE_TP_OPS = (
    "comm_prepare_attn", "attn_prepare", "attn_core", "attn_reduce_a", Yield,
    "attn_reduce_b", "comm_prepare_mlp", "mlp", "mlp_reduce_a", Yield,
    "mlp_reduce_b", "output", "comm_postprocess_layer",
)

_MOE_TP_OPS = (
    "comm_prepare_attn", "attn_prepare", "attn_core", "attn_reduce_a", Yield,
    "attn_reduce_b", "comm_prepare_mlp", "gate", "select_experts", "routed_experts", "moe_reduce_a",
    "shared_experts", "shared_reduce_a", Yield,
    "moe_reduce_b", "shared_reduce_b", "output", "comm_postprocess_layer",
)


#: One MoE layer with expert-parallel experts under TP attention, decode (lead 2): seven stages a layer once the
#: first joins the previous layer's last. A microbatch has four transfers in a chain and a stage with nothing to
#: compute (the combine's wait and the routed sum's launch); attention in two stages and the router in its own put
#: that stage where the other microbatch launches nothing (`tbo lint` finds no transfer without compute beside it,
#: with or without a shared expert), and the dispatch is in flight alone, as DeepEP's low-latency mode needs
_MOE_TP_EP_DECODE_OPS = (
    "comm_prepare_attn", Yield,
    "attn_prepare", Yield,
    "attn_core", "attn_reduce_a", Yield,
    "attn_reduce_b", "comm_prepare_mlp", Yield,
    "gate", "select_experts", "dispatch_a", "shared_experts", "shared_reduce_a", Yield,
    "dispatch_b", "experts", "combine_a", Yield,
    "combine_b", "moe_reduce_a", Yield,
    "moe_reduce_b", "shared_reduce_b", "output", "comm_postprocess_layer",
)

#: The same layer, prefill (no lead): the dispatch launched with the routing, the shared expert beside the routed
#: output's sum (on a layer without one, the other microbatch's combine has only that launch beside it)
_MOE_TP_EP_PREFILL_OPS = (
    "comm_prepare_attn", "attn_prepare", "attn_core", "attn_reduce_a", Yield,
    "attn_reduce_b", "comm_prepare_mlp", "gate", "select_experts", "dispatch_a", Yield,
    "dispatch_b", "experts", "combine_a", Yield,
    "combine_b", "moe_reduce_a", "shared_experts", "shared_reduce_a", Yield,
    "moe_reduce_b", "shared_reduce_b", "output", "comm_postprocess_layer",
)


def is_tp(strategy: OperationsStrategy) -> bool:
    """Whether ``strategy`` reduces attention's output as a transfer (a TP strategy, whose layers' outputs are
    partial sums)."""
    return "attn_reduce_a" in strategy.operations


def dense_tp_decode(delta_stages: int = 0) -> OperationsStrategy:
    """Dense layers under TP, decode. ``delta_stages``: the lead (another value joins a MoE TP list's)."""
    return OperationsStrategy(name="dense_tp_decode", delta_stages=delta_stages, operations=list(DENSE_TP_OPS))


def dense_tp_prefill(comm_num_sms: int | None = None, device_sms: int | None = None) -> OperationsStrategy:
    """Dense layers under TP, prefill: the decode shape, with ``comm_num_sms`` SMs left to the all-reduce."""
    return OperationsStrategy(name="dense_tp_prefill", delta_stages=0, operations=list(DENSE_TP_OPS),
                              deep_gemm_num_sms=gemm_num_sms_beside(comm_num_sms, device_sms))


def moe_tp_decode() -> OperationsStrategy:
    """MoE layers with TP-sharded experts (and shared expert, if any), decode."""
    return OperationsStrategy(name="moe_tp_decode", delta_stages=0, operations=list(_MOE_TP_OPS))


def moe_tp_prefill(comm_num_sms: int | None = None, device_sms: int | None = None) -> OperationsStrategy:
    """MoE layers with TP-sharded experts, prefill: the decode shape, with ``comm_num_sms`` SMs left to the
    all-reduce."""
    return OperationsStrategy(name="moe_tp_prefill", delta_stages=0, operations=list(_MOE_TP_OPS),
                              deep_gemm_num_sms=gemm_num_sms_beside(comm_num_sms, device_sms))


def moe_tp_ep_decode() -> OperationsStrategy:
    """MoE layers with expert-parallel experts under TP attention, decode: attention's sum, the dispatch, the combine
    and the routed output's sum as transfers (see the module docstring)."""
    return OperationsStrategy(name="moe_tp_ep_decode", delta_stages=2, operations=list(_MOE_TP_EP_DECODE_OPS))


def moe_tp_ep_prefill(comm_num_sms: int | None = None, device_sms: int | None = None) -> OperationsStrategy:
    """MoE layers with expert-parallel experts under TP attention, prefill: no lead, ``comm_num_sms`` SMs left to
    the transfers."""
    return OperationsStrategy(name="moe_tp_ep_prefill", delta_stages=0, operations=list(_MOE_TP_EP_PREFILL_OPS),
                              deep_gemm_num_sms=gemm_num_sms_beside(comm_num_sms, device_sms))
