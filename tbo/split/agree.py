"""Agreement across ranks: if any rank cannot split this step, no rank splits, and no rank runs another configuration.

With expert parallelism every rank takes part in every dispatch and combine. If one rank ran two microbatches and
another ran one, their collectives would pair up wrongly and deadlock. One all-reduce settles it (`agree_to_split`).
Data-parallel attention needs more, settled by one all-reduce of every rank's `StepVote` (`agree_step`): whether to
split (a rank with too few tokens of its own, or none, still takes part, with empty microbatches), the microbatch
count, and which strategy runs (decode and prefill strategies issue their collectives in different orders).

The same all-reduce also carries each rank's token rows per microbatch (`StepVote.rows`). With them every rank
knows, before the step, the most rows any peer can send it in each dispatch (a token goes to a rank at most once),
so a dispatch needs no row-count exchange of its own: it sends each peer a chunk padded to its own row count, and
nothing waits for the peer until the rows are due (`tbo.comm.alltoall.AllToAllBackend.dispatch_a`'s
``rows_per_rank``).

**The configuration rides along.** Ranks started with another strategy, op list, backend, link or ``agreed_rows``
issue other collectives, in other orders: a gloo abort, a hang, or a silent mis-pairing when the sizes happen to
match. So each agreement also carries a digest of everything that shapes the collectives (`AgreedConfig`: a table
of named values, digested once). When the digests differ, every rank sees it in the same all-reduce, and all of
them then exchange their tables once (a second collective, run only then) and raise `AgreementMismatchError` naming
each key that differs and its value on every rank. `agree_step` and `agree_to_split` all-reduce the same table (one
shape, one op), with the caller's kind in it: a rank calling one while its peer calls the other is refused by name
on both, where collectives of two shapes would abort the processes in gloo.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from tbo.comm.wait import DEFAULT_TIMEOUT_S, wait_work
from tbo.split.kinds import Slot, StepKind
from tbo.split.plan import SplitPlan

__all__ = ["agree_to_split", "agree_step", "poisoned", "decide_step", "describe", "AgreedConfig", "AgreementMismatchError",
           "StepVote", "StepAgreement", "STEP_MODES", "MAX_AGREED_MICROBATCHES"]


#: what a rank can vote for: the slot its step needs, or `StepKind.IDLE`: it has no tokens of its own and runs whatever
#: its peers agree (the wire carries the index into this tuple)
STEP_MODES = (Slot.DECODE, Slot.PREFILL, StepKind.IDLE)

#: the most microbatches a vote's ``rows`` can describe: the all-reduced table has one fixed width on every rank, so
#: that ranks configured with different microbatch counts get the named mismatch, not a collective of two sizes
MAX_AGREED_MICROBATCHES = 16


@dataclass(frozen=True)
class StepVote:
    """What one rank brings to a step's agreement.

    ``wants_split``: its own policy planned a split. ``can_split``: nothing forbids it to run the agreed
    microbatches (False vetoes the split for every rank). ``mode``: the `Slot` its step needs, or
    `StepKind.IDLE` for a rank with nothing of its own to run (a dummy step). ``rows``: the token
    rows of each of its ``num_microbatches`` microbatches should the step split (its own plan's, or all its tokens
    in the first and none in the others); unsplit, it runs their sum. Empty: not told, and the agreement carries
    no rows (`StepAgreement.rows` is None). ``measured_ns``: this rank's wall time of the previous agreed step, in
    nanoseconds, for a policy that learns from step times on every rank alike (`tbo.split.adaptive`); -1: none.
    """

    num_microbatches: int
    wants_split: bool
    can_split: bool
    mode: Slot | StepKind
    rows: tuple[int, ...] = ()
    measured_ns: int = -1

    def __post_init__(self) -> None:
        if self.mode not in STEP_MODES:
            raise ValueError(f"StepVote.mode must be one of {', '.join(STEP_MODES)}, got {self.mode!r}")
        object.__setattr__(self, "mode", STEP_MODES[STEP_MODES.index(self.mode)])  # a string given: its member
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
    slot: Slot  #: the strategy slot every rank runs
    votes: tuple[StepVote, ...]

    @property
    def idle_ranks(self) -> int:
        return sum(v.mode == StepKind.IDLE for v in self.votes)

    @property
    def all_idle(self) -> bool:
        """Every rank runs a dummy step: no rank has a token of its own, so no dispatch has a row to carry."""
        return self.idle_ranks == len(self.votes)

    @property
    def tokens_per_rank(self) -> tuple[int, ...] | None:
        """Each rank's token count in this step, indexed by rank (None when a vote did not tell its rows): what
        vLLM's DP batch coordination all-reduces again (`tbo.integrations.vllm.step.agree.StepAgreementHook.coordinate`)."""
        if not all(v.rows for v in self.votes):
            return None
        return tuple(sum(v.rows) for v in self.votes)

    @property
    def measured_s(self) -> float | None:
        """The previous agreed step's wall time, the mean over the ranks that measured it (None: none did). The
        same number on every rank: the votes are."""
        times = [v.measured_ns for v in self.votes if v.measured_ns >= 0]
        return sum(times) / len(times) / 1e9 if times else None

    @property
    def tokens(self) -> int:
        """The most tokens any rank runs in this step (0 when no vote told its rows)."""
        return max((sum(v.rows) for v in self.votes), default=0)

    @property
    def rows(self) -> tuple[tuple[int, ...], ...] | None:
        """Per microbatch of the agreed step, every rank's token rows (indexed by rank): one entry (each rank's
        total) when it runs unsplit. None when a vote did not tell its rows."""
        if not all(v.rows for v in self.votes):
            return None
        if not self.split:
            return (tuple(sum(v.rows) for v in self.votes),)
        return tuple(zip(*(v.rows for v in self.votes)))


class AgreementMismatchError(ValueError):
    """The ranks of one agreement are not running the same thing: another agreement call, microbatch count or
    configuration. The message names what differs and its value on each rank; every rank raises it, in the same
    agreement (at warm-up for a configuration), before any collective of the step could mis-pair."""


def describe(value: Any) -> str:
    """A configuration value as canonical text, the same on every rank for the same value: a strategy as its name,
    lead, SM budget and op names in order (``|`` for a Yield; bound methods by their op name, so a rank's own layers
    describe as its peers' do); mappings by sorted key; sequences in order; anything else by ``str``."""
    from tbo.core.operations import is_yield, op_name
    from tbo.core.strategy import OperationsStrategy

    if isinstance(value, OperationsStrategy):
        ops = " ".join("|" if is_yield(op) else op_name(op) for op in value.operations)
        return f"{value.name} delta_stages={value.delta_stages} sms={value.deep_gemm_num_sms} ops=[{ops}]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {describe(value[k])}" for k in sorted(value, key=str)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe(v) for v in value) + "]"
    return str(value)


@dataclass(frozen=True)
class AgreedConfig:
    """What shapes a rank's collectives, as named text (`describe`), and its 63-bit digest: build it once (an
    engine's strategies describe as thousands of op names), pass it to every agreement."""

    table: Mapping[str, str] = field(default_factory=dict)
    digest: int = 0

    @classmethod
    def of(cls, config: "Mapping[str, Any] | AgreedConfig | None") -> "AgreedConfig":
        if isinstance(config, AgreedConfig):
            return config
        table = {str(k): describe(v) for k, v in sorted((config or {}).items(), key=lambda kv: str(kv[0]))}
        if not table:
            return cls()
        raw = hashlib.blake2b(json.dumps(table, sort_keys=True).encode(), digest_size=8).digest()
        return cls(table, int.from_bytes(raw, "little", signed=True) or 1)


#: the columns of an agreement's table, one row per rank (then the vote's rows per microbatch): ``_STEP`` the
#: caller's step number, ``_DEADLINE`` the wall-clock time (ns) at which this rank gives the agreement up
_KIND, _N, _WANTS, _CAN, _MODE, _MEASURED, _NROWS, _DIGEST, _STEP, _DEADLINE = range(10)
_HEADER = 10
#: groups whose agreement timed out (by ``id`` of the group; None: the default group): the error, and no collective
#: more. A rank that gave up leaves its all-reduce in flight, so its next one would pair with its peers' previous one
_POISONED: dict[int, str] = {}
#: what a rank's row says it called: 0 never appears in a row a rank wrote (a row of zeros: the rank is not there)
_KINDS = {1: "agree_step", 2: "agree_to_split"}


def _group_device(group: Any) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(t: torch.Tensor, group: Any, timeout_s: float, what: str) -> torch.Tensor:
    """``t`` (each rank's share in its own row, zeros elsewhere) summed over ``group``: every rank's rows."""
    import torch.distributed as dist

    t = t.to(_group_device(group))
    work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)
    wait_work(work, timeout_s, what)
    return t.cpu()


def poisoned(group: Any = None) -> str | None:
    """Why ``group``'s agreements are refused (an earlier one timed out), or None."""
    return _POISONED.get(id(group))


def _agree(kind: int, fields: list[int], rows: tuple[int, ...], config: AgreedConfig, group: Any,
           timeout_s: float, what: str, step: int) -> list[list[int]]:
    """The one all-reduce both agreements make: every rank's row of ``[kind, *fields, digest, step, deadline,
    *rows]`` in a table of one shape (``_HEADER + MAX_AGREED_MICROBATCHES`` int64 columns), checked for one kind,
    one step and one configuration before anything else is read from it.

    A time-out poisons the group (`poisoned`): this rank's all-reduce stays in flight, so every later agreement on
    it is refused by name, without a collective. A late peer sees, in the table, that a rank's deadline passed before
    the all-reduce completed: that rank has given the step up, so the late one raises too (and poisons), instead of
    returning an agreement its peer never got."""
    import time

    import torch.distributed as dist

    from tbo.core.errors import CommTimeoutError

    earlier = _POISONED.get(id(group))
    if earlier is not None:
        raise CommTimeoutError(f"{what} at step {step}: refused, this group's agreement is poisoned since {earlier} "
                               "(rebuild the process group)")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros((size, _HEADER + MAX_AGREED_MICROBATCHES), dtype=torch.int64)
    deadline_ns = time.time_ns() + int(timeout_s * 1e9)
    table[rank, :_HEADER] = torch.tensor([kind, *fields, len(rows), config.digest, step, deadline_ns])
    table[rank, _HEADER:_HEADER + len(rows)] = torch.tensor(rows, dtype=torch.int64)
    try:
        table_rows = _all_reduce(table, group, timeout_s, what).tolist()
    except CommTimeoutError as e:
        _POISONED[id(group)] = f"step {step}: {e}"
        raise
    now = time.time_ns()
    gave_up = [r for r, row in enumerate(table_rows) if r != rank and row[_DEADLINE] and now > row[_DEADLINE]]
    if gave_up:
        message = (f"{what} at step {step}: rank(s) {gave_up} gave the agreement up at their deadline before this "
                   f"rank (rank {rank}) took part: the step is lost on every rank")
        _POISONED[id(group)] = f"step {step}: rank(s) {gave_up} gave it up at their deadline"
        raise CommTimeoutError(message)
    steps = [row[_STEP] for row in table_rows]
    if len(set(steps)) > 1:
        per_rank = ", ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
        raise AgreementMismatchError(f"the ranks agree on different steps ({per_rank}): a rank missed or repeated "
                                     "a step")
    kinds = [row[_KIND] for row in table_rows]
    if len(set(kinds)) > 1:
        calls = ", ".join(f"rank {r}: {_KINDS.get(k, f'unknown ({k})')}" for r, k in enumerate(kinds))
        raise AgreementMismatchError(f"the ranks made different agreement calls ({calls}): every rank must make the "
                                     "same one, agree_step or agree_to_split, in every step")
    if len({row[_DIGEST] for row in table_rows}) > 1:  # every rank sees it: all of them exchange their tables now
        _refuse_configs(config, group, timeout_s, what)
    return table_rows


def _refuse_configs(config: AgreedConfig, group: Any, timeout_s: float, what: str) -> None:
    """Every rank's configuration table (JSON text, gathered by two all-reduces: lengths, then the bytes), and the
    `AgreementMismatchError` naming each key that differs and its value on each rank."""
    import torch.distributed as dist

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.tensor(list(json.dumps(dict(config.table), sort_keys=True).encode()), dtype=torch.int64)
    lengths = torch.zeros(size, dtype=torch.int64)
    lengths[rank] = mine.numel()
    lengths = _all_reduce(lengths, group, timeout_s, f"{what}: the configurations' lengths")
    texts = torch.zeros((size, int(lengths.max())), dtype=torch.int64)
    texts[rank, :mine.numel()] = mine
    texts = _all_reduce(texts, group, timeout_s, f"{what}: the configurations")
    tables = [json.loads(bytes(texts[r, :int(lengths[r])].tolist()).decode()) for r in range(size)]
    lines = []
    for key in sorted(set().union(*tables)):
        values = [t.get(key) for t in tables]
        if len(set(values)) > 1:
            lines.append(f"{key!r} differs: " + ", ".join(
                f"rank {r}: " + ("(not set)" if v is None else _short(v, values)) for r, v in enumerate(values)))
    raise AgreementMismatchError("the ranks run different tbo configurations, which issue different collectives: "
                                 + "; ".join(lines or ["their digests differ"])
                                 + ". Start every rank with the same configuration")


def _short(value: str, others: list[str | None], width: int = 120) -> str:
    """``value``, or where it is long (an op list) the part around its first difference from the other values."""
    if len(value) <= width:
        return repr(value)
    at = min((next((i for i, (a, b) in enumerate(zip(value, o)) if a != b), min(len(value), len(o)))
              for o in others if o is not None and o != value), default=0)
    lo = max(0, at - width // 3)
    return f"...{value[lo:lo + width]!r}... (first difference at character {at})"


def agree_to_split(plan_or_none: SplitPlan | None, group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                   strategy: Any = None, config: "Mapping[str, Any] | AgreedConfig | None" = None,
                   step: int = 0) -> bool:
    """True only if every rank in ``group`` has a plan. Raises `CommTimeoutError` instead of hanging.

    The all-reduce also carries the plan's microbatch count and a digest of ``strategy`` (the strategy, or its
    name, that this rank runs the step with: `describe`) and of ``config`` (anything else that shapes the
    collectives): ranks whose plans have different microbatch counts, or that run another strategy or
    configuration, raise `AgreementMismatchError` naming it (the collectives of the step would otherwise abort or
    mis-pair). So does a peer calling `agree_step` in the same step, and one at another ``step`` (the caller's step
    number). A time-out poisons the group (see `_agree`)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return plan_or_none is not None
    if strategy is not None:
        config = {**AgreedConfig.of(config).table, "strategy": describe(strategy)}
    agreed = AgreedConfig.of(config)
    n = 0 if plan_or_none is None else plan_or_none.num_microbatches
    rows = _agree(2, [n, int(n > 0), int(n > 0), 0, -1], (), agreed, group, timeout_s,
                  "agree_to_split all_reduce (the step's split, microbatches and configuration)", step)
    counts = [row[_N] for row in rows]
    planned = {c for c in counts if c}
    if len(planned) > 1:
        per_rank = ", ".join(f"rank {r}: " + (str(c) if c else "no plan") for r, c in enumerate(counts))
        raise AgreementMismatchError(f"the ranks' plans have different microbatch counts ({per_rank}): every rank "
                                     "must plan with the same SplitPolicy(num_microbatches=...)")
    return all(counts)


def decide_step(votes: tuple[StepVote, ...]) -> StepAgreement:
    """The rule, the same on every rank: split when at least one rank planned a split and no rank vetoes it; the
    prefill strategy when any rank prefills (its collectives' order then rules), decode otherwise. Every rank must
    have the same microbatch count: a mismatch is a configuration error, named (`AgreementMismatchError`)."""
    counts = {v.num_microbatches for v in votes}
    if len(counts) != 1:
        per_rank = ", ".join(f"rank {r}: {v.num_microbatches}" for r, v in enumerate(votes))
        raise AgreementMismatchError(f"the ranks disagree on num_microbatches ({per_rank}): every rank must run the "
                                     "same tbo configuration")
    split = all(v.can_split for v in votes) and any(v.wants_split for v in votes)
    prefill = any(v.mode == Slot.PREFILL for v in votes) or all(v.mode == StepKind.IDLE for v in votes)
    return StepAgreement(split, counts.pop(), Slot.PREFILL if prefill else Slot.DECODE, tuple(votes))


def agree_step(vote: StepVote, group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S,
               config: "Mapping[str, Any] | AgreedConfig | None" = None, step: int = 0) -> StepAgreement:
    """One collective over ``group`` (an all-reduce of every rank's vote): the same `StepAgreement` on every rank.
    Raises `CommTimeoutError` naming this rank and the op when a peer does not take part within ``timeout_s``, and
    `AgreementMismatchError` when the ranks' ``config`` (build it once: `AgreedConfig.of`) or microbatch counts
    differ, or a peer called `agree_to_split`."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return decide_step((vote,))
    agreed = AgreedConfig.of(config)
    fields = [vote.num_microbatches, int(vote.wants_split), int(vote.can_split), STEP_MODES.index(vote.mode),
              vote.measured_ns]
    rows = _agree(1, fields, vote.rows, agreed, group, timeout_s,
                  "agree_step all_reduce (the step's split, microbatches, strategy, rows and configuration)", step)
    return decide_step(tuple(StepVote(r[_N], bool(r[_WANTS]), bool(r[_CAN]), STEP_MODES[r[_MODE]],
                                      tuple(r[_HEADER:_HEADER + r[_NROWS]]), r[_MEASURED]) for r in rows))
