"""Agreement across ranks: if any rank cannot split this step, no rank splits.

With expert parallelism every rank takes part in every dispatch and combine. If one rank ran two microbatches and
another ran one, their collectives would pair up wrongly and deadlock. One all-reduce (MIN) of a flag settles it
(`agree_to_split`). Data-parallel attention needs more, settled by one all-reduce of every rank's `StepVote`
(`agree_step`): whether to split (a rank with too few tokens of its own, or none, still takes part, with empty
microbatches), the microbatch count, and which strategy runs (decode and prefill strategies issue their
collectives in different orders).

The same all-reduce also carries each rank's token rows per microbatch (`StepVote.rows`). With them every rank
knows, before the step, the most rows any peer can send it in each dispatch (a token goes to a rank at most once),
so a dispatch needs no row-count exchange of its own: it sends each peer a chunk padded to its own row count, and
nothing waits for the peer until the rows are due (`tbo.comm.alltoall.AllToAllBackend.dispatch_a`'s
``rows_per_rank``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tbo.comm.wait import DEFAULT_TIMEOUT_S, wait_work
from tbo.split.plan import SplitPlan

__all__ = ["agree_to_split", "agree_step", "decide_step", "StepVote", "StepAgreement", "STEP_MODES",
           "MAX_AGREED_MICROBATCHES"]


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

#: the most microbatches a vote's ``rows`` can describe: the all-reduced table has one fixed width on every rank, so
#: that ranks configured with different microbatch counts get the named mismatch, not a collective of two sizes
MAX_AGREED_MICROBATCHES = 16


@dataclass(frozen=True)
class StepVote:
    """What one rank brings to a step's agreement.

    ``wants_split``: its own policy planned a split. ``can_split``: nothing forbids it to run the agreed
    microbatches (False vetoes the split for every rank). ``mode``: the strategy its step needs (``"decode"``,
    ``"prefill"``), or ``"idle"`` for a rank with nothing of its own to run (a dummy step). ``rows``: the token
    rows of each of its ``num_microbatches`` microbatches should the step split (its own plan's, or all its tokens
    in the first and none in the others); unsplit, it runs their sum. Empty: not told, and the agreement carries
    no rows (`StepAgreement.rows` is None).
    """

    num_microbatches: int
    wants_split: bool
    can_split: bool
    mode: str
    rows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in STEP_MODES:
            raise ValueError(f"StepVote.mode must be one of {STEP_MODES}, got {self.mode!r}")
        if not 1 <= self.num_microbatches <= MAX_AGREED_MICROBATCHES:
            raise ValueError(f"StepVote.num_microbatches must be 1..{MAX_AGREED_MICROBATCHES}, got "
                             f"{self.num_microbatches}")
        if self.rows and (len(self.rows) != self.num_microbatches or min(self.rows) < 0):
            raise ValueError(f"StepVote.rows must give {self.num_microbatches} row counts >= 0 (one per "
                             f"microbatch), got {self.rows}")


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

    @property
    def rows(self) -> tuple[tuple[int, ...], ...] | None:
        """Per microbatch of the agreed step, every rank's token rows (indexed by rank): one entry (each rank's
        total) when it runs unsplit. None when a vote did not tell its rows."""
        if not all(v.rows for v in self.votes):
            return None
        if not self.split:
            return (tuple(sum(v.rows) for v in self.votes),)
        return tuple(zip(*(v.rows for v in self.votes)))


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
    table = torch.zeros((size, 5 + MAX_AGREED_MICROBATCHES), dtype=torch.int64)  # one width on every rank
    table[rank, :5] = torch.tensor([vote.num_microbatches, int(vote.wants_split), int(vote.can_split),
                                    STEP_MODES.index(vote.mode), len(vote.rows)])
    table[rank, 5:5 + len(vote.rows)] = torch.tensor(vote.rows, dtype=torch.int64)
    table = table.to(device)
    work = dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group, async_op=True)
    wait_work(work, timeout_s, "agree_step all_reduce (the step's split, microbatches, strategy and rows)")
    return decide_step(tuple(StepVote(n, bool(w), bool(c), STEP_MODES[m], tuple(r[:k]))
                             for n, w, c, m, k, *r in table.cpu().tolist()))
