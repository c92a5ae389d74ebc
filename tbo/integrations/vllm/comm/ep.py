"""Expert parallelism's transport under DP attention: tbo's all-to-all (the kit's `EpBackend`) over vLLM's
expert-parallel group (`ep_group`). The layer that hands its experts the rows this rank received:
`tbo.integrations.vllm.model.ep_layer.EpDecoderLayer`.
"""

from __future__ import annotations

from typing import Any

from tbo.integrations.engine.ep import EpBackend

__all__ = ["EpBackend", "ep_group", "expert_parallel_size"]


def expert_parallel_size() -> int:
    """The size of vLLM's expert-parallel group in this process (1 without expert parallelism)."""
    from vllm.distributed import get_ep_group

    return get_ep_group().world_size


def ep_group(platform: str) -> Any:
    """The process group tbo's all-to-all runs over: vLLM's expert-parallel group, its gloo CPU group on a CPU and
    its device group (NCCL) on CUDA."""
    from vllm.distributed import get_ep_group

    group = get_ep_group()
    return group.cpu_group if platform == "cpu" else group.device_group
