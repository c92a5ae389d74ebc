"""Agreement across ranks: if any rank cannot split this step, no rank splits.

With expert parallelism every rank takes part in every dispatch and combine. If one rank ran two microbatches and
another ran one, their collectives would pair up wrongly and deadlock. One all-reduce (MIN) of a flag settles it
(`agree_to_split`). Data-parallel attention needs more, settled by one all-reduce of every rank's `StepVote`
(`agree_step`): whether to split (a rank with too few tokens of its own, or none, still takes part, with empty
microbatches), the microbatch count, and which strategy runs (decode and prefill strategies issue their
collectives in different orders).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tbo.comm.wait import DEFAULT_TIMEOUT_S, wait_work
from tbo.split.plan import SplitPlan

__all__ = ["agree_to_split", "agree_step", "decide_step", "StepVote", "StepAgreement", "STEP_MODES"]


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


#: the strategy modes a rank can vote for; "idle": it has no tokens of its own and runs whatever its peers agree
STEP_MODES = ("decode", "prefill", "idle")


@dataclass(frozen=True)
class StepVote:
    """What one rank brings to a step's agreement.

    ``wants_split``: its own policy planned a split. ``can_split``: nothing forbids it to run the agreed
    microbatches (False vetoes the split for every rank). ``mode``: the strategy its step needs (``"decode"``,
    ``"prefill"``), or ``"idle"`` for a rank with nothing of its own to run (a dummy step).
    """

    num_microbatches: int
    wants_split: bool
    can_split: bool
    mode: str

    def __post_init__(self) -> None:
        if self.mode not in STEP_MODES:
            raise ValueError(f"StepVote.mode must be one of {STEP_MODES}, got {self.mode!r}")


@dataclass(frozen=True)
class StepAgreement:
    """The step every rank runs: split or not, into how many microbatches, with which strategy."""

    split: bool
    num_microbatches: int
    strategy_mode: str  #: "decode" or "prefill"
    votes: tuple[StepVote, ...]

    @property
    def idle_ranks(self) -> int:
        return sum(v.mode == "idle" for v in self.votes)


def decide_step(votes: tuple[StepVote, ...]) -> StepAgreement:
    """The rule, the same on every rank: split when at least one rank planned a split and no rank vetoes it; the
    prefill strategy when any rank prefills (its collectives' order then rules), decode otherwise. Every rank must
    have the same microbatch count: a mismatch is a configuration error, named."""
    counts = {v.num_microbatches for v in votes}
    if len(counts) != 1:
        per_rank = ", ".join(f"rank {r}: {v.num_microbatches}" for r, v in enumerate(votes))
        raise ValueError(f"the ranks disagree on num_microbatches ({per_rank}): every rank must run the same "
                         "tbo configuration")
    split = all(v.can_split for v in votes) and any(v.wants_split for v in votes)
    mode = "prefill" if any(v.mode == "prefill" for v in votes) or all(v.mode == "idle" for v in votes) else "decode"
    return StepAgreement(split, counts.pop(), mode, tuple(votes))


def agree_step(vote: StepVote, group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> StepAgreement:
    """One collective over ``group`` (an all-reduce of every rank's vote): the same `StepAgreement` on every rank.
    Raises `CommTimeoutError` naming this rank and the op when a peer does not take part within ``timeout_s``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return decide_step((vote,))
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros((size, 4), dtype=torch.int32)
    table[rank] = torch.tensor([vote.num_microbatches, int(vote.wants_split), int(vote.can_split),
                                STEP_MODES.index(vote.mode)], dtype=torch.int32)
    table = table.to(device)
    work = dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group, async_op=True)
    wait_work(work, timeout_s, "agree_step all_reduce (the step's split, microbatches and strategy)")
    rows = table.cpu().tolist()
    return decide_step(tuple(StepVote(n, bool(w), bool(c), STEP_MODES[m]) for n, w, c, m in rows))
