"""The tensor-parallel all-reduce a layer's deferred reductions run through (`tbo.integrations.vllm.model.tp`): tbo's
`tbo.comm.allreduce.TPAllReduce` over vLLM's tensor-parallel group, with the engine's deadline, in an
`tbo.comm.emulated.EmulatedLink` where ``link`` is set (so a CPU shows what hiding the all-reduce is worth).
"""

from __future__ import annotations

from typing import Any

from tbo.integrations.vllm.config import TboVllmConfig

__all__ = ["tp_group", "tp_reducer"]


def tp_group(platform: str) -> Any:
    """vLLM's tensor-parallel group as a torch.distributed group: its gloo CPU group on a CPU, its device group
    (NCCL) on CUDA, as `tbo.integrations.vllm.comm.ep.ep_group` picks for expert parallelism."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    return group.cpu_group if platform == "cpu" else group.device_group


def tp_reducer(config: TboVllmConfig, platform: str) -> Any:
    """The reducer the layers' ``*_reduce_a/_b`` ops call: ``reduce_a(x, what)`` launches the sum of ``x`` over the
    TP group and returns, ``reduce_b(state)`` waits for it within ``comm_timeout_s`` (a dead peer is a named error)."""
    from tbo.comm.allreduce import TPAllReduce
    from tbo.comm.emulated import EmulatedLink

    reducer: Any = TPAllReduce(tp_group(platform), timeout_s=config.comm_timeout_s)
    return reducer if config.link is None else EmulatedLink.from_spec(reducer, config.link)
