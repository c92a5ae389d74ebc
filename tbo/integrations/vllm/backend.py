"""The expert-parallel backend the plugin dispatches vLLM's MoE tokens through, from ``additional_config``.

``local``: tbo's own all-to-all, NORMAL layout (vLLM's fused-MoE kernel takes each token once with its top-k ids and
weights): every expert on this rank (with tensor parallelism each rank holds all experts, sharded), or, with data
parallel + expert parallel, `tbo.integrations.vllm.ep.EpBackend` over vLLM's expert-parallel group. ``deepep``:
DeepEP over that group, in a NORMAL-layout kind (V2, or V1 normal mode): CUDA only. ``link`` wraps either in
`EmulatedLink`, so that dispatch and combine take the time a real interconnect would and overlap shows on a CPU.
"""

from __future__ import annotations

from typing import Any

from tbo.comm.alltoall import LocalBackend
from tbo.comm.emulated import EmulatedLink
from tbo.comm.types import DispatchFormat
from tbo.integrations.vllm.config import TboVllmConfig

__all__ = ["make_backend"]


def make_backend(config: TboVllmConfig, num_experts: int, *, hidden: int, top_k: int, max_tokens: int,
                 ep_size: int = 1, platform: str = "cpu", fp8: bool = False) -> Any:
    """The `EPBackend` ``config`` asks for, routing ``num_experts`` experts with top-``top_k`` over tokens of
    ``hidden`` channels, at most ``max_tokens`` per step, over ``ep_size`` expert-parallel ranks; ``fp8``: its
    dispatches carry FP8 rows with their scales (DeepEP's buffers sized for them)."""
    if config.backend == "local" and ep_size > 1:
        from tbo.integrations.vllm.ep import EpBackend, ep_group

        backend: Any = EpBackend(num_experts, ep_group(platform), config.comm_timeout_s)
    elif config.backend == "local":
        backend = LocalBackend(num_experts, DispatchFormat.NORMAL)
    else:
        from vllm.distributed import get_ep_group

        from tbo.comm.deepep_select import deepep_backend

        kind = config.deepep_kind  # "auto" in prefill mode: V2 when installed, else V1 normal; both NORMAL layout
        backend = deepep_backend(get_ep_group().device_group, num_experts, hidden=hidden,
                                 num_max_tokens_per_rank=max_tokens, num_topk=top_k, kind=kind, mode="prefill",
                                 use_fp8=fp8)
    if config.link is not None:
        backend = EmulatedLink.from_spec(backend, config.link)
    return backend
