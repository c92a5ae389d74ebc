"""DeepSeek-V3 strategies: decode (low-latency, delta 2) and prefill (normal mode, SM partition, delta 0).

Decode yields after each launch so the other microbatch's attention and experts fill the wait; microbatch A leads by
two stages. Prefill has fewer, longer stages; DeepGEMM is told to leave DeepEP's SMs free.

Which DeepEP fits: decode was written for V1's low-latency mode, whose transfers take no SMs while in flight (the
receive hook does the receiving), so DeepGEMM keeps every SM. DeepEP V2 has no zero-SM hook mode: a decode
strategy over V2 overlaps the way normal mode does, with the communication kernels holding SMs for the whole
transfer. Pass ``comm_num_sms=backend.comm_num_sms(top_k)`` (V2's ``get_theoretical_num_sms``) and DeepGEMM is
limited to the rest. Prefill fits V1 normal mode and V2 alike; without ``comm_num_sms`` it budgets for V1's
``Buffer.num_sms``.
"""

from __future__ import annotations

from tbo.core.operations import Yield
from tbo.core.strategy import OperationsStrategy
from tbo.comm.sm_budget import gemm_num_sms_beside

__all__ = ["deepseek_decode", "deepseek_prefill", "prefill_deep_gemm_num_sms"]


def prefill_deep_gemm_num_sms() -> int | None:
    """Device SMs minus DeepEP V1's SMs (``Buffer.num_sms``) on a GPU, else None."""
    import torch

    if not torch.cuda.is_available():
        return None
    from tbo.util.optional import try_import

    deep_ep = try_import("deep_ep")
    comm_sms = getattr(getattr(deep_ep, "Buffer", None), "num_sms", 0)  # None: no deep_ep, or V2 without V1
    return gemm_num_sms_beside(comm_sms)


def deepseek_decode(comm_num_sms: int | None = None, device_sms: int | None = None) -> OperationsStrategy:
    """Decode. ``comm_num_sms``: SMs the communication kernels hold (DeepEP V2: ``backend.comm_num_sms(top_k)``);
    DeepGEMM then gets the device's other SMs (``device_sms``, default: the current GPU's; no budget on CPU)."""
    return OperationsStrategy(
        name="deepseek_decode",
        delta_stages=2,
        deep_gemm_num_sms=gemm_num_sms_beside(comm_num_sms, device_sms),
        operations=[
            "comm_prepare_attn", "attn_prepare", Yield,
            "attn_core", "comm_prepare_mlp", "gate", "select_experts", Yield,
            "dispatch_a", "shared_experts", Yield,
            "dispatch_b", "experts", "combine_a", Yield,
            "combine_b", Yield,
            "output", "comm_postprocess_layer",
        ],
    )


def deepseek_prefill(comm_num_sms: int | None = None, device_sms: int | None = None) -> OperationsStrategy:
    """Prefill. ``comm_num_sms`` as for decode; without it, DeepEP V1's ``Buffer.num_sms`` is budgeted for."""
    budget = prefill_deep_gemm_num_sms() if comm_num_sms is None else gemm_num_sms_beside(comm_num_sms, device_sms)
    return OperationsStrategy(
        name="deepseek_prefill",
        delta_stages=0,
        deep_gemm_num_sms=budget,
        operations=[
            "comm_prepare_attn", "attn_prepare", "attn_core", "comm_prepare_mlp", "gate", "select_experts",
            "dispatch_a", Yield,
            "dispatch_b", "experts", "combine_a", Yield,
            "shared_experts", "combine_b", "output", "comm_postprocess_layer",
        ],
    )
