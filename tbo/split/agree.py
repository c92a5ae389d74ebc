"""Agreement across ranks: if any rank cannot split this step, no rank splits.

With expert parallelism every rank takes part in every dispatch and combine. If one rank ran two microbatches and
another ran one, their collectives would pair up wrongly and deadlock. One all-reduce (MIN) of a flag settles it.
"""

from __future__ import annotations

from typing import Any

import torch

from tbo.comm.wait import DEFAULT_TIMEOUT_S, wait_work
from tbo.split.plan import SplitPlan

__all__ = ["agree_to_split"]


def agree_to_split(plan_or_none: SplitPlan | None, group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """True only if every rank in ``group`` has a plan. Raises `CommTimeoutError` instead of hanging."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return plan_or_none is not None
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([0 if plan_or_none is None else 1], dtype=torch.int32, device=device)
    work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group, async_op=True)
    wait_work(work, timeout_s, "agree_to_split all_reduce")
    return bool(flag.item())
