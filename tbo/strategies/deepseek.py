"""DeepSeek-V3 strategies: decode (low-latency, delta 2) and prefill (normal mode, SM partition, delta 0).

Decode yields after each launch so the other microbatch's attention and experts fill the wait; microbatch A leads by
two stages. Prefill has fewer, longer stages; DeepGEMM is told to leave DeepEP's SMs free.
"""

from __future__ import annotations

from tbo.core.operations import Yield
from tbo.core.strategy import OperationsStrategy

__all__ = ["deepseek_decode", "deepseek_prefill", "prefill_deep_gemm_num_sms"]


def prefill_deep_gemm_num_sms() -> int | None:
    """Device SMs minus DeepEP's SMs on a GPU (DeepEP's communication kernels run beside the GEMMs), else None."""
    import torch

    if not torch.cuda.is_available():
        return None
    from tbo.util.optional import try_import

    deep_ep = try_import("deep_ep")
    comm_sms = deep_ep.Buffer.num_sms if deep_ep is not None else 0
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return total - comm_sms if comm_sms else None


def deepseek_decode() -> OperationsStrategy:
    return OperationsStrategy(
        name="deepseek_decode",
        delta_stages=2,
        operations=[
            "comm_prepare_attn", "attn_prepare", Yield,
            "attn_core", "comm_prepare_mlp", "gate", "select_experts", Yield,
            "dispatch_a", "shared_experts", Yield,
            "dispatch_b", "experts", "combine_a", Yield,
            "combine_b", Yield,
            "output", "comm_postprocess_layer",
        ],
    )


def deepseek_prefill() -> OperationsStrategy:
    return OperationsStrategy(
        name="deepseek_prefill",
        delta_stages=0,
        deep_gemm_num_sms=prefill_deep_gemm_num_sms(),
        operations=[
            "comm_prepare_attn", "attn_prepare", "attn_core", "comm_prepare_mlp", "gate", "select_experts",
            "dispatch_a", Yield,
            "dispatch_b", "experts", "combine_a", Yield,
            "shared_experts", "combine_b", "output", "comm_postprocess_layer",
        ],
    )
